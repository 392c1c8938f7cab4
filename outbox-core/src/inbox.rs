use crate::{Error, HandlerError, MsgId};

/// Longest consumer group name, in bytes: the `VARCHAR(64)` of `consumed_msg`.
pub const MAX_CONSUMER_GROUP_LEN: usize = 64;

/// Whether a message was applied or had been applied before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Processed {
    /// The handler ran and its writes committed with the dedup row.
    Applied,
    /// `(consumer_group, msg_id)` was already recorded: the handler did not run.
    Duplicate,
}

/// The outcome of each message of a batch, in the order of the batch's msg_ids:
/// `Ok(Applied)`, `Ok(Duplicate)`, or that message's own error (its handler failed or
/// panicked, or it could not be decoded).
pub type InboxBatchOutcomes = Vec<Result<Processed, Error>>;

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
    /// A handler failure is `Err(Error::Handler(..))` and leaves no dedup row. A transient
    /// conflict with another transaction (a deadlock, a serialization failure, a lock
    /// wait that gave up), in the handler or the dedup insert, is
    /// `Err(Error::Transient(..))`: nothing committed, retry soon
    /// ([`Error::is_transient`]). Rolled-back work is never reported `Applied`.
    fn process<F>(&self, group: &str, msg_id: &MsgId, handle: F) -> Result<Processed, Error>
    where
        F: FnOnce(&mut Self::Conn) -> Result<(), HandlerError>;

    /// How many transactions the store can run at once, if it is bounded (a pool's
    /// size). The consumer runs at most that many at once, so that waiting for a
    /// connection is back-pressure in the runner, never a check-out timeout mistaken
    /// for an outage. The default, `None`, means unbounded.
    fn capacity(&self) -> Option<usize> {
        None
    }

    /// Processes many messages, ideally in one transaction with a savepoint per message:
    /// for each `msg_ids[i]` in order, insert the dedup row and, if it was new, run
    /// `handle(i, conn)`. A message whose handler fails rolls back only its own writes
    /// and dedup row; the others commit together.
    ///
    /// The result has one outcome per msg_id, aligned with `msg_ids`, each as
    /// [`process`](Self::process) would report it. `handle` is called at most once per
    /// index, only for messages not recorded before (a msg_id that appears twice in the
    /// batch is a [`Processed::Duplicate`] the second time, unless the first attempt
    /// failed). A message's transient conflict is its outcome `Err(Error::Transient(..))`
    /// when only its own savepoint rolled back. The outer `Err` means nothing of the batch
    /// is known to have committed: the store failed as a whole (connection lost, commit
    /// failed), and a redelivery finds out which messages did; or
    /// [`Error::TransientBatch`]: a transient conflict made the database roll back the
    /// whole transaction (MySQL and MariaDB on a deadlock), so nothing committed and the
    /// batch (or each of its messages alone) is to be retried soon.
    ///
    /// A panic in `handle` unwinds out of this method, and what the batch had not
    /// committed yet is rolled back. [`Dispatcher::consume_batch`](crate::Dispatcher::consume_batch)
    /// catches handler panics, so that one panicking handler costs only its own message.
    ///
    /// The default implementation calls [`process`](Self::process) once per message:
    /// each message commits on its own, a store failure is that message's outcome, and
    /// the outer `Err` is never returned. Stores with savepoints override it.
    ///
    /// ```
    /// use outbox_core::{Error, HandlerError, Inbox, MemoryDb, MsgId, Processed};
    ///
    /// let db = MemoryDb::new(Vec::<usize>::new());
    /// let ids = ["a:E", "b:E", "a:E"].map(|s| MsgId::new(s).unwrap());
    /// let outcomes = db.process_batch("group", &ids, |i, tx| {
    ///     tx.data().push(i);
    ///     if i == 1 { Err(HandlerError::msg("no")) } else { Ok(()) }
    /// })?;
    /// assert_eq!(outcomes[0].as_ref().ok(), Some(&Processed::Applied));
    /// assert!(matches!(outcomes[1], Err(Error::Handler(_))));
    /// assert_eq!(outcomes[2].as_ref().ok(), Some(&Processed::Duplicate));
    /// assert_eq!(db.read(|d| d.clone()), [0]); // message 1 left no trace
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    fn process_batch<F>(
        &self,
        group: &str,
        msg_ids: &[MsgId],
        mut handle: F,
    ) -> Result<InboxBatchOutcomes, Error>
    where
        F: FnMut(usize, &mut Self::Conn) -> Result<(), HandlerError>,
    {
        Ok(msg_ids
            .iter()
            .enumerate()
            .map(|(i, msg_id)| self.process(group, msg_id, |conn| handle(i, conn)))
            .collect())
    }
}
