#![doc = include_str!("../README.md")]
//!
//! ## Configuration
//!
//! Every config type ([`RelayConfig`], [`RetryPolicy`], [`OutageBackoff`]) is
//! `#[non_exhaustive]` and `Default`: start from the default and change fields with its
//! consuming `with_<field>` setters, each of which keeps the other fields. The component
//! that takes a config validates it ([`Relay::with_config`]) and refuses a value out of
//! range with [`Error::Config`], an [`InvalidConfig`] that names the field and the rule.
#![doc(test(attr(deny(warnings))))]

// Lets the derive's `::outbox_core::` paths resolve in this crate's own unit tests.
#[cfg(test)]
extern crate self as outbox_core;

mod async_inbox;
mod dispatch;
mod error;
mod error_chain;
mod event;
#[cfg(feature = "memory")]
mod flaky;
mod inbox;
#[cfg(feature = "memory")]
mod memory;
mod message;
mod msg_id;
mod partition;
mod publish;
mod relay;
mod retry;
mod store;
pub mod trace;

pub use async_inbox::{AsyncInbox, TxFuture};
pub use dispatch::{
    AsyncHandler, AsyncTxHandler, Delivery, Dispatcher, Handler, Prepared, panic_message,
};
pub use error::{BoxError, Error, HandlerError, InvalidConfig, Result};
pub use error_chain::{ErrorChain, error_chain};
pub use event::OutboxEvent;
#[cfg(feature = "memory")]
pub use flaky::{FailAs, FlakyPublisher};
pub use inbox::{Inbox, InboxBatchOutcomes, MAX_CONSUMER_GROUP_LEN, Processed};
#[cfg(feature = "memory")]
pub use memory::{MemoryBatch, MemoryBroker, MemoryDb, MemoryTx, OutboxRow};
pub use message::{
    DEFAULT_MAX_PAYLOAD_BYTES, Envelope, Headers, Status, StoredMessage, TRACEPARENT,
};
pub use msg_id::{InvalidMsgId, MAX_MSG_ID_LEN, MsgId};
pub use partition::{MAX_PARTITIONS, Partitions, partition_of};
pub use publish::{PublishOutcomes, Publisher, RejectKind, Rejected};
pub use relay::{BatchReport, Relay, RelayConfig};
pub use retry::{OutageBackoff, RetryDecision, RetryPolicy};
pub use store::{Backlog, ClaimedBatch, DeadRow, RelayBatchOutcome, RelayStore, RetryRow};

/// Derives [`OutboxEvent`](trait@OutboxEvent) for a struct or an enum with named fields.
///
/// # Attributes
///
/// On the type:
///
/// | attribute | meaning | default |
/// |---|---|---|
/// | `#[outbox(topic = "order.paid")]` | the stream topic, `[A-Za-z0-9._-]+` | type name split at case, dotted: `OrderPaid` → `order.paid` |
/// | `#[outbox(name = "OrderPaid")]` | the event type name (structs; on enums, per variant) | the type (or variant) name |
/// | `#[outbox(version = 2)]` | the payload's schema version | `1` |
/// | `#[outbox(partitions = 8)]` | the partition streams each of its topics is spread over by ordering key, 1 to [`MAX_PARTITIONS`] ([`OutboxEvent::PARTITIONS`](trait@OutboxEvent); docs/partitions.md) | `1`: one stream a topic |
/// | `#[outbox(key = field)]` | the ordering key: messages sharing it are published in order | the business key |
/// | `#[outbox(id = "{tenant}/{order_id}")]` | the business key as a template over fields | — |
/// | `#[outbox(crate = "my_app::outbox")]` | the path the generated code reaches `outbox-core` by | `::outbox_core`; through the `typed-outbox` facade, `::outbox` |
///
/// On fields: `#[outbox(id)]` marks the business key; several marked fields join with `:`
/// in field order. Exactly one of field ids and a template is required.
/// An id field (or a `{field}` of the template) that renders empty makes `msg_id()` and
/// `msg_id_for` fail with [`InvalidMsgId::EmptyPart`] naming the field, so emit refuses
/// the event instead of giving every such event the id `:EventType`.
///
/// On enum variants: `topic`, `name`, `key` and `id` as above, and `#[outbox(id)]` fields,
/// which replace the enum's id template for that variant. Each variant is its own event
/// type (two variants may not share a name) and shares the enum's topic unless it sets one.
///
/// # What it generates
///
/// The [`OutboxEvent`](trait@OutboxEvent) impl, and for structs the inherent items
/// `TOPIC`, `EVENT_TYPE` and `msg_id_for(id fields...)`, which builds the msg_id without an
/// instance:
///
/// ```
/// use outbox_core::OutboxEvent;
///
/// #[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
/// struct OrderPaid { #[outbox(id)] order_id: String, amount_cents: i64 }
///
/// let e = OrderPaid { order_id: "order-42".into(), amount_cents: 1999 };
/// assert_eq!(OrderPaid::TOPIC, "order.paid");
/// assert_eq!(OrderPaid::EVENT_TYPE, "OrderPaid");
/// assert_eq!(e.msg_id().unwrap().as_str(), "order-42:OrderPaid");
/// assert_eq!(OrderPaid::msg_id_for("order-42").unwrap().as_str(), "order-42:OrderPaid");
///
/// #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
/// #[outbox(id = "{tenant}/{order_id}", topic = "billing", version = 2)]
/// enum Billing {
///     Invoiced { tenant: String, order_id: u64 },
///     #[outbox(name = "Refund", topic = "refunds")]
///     Refunded { tenant: String, order_id: u64 },
/// }
/// let r = Billing::Refunded { tenant: "acme".into(), order_id: 7 };
/// assert_eq!(r.msg_id().unwrap().as_str(), "acme/7:Refund");
/// assert_eq!(r.topic(), "refunds");
/// assert_eq!(Billing::EVENT_TYPES, ["Invoiced", "Refund"]);
/// ```
///
/// A crate that renames the `outbox-core` dependency, or re-exports it to its own users,
/// names the path with `crate` (a string, as serde's `#[serde(crate = "...")]`); a path
/// that resolves to nothing is reported at that string:
///
/// ```
/// mod facade {
///     pub use outbox_core as outbox; // e.g. a crate re-exporting outbox-core
/// }
///
/// #[derive(serde::Serialize, serde::Deserialize, facade::outbox::OutboxEvent)]
/// #[outbox(crate = "facade::outbox")]
/// struct OrderPaid { #[outbox(id)] order_id: String }
///
/// let e = OrderPaid { order_id: "order-42".into() };
/// assert_eq!(facade::outbox::OutboxEvent::topic(&e), "order.paid");
/// assert_eq!(OrderPaid::msg_id_for("order-42").unwrap().as_str(), "order-42:OrderPaid");
/// ```
///
/// Mistakes are compile errors pointing at the attribute, all reported in one build.
#[cfg(feature = "derive")]
pub use outbox_derive::OutboxEvent;

/// Paths used by the derive's generated code. Not public API.
#[doc(hidden)]
pub mod __private {
    pub use serde::{Serialize, de::DeserializeOwned};
    pub use std::format;
    pub use std::string::{String, ToString};

    pub use crate::msg_id::id_part;
}
