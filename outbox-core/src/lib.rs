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
mod consumer;
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
mod redact;
mod relay;
mod retry;
mod store;
pub mod trace;

pub use async_inbox::{AsyncInbox, TxFuture};
pub use consumer::{AsyncStore, ConsumerHealth, ConsumerStore};
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
pub use redact::redact_url;
pub use relay::{BatchReport, Relay, RelayConfig};
pub use retry::{OutageBackoff, RetryDecision, RetryPolicy};
pub use store::{Backlog, ClaimedBatch, DeadRow, RelayBatchOutcome, RelayStore, RetryRow};

#[doc = include_str!("../docs/derive.md")]
#[cfg(feature = "derive")]
pub use outbox_derive::OutboxEvent;

/// Paths used by the derive's generated code. Not public API.
#[doc(hidden)]
pub mod __private {
    pub use serde::{Serialize, de::DeserializeOwned};
    pub use std::format;
    pub use std::string::{String, ToString};

    pub use crate::msg_id::id_part;

    /// The broker-free half of the broker crates' consumer builders.
    pub mod builder {
        pub use crate::dispatch::{Routed, Routes};
    }

    /// The consumer runners' side of [`ConsumerStore`](crate::ConsumerStore): how a
    /// store runs its transactions and where. For the broker crates, not for users.
    pub mod consumer {
        #[cfg(feature = "http")]
        pub use crate::consumer::health_router;
        pub use crate::consumer::{
            Executor, HealthState, ReaderHealth, StoreRun, Transactions, block_on, waker,
        };
    }
}
