//! Where the failure path writes: the outbox's own database, PostgreSQL's or (feature
//! `mysql`) MySQL's. The publishing logic ([`Deliverer`](crate::deliver::Deliverer)) is
//! the same for both relays; only its writes differ.

use crate::park::{Writes, db};
use crate::{PgPool, Result};

/// Writes the outcome of a publish call: refused rows, parked messages, re-published ones.
pub(crate) trait FailureWrites: Send + Sync {
    /// Writes `writes` in one transaction.
    fn write(&self, writes: Writes) -> impl Future<Output = Result<()>> + Send;
}

impl FailureWrites for PgPool {
    async fn write(&self, writes: Writes) -> Result<()> {
        db(self, move |c| writes.apply(c)).await
    }
}
