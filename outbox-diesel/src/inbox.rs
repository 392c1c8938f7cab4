use std::collections::HashSet;
use std::num::NonZeroU32;

use diesel::connection::TransactionManager;
use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use outbox_core::{
    BoxError, HandlerError, Inbox, InboxBatchOutcomes, MsgId, Processed, error_chain,
};

use crate::backend::{Database as _, check_group};
use crate::error::has_transient_cause;
use crate::{Error, OutboxConnection, is_transient};

#[doc = include_str!("../docs/diesel_inbox.md")]
pub struct DieselInbox<C: R2D2Connection + 'static> {
    pool: Pool<ConnectionManager<C>>,
}

impl<C: R2D2Connection + 'static> Clone for DieselInbox<C> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
        }
    }
}

impl<C: R2D2Connection + 'static> std::fmt::Debug for DieselInbox<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DieselInbox").finish_non_exhaustive()
    }
}

impl<C: R2D2Connection + 'static> DieselInbox<C> {
    /// An inbox over `pool`.
    pub fn new(pool: Pool<ConnectionManager<C>>) -> Self {
        Self { pool }
    }

    /// An inbox over a new pool of `max_size` connections to `database_url`, built for
    /// the consumer: connections are not tested on check-out (r2d2's default `SELECT 1`
    /// before each transaction, see [Speed](Self#speed)), and idle ones are closed after 10
    /// minutes, before servers and proxies usually drop them. A connection the server
    /// has dropped all the same fails its message's transaction, which is not
    /// acknowledged and runs again; the pool discards the connection.
    pub fn connect(database_url: &str, max_size: u32) -> crate::Result<Self> {
        let pool = Pool::builder()
            .max_size(max_size)
            .test_on_check_out(false)
            .idle_timeout(Some(std::time::Duration::from_secs(600)))
            .build(ConnectionManager::<C>::new(database_url))?;
        Ok(Self::new(pool))
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<ConnectionManager<C>> {
        &self.pool
    }
}

pub(crate) enum TxError {
    Store(Error),
    Handler(HandlerError),
    /// The database ended the transaction while the handler ran.
    Ended,
}

impl From<diesel::result::Error> for TxError {
    fn from(e: diesel::result::Error) -> Self {
        Self::Store(e.into())
    }
}

impl From<Error> for TxError {
    fn from(e: Error) -> Self {
        Self::Store(e)
    }
}

impl TxError {
    pub(crate) fn into_core(self) -> outbox_core::Error {
        match self {
            Self::Store(e) => store_error(e),
            Self::Handler(e) => handler_error(e),
            Self::Ended => outbox_core::Error::Transient(ENDED.into()),
        }
    }
}

/// What a handler that went on after MySQL ended its transaction did.
pub(crate) const ENDED: &str = "the database ended the transaction while the handler ran (MySQL and \
    MariaDB roll it back on a deadlock), so the dedup row is gone; the handler went on, and \
    its statements after that point ran outside the transaction, each committed on its own";

/// A handler's error: [`outbox_core::Error::Transient`] if it carries a transient database
/// error, [`outbox_core::Error::Handler`] otherwise.
pub(crate) fn handler_error(e: HandlerError) -> outbox_core::Error {
    let e = e.into_inner();
    if has_transient_cause(&*e) {
        outbox_core::Error::Transient(e)
    } else {
        outbox_core::Error::Handler(e)
    }
}

/// An error of the inbox's own statements (dedup insert, savepoints, commit): a transient
/// conflict is named as one, anything else is the store's failure.
pub(crate) fn store_error(e: Error) -> outbox_core::Error {
    if e.is_transient() {
        outbox_core::Error::Transient(Box::new(e))
    } else {
        e.into()
    }
}

impl<C: OutboxConnection + R2D2Connection> Inbox for DieselInbox<C> {
    type Conn = C;

    fn capacity(&self) -> Option<usize> {
        Some(self.pool.max_size() as usize)
    }

    fn process<F>(
        &self,
        group: &str,
        msg_id: &MsgId,
        handle: F,
    ) -> Result<Processed, outbox_core::Error>
    where
        F: FnOnce(&mut C) -> Result<(), HandlerError>,
    {
        check_group(group, msg_id)?;
        let mut conn = self.pool.get().map_err(Error::from)?;
        let c: &mut C = &mut conn;
        if let Err(e) = Tm::<C>::begin_transaction(c) {
            c.db().forget_if_lost();
            return Err(store_error(e.into()));
        }
        let failed = match run_one(c, group, msg_id, handle) {
            Ok(processed) => match c.db().commit_checked() {
                Ok(Ok(())) => return Ok(processed),
                Ok(Err(e)) => TxError::Handler(HandlerError::msg(format_args!(
                    "the handler's writes could not be kept (did it ignore a failed statement?): {e}"
                ))),
                Err(e) => TxError::Store(e),
            },
            Err(e) => e,
        };
        // As diesel's `transaction` would: roll back; a connection left inside a
        // transaction is not returned to the pool, and the server rolls back.
        let _ = unwind_to(c, 0);
        Err(failed.into_core())
    }

    fn process_batch<F>(
        &self,
        group: &str,
        msg_ids: &[MsgId],
        mut handle: F,
    ) -> Result<InboxBatchOutcomes, outbox_core::Error>
    where
        F: FnMut(usize, &mut C) -> Result<(), HandlerError>,
    {
        let Some(first) = msg_ids.first() else {
            return Ok(Vec::new());
        };
        check_group(group, first)?;
        let mut conn = self.pool.get().map_err(Error::from)?;
        let c: &mut C = &mut conn;
        if let Err(e) = Tm::<C>::begin_transaction(c) {
            c.db().forget_if_lost();
            return Err(store_error(e.into()));
        }
        let mut run = || {
            let mut distinct = HashSet::with_capacity(msg_ids.len());
            let firsts: Vec<&str> = msg_ids
                .iter()
                .map(MsgId::as_str)
                .filter(|id| distinct.insert(*id))
                .collect();
            let ahead = c
                .db()
                .insert_consumed_batch(group, &firsts)
                .map_err(|e| batch_error(e, None))?;
            if let Some(new) = ahead {
                return crate::inbox_ahead::run(c, group, msg_ids, &new, &mut handle);
            }
            let mut outcomes = Vec::with_capacity(msg_ids.len());
            for (i, msg_id) in msg_ids.iter().enumerate() {
                outcomes.push(in_savepoint(c, group, msg_id, |c| handle(i, c))?);
            }
            Tm::<C>::commit_transaction(c).map_err(commit_error)?;
            Ok::<_, outbox_core::Error>(outcomes)
        };
        let outcomes = run();
        if outcomes.is_err() {
            // Best effort: a connection still in a transaction, or whose transaction
            // state is broken, is not returned to the pool, and the server rolls back.
            let _ = unwind_to(c, 0);
        }
        outcomes
    }
}

/// A failed `COMMIT` of a batch: nothing of it committed. PostgreSQL checks
/// SERIALIZABLE transactions at `COMMIT`: a conflict there is the batch's.
pub(crate) fn commit_error(e: diesel::result::Error) -> outbox_core::Error {
    batch_error(e.into(), None)
}

/// A statement of the inbox's own that failed the whole batch: a transient conflict is
/// [`outbox_core::Error::TransientBatch`] (the consumer runs the messages again one by
/// one), anything else the store's failure.
fn batch_error(e: Error, msg_id: Option<MsgId>) -> outbox_core::Error {
    if e.is_transient() {
        outbox_core::Error::TransientBatch {
            msg_id,
            source: Box::new(e),
        }
    } else {
        store_error(e)
    }
}

/// The dedup insert and the handler of one message, in the open transaction.
fn run_one<C: OutboxConnection>(
    c: &mut C,
    group: &str,
    msg_id: &MsgId,
    handle: impl FnOnce(&mut C) -> Result<(), HandlerError>,
) -> Result<Processed, TxError> {
    if !c.db().insert_consumed(group, msg_id.as_str())? {
        return Ok(Processed::Duplicate);
    }
    handle(c).map_err(TxError::Handler)?;
    check_handler_left_committable(c)?;
    Ok(Processed::Applied)
}

/// A handler that returned `Ok` must not have left the transaction unable to commit:
/// a nested transaction of its own still open would make our commit only release it, an
/// ignored failed statement makes PostgreSQL's commit a silent rollback, and a deadlock
/// the handler swallowed on MySQL has already rolled everything back (our commit would
/// then commit nothing, and the dedup row is gone). Either way the message would be
/// acknowledged with nothing written; report an error so everything rolls back and the
/// message is retried.
fn check_handler_left_committable<C: OutboxConnection>(c: &mut C) -> Result<(), TxError> {
    if depth(c)? != 1 {
        unwind_to(c, 1)?;
        return Err(TxError::Handler(HandlerError::msg(
            "the handler returned with a transaction of its own still open",
        )));
    }
    // An ignored failed statement (PostgreSQL) is caught by the commit:
    // `Database::commit_checked`.
    if !c.db().transaction_open()? {
        return Err(TxError::Ended);
    }
    Ok(())
}

pub(crate) type Tm<C> = <C as diesel::Connection>::TransactionManager;

/// The transaction nesting depth: 0 outside a transaction, 1 in it, 2 in a savepoint.
///
/// `transaction_manager_status_mut` is hidden from diesel's docs (it is meant for
/// connection implementations) but public; it is the only way to see whether a handler
/// left a nested transaction of its own open, e.g. by panicking inside
/// `conn.transaction(..)`.
pub(crate) fn depth<C: diesel::Connection>(c: &mut C) -> Result<u32, Error> {
    let depth = Tm::<C>::transaction_manager_status_mut(c).transaction_depth()?;
    Ok(depth.map_or(0, NonZeroU32::get))
}

/// Rolls back savepoints (and at 0 the transaction) until the depth is `target`, going
/// on past a savepoint that cannot be rolled back (MySQL has dropped every savepoint when
/// it ended the transaction itself; diesel still counts the level as left). Returns the
/// first error, or an error if no level could be left (the connection is unusable).
fn unwind_to<C: diesel::Connection>(c: &mut C, target: u32) -> Result<(), Error> {
    let mut first = None;
    loop {
        let before = depth(c)?;
        if before <= target {
            return first.map_or(Ok(()), Err);
        }
        if let Err(e) = Tm::<C>::rollback_transaction(c) {
            if depth(c)? >= before {
                return Err(e.into());
            }
            first.get_or_insert(e.into());
        }
    }
}

/// Why a message of a batch did not end with its savepoint released.
pub(crate) enum Failure {
    /// The handler failed, or returned with a nested transaction still open.
    Handler(BoxError),
    /// The dedup insert failed.
    Store(Error),
    /// Releasing the savepoint failed (PostgreSQL after an ignored failed statement;
    /// MySQL after it ended the transaction).
    Release(diesel::result::Error),
}

impl Failure {
    /// A transient conflict between transactions ([`is_transient`]).
    pub(crate) fn is_transient(&self) -> bool {
        match self {
            Self::Handler(e) => has_transient_cause(&**e),
            Self::Store(e) => e.is_transient(),
            Self::Release(e) => is_transient(e),
        }
    }

    pub(crate) fn into_source(self) -> BoxError {
        match self {
            Self::Handler(e) => e,
            Self::Store(e) => Box::new(e),
            Self::Release(e) => Box::new(Error::from(e)),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Handler(e) => write!(f, "the handler failed: {}", error_chain(&**e)),
            Self::Store(e) => write!(f, "the dedup insert failed: {}", error_chain(e)),
            Self::Release(e) => write!(f, "its savepoint could not be released: {e}"),
        }
    }
}

/// One message of a batch in its own savepoint. The inner result is the message's
/// outcome; the outer error ends the batch, with nothing committed: a store failure, or
/// [`outbox_core::Error::TransientBatch`] when the database ended the batch's transaction.
pub(crate) fn in_savepoint<C: OutboxConnection>(
    c: &mut C,
    group: &str,
    msg_id: &MsgId,
    handle: impl FnOnce(&mut C) -> Result<(), HandlerError>,
) -> Result<Result<Processed, outbox_core::Error>, outbox_core::Error> {
    let outer = depth(c).map_err(store_error)?;
    Tm::<C>::begin_transaction(c).map_err(|e| store_error(e.into()))?;
    let failure = match c.db().insert_consumed(group, msg_id.as_str()) {
        Ok(false) => {
            Tm::<C>::commit_transaction(c).map_err(|e| store_error(e.into()))?;
            return Ok(Ok(Processed::Duplicate));
        }
        Err(e) => Failure::Store(e),
        Ok(true) => {
            let handled = handle(c);
            let balanced = depth(c).map_err(store_error)? == outer + 1;
            match handled {
                Ok(()) if balanced => match Tm::<C>::commit_transaction(c) {
                    Ok(()) => return Ok(Ok(Processed::Applied)),
                    Err(e) => Failure::Release(e),
                },
                Ok(()) => Failure::Handler(
                    "the handler returned with a transaction of its own still open".into(),
                ),
                Err(e) => Failure::Handler(e.into_inner()),
            }
        }
    };
    roll_back_message(c, outer, msg_id, failure, None)
}

/// Ends a failed message of a batch: rolls back to depth `outer` (the handler's own open
/// savepoints too, then the message's), deletes its dedup row if `give_back` names the
/// group (a row inserted ahead of the batch, outside the message's savepoint), and says
/// how the message ended. The outer error ends the batch, with nothing committed.
pub(crate) fn roll_back_message<C: OutboxConnection>(
    c: &mut C,
    outer: u32,
    msg_id: &MsgId,
    failure: Failure,
    give_back: Option<&str>,
) -> Result<Result<Processed, outbox_core::Error>, outbox_core::Error> {
    let unwound = unwind_to(c, outer);
    // A deadlock on MySQL has ended the whole transaction, and diesel may even report the
    // savepoint's rollback as done (after a `SerializationFailure` it tolerates failed
    // savepoint rollbacks): ask the server. If the batch's transaction is gone, nothing of
    // it committed, the earlier messages' work included.
    if !c.db().transaction_open().map_err(store_error)? {
        let source = if failure.is_transient() {
            failure.into_source()
        } else {
            format!("{ENDED}; then {failure}").into()
        };
        return Err(outbox_core::Error::TransientBatch {
            msg_id: Some(msg_id.clone()),
            source,
        });
    }
    // Otherwise a failed rollback leaves the connection unusable: the batch fails.
    unwound.map_err(store_error)?;
    if let Some(group) = give_back {
        // Its own row, locked by this transaction: no wait, no conflict.
        c.db()
            .delete_consumed(group, msg_id.as_str())
            .map_err(store_error)?;
    }
    if failure.is_transient() {
        return Ok(Err(outbox_core::Error::Transient(failure.into_source())));
    }
    Ok(Err(match failure {
        Failure::Handler(e) => outbox_core::Error::Handler(e),
        // The dedup insert failed: the store, as a whole.
        Failure::Store(e) => return Err(e.into()),
        Failure::Release(e) => HandlerError::msg(format_args!(
            "the handler's writes could not be kept (did it ignore a failed statement?): {e}"
        ))
        .into(),
    }))
}
