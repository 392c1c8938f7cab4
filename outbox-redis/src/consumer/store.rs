//! The idempotency store a consumer runs its transactions on: broker-free, in
//! outbox-core ([`ConsumerStore`], [`AsyncStore`]), shared with the other brokers.

pub use outbox_core::{AsyncStore, ConsumerStore};

pub(crate) use outbox_core::__private::consumer::{StoreRun, Transactions};
