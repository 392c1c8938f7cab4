//! SQLite: a single relay per database, enforced by a lease row.

use std::time::Duration;

use diesel::SqliteConnection;
use diesel::connection::SimpleConnection as _;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool};
use outbox_core::{Backlog, BatchOutcome, ClaimedBatch, RelayStore, StoredMessage};

use crate::backend::sqlite::{lease, release};
use crate::relay::{blocking, stored};
use crate::{ClaimOrder, OutboxConnection as _, Result, SqlitePool};

/// Per-connection settings SQLite needs under a pool: a busy timeout (so writers wait
/// for each other instead of failing with `SQLITE_BUSY`) and, by default, WAL mode (so
/// readers do not block the writer).
///
/// ```
/// use outbox_diesel::SqliteCustomizer;
/// let c = SqliteCustomizer::default();
/// assert_eq!(c.busy_timeout, std::time::Duration::from_secs(5));
/// assert!(c.wal);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqliteCustomizer {
    /// How long a statement waits for a lock held by another connection (default 5 s).
    pub busy_timeout: Duration,
    /// Switch the database to WAL mode with `synchronous = NORMAL` (default true).
    pub wal: bool,
}

impl Default for SqliteCustomizer {
    fn default() -> Self {
        Self {
            busy_timeout: Duration::from_secs(5),
            wal: true,
        }
    }
}

impl SqliteCustomizer {
    /// Sets the busy timeout.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Enables or disables WAL mode.
    pub fn wal(mut self, wal: bool) -> Self {
        self.wal = wal;
        self
    }
}

impl CustomizeConnection<SqliteConnection, diesel::r2d2::Error> for SqliteCustomizer {
    fn on_acquire(&self, conn: &mut SqliteConnection) -> Result<(), diesel::r2d2::Error> {
        let mut sql = format!("PRAGMA busy_timeout = {};", self.busy_timeout.as_millis());
        if self.wal {
            sql.push_str("PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;");
        }
        conn.batch_execute(&sql)
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

/// A pool of `max_size` connections to the SQLite database file `database_url`, with
/// the default [`SqliteCustomizer`]. (`:memory:` would give each connection its own
/// database: use a file.)
pub fn sqlite_pool(database_url: &str, max_size: u32) -> Result<SqlitePool> {
    Ok(Pool::builder()
        .max_size(max_size)
        .connection_customizer(Box::new(SqliteCustomizer::default()))
        .build(ConnectionManager::<SqliteConnection>::new(database_url))?)
}

/// The relay's store on SQLite. SQLite has no row locks, so one relay runs per database:
/// the store takes a lease (`outbox_relay_lease`) when it is created, renews it with
/// every claim, and gives it up when dropped. A second store on the same database fails
/// with [`Error::RelayAlreadyRunning`](crate::Error::RelayAlreadyRunning) until then, or
/// until the lease expires (its holder crashed): the lease time, 2 min by default, must
/// exceed the relay's poll interval and its longest outage pause (30 s by default) plus
/// a publish timeout, or a relay waiting out a broker outage could lose its lease. A
/// relay that loses it stops: `Relay::run_until` returns
/// [`outbox_core::Error::RelayConflict`].
///
/// Claims and completions run in short immediate (write-locking) transactions, each of
/// which checks the lease first; the batch holds no database lock while it is being
/// published, so emitters are never blocked by a publish. Waiting for work polls.
#[derive(Debug)]
pub struct SqliteRelayStore {
    pool: SqlitePool,
    owner: String,
    lease_ttl: Duration,
    order: ClaimOrder,
}

impl SqliteRelayStore {
    /// The default lease time: 2 min.
    pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(120);

    /// Takes the database's relay lease (blocking briefly) with the default lease time.
    pub fn new(pool: SqlitePool) -> Result<Self> {
        Self::with_lease_ttl(pool, Self::DEFAULT_LEASE_TTL)
    }

    /// Takes the database's relay lease, which expires `lease_ttl` after the last claim.
    pub fn with_lease_ttl(pool: SqlitePool, lease_ttl: Duration) -> Result<Self> {
        let owner = format!("pid{}-{:016x}", std::process::id(), fastrand::u64(..));
        let mut conn = pool.get()?;
        conn.immediate_transaction(|c| lease(c, &owner, lease_ttl, false))?;
        Ok(Self {
            pool,
            owner,
            lease_ttl,
            order: ClaimOrder::default(),
        })
    }

    /// Sets the claim order (default [`ClaimOrder::PerKey`]). With one relay per
    /// database, id order is per-key order except across retries: the per-key mode holds
    /// back the later messages of a key whose older message waits for its retry time.
    pub fn with_order(mut self, order: ClaimOrder) -> Self {
        self.order = order;
        self
    }

    /// The claim order.
    pub fn order(&self) -> ClaimOrder {
        self.order
    }

    /// This relay's owner token, as stored in the lease.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

impl Drop for SqliteRelayStore {
    fn drop(&mut self) {
        let released = self
            .pool
            .get()
            .map_err(Into::into)
            .and_then(|mut c| release(&mut c, &self.owner));
        if let Err(e) = released {
            tracing::warn!(error = %e, "could not release the SQLite relay lease; it expires on its own");
        }
    }
}

/// A batch claimed by [`SqliteRelayStore`]. It holds no lock; the relay lease keeps other
/// relays away. Dropping it leaves the rows NEW.
#[derive(Debug)]
pub struct SqliteBatch {
    pool: SqlitePool,
    owner: String,
    lease_ttl: Duration,
    messages: Vec<StoredMessage>,
}

impl RelayStore for SqliteRelayStore {
    type Batch = SqliteBatch;

    async fn claim(&self, limit: usize) -> Result<SqliteBatch, outbox_core::Error> {
        let pool = self.pool.clone();
        let owner = self.owner.clone();
        let ttl = self.lease_ttl;
        let order = self.order;
        let messages = blocking(move || {
            let mut conn = pool.get()?;
            conn.immediate_transaction(|c| {
                lease(c, &owner, ttl, true)?;
                match order {
                    ClaimOrder::PerKey => c.__claim_per_key(limit),
                    ClaimOrder::Unordered => c.__claim(limit),
                }
            })
        })
        .await?;
        Ok(SqliteBatch {
            pool: self.pool.clone(),
            owner: self.owner.clone(),
            lease_ttl: self.lease_ttl,
            messages: stored(messages),
        })
    }

    async fn backlog(&self) -> Result<Backlog, outbox_core::Error> {
        let pool = self.pool.clone();
        Ok(blocking(move || pool.get()?.__backlog()).await?)
    }
}

impl ClaimedBatch for SqliteBatch {
    fn messages(&self) -> &[StoredMessage] {
        &self.messages
    }

    async fn complete(self, outcome: BatchOutcome) -> Result<(), outbox_core::Error> {
        if outcome.is_empty() {
            return Ok(());
        }
        let SqliteBatch {
            pool,
            owner,
            lease_ttl,
            ..
        } = self;
        Ok(blocking(move || {
            let mut conn = pool.get()?;
            conn.immediate_transaction(|c| {
                lease(c, &owner, lease_ttl, true)?;
                c.__complete(&outcome)
            })
        })
        .await?)
    }
}
