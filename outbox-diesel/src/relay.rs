use diesel::connection::TransactionManager as _;
use diesel::r2d2::{ConnectionManager, Pool, PooledConnection, R2D2Connection};
use outbox_core::{BatchOutcome, ClaimedBatch, StoredMessage};

use crate::{Error, OutboxConnection, OutboxRecord, Result};

/// Runs blocking diesel work on tokio's blocking pool.
pub(crate) async fn blocking<T, F>(f: F) -> Result<T>
where
    F: FnOnce() -> Result<T> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Task(e.to_string()))?
}

pub(crate) fn stored(records: Vec<OutboxRecord>) -> Vec<StoredMessage> {
    records
        .into_iter()
        .map(|r| StoredMessage {
            id: r.id,
            retries: r.retries,
            envelope: r.envelope,
        })
        .collect()
}

/// A batch claimed with row locks (PostgreSQL, MySQL/MariaDB): it owns a pooled
/// connection whose transaction holds `FOR UPDATE` locks on the claimed rows, so
/// concurrent relays skip them (`SKIP LOCKED`).
///
/// [`complete`](ClaimedBatch::complete) writes the outcome and commits. Dropping the
/// batch instead rolls the transaction back on a blocking thread, leaving every row as
/// it was; should that fail, the pool discards the connection (it is still inside a
/// transaction) and the server rolls back when it closes. A crashed relay's locks go
/// with its connection, so its rows become claimable again without an operator.
pub struct LockedBatch<C: R2D2Connection + 'static> {
    conn: Option<PooledConnection<ConnectionManager<C>>>,
    messages: Vec<StoredMessage>,
}

impl<C: R2D2Connection + 'static> std::fmt::Debug for LockedBatch<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockedBatch")
            .field("messages", &self.messages.len())
            .field("holds_locks", &self.conn.is_some())
            .finish()
    }
}

fn rollback<C: R2D2Connection>(conn: &mut C) {
    if let Err(e) = C::TransactionManager::rollback_transaction(conn) {
        tracing::warn!(error = %e, "rolling back a released outbox batch failed; the pool drops the connection");
    }
}

impl<C: OutboxConnection + R2D2Connection> LockedBatch<C> {
    /// Claims up to `limit` due NEW rows on a connection of `pool`.
    pub(crate) async fn claim(pool: Pool<ConnectionManager<C>>, limit: usize) -> Result<Self> {
        blocking(move || {
            let mut conn = pool.get()?;
            let c: &mut C = &mut conn;
            c.__begin_claim()?;
            let claimed = match c.__claim(limit) {
                Ok(rows) => rows,
                Err(e) => {
                    rollback(c);
                    return Err(e);
                }
            };
            if claimed.is_empty() {
                // Nothing to hold: end the transaction now.
                C::TransactionManager::commit_transaction(c)?;
                return Ok(Self {
                    conn: None,
                    messages: Vec::new(),
                });
            }
            Ok(Self {
                conn: Some(conn),
                messages: stored(claimed),
            })
        })
        .await
    }
}

impl<C: R2D2Connection + 'static> Drop for LockedBatch<C> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        let release = move || {
            let mut conn = conn;
            rollback::<C>(&mut conn);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(release);
            }
            Err(_) => release(),
        }
    }
}

impl<C: OutboxConnection + R2D2Connection> ClaimedBatch for LockedBatch<C> {
    fn messages(&self) -> &[StoredMessage] {
        &self.messages
    }

    async fn complete(mut self, outcome: BatchOutcome) -> Result<(), outbox_core::Error> {
        let Some(mut conn) = self.conn.take() else {
            return Ok(());
        };
        blocking(move || {
            let c: &mut C = &mut conn;
            let done = c
                .__complete(&outcome)
                .and_then(|()| Ok(C::TransactionManager::commit_transaction(c)?));
            if done.is_err() {
                rollback(c);
            }
            done
        })
        .await
        .map_err(Into::into)
    }
}

#[cfg(feature = "mysql")]
pub use mysql_store::MysqlRelayStore;

#[cfg(feature = "mysql")]
mod mysql_store {
    use diesel::MysqlConnection;
    use outbox_core::{Backlog, RelayStore};

    use super::{LockedBatch, blocking};
    use crate::{MysqlPool, OutboxConnection as _};

    /// The relay's store on MySQL / MariaDB: claims with `FOR UPDATE SKIP LOCKED` in a
    /// READ COMMITTED transaction on a pooled connection, so any number of relays can
    /// run side by side. Waiting for work polls.
    #[derive(Debug, Clone)]
    pub struct MysqlRelayStore {
        pool: MysqlPool,
    }

    impl MysqlRelayStore {
        /// A store over `pool`. Each claimed batch holds one pooled connection until it
        /// is completed.
        pub fn new(pool: MysqlPool) -> Self {
            Self { pool }
        }

        /// The pool.
        pub fn pool(&self) -> &MysqlPool {
            &self.pool
        }
    }

    impl RelayStore for MysqlRelayStore {
        type Batch = LockedBatch<MysqlConnection>;

        async fn claim(&self, limit: usize) -> Result<Self::Batch, outbox_core::Error> {
            Ok(LockedBatch::claim(self.pool.clone(), limit).await?)
        }

        async fn backlog(&self) -> Result<Backlog, outbox_core::Error> {
            let pool = self.pool.clone();
            Ok(blocking(move || pool.get()?.__backlog()).await?)
        }
    }
}
