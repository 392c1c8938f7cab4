//! Where a consumer runs the work on its messages, chosen once from its store's kind:
//! broker-free, in outbox-core.

pub(crate) use outbox_core::__private::consumer::{Executor, block_on, waker};
