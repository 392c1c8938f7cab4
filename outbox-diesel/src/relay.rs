#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::time::Duration;

use diesel::connection::TransactionManager as _;
use diesel::r2d2::{ConnectionManager, PooledConnection, R2D2Connection};
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

/// Which rows a relay store's claim may hand to the relay.
///
/// # Per key (the default)
///
/// Messages that share a key (by default the msg_id's business key) reach the broker in
/// id order, also across retries and with any number of relay instances, by a stateless
/// rule (ARCHITECTURE.md, "Order per key"):
///
/// 1. lock a batch `L`: due NEW rows in id order, `LIMIT n FOR UPDATE SKIP LOCKED`,
///    skipping keys whose oldest NEW row waits for its retry time;
/// 2. keep a row `o` of `L` only if no NEW row outside `L` has `o`'s key and a smaller
///    id: a row locked by another relay, or waiting for its retry, holds back the later
///    rows of its key (one probe per key of `L` on the index of NEW rows by
///    `(msg_key, id)`);
/// 3. hand the kept rows to the relay in id order; the others stay NEW and are
///    released at commit.
///
/// A hot key is not capped at one message per batch: all of its rows in `L` go out in
/// one batch when nothing older holds them back. The cost over [`Unordered`](Self::Unordered):
/// on PostgreSQL, in the same statement, a second walk of the id range the claim
/// covered (which finds the NEW rows the batch does not hold) and a look at the small
/// index of rows waiting for a retry (`outbox_retrying`): about 1.6 times the unordered
/// claim's time; on SQLite, in the same statement, and on MySQL/MariaDB, in a second
/// statement of the claim's transaction, one index lookup per candidate row and one per
/// key of the batch. Rows held back by another relay are locked by this
/// claim until it completes, so they are skipped by third relays meanwhile.
///
/// Caveat: id order is commit order for a key only when writes to one key are
/// serialized, as they are when the business updates the aggregate's row before it
/// emits (the usual case). Two transactions that emit for the same key concurrently
/// get ids in insert order but may commit in the other order; the relay may then
/// publish the later id first, if it claims between the two commits. A dead-lettered
/// message no longer holds back its key.
///
/// Within a batch, see [`outbox_core::Relay`] for what happens when the broker rejects
/// one message and accepts a later one of the same key.
///
/// # Unordered
///
/// Plain `SKIP LOCKED` in id order: each relay publishes its batch in id order, but a
/// later message of a key may overtake one that is retrying or that another instance
/// is publishing at the same time. Faster when order does not matter.
///
/// SQLite runs one relay per database, so its unordered claim is in id order except
/// across retries; the per-key mode there only holds back the later messages of a key
/// whose older message waits for its retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ClaimOrder {
    /// Keep each key in id order (the default; see above).
    #[default]
    PerKey,
    /// Claim due NEW rows in id order with plain `SKIP LOCKED`, with no per-key guard.
    Unordered,
}

/// The default stall timeout (`with_stall_timeout`) of the stores with row locks:
/// 30 s, well above the Redis publisher's 5 s response timeout and under a minute.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A batch claimed with row locks (PostgreSQL, MySQL/MariaDB): it owns a pooled
/// connection whose transaction holds `FOR UPDATE` locks on the claimed rows, so
/// concurrent relays skip them (`SKIP LOCKED`).
///
/// [`complete`](ClaimedBatch::complete) writes the outcome and commits. Dropping the
/// batch instead rolls the transaction back on a blocking thread, leaving every row as
/// it was; should that fail, the pool discards the connection (it is still inside a
/// transaction) and the server rolls back when it closes. A crashed relay's locks go
/// with its connection, so its rows become claimable again without an operator; a
/// stalled one's go when the server ends its transaction after the store's stall
/// timeout.
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
    /// Claims up to `limit` due NEW rows on a connection of `pool` (PostgreSQL and MySQL;
    /// SQLite claims under its lease instead), in a transaction that the server ends if
    /// it sits idle for `stall` (the store's `with_stall_timeout`).
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) async fn claim(
        pool: diesel::r2d2::Pool<ConnectionManager<C>>,
        limit: usize,
        order: ClaimOrder,
        stall: Duration,
    ) -> Result<Self> {
        blocking(move || {
            let mut conn = pool.get()?;
            let c: &mut C = &mut conn;
            c.__begin_bounded_claim(stall)?;
            let claimed = match order {
                ClaimOrder::PerKey => c.__claim_per_key(limit),
                ClaimOrder::Unordered => c.__claim(limit),
            };
            let claimed = match claimed {
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
    use std::time::Duration;

    use diesel::MysqlConnection;
    use outbox_core::{Backlog, RelayStore};

    use super::{ClaimOrder, LockedBatch, blocking};
    use crate::{MysqlPool, OutboxConnection as _};

    /// The relay's store on MySQL / MariaDB: claims with `FOR UPDATE SKIP LOCKED` in a
    /// READ COMMITTED transaction on a pooled connection, so any number of relays can
    /// run side by side, in per-key order by default ([`ClaimOrder`]). Waiting for work
    /// polls.
    ///
    /// # A stalled relay
    ///
    /// A relay that stops answering while it holds a batch (its process stopped, its VM
    /// paused, its network cut) holds that batch's row locks, and in per-key order the
    /// later messages of its keys, until the server drops its connection. The store
    /// bounds that by the [stall timeout](Self::with_stall_timeout) (default 30 s): it
    /// sets these session variables on the connection of each claim:
    ///
    /// - `idle_transaction_timeout` (MariaDB 10.3+): the server closes a connection that
    ///   sits idle inside a transaction that long, which rolls the batch back and
    ///   releases its rows to the other relays;
    /// - `innodb_lock_wait_timeout`: no statement of the relay waits longer for a lock.
    ///
    /// MySQL has no `idle_transaction_timeout` (the setting is skipped there): bound a
    /// stalled relay with a `wait_timeout` on the relay's connections instead. The
    /// variables are session settings, so they stay on the pooled connections: give
    /// the store a pool of its own rather than your application's.
    #[derive(Debug, Clone)]
    pub struct MysqlRelayStore {
        pool: MysqlPool,
        order: ClaimOrder,
        stall: Duration,
    }

    impl MysqlRelayStore {
        /// A store over `pool` claiming in [`ClaimOrder::PerKey`]. Each claimed batch
        /// holds one pooled connection until it is completed.
        pub fn new(pool: MysqlPool) -> Self {
            Self {
                pool,
                order: ClaimOrder::default(),
                stall: super::DEFAULT_STALL_TIMEOUT,
            }
        }

        /// Sets the stall timeout (default 30 s, whole seconds, rounded up): how long the
        /// server keeps a claimed batch whose relay has gone silent before it rolls the
        /// batch back, so that another relay takes its rows and keys over (see
        /// [a stalled relay](Self#a-stalled-relay)). It must exceed the longest time a
        /// relay may take to publish one batch (with the Redis publisher, its response
        /// timeout, 5 s by default, per round trip of the batch): a batch that takes
        /// longer loses its claim, is published again by another relay, and the slow relay
        /// backs off as after a database outage. `Duration::ZERO` sets nothing: the
        /// server's settings apply.
        pub fn with_stall_timeout(mut self, timeout: Duration) -> Self {
            self.stall = timeout;
            self
        }

        /// The stall timeout.
        pub fn stall_timeout(&self) -> Duration {
            self.stall
        }

        /// Sets the claim order.
        pub fn with_order(mut self, order: ClaimOrder) -> Self {
            self.order = order;
            self
        }

        /// The claim order.
        pub fn order(&self) -> ClaimOrder {
            self.order
        }

        /// The pool.
        pub fn pool(&self) -> &MysqlPool {
            &self.pool
        }
    }

    impl RelayStore for MysqlRelayStore {
        type Batch = LockedBatch<MysqlConnection>;

        async fn claim(&self, limit: usize) -> Result<Self::Batch, outbox_core::Error> {
            Ok(LockedBatch::claim(self.pool.clone(), limit, self.order, self.stall).await?)
        }

        async fn backlog(&self) -> Result<Backlog, outbox_core::Error> {
            let pool = self.pool.clone();
            Ok(blocking(move || pool.get()?.__backlog()).await?)
        }

        /// Yes: a claim skips the rows another claim holds (`SKIP LOCKED`), and the
        /// per-key claim holds back the later rows of their keys.
        fn claims_ahead(&self) -> bool {
            true
        }
    }
}
