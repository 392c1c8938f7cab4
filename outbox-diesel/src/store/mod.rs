//! The relay stores: the claim shared by the stores with row locks ([`LockedBatch`]),
//! the claim order. Each database's store is in its own module (`pg::store`,
//! `mysql::store`, `sqlite::store`).

#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::time::Duration;

use diesel::connection::TransactionManager as _;
use diesel::r2d2::{ConnectionManager, PooledConnection, R2D2Connection};
use outbox_core::{ClaimedBatch, RelayBatchOutcome, StoredMessage};

use crate::backend::Database as _;
use crate::{Error, OutboxConnection, Result};

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

/// Which rows a relay store's claim may hand to the relay.
///
/// [`PerKey`](Self::PerKey), the default, keeps messages that share a key (by default
/// the msg_id's business key) in id order, across retries and any number of relays, by
/// the stateless rule of [order per key](outbox_core::Relay#order-per-key): a row whose
/// key has an older NEW row outside the batch (held by another relay, or waiting for its
/// retry) stays NEW, and other keys go on. A dead-lettered message does not hold back its
/// key. Rows held back by another relay stay locked by this claim until it completes. The
/// cost is index probes on the NEW rows by `(msg_key, id)`: in the claim's own statement
/// on PostgreSQL and SQLite, in a second statement of its transaction on MySQL/MariaDB.
///
/// [`Unordered`](Self::Unordered) is plain `SKIP LOCKED` in id order: faster, but a later
/// message of a key may overtake one that is retrying or that another relay is
/// publishing.
///
/// SQLite runs one relay per database, so there the per-key mode only holds back the
/// later messages of a key whose older message waits for its retry.
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

/// How the stores with row locks (PostgreSQL, MySQL/MariaDB) claim: the settings behind
/// their `with_order` and `with_stall_timeout`, kept once here.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(Debug, Clone, Copy)]
pub(crate) struct LockedClaim {
    /// Which rows a claim may hand to the relay.
    pub(crate) order: ClaimOrder,
    /// How long the server keeps a claim's transaction that sits idle.
    pub(crate) stall: Duration,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl Default for LockedClaim {
    fn default() -> Self {
        Self {
            order: ClaimOrder::default(),
            stall: DEFAULT_STALL_TIMEOUT,
        }
    }
}

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
    // A COMMIT that failed has ended the transaction as well.
    if matches!(crate::inbox::depth(conn), Ok(0)) {
        return;
    }
    if let Err(e) = C::TransactionManager::rollback_transaction(conn) {
        tracing::warn!(error = %e, "rolling back a released outbox batch failed; the pool drops the connection");
    }
}

impl<C: OutboxConnection + R2D2Connection> LockedBatch<C> {
    /// Claims up to `limit` due NEW rows on a connection of `pool` (PostgreSQL and MySQL;
    /// SQLite claims under its lease instead), in a transaction that the server ends if
    /// it sits idle for the stall timeout of `how` (the store's `with_stall_timeout`), in
    /// its claim order (`with_order`). `held`: the ids of
    /// the batch in hand for a claim ahead ([`outbox_core::RelayStore::claim_after`]),
    /// else empty. `first` runs in the claim's transaction (its settings) just before
    /// the claim, in a snapshot of its own: it returns where the claim walks from
    /// (PostgreSQL's `ClaimFloor`; zero elsewhere) and what comes with the batch.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) async fn claim<T: Send + 'static>(
        pool: diesel::r2d2::Pool<ConnectionManager<C>>,
        limit: usize,
        how: LockedClaim,
        held: Vec<i64>,
        first: impl FnOnce(&mut C) -> Result<(crate::backend::Floor, T)> + Send + 'static,
    ) -> Result<(Self, T)> {
        blocking(move || {
            let mut conn = pool.get()?;
            let c: &mut C = &mut conn;
            if let Err(e) = c.db().begin_claim(how.stall) {
                c.db().forget_if_lost();
                return Err(e);
            }
            let claimed = first(c).and_then(|(floor, noted)| {
                let rows = match how.order {
                    ClaimOrder::PerKey => c.db().claim_per_key(limit, &held, floor),
                    ClaimOrder::Unordered => c.db().claim(limit, &held, floor.at),
                };
                Ok((rows?, noted))
            });
            let (claimed, noted) = match claimed {
                Ok(claimed) => claimed,
                Err(e) => {
                    rollback(c);
                    return Err(e);
                }
            };
            if claimed.is_empty() {
                // Nothing to hold: end the transaction now.
                C::TransactionManager::commit_transaction(c)?;
                let empty = Self {
                    conn: None,
                    messages: Vec::new(),
                };
                return Ok((empty, noted));
            }
            let batch = Self {
                conn: Some(conn),
                messages: claimed,
            };
            Ok((batch, noted))
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

    async fn complete(mut self, outcome: RelayBatchOutcome) -> Result<(), outbox_core::Error> {
        let Some(mut conn) = self.conn.take() else {
            return Ok(());
        };
        blocking(move || {
            let c: &mut C = &mut conn;
            let done = if outcome.retry.is_empty() && outcome.dead.is_empty() {
                c.db().mark_sent_and_commit(&outcome.sent)
            } else {
                crate::backend::complete(c.db(), &outcome)
                    .and_then(|()| Ok(C::TransactionManager::commit_transaction(c)?))
            };
            if done.is_err() {
                rollback(c);
            }
            done
        })
        .await
        .map_err(Into::into)
    }
}
