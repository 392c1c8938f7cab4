use crate::{Error, HandlerError, MsgId};

/// Whether a message was applied or had been applied before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Processed {
    /// The handler ran and its writes committed with the dedup row.
    Applied,
    /// `(consumer_group, msg_id)` was already recorded: the handler did not run.
    Duplicate,
}

/// The consumer's idempotency store: records `(consumer_group, msg_id)` in the same
/// transaction as the handler's writes.
///
/// Implementations are synchronous (diesel is); async runners call them on a blocking
/// thread.
pub trait Inbox: Send + Sync + 'static {
    /// What handlers receive to write with: the transaction's connection.
    type Conn;

    /// In one transaction: insert the dedup row; if it was new, run `handle` with the
    /// transaction's connection; commit if both succeeded, roll back otherwise.
    ///
    /// A duplicate is `Ok(Processed::Duplicate)`, not an error, and does not run `handle`.
    /// A handler failure is `Err(Error::Handler(..))` and leaves no dedup row.
    fn process<F>(&self, group: &str, msg_id: &MsgId, handle: F) -> Result<Processed, Error>
    where
        F: FnOnce(&mut Self::Conn) -> Result<(), HandlerError>;
}
