//! PostgreSQL: the relay store, whose idle wait is woken by `NOTIFY` (see `listen`).

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::{BigInt, Bool, Double};
use diesel::{Connection as _, PgConnection, QueryableByName, RunQueryDsl as _};
use outbox_core::{Backlog, ClaimedBatch as _, RelayStore};

use super::floor::ClaimFloor;
use super::listen::Listener;
use super::maintenance::Maintenance;
use crate::store::{LockedBatch, LockedClaim, blocking};
use crate::{ClaimOrder, DEFAULT_CHANNEL, PgPool, Result};

#[doc = include_str!("../../docs/pg_relay_store.md")]
#[derive(Debug, Clone)]
pub struct PgRelayStore {
    pool: PgPool,
    listener: Option<Arc<Listener>>,
    channel: String,
    claim: LockedClaim,
    seen: Arc<Seen>,
    stats: Arc<StatsCheck>,
    maintenance: Arc<Maintenance>,
    floor: Arc<ClaimFloor>,
    /// No CDC relay owns the outbox (looked at the first claim; see [`cdc_slot`]).
    not_cdc: Arc<AtomicBool>,
}

/// What the last claims saw, for the due check before parking.
#[derive(Debug, Default)]
struct Seen {
    /// The last claim returned nothing.
    empty: AtomicBool,
    /// The newest due row an empty claim that followed an empty one saw (all held back
    /// by the per-key claim or taken by another relay); 0 (every due row counts)
    /// otherwise.
    newest_due: AtomicI64,
}

impl PgRelayStore {
    /// A store over `pool` claiming in [`ClaimOrder::PerKey`], without a listener:
    /// waiting for work polls.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            listener: None,
            channel: DEFAULT_CHANNEL.to_owned(),
            claim: LockedClaim::default(),
            seen: Arc::default(),
            stats: Arc::default(),
            maintenance: Arc::default(),
            floor: Arc::default(),
            not_cdc: Arc::default(),
        }
    }

    /// Sets the stall timeout (default 30 s): how long the server keeps a claimed batch
    /// whose relay has gone silent before it rolls the batch back, so that another relay
    /// takes its rows and keys over (see [a stalled relay](Self#a-stalled-relay)). It
    /// must exceed the longest time a relay may take to publish one batch (with the
    /// Redis publisher, its response timeout, 5 s by default, per round trip of the
    /// batch): a batch that takes longer loses its claim, is published again by another
    /// relay, and the slow relay backs off as after a database outage.
    /// `Duration::ZERO` sets nothing: the server's settings apply.
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

    /// Builds a pool of `max_size` connections to `database_url` and a store that
    /// listens for wake-ups on a dedicated connection to the same URL. The pool's
    /// connections get TCP keepalives (see [a stalled relay](Self#a-stalled-relay))
    /// unless the URL sets its own.
    ///
    /// The pool does not test connections on check-out (r2d2's `test_on_check_out`, a
    /// `SELECT 1` round trip before each claim): a connection the server has dropped
    /// fails its claim instead, which the relay takes as a database outage and backs off
    /// from (100 ms at first), and the pool discards it.
    pub fn connect(database_url: &str, max_size: u32) -> Result<Self> {
        let pool = Pool::builder()
            .max_size(max_size)
            .test_on_check_out(false)
            .build(ConnectionManager::<PgConnection>::new(with_keepalives(
                database_url,
            )))?;
        Ok(Self::new(pool).with_listener(database_url))
    }

    /// Waits for work with `LISTEN` on a dedicated connection to `database_url` (opened
    /// on the first wait, without TLS: see [the LISTEN connection](Self#the-listen-connection)).
    /// Use the URL of the pool's database and schema.
    #[must_use]
    pub fn with_listener(mut self, database_url: impl Into<String>) -> Self {
        self.listener = Some(Arc::new(Listener::new(database_url.into())));
        self
    }

    /// Sets the `NOTIFY` channel (default `outbox`): the one emitters use in
    /// [`EmitOptions::with_channel`](crate::EmitOptions::with_channel).
    #[must_use]
    pub fn with_channel(mut self, channel: impl Into<String>) -> Self {
        // An open LISTEN connection on another channel is replaced on the next wait.
        self.channel = channel.into();
        self
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The `NOTIFY` channel.
    pub fn channel(&self) -> &str {
        &self.channel
    }

    /// The id this store's claims start their walk at: no row below it is NEW (0 until
    /// its first steps settle; see [the claim's floor](Self#the-claims-floor)).
    pub fn claim_floor(&self) -> i64 {
        self.floor.get()
    }
}

impl PgRelayStore {
    /// Refuses to relay ([`outbox_core::Error::RelayConflict`], which stops the relay)
    /// an outbox that the CDC relay (`typed-outbox-cdc`) owns: it publishes every row
    /// from the log and leaves them NEW, so this relay would publish them all again.
    async fn refuse_in_cdc_mode(&self) -> Result<(), outbox_core::Error> {
        let pool = self.pool.clone();
        match blocking(move || cdc_slot(&mut *pool.get()?)).await? {
            None => {
                self.not_cdc.store(true, Ordering::Relaxed);
                Ok(())
            }
            Some(slot) => Err(outbox_core::Error::RelayConflict(
                format!(
                    "this outbox is relayed by the CDC relay (slot `{slot}`, table outbox_cdc): \
                     a polling relay would publish every row again; run `outbox relay --cdc`, \
                     or switch back to polling with outbox_cdc::switch_to_polling first"
                )
                .into(),
            )),
        }
    }
}

/// The CDC relay's slot if CDC mode is on (the `outbox_cdc` table of typed-outbox-cdc
/// holds a row).
pub(super) fn cdc_slot(conn: &mut PgConnection) -> Result<Option<String>> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
        slot: Option<String>,
    }
    let exists: Row =
        diesel::sql_query("SELECT to_regclass('outbox_cdc')::text AS slot").get_result(conn)?;
    if exists.slot.is_none() {
        return Ok(None);
    }
    let rows: Vec<Row> =
        diesel::sql_query("SELECT slot_name AS slot FROM outbox_cdc LIMIT 1").load(conn)?;
    Ok(rows.into_iter().next().and_then(|r| r.slot))
}

impl RelayStore for PgRelayStore {
    type Batch = LockedBatch<PgConnection>;

    async fn claim(&self, limit: usize) -> Result<Self::Batch, outbox_core::Error> {
        self.claim_after(limit, &[]).await
    }

    async fn claim_after(
        &self,
        limit: usize,
        held: &[i64],
    ) -> Result<Self::Batch, outbox_core::Error> {
        // An idle relay notes the newest due row before it claims: if the claim still
        // returns nothing, every due row up to there is held back or taken, and the due
        // check before parking looks above it, and below it only at rows that statement
        // could not see yet. (Read in a statement before the claim's, so that a row
        // committed in between counts as new; in the claim's transaction, whose settings
        // keep it on the index.)
        let idle = self.listener.is_some() && self.seen.empty.load(Ordering::Relaxed);
        if !self.not_cdc.load(Ordering::Relaxed) {
            self.refuse_in_cdc_mode().await?;
        }
        self.maintenance.start_if_due(&self.pool);
        if self.stats.due(self.seen.empty.load(Ordering::Relaxed)) {
            let pool = self.pool.clone();
            let analyzed = blocking(move || analyze_if_stale(&mut *pool.get()?)).await;
            match analyzed {
                Ok(analyzed) => self.stats.checked(analyzed),
                Err(e) => tracing::warn!(
                    error = %outbox_core::error_chain(&e),
                    "checking the outbox table's statistics failed"
                ),
            }
        }
        let (pool, held) = (self.pool.clone(), held.to_vec());
        let (floor, step) = self.floor.for_claim();
        let how = self.claim;
        let (batch, (newest, stepped)) = LockedBatch::claim(pool, limit, how, held, move |c| {
            let stepped = step.and_then(|step| step.run(c));
            // What the step found holds for this claim already: the first claim after a
            // failover or a restore walks from the floor brought down, not the old one.
            let floor = stepped.as_ref().and_then(|s| s.floor()).unwrap_or(floor);
            let newest = if idle { newest_due(c, floor.at)? } else { 0 };
            Ok((floor, (newest, stepped)))
        })
        .await?;
        if let Some(stepped) = stepped {
            self.floor.finish(stepped);
        }
        let empty = batch.messages().is_empty();
        if !empty && let Some(listener) = &self.listener {
            // Back to work after a wait that timed out: emits stop notifying.
            listener.busy();
        }
        self.seen.empty.store(empty, Ordering::Relaxed);
        let newest = if empty { newest } else { 0 };
        self.seen.newest_due.store(newest, Ordering::Relaxed);
        Ok(batch)
    }

    async fn wait_for_work(&self, timeout: Duration) {
        match &self.listener {
            Some(listener) => {
                let seen = self.seen.newest_due.load(Ordering::Relaxed);
                listener.wait(&self.channel, timeout, seen).await;
            }
            None => tokio::time::sleep(timeout).await,
        }
    }

    async fn backlog(&self) -> Result<Backlog, outbox_core::Error> {
        let pool = self.pool.clone();
        Ok(blocking(move || crate::backlog(&mut pool.get()?)).await?)
    }

    /// Yes: a claim skips the rows another claim holds (`SKIP LOCKED`), and the per-key
    /// claim holds back the later rows of their keys, except behind the batch in hand
    /// ([`claim_after`](RelayStore::claim_after)).
    fn claims_ahead(&self) -> bool {
        true
    }
}

/// libpq's TCP keepalive parameters for the relay's pool: a dead server or a cut
/// network is noticed after about 25 s of silence instead of the system's two hours.
const KEEPALIVES: [(&str, &str); 4] = [
    ("keepalives", "1"),
    ("keepalives_idle", "10"),
    ("keepalives_interval", "5"),
    ("keepalives_count", "3"),
];

/// `url` with libpq's TCP keepalive parameters added (`keepalives_idle=10`,
/// `keepalives_interval=5`, `keepalives_count=3`: a dead server or a cut network is
/// noticed after about 25 s of silence instead of the system's two hours), unless it
/// sets a keepalive parameter itself. Takes both of libpq's forms: `postgres://..` URIs
/// and `key=value` strings. [`PgRelayStore::connect`] uses it for its pool; use it for a
/// relay pool you build yourself.
pub fn with_keepalives(url: &str) -> String {
    if url.contains("keepalives") {
        return url.to_owned();
    }
    let is_uri = ["postgres://", "postgresql://"].iter().any(|scheme| {
        url.get(..scheme.len())
            .is_some_and(|s| s.eq_ignore_ascii_case(scheme))
    });
    let mut out = url.to_owned();
    for (i, (key, value)) in KEEPALIVES.iter().enumerate() {
        let sep = match (is_uri, i) {
            (false, _) => " ",
            (true, 0) if !url.contains('?') => "?",
            (true, _) => "&",
        };
        out.push_str(&format!("{sep}{key}={value}"));
    }
    out
}

/// How often the store looks at the table's statistics while claims return rows.
const STATS_CHECK_INTERVAL: Duration = Duration::from_secs(60);
/// How long after an `ANALYZE` it looks again.
const ANALYZE_INTERVAL: Duration = Duration::from_secs(600);
/// A never-analyzed table smaller than this (in 8 kB pages: 2 MB, some 8,000 rows of a
/// few hundred bytes) is left alone: any plan reads it fast.
const ANALYZE_MIN_PAGES: i64 = 256;
/// How long `ANALYZE` may wait for a lock on the table before giving up.
const ANALYZE_LOCK_TIMEOUT: Duration = Duration::from_millis(200);
/// Below this many changed rows, statistics are fresh enough.
const ANALYZE_MIN_CHANGED: f64 = 10_000.0;

/// When the store next looks at the table's statistics (see
/// [the table's statistics](PgRelayStore#the-tables-statistics)).
#[derive(Debug, Default)]
struct StatsCheck {
    /// `None`: at the next claim.
    next: Mutex<Option<Instant>>,
}

impl StatsCheck {
    /// Whether to look now (`last_empty`: the last claim returned nothing, so there is no
    /// backlog to plan for); if so, the next look waits for the check interval.
    fn due(&self, last_empty: bool) -> bool {
        let now = Instant::now();
        let mut next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
        let due = match *next {
            None => true,
            Some(at) => now >= at && !last_empty,
        };
        if due {
            *next = Some(now + STATS_CHECK_INTERVAL);
        }
        due
    }

    /// After a look that ran `ANALYZE`, the next one waits longer.
    fn checked(&self, analyzed: bool) {
        if analyzed {
            let mut next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
            *next = Some(Instant::now() + ANALYZE_INTERVAL);
        }
    }
}

/// The `outbox` table's statistics as the planner sees them.
#[derive(QueryableByName, Debug)]
struct TableStats {
    /// Rows at the last `ANALYZE` (or `VACUUM`); -1: never analyzed.
    #[diesel(sql_type = Double)]
    reltuples: f64,
    /// The table's size now, in pages.
    #[diesel(sql_type = BigInt)]
    pages: i64,
    /// Rows inserted, updated or deleted since the last `ANALYZE` (the cumulative
    /// statistics system's count, which autovacuum uses too).
    #[diesel(sql_type = BigInt)]
    changed: i64,
    /// The relay's role owns the table (or is a member of its owner): it may analyze it.
    #[diesel(sql_type = Bool)]
    owned: bool,
}

/// Why the table needs `ANALYZE`, if it does.
fn stale_statistics(s: &TableStats) -> Option<&'static str> {
    if s.reltuples < 0.0 {
        return (s.pages >= ANALYZE_MIN_PAGES).then_some("it has never been analyzed");
    }
    (s.changed as f64 > s.reltuples.max(ANALYZE_MIN_CHANGED))
        .then_some("more rows changed since its last analyze than it held then")
}

/// Runs `ANALYZE outbox` if the table's statistics are missing or stale; whether it
/// tried (the next look then waits longer).
///
/// Under a short `lock_timeout`: a lock that `ANALYZE` would wait for (a long `VACUUM`,
/// an anti-wraparound autovacuum, another relay's `ANALYZE`, `CREATE INDEX
/// CONCURRENTLY`) fails it at once instead of holding the relay's claim up. A role that
/// does not own the table cannot analyze it (the server would skip it with a warning of
/// its own): the relay says so and leaves it.
fn analyze_if_stale(conn: &mut PgConnection) -> Result<bool> {
    let stats: TableStats = diesel::sql_query(
        "SELECT c.reltuples::float8 AS reltuples, \
         (pg_relation_size(c.oid) / current_setting('block_size')::int)::bigint AS pages, \
         COALESCE(pg_stat_get_mod_since_analyze(c.oid), 0) AS changed, \
         pg_has_role(c.relowner, 'USAGE') AS owned \
         FROM pg_class c WHERE c.oid = 'outbox'::regclass",
    )
    .get_result(conn)?;
    let Some(why) = stale_statistics(&stats) else {
        return Ok(false);
    };
    if !stats.owned {
        tracing::warn!(
            "the outbox table's statistics are stale ({why}), and the relay's role does not \
             own the table to analyze it: run ANALYZE outbox as its owner, or turn \
             autovacuum on"
        );
        return Ok(true);
    }
    tracing::warn!(
        reltuples = stats.reltuples,
        pages = stats.pages,
        changed = stats.changed,
        "the outbox table's statistics are stale ({why}; is autovacuum off?): \
         running ANALYZE outbox"
    );
    let started = Instant::now();
    let analyzed = conn.transaction(|c| {
        diesel::sql_query(format!(
            "SET LOCAL lock_timeout = {}",
            ANALYZE_LOCK_TIMEOUT.as_millis()
        ))
        .execute(c)?;
        diesel::sql_query("ANALYZE outbox").execute(c)
    });
    match analyzed {
        Ok(_) => tracing::info!(
            elapsed_ms = started.elapsed().as_millis() as u64,
            "ANALYZE outbox done"
        ),
        Err(e) => tracing::warn!(
            error = %e,
            "ANALYZE outbox did not run (the table is locked: VACUUM, another ANALYZE?); \
             the relay tries again in {} minutes",
            ANALYZE_INTERVAL.as_secs() / 60
        ),
    }
    Ok(true)
}

/// The id of the newest due NEW row at or above the claim's floor (0 if none; a backward
/// walk on `outbox_pending` that stops at the floor).
fn newest_due(conn: &mut PgConnection, floor: i64) -> Result<i64> {
    #[derive(QueryableByName)]
    struct Newest {
        #[diesel(sql_type = BigInt)]
        id: i64,
    }
    let newest: Newest = diesel::sql_query(
        "SELECT COALESCE((SELECT id FROM outbox WHERE status = 0 AND next_retry_at <= now() \
         AND id >= $1 ORDER BY id DESC LIMIT 1), 0) AS id",
    )
    .bind::<BigInt, _>(floor)
    .get_result(conn)?;
    Ok(newest.id)
}

#[cfg(test)]
mod tests {
    use super::{ANALYZE_MIN_PAGES, StatsCheck, TableStats, stale_statistics, with_keepalives};

    #[test]
    fn large_tables_without_or_with_outgrown_statistics_are_analyzed() {
        let stats = |reltuples, pages, changed| TableStats {
            reltuples,
            pages,
            changed,
            owned: true,
        };
        // Never analyzed: only once it is large.
        assert!(stale_statistics(&stats(-1.0, ANALYZE_MIN_PAGES - 1, 0)).is_none());
        assert!(stale_statistics(&stats(-1.0, ANALYZE_MIN_PAGES, 0)).is_some());
        // Analyzed while it held 100,000 rows (all SENT), then a burst of 150,000.
        assert!(stale_statistics(&stats(100_000.0, 7_000, 150_000)).is_some());
        assert!(stale_statistics(&stats(100_000.0, 7_000, 90_000)).is_none());
        // Analyzed empty: a few thousand changes are not worth it, a burst is.
        assert!(stale_statistics(&stats(0.0, 100, 5_000)).is_none());
        assert!(stale_statistics(&stats(0.0, 5_000, 150_000)).is_some());
    }

    #[test]
    fn statistics_are_looked_at_first_then_only_after_the_interval_while_claims_find_rows() {
        let check = StatsCheck::default();
        assert!(check.due(true), "the first claim looks");
        assert!(!check.due(false), "then not before the interval");
        *check.next.lock().unwrap() = Some(std::time::Instant::now());
        assert!(!check.due(true), "an idle relay has no backlog to plan for");
        assert!(check.due(false));
    }

    #[test]
    fn keepalives_join_either_form_of_url_unless_it_has_its_own() {
        let keep = "keepalives=1&keepalives_idle=10&keepalives_interval=5&keepalives_count=3";
        assert_eq!(
            with_keepalives("postgres://u@h/db"),
            format!("postgres://u@h/db?{keep}")
        );
        assert_eq!(
            with_keepalives("postgresql://h/db?options=-c%20search_path%3Dx"),
            format!("postgresql://h/db?options=-c%20search_path%3Dx&{keep}")
        );
        assert_eq!(
            with_keepalives("host=h dbname=db"),
            format!("host=h dbname=db {}", keep.replace('&', " "))
        );
        let own = "postgres://h/db?keepalives_idle=60";
        assert_eq!(with_keepalives(own), own);
    }
}
