//! The consumer's idempotency store on diesel-async: [`AsyncDieselInbox`], the async twin
//! of [`DieselInbox`](crate::DieselInbox).

use std::future::Future;
use std::num::NonZeroU32;
use std::ops::DerefMut;

use diesel_async::pooled_connection::deadpool::{Pool, PoolError};
use diesel_async::pooled_connection::{
    AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod,
};
use diesel_async::{AsyncConnection, TransactionManager};
use outbox_core::{AsyncInbox, HandlerError, InboxBatchOutcomes, MsgId, Processed, TxFuture};

use crate::backend::check_group;
use crate::inbox::{ENDED, Failure, TxError, store_error};
use crate::{Error, Result, is_transient};

/// The diesel-async connections [`AsyncDieselInbox`] works with: `AsyncPgConnection`
/// (feature `async-postgres`) and `AsyncMysqlConnection` (feature `async-mysql`).
/// Crate-private, so the inbox's bound is sealed. Each backend runs the statements of
/// the blocking inbox (the same `INSERT .. ON CONFLICT DO NOTHING` / `INSERT IGNORE`).
pub(crate) trait AsyncInboxConnection: AsyncConnection + Send + 'static {
    /// diesel-async's deadpool pool of this connection type. (An associated type: the
    /// pool type's bounds are met per connection type, and cannot be stated generically.)
    type Pool: Clone + Send + Sync + 'static;
    /// A connection checked out of [`Pool`](Self::Pool).
    type Pooled: DerefMut<Target = Self> + Send;

    /// A connection from `pool`.
    fn checkout(
        pool: &Self::Pool,
    ) -> impl Future<Output = std::result::Result<Self::Pooled, PoolError>> + Send;

    /// The most connections `pool` opens.
    fn max_size(pool: &Self::Pool) -> usize;

    /// Takes `pooled` out of its pool and closes it.
    fn discard(pooled: Self::Pooled);

    /// Inserts a dedup row; `false` if it was there.
    fn insert_consumed(
        &mut self,
        group: &str,
        msg_id: &str,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Commits the open transaction if it can commit. `Ok(Err(e))`: it cannot (an
    /// ignored failed statement, `e`) and is still open, to be rolled back; `Err`: the
    /// store failed (the transaction is over, or the connection lost). See the blocking
    /// `Database::commit_checked`.
    fn commit_checked(&mut self) -> impl Future<Output = Result<Result<()>>> + Send;

    /// Whether the transaction this connection began is still open on the server (MySQL
    /// ends it on a deadlock); see the blocking `Database::transaction_open`.
    fn transaction_open(&mut self) -> impl Future<Output = Result<bool>> + Send;
}

#[doc = include_str!("../docs/async_diesel_inbox.md")]
#[allow(private_bounds)] // the crate-private `AsyncInboxConnection` is the seal
pub struct AsyncDieselInbox<C: AsyncInboxConnection> {
    pool: C::Pool,
}

#[allow(private_bounds)]
impl<C: AsyncInboxConnection> Clone for AsyncDieselInbox<C> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
        }
    }
}

#[allow(private_bounds)]
impl<C: AsyncInboxConnection> std::fmt::Debug for AsyncDieselInbox<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncDieselInbox")
            .field("max_size", &C::max_size(&self.pool))
            .finish_non_exhaustive()
    }
}

#[allow(private_bounds)]
impl<C: AsyncInboxConnection> AsyncDieselInbox<C> {
    async fn checkout(&self) -> std::result::Result<Checkout<C>, outbox_core::Error> {
        let pooled = C::checkout(&self.pool)
            .await
            .map_err(|e| Error::AsyncPool(Box::new(e)))?;
        Ok(Checkout(Some(pooled)))
    }
}

/// A checked-out connection that never goes back to the pool inside a transaction.
///
/// A message's future can be dropped mid-transaction (a cancelled task, the consumer's
/// shutdown timeout), and a panic can unwind through it. deadpool would take the
/// connection back as it is and test it only at its next checkout, so its transaction,
/// with the dedup row's lock, would stay open on an idle connection, and another
/// consumer's insert of that row would wait for it. Closing the connection instead makes
/// the server roll the transaction back at once.
struct Checkout<C: AsyncInboxConnection>(Option<C::Pooled>);

impl<C: AsyncInboxConnection> Checkout<C> {
    fn conn(&mut self) -> &mut C {
        self.0.as_mut().expect("taken only on drop")
    }
}

impl<C: AsyncInboxConnection> Drop for Checkout<C> {
    fn drop(&mut self) {
        if let Some(mut pooled) = self.0.take()
            && depth(&mut *pooled).map_or(true, |d| d != 0)
        {
            C::discard(pooled);
        }
    }
}

/// The constructors of one backend's inbox: `new`, `connect` and `pool`, the same for
/// each connection type (a macro: the pool type cannot be named generically).
macro_rules! constructors {
    ($feature:literal, $conn:ty) => {
        #[cfg(feature = $feature)]
        impl AsyncDieselInbox<$conn> {
            /// An inbox over `pool`.
            pub fn new(pool: Pool<$conn>) -> Self {
                Self { pool }
            }

            /// An inbox over a new pool of at most `max_size` connections to
            /// `database_url` (opened when first needed), built for the consumer: a
            /// connection is not tested with a query before each transaction
            /// (diesel-async's default `RecyclingMethod::Verified` adds a round trip to
            /// every message; see [`DieselInbox`](crate::DieselInbox)'s "Speed"). A
            /// connection the server dropped fails its message's transaction, which is
            /// not acknowledged and runs again; the pool discards the connection.
            pub fn connect(database_url: &str, max_size: usize) -> Result<Self> {
                let mut config = ManagerConfig::default();
                config.recycling_method = RecyclingMethod::Fast;
                let manager =
                    AsyncDieselConnectionManager::<$conn>::new_with_config(database_url, config);
                let pool = Pool::builder(manager)
                    .max_size(max_size)
                    .build()
                    .map_err(|e| Error::AsyncPool(Box::new(e)))?;
                Ok(Self::new(pool))
            }

            /// The pool.
            pub fn pool(&self) -> &Pool<$conn> {
                &self.pool
            }
        }
    };
}

constructors!("async-postgres", diesel_async::AsyncPgConnection);
constructors!("async-mysql", diesel_async::AsyncMysqlConnection);

impl<C: AsyncInboxConnection> AsyncInbox for AsyncDieselInbox<C> {
    type Conn = C;

    fn capacity(&self) -> Option<usize> {
        Some(C::max_size(&self.pool))
    }

    async fn process<'a, F>(
        &'a self,
        group: &'a str,
        msg_id: &'a MsgId,
        handle: F,
    ) -> std::result::Result<Processed, outbox_core::Error>
    where
        F: for<'c> FnOnce(&'c mut C) -> TxFuture<'c> + Send + 'a,
    {
        check_group(group, msg_id)?;
        let mut conn = self.checkout().await?;
        let c = conn.conn();
        Tm::<C>::begin_transaction(c)
            .await
            .map_err(|e| store_error(e.into()))?;
        let failed = match run_one(c, group, msg_id, handle).await {
            Ok(processed) => match c.commit_checked().await {
                Ok(Ok(())) => return Ok(processed),
                Ok(Err(e)) => TxError::Handler(HandlerError::msg(format_args!(
                    "the handler's writes could not be kept (did it ignore a failed statement?): {}",
                    outbox_core::error_chain(&e)
                ))),
                Err(e) => TxError::Store(e),
            },
            Err(e) => e,
        };
        // As diesel-async's `transaction` would: roll back; a connection left inside a
        // transaction is not handed out again by the pool, and the server rolls back.
        let _ = unwind_to(c, 0).await;
        Err(failed.into_core())
    }

    async fn process_batch<'a, F>(
        &'a self,
        group: &'a str,
        msg_ids: &'a [MsgId],
        mut handle: F,
    ) -> std::result::Result<InboxBatchOutcomes, outbox_core::Error>
    where
        F: for<'c> FnMut(usize, &'c mut C) -> TxFuture<'c> + Send + 'a,
    {
        let Some(first) = msg_ids.first() else {
            return Ok(Vec::new());
        };
        check_group(group, first)?;
        let mut conn = self.checkout().await?;
        let c = conn.conn();
        Tm::<C>::begin_transaction(c)
            .await
            .map_err(|e| store_error(e.into()))?;
        let outcomes = async {
            let mut outcomes = Vec::with_capacity(msg_ids.len());
            for (i, msg_id) in msg_ids.iter().enumerate() {
                let handle = &mut handle;
                outcomes.push(in_savepoint(c, group, msg_id, move |c| handle(i, c)).await?);
            }
            Tm::<C>::commit_transaction(c).await.map_err(|e| {
                // PostgreSQL checks SERIALIZABLE transactions at COMMIT.
                if is_transient(&e) {
                    outbox_core::Error::TransientBatch {
                        msg_id: None,
                        source: Box::new(Error::from(e)),
                    }
                } else {
                    store_error(e.into())
                }
            })?;
            Ok::<_, outbox_core::Error>(outcomes)
        }
        .await;
        if outcomes.is_err() {
            // Best effort: a connection still in a transaction is not handed out again.
            let _ = unwind_to(c, 0).await;
        }
        outcomes
    }
}

type Tm<C> = <C as AsyncConnection>::TransactionManager;

/// The dedup insert and the handler of one message, in the open transaction.
async fn run_one<C: AsyncInboxConnection>(
    c: &mut C,
    group: &str,
    msg_id: &MsgId,
    handle: impl for<'c> FnOnce(&'c mut C) -> TxFuture<'c>,
) -> std::result::Result<Processed, TxError> {
    if !c.insert_consumed(group, msg_id.as_str()).await? {
        return Ok(Processed::Duplicate);
    }
    handle(c).await.map_err(TxError::Handler)?;
    check_handler_left_committable(c).await?;
    Ok(Processed::Applied)
}

/// The blocking inbox's check of the same name: a handler that returned `Ok` must not
/// have left the transaction unable to commit (a nested transaction of its own still
/// open; on MySQL a deadlock it swallowed, which ended the transaction).
async fn check_handler_left_committable<C: AsyncInboxConnection>(
    c: &mut C,
) -> std::result::Result<(), TxError> {
    if depth(c)? != 1 {
        unwind_to(c, 1).await?;
        return Err(TxError::Handler(HandlerError::msg(
            "the handler returned with a transaction of its own still open",
        )));
    }
    if !c.transaction_open().await? {
        return Err(TxError::Ended);
    }
    Ok(())
}

/// The transaction nesting depth: 0 outside a transaction, 1 in it, 2 in a savepoint.
fn depth<C: AsyncConnection>(c: &mut C) -> Result<u32> {
    let depth = Tm::<C>::transaction_manager_status_mut(c).transaction_depth()?;
    Ok(depth.map_or(0, NonZeroU32::get))
}

/// Rolls back savepoints (and at 0 the transaction) until the depth is `target`; see the
/// blocking inbox's `unwind_to`.
async fn unwind_to<C: AsyncConnection>(c: &mut C, target: u32) -> Result<()> {
    let mut first = None;
    loop {
        let before = depth(c)?;
        if before <= target {
            return first.map_or(Ok(()), Err);
        }
        if let Err(e) = Tm::<C>::rollback_transaction(c).await {
            if depth(c)? >= before {
                return Err(e.into());
            }
            first.get_or_insert(e.into());
        }
    }
}

/// One message of a batch in its own savepoint: the blocking inbox's `in_savepoint`,
/// awaited. The inner result is the message's outcome; the outer error ends the batch,
/// with nothing committed.
async fn in_savepoint<C: AsyncInboxConnection>(
    c: &mut C,
    group: &str,
    msg_id: &MsgId,
    handle: impl for<'c> FnOnce(&'c mut C) -> TxFuture<'c>,
) -> std::result::Result<std::result::Result<Processed, outbox_core::Error>, outbox_core::Error> {
    let outer = depth(c).map_err(store_error)?;
    Tm::<C>::begin_transaction(c)
        .await
        .map_err(|e| store_error(e.into()))?;
    let failure = match c.insert_consumed(group, msg_id.as_str()).await {
        Ok(false) => {
            Tm::<C>::commit_transaction(c)
                .await
                .map_err(|e| store_error(e.into()))?;
            return Ok(Ok(Processed::Duplicate));
        }
        Err(e) => Failure::Store(e),
        Ok(true) => {
            let handled = handle(c).await;
            let balanced = depth(c).map_err(store_error)? == outer + 1;
            match handled {
                Ok(()) if balanced => match Tm::<C>::commit_transaction(c).await {
                    Ok(()) => return Ok(Ok(Processed::Applied)),
                    Err(e) => {
                        restore_savepoint(c, outer).await;
                        Failure::Release(e)
                    }
                },
                Ok(()) => Failure::Handler(
                    "the handler returned with a transaction of its own still open".into(),
                ),
                Err(e) => Failure::Handler(e.into_inner()),
            }
        }
    };
    // Rolls back the handler's own open savepoints too, then this message's.
    let unwound = unwind_to(c, outer).await;
    // A deadlock on MySQL has ended the whole transaction: ask the server.
    if !c.transaction_open().await.map_err(store_error)? {
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
    unwound.map_err(store_error)?;
    if failure.is_transient() {
        return Ok(Err(outbox_core::Error::Transient(failure.into_source())));
    }
    Ok(Err(match failure {
        Failure::Handler(e) => outbox_core::Error::Handler(e),
        Failure::Store(e) => return Err(e.into()),
        Failure::Release(e) => HandlerError::msg(format_args!(
            "the handler's writes could not be kept (did it ignore a failed statement?): {e}"
        ))
        .into(),
    }))
}

/// After a failed `RELEASE SAVEPOINT`: diesel-async counts the savepoint as left, while
/// PostgreSQL (after a failed statement the handler ignored) keeps it, and the
/// transaction aborted. Rolling back to it by name makes the transaction usable again
/// for the batch's next messages, and its depth match diesel-async's count. diesel-async
/// names the savepoint entered at depth `outer` `diesel_savepoint_{outer}` (its
/// `begin_transaction`; pinned by the tests of this crate). If it is gone (MySQL ended
/// the transaction on a deadlock), this fails and `in_savepoint` finds out why.
async fn restore_savepoint<C: AsyncInboxConnection>(c: &mut C, outer: u32) {
    if depth(c).is_ok_and(|d| d == outer) {
        let _ = c
            .batch_execute(&format!("ROLLBACK TO SAVEPOINT diesel_savepoint_{outer}"))
            .await;
    }
}
