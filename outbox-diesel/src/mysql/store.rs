//! MySQL / MariaDB: the relay store, polling for work.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use diesel::{MysqlConnection, QueryableByName, RunQueryDsl as _};
use outbox_core::{Backlog, RelayStore};

use crate::ClaimOrder;
use crate::MysqlPool;
use crate::backend::{Backend as _, Database as _};
use crate::store::{LockedBatch, LockedClaim, blocking};

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
    claim: LockedClaim,
    /// No CDC relay owns the outbox (looked at the first claim; see [`mysql_cdc_lock`]).
    not_cdc: Arc<AtomicBool>,
}

impl MysqlRelayStore {
    /// A store over `pool` claiming in [`ClaimOrder::PerKey`]. Each claimed batch
    /// holds one pooled connection until it is completed.
    pub fn new(pool: MysqlPool) -> Self {
        Self {
            pool,
            claim: LockedClaim::default(),
            not_cdc: Arc::default(),
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
    #[must_use]
    pub fn with_stall_timeout(mut self, timeout: Duration) -> Self {
        self.claim.stall = timeout;
        self
    }

    /// The stall timeout.
    pub fn stall_timeout(&self) -> Duration {
        self.claim.stall
    }

    /// Sets the claim order.
    #[must_use]
    pub fn with_order(mut self, order: ClaimOrder) -> Self {
        self.claim.order = order;
        self
    }

    /// The claim order.
    pub fn order(&self) -> ClaimOrder {
        self.claim.order
    }

    /// The pool.
    pub fn pool(&self) -> &MysqlPool {
        &self.pool
    }
}

impl MysqlRelayStore {
    /// Refuses to relay ([`outbox_core::Error::RelayConflict`], which stops the relay)
    /// an outbox that the binlog CDC relay (`typed-outbox-cdc`, feature `mysql`) owns:
    /// it publishes every row from the binlog and leaves them NEW, so this relay would
    /// publish them all again.
    async fn refuse_in_cdc_mode(&self) -> Result<(), outbox_core::Error> {
        let pool = self.pool.clone();
        match blocking(move || mysql_cdc_lock(&mut *pool.get()?)).await? {
            None => {
                self.not_cdc.store(true, Ordering::Relaxed);
                Ok(())
            }
            Some(lock) => Err(outbox_core::Error::RelayConflict(
                format!(
                    "this outbox is relayed by the binlog CDC relay (lock `{lock}`, table \
                     outbox_cdc): a polling relay would publish every row again; run the CDC \
                     relay, or switch back to polling with outbox_cdc::mysql::switch_to_polling first"
                )
                .into(),
            )),
        }
    }
}

/// The binlog CDC relay's lock name if CDC mode is on (the `outbox_cdc` table of
/// typed-outbox-cdc holds a row), `None` when it is off: the polling relay and the
/// redrive refuse to run while it is on, and `outbox status` shows the binlog relay's lag
/// then.
pub fn mysql_cdc_lock(conn: &mut MysqlConnection) -> crate::Result<Option<String>> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
        name: Option<String>,
    }
    let exists: Vec<Row> = diesel::sql_query(
        "SELECT table_name AS name FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND table_name = 'outbox_cdc'",
    )
    .load(conn)?;
    if exists.is_empty() {
        return Ok(None);
    }
    let rows: Vec<Row> =
        diesel::sql_query("SELECT slot_name AS name FROM outbox_cdc LIMIT 1").load(conn)?;
    Ok(rows.into_iter().next().and_then(|r| r.name))
}

impl RelayStore for MysqlRelayStore {
    type Batch = LockedBatch<MysqlConnection>;

    async fn claim(&self, limit: usize) -> Result<Self::Batch, outbox_core::Error> {
        if !self.not_cdc.load(Ordering::Relaxed) {
            self.refuse_in_cdc_mode().await?;
        }
        let (pool, held) = (self.pool.clone(), Vec::new());
        let (batch, ()) =
            LockedBatch::claim(pool, limit, self.claim, held, |_| Ok(Default::default())).await?;
        Ok(batch)
    }

    async fn backlog(&self) -> Result<Backlog, outbox_core::Error> {
        let pool = self.pool.clone();
        Ok(blocking(move || {
            let mut conn = pool.get()?;
            let backlog = crate::backlog(&mut conn);
            if backlog.is_err() {
                conn.db().forget_if_lost();
            }
            backlog
        })
        .await?)
    }

    /// Yes: a claim skips the rows another claim holds (`SKIP LOCKED`), and the
    /// per-key claim holds back the later rows of their keys.
    ///
    /// It keeps the default [`claim_after`](RelayStore::claim_after) (the batch in hand
    /// holds back the later rows of its keys): the head check inside MariaDB's locking
    /// statement is a locking read too, which skips a key whose first NEW row another
    /// transaction holds (the batch in hand included), so a claim ahead could not take
    /// the later rows of its keys anyway.
    fn claims_ahead(&self) -> bool {
        true
    }
}
