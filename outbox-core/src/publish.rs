use std::future::Future;

use crate::{Error, StoredMessage};

/// One message the broker refused. It spends a retry; the rest of the batch is unaffected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// Why, as stored in the row's `last_error`.
    pub reason: String,
}

impl Rejected {
    /// A rejection with a reason.
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
        }
    }
}

/// Per-message results of [`Publisher::publish`], aligned with the batch.
pub type PublishOutcomes = Vec<Result<(), Rejected>>;

/// A broker the relay publishes to, a batch at a time.
///
/// Return `Err(Error::BrokerUnavailable(..))` when the broker as a whole failed (connection
/// refused, timeout): the relay then backs off and spends no message's retries. Return
/// `Ok` with one entry per message otherwise, `Err(Rejected)` for a message the broker
/// refused on its own.
pub trait Publisher: Send + Sync {
    /// Publishes `batch` (in id order; keep that order per topic).
    fn publish(
        &self,
        batch: &[StoredMessage],
    ) -> impl Future<Output = Result<PublishOutcomes, Error>> + Send;
}

impl<P: Publisher> Publisher for std::sync::Arc<P> {
    fn publish(
        &self,
        batch: &[StoredMessage],
    ) -> impl Future<Output = Result<PublishOutcomes, Error>> + Send {
        (**self).publish(batch)
    }
}
