//! The derive's generated code must not warn in a crate that denies warnings, missing docs,
//! unreachable `pub` and unused qualifications, whatever the visibility of the event type
//! and whatever path names `outbox-core`.
#![deny(warnings, missing_docs, unreachable_pub, unused_qualifications)]
#![warn(clippy::all, clippy::pedantic)]

// `outbox-core` under another name, as `#[outbox(crate = "...")]` is for.
extern crate outbox_core as renamed;

use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};

/// Public events: the generated `TOPIC`, `EVENT_TYPE` and `msg_id_for` are public too and
/// must carry docs.
pub mod events {
    use super::{Deserialize, OutboxEvent, Serialize};

    /// An order was paid.
    #[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
    pub struct OrderPaid {
        /// The order.
        #[outbox(id)]
        pub order_id: String,
        /// The amount.
        pub amount_cents: i64,
    }

    /// A generic event with a template id and an ordering key.
    #[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
    #[outbox(id = "{tenant}/{seq}", key = tenant, version = 2)]
    pub struct Wrapped<T> {
        /// The tenant.
        pub tenant: String,
        /// The sequence number.
        pub seq: u64,
        /// The payload.
        pub inner: T,
    }

    /// Order events.
    #[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
    #[outbox(topic = "orders")]
    pub enum OrderEvent {
        /// Placed.
        Placed {
            /// The order.
            #[outbox(id)]
            order_id: String,
        },
        /// Refunded.
        #[outbox(topic = "refunds", key = order_id)]
        Refunded {
            /// The order.
            order_id: String,
            /// The refund.
            #[outbox(id)]
            refund_no: u32,
        },
    }
}

/// Events whose generated code names `outbox-core` by a path of the user's: a path written
/// by the user carries the user's span, so rustc lints it as the user's code, and
/// `renamed::__private::String` would be an unused qualification of the prelude's `String`.
pub mod overridden {
    use super::{Deserialize, OutboxEvent, Serialize};

    /// `outbox-core` re-exported, as a crate wrapping it would.
    pub use outbox_core as facade;

    /// An event reaching `outbox-core` through the re-export, with an ordering key.
    #[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
    #[outbox(crate = "crate::overridden::facade", key = account)]
    pub struct Moved<T> {
        /// The transfer.
        #[outbox(id)]
        pub transfer_id: String,
        /// The account.
        pub account: String,
        /// The payload.
        pub inner: T,
    }

    /// Events through the renamed crate; one variant keeps the business key as its
    /// ordering key (`OutboxEvent::business_key`, with `OutboxEvent` in scope).
    #[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
    #[outbox(crate = "renamed", id = "{account}")]
    pub enum Account {
        /// Opened.
        Opened {
            /// The account.
            account: String,
        },
        /// Credited.
        #[outbox(key = account)]
        Credited {
            /// The account.
            account: String,
        },
    }
}

mod internal {
    use super::{Deserialize, OutboxEvent, Serialize};

    /// A crate-visible event.
    #[derive(Serialize, Deserialize, OutboxEvent)]
    pub(crate) struct Audited {
        #[outbox(id)]
        pub(crate) audit_id: u64,
    }

    /// A private event whose generated inherent items are never used: no dead-code warning.
    #[derive(Serialize, Deserialize, OutboxEvent)]
    struct Unused {
        #[outbox(id)]
        id: u64,
    }

    pub(crate) fn unused() -> impl OutboxEvent {
        Unused { id: 1 }
    }
}

#[test]
fn generated_code_is_warning_free() {
    assert_eq!(events::OrderPaid::TOPIC, "order.paid");
    assert_eq!(
        events::OrderPaid::msg_id_for("o-1").unwrap().as_str(),
        "o-1:OrderPaid"
    );
    assert_eq!(
        events::Wrapped::<u8>::msg_id_for("acme", 3)
            .unwrap()
            .as_str(),
        "acme/3:Wrapped"
    );
    assert_eq!(
        <events::OrderEvent as OutboxEvent>::TOPICS,
        ["orders", "refunds"]
    );
    let audited = internal::Audited { audit_id: 5 };
    assert_eq!(audited.audit_id, 5);
    assert_eq!(audited.msg_id().unwrap().as_str(), "5:Audited");
    assert_eq!(internal::unused().event_type(), "Unused");
    assert_eq!(
        overridden::Moved::<u8>::msg_id_for("t-1").unwrap().as_str(),
        "t-1:Moved"
    );
    let opened = overridden::Account::Opened {
        account: "a-1".into(),
    };
    assert_eq!(opened.ordering_key(), "a-1");
}
