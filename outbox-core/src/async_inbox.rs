use std::future::Future;
use std::pin::Pin;

use crate::{Error, HandlerError, InboxBatchOutcomes, MsgId, Processed};

/// What a handler given to an [`AsyncInbox`] returns: a boxed future that borrows the
/// transaction's connection (diesel-async's `transaction` takes the same shape, through
/// `scoped_futures`). Make one with `Box::pin(async move { .. })`.
pub type TxFuture<'c> = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send + 'c>>;

/// The consumer's idempotency store on an async database connection: [`Inbox`]'s
/// contract, awaited instead of run on a blocking thread.
///
/// Records `(consumer_group, msg_id)` in the same transaction as the handler's writes;
/// the handler receives that transaction's connection (`&mut AsyncPgConnection` with
/// `outbox-diesel`'s `AsyncPgInbox`). Every rule of [`Inbox::process`] and
/// [`Inbox::process_batch`] holds here, outcome for outcome: a duplicate is
/// `Ok(Processed::Duplicate)` and does not run the handler; a handler failure is
/// [`Error::Handler`] and leaves no dedup row; a transient conflict is
/// [`Error::Transient`] (or [`Error::TransientBatch`] for a batch the database rolled back
/// as a whole); a store failure is an outage ([`Error::is_outage`]); rolled-back work is
/// never reported `Applied`.
///
/// A panic in the handler's future unwinds out of `process`; the connection, still inside
/// the transaction, must not be reused (diesel-async's pools discard a connection returned
/// with a transaction open). [`Dispatcher::consume_async`](crate::Dispatcher::consume_async)
/// catches a handler's panic inside the transaction and reports it as the handler's error.
/// Dropping the future (a cancelled task, a shutdown timeout) likewise leaves the
/// transaction uncommitted.
///
/// [`Inbox`]: crate::Inbox
/// [`Inbox::process`]: crate::Inbox::process
/// [`Inbox::process_batch`]: crate::Inbox::process_batch
pub trait AsyncInbox: Send + Sync + 'static {
    /// What handlers receive to write with: the transaction's connection.
    type Conn: Send;

    /// In one transaction: insert the dedup row; if it was new, run `handle` with the
    /// transaction's connection and await it; commit if both succeeded, roll back
    /// otherwise. The outcomes are [`Inbox::process`](crate::Inbox::process)'s.
    fn process<'a, F>(
        &'a self,
        group: &'a str,
        msg_id: &'a MsgId,
        handle: F,
    ) -> impl Future<Output = Result<Processed, Error>> + Send + 'a
    where
        F: for<'c> FnOnce(&'c mut Self::Conn) -> TxFuture<'c> + Send + 'a;

    /// How many transactions the store can run at once (a pool's size), if bounded; see
    /// [`Inbox::capacity`](crate::Inbox::capacity).
    fn capacity(&self) -> Option<usize> {
        None
    }

    /// Processes many messages; the outcomes are
    /// [`Inbox::process_batch`](crate::Inbox::process_batch)'s, one per msg_id, in order.
    ///
    /// The default implementation awaits [`process`](Self::process) once per message:
    /// each message commits on its own, a store failure is that message's outcome, and
    /// the outer `Err` is never returned.
    fn process_batch<'a, F>(
        &'a self,
        group: &'a str,
        msg_ids: &'a [MsgId],
        mut handle: F,
    ) -> impl Future<Output = Result<InboxBatchOutcomes, Error>> + Send + 'a
    where
        F: for<'c> FnMut(usize, &'c mut Self::Conn) -> TxFuture<'c> + Send + 'a,
    {
        async move {
            let mut outcomes = Vec::with_capacity(msg_ids.len());
            for (i, msg_id) in msg_ids.iter().enumerate() {
                let handle = &mut handle;
                outcomes.push(self.process(group, msg_id, move |c| handle(i, c)).await);
            }
            Ok(outcomes)
        }
    }
}
