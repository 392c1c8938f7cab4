//! Time-partitioned `outbox` and `consumed_msg` tables on PostgreSQL: created by
//! [`migrate_partitioned`], kept by [`maintain_partitions`] (which the relay runs by
//! itself), retention by dropping whole partitions instead of deleting rows.
//!
//! The layout, its dedup window and the migration of an unpartitioned table are described
//! in `docs/table-partitions.md`.

use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use diesel::connection::SimpleConnection as _;
use diesel::sql_types::{BigInt, Bool, Integer, Nullable, Text, Timestamptz};
use diesel::{Connection as _, PgConnection, QueryableByName, RunQueryDsl as _};

use crate::{Error, Result};

pub(crate) const POSTGRES_PARTITIONED_UP: &str =
    include_str!("../../migrations/postgres-partitioned/2025-01-01-000000_outbox/up.sql");

/// The partitioned PostgreSQL migration (`migrations/postgres-partitioned/`): what
/// [`migrate_partitioned`] runs after converting unpartitioned tables. It creates no
/// partition; [`maintain_partitions`] (or the relay) does.
pub const POSTGRES_PARTITIONED_MIGRATION: crate::Migration = crate::Migration {
    name: "2025-01-01-000000_outbox",
    up: POSTGRES_PARTITIONED_UP,
    down: include_str!("../../migrations/postgres-partitioned/2025-01-01-000000_outbox/down.sql"),
};

/// One maintenance run at a time per schema (any number of relays run it): a session
/// lock on a class id of ours and the schema's oid. Waits; tries; releases.
const MAINTENANCE_LOCK: &str = "SELECT true AS locked FROM pg_advisory_lock(1869968486, \
     (SELECT relnamespace::int FROM pg_class WHERE oid = to_regclass('outbox')))";
const MAINTENANCE_TRY_LOCK: &str = "SELECT pg_try_advisory_lock(1869968486, \
     (SELECT relnamespace::int FROM pg_class WHERE oid = to_regclass('outbox'))) AS locked";
const MAINTENANCE_UNLOCK: &str = "SELECT pg_advisory_unlock(1869968486, \
     (SELECT relnamespace::int FROM pg_class WHERE oid = to_regclass('outbox'))) AS locked";
/// One maker of partitions ahead at a time per schema, whether or not it holds the
/// maintenance lock: a transaction lock, so a maker that stops ends with its transaction.
const AHEAD_LOCK: &str = "SELECT pg_advisory_xact_lock(1869968487, \
     (SELECT relnamespace::int FROM pg_class WHERE oid = to_regclass('outbox')))";
/// How long creating, attaching or dropping a partition waits for a table lock before it
/// gives up until the next run (ATTACH takes `SHARE UPDATE EXCLUSIVE` on the parent: it
/// waits only for `VACUUM`, `ANALYZE`, DDL and a `DETACH .. CONCURRENTLY`, never for
/// emits or claims; a `DROP` may wait behind a `pg_dump`).
const LOCK_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a maintenance session may sit idle, between statements or in a transaction,
/// before the server ends it (`idle_session_timeout`, PostgreSQL 14): a maintainer stopped
/// (SIGSTOP, a paused VM) would otherwise keep the maintenance lock for as long as its
/// connection lives. A running one sends its next statement at once.
const IDLE_LIMIT: Duration = Duration::from_secs(10);
/// How long `DETACH .. CONCURRENTLY` waits for the transactions that may still see the
/// partition (a long report, `pg_dump`) before it gives up until the next run.
const DETACH_TIMEOUT: Duration = Duration::from_secs(30);
/// The first open transaction that may still write to partition `$1` of table `$3`,
/// which ends at `$2`: a session of this database whose transaction began before that end
/// (a row's time is its transaction's start), or whose start this role may not see
/// (another role's, without `pg_read_all_stats`); or a prepared transaction that wrote to
/// it. A prepared transaction that holds the table itself writes nothing more, but the
/// detach would wait for it (`DETACH_TIMEOUT` at every run, each partition): a two-phase
/// commit left undecided keeps every partition until it is committed or rolled back.
const OPEN_WRITER: &str = "SELECT coalesce((SELECT CASE WHEN a.xact_start IS NULL \
     THEN format('a transaction of another role is open (pid %s; grant pg_read_all_stats \
     to see when it began)', a.pid) \
     ELSE format('a transaction open since %s may still write to it (pid %s)', a.xact_start, a.pid) END \
     FROM pg_stat_activity a WHERE a.datname = current_database() AND a.pid <> pg_backend_pid() \
     AND a.backend_type IS DISTINCT FROM 'autovacuum worker' \
     AND (a.xact_start < $2 OR a.xact_start IS NULL AND EXISTS (SELECT 1 FROM pg_locks v \
     WHERE v.pid = a.pid AND v.locktype = 'virtualxid')) LIMIT 1), \
     (SELECT 'a prepared transaction wrote to it' FROM pg_locks l \
     WHERE l.pid IS NULL AND l.relation = to_regclass($1) AND l.mode = 'RowExclusiveLock' \
     LIMIT 1), \
     (SELECT format('prepared transaction %L holds %s: its detach would wait for it \
     (COMMIT PREPARED or ROLLBACK PREPARED it; see pg_prepared_xacts)', x.gid, $3) \
     FROM pg_locks l JOIN pg_prepared_xacts x ON x.transaction = l.transactionid \
     WHERE l.pid IS NULL AND l.locktype = 'transactionid' AND EXISTS (SELECT 1 FROM pg_locks t \
     WHERE t.pid IS NULL AND t.virtualtransaction = l.virtualtransaction \
     AND t.relation = to_regclass($3)) LIMIT 1)) AS reason";
/// Longest interval and retention a policy takes.
const MAX_POLICY_SECS: u64 = 100 * 365 * 86_400;

/// How the partitioned tables are kept: stored in the database (`outbox_partitioning`) by
/// [`migrate_partitioned`], read by every [`maintain_partitions`].
///
/// Partitions cover `interval` each, aligned to the Unix epoch in UTC (daily partitions
/// start at 00:00 UTC).
///
/// ```
/// use std::time::Duration;
/// use outbox_diesel::PartitionPolicy;
///
/// let hourly = PartitionPolicy::default()
///     .with_interval(Duration::from_secs(3600))
///     .with_retention(Duration::from_secs(2 * 86_400));
/// assert_eq!(hourly.premake, 7);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionPolicy {
    /// The time one partition covers, in whole seconds (default one day).
    pub interval: Duration,
    /// Partitions kept ready after the current one (default 7): how long emits go on
    /// when no relay and no `outbox partitions maintain` runs. A row whose time has no
    /// partition fails its insert.
    pub premake: u32,
    /// How long a partition is kept after its range ends (default 7 days). It is the
    /// dedup window: a msg_id is refused while any partition holds it, at least this
    /// long after it was emitted.
    pub retention: Duration,
}

impl Default for PartitionPolicy {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(86_400),
            premake: 7,
            retention: Duration::from_secs(7 * 86_400),
        }
    }
}

impl PartitionPolicy {
    /// Sets [`interval`](Self::interval).
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Sets [`premake`](Self::premake).
    pub fn with_premake(mut self, premake: u32) -> Self {
        self.premake = premake;
        self
    }

    /// Sets [`retention`](Self::retention).
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Checks the policy: an interval of whole seconds, at least one second; interval and
    /// retention at most 100 years; at most 1,000 partitions ahead.
    pub fn validate(&self) -> Result<()> {
        let invalid = |reason: &str| {
            Err(Error::InvalidPartitionPolicy {
                reason: reason.into(),
            })
        };
        if self.interval < Duration::from_secs(1) || self.interval.subsec_nanos() != 0 {
            return invalid("the interval must be a whole number of seconds, at least 1 s");
        }
        if self.interval.as_secs() > MAX_POLICY_SECS || self.retention.as_secs() > MAX_POLICY_SECS {
            return invalid("interval and retention must be at most 100 years");
        }
        if self.premake > 1000 {
            return invalid("premake must be at most 1000 partitions");
        }
        Ok(())
    }
}

/// One partition of `outbox` or `consumed_msg`, as [`partitions`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Partition {
    /// The partitioned table: `outbox` or `consumed_msg`.
    pub table: &'static str,
    /// The partition's table name.
    pub name: String,
    /// Its range's start (`None`: from the beginning, as an unpartitioned table converted
    /// by [`migrate_partitioned`] is attached).
    pub from: Option<DateTime<Utc>>,
    /// Its range's end, exclusive.
    pub to: Option<DateTime<Utc>>,
    /// A `DETACH .. CONCURRENTLY` was interrupted; the next maintenance finishes it.
    pub detaching: bool,
}

/// What a [`maintain_partitions`] run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionReport {
    /// Partitions created.
    pub created: Vec<String>,
    /// Partitions detached and dropped.
    pub dropped: Vec<String>,
    /// Expired partitions kept, with the reason (NEW or DEAD rows in them).
    pub kept: Vec<(String, String)>,
    /// Steps that failed (a lock not granted in time, a range already taken), with the
    /// error; the next run tries again.
    pub failed: Vec<(String, String)>,
    /// Another maintenance run was in progress (another relay): this one only made the
    /// partitions ahead.
    pub busy: bool,
}

/// A partitioned table and the unique indexes each of its partitions gets.
struct Table {
    name: &'static str,
    /// `(index name suffix, columns)`.
    unique: &'static [(&'static str, &'static str)],
    /// Has NEW and DEAD rows, which keep a partition past its retention.
    has_status: bool,
    /// The unique index (suffix) each partition's replica identity uses: a table with
    /// none cannot be updated or deleted from while a publication publishes its updates
    /// and deletes, as the CDC relay's does (outbox-cdc, issue 35); PostgreSQL does not
    /// carry a parent's replica identity to its partitions.
    replica_identity: Option<&'static str>,
}

const TABLES: [Table; 2] = [
    Table {
        name: "outbox",
        unique: &[("id", "id"), ("msg_id", "msg_id")],
        has_status: true,
        replica_identity: Some("id"),
    },
    Table {
        name: "consumed_msg",
        unique: &[("key", "consumer_group, msg_id")],
        has_status: false,
        replica_identity: None,
    },
];

/// Creates the partitioned tables (converting unpartitioned ones first), records
/// `policy`, and creates the current partition and `policy.premake` after it. Safe to run
/// again: it then only records `policy` and maintains the partitions.
///
/// The first partitions are made in the migration's transaction; one that cannot be made
/// fails it ([`Error::PartitionNotCreated`]) and nothing changes.
///
/// An unpartitioned `outbox` (or `consumed_msg`) becomes the first partition of the new
/// table, renamed `outbox_legacy` and covering everything before now, with its rows, ids
/// and indexes as they are: nothing is copied. It takes the table's `ACCESS EXCLUSIVE`
/// lock for the conversion, which scans the table once to check its rows' times: emits
/// and relays wait for it, and carry on after. Dropped like the others once its range
/// ends `retention` ago and it holds no NEW or DEAD row.
///
/// Needs PostgreSQL 14 or later. MySQL and MariaDB have no partitioned layout (see
/// `docs/table-partitions.md`).
pub fn migrate_partitioned(
    conn: &mut PgConnection,
    policy: &PartitionPolicy,
) -> Result<PartitionReport> {
    policy.validate()?;
    crate::migrate::check_version(conn)?;
    let created = conn.transaction(|c| create_tables(c, policy))?;
    let mut rest = maintain(conn, MAINTENANCE_LOCK)?;
    rest.created.splice(0..0, created.created);
    Ok(rest)
}

/// The transaction of [`migrate_partitioned`]: converts, migrates, records the policy and
/// makes the first partitions (what it made).
fn create_tables(c: &mut PgConnection, policy: &PartitionPolicy) -> Result<PartitionReport> {
    // The migration's own lock first, so that a concurrent run waits, then finds the
    // tables partitioned.
    c.batch_execute("SELECT pg_advisory_xact_lock(7362291004541029)")?;
    let mut plain = Vec::new();
    for table in &TABLES {
        if kind(c, table.name)? == Some(Kind::Plain) {
            plain.push(table);
        }
    }
    for table in &plain {
        rename_to_legacy(c, table)?;
    }
    // Read once the old tables are locked: every row in them is older.
    let now = db_clock(c)?;
    c.batch_execute(POSTGRES_PARTITIONED_UP)?;
    for table in &plain {
        c.batch_execute(&format!(
            "ALTER TABLE {t} ATTACH PARTITION {t}_legacy FOR VALUES FROM (MINVALUE) TO ({})",
            literal(now),
            t = table.name
        ))?;
    }
    diesel::sql_query(
        "UPDATE outbox_partitioning SET interval_secs = $1, premake = $2, retention_secs = $3",
    )
    .bind::<BigInt, _>(policy.interval.as_secs() as i64)
    .bind::<Integer, _>(policy.premake as i32)
    .bind::<BigInt, _>(policy.retention.as_secs() as i64)
    .execute(c)?;
    // In the same transaction: an emit right after the commit must find its partition.
    let mut report = PartitionReport::default();
    for table in &TABLES {
        create_ahead(c, table, policy, now, &mut report);
    }
    match report.failed.first() {
        Some((name, error)) => Err(Error::PartitionNotCreated {
            name: name.clone(),
            error: error.clone(),
        }),
        None => Ok(report),
    }
}

/// The stored policy when `outbox` is partitioned; `None` for the unpartitioned layout
/// (or no tables at all).
pub fn partition_policy(conn: &mut PgConnection) -> Result<Option<PartitionPolicy>> {
    if kind(conn, "outbox")? != Some(Kind::Partitioned) {
        return Ok(None);
    }
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = BigInt)]
        interval_secs: i64,
        #[diesel(sql_type = Integer)]
        premake: i32,
        #[diesel(sql_type = BigInt)]
        retention_secs: i64,
    }
    let row: Option<Row> =
        diesel::sql_query("SELECT interval_secs, premake, retention_secs FROM outbox_partitioning")
            .get_result(conn)
            .map(Some)
            .or_else(|e| match e {
                diesel::result::Error::NotFound => Ok(None),
                e => Err(e),
            })?;
    Ok(Some(row.map_or_else(PartitionPolicy::default, |r| {
        PartitionPolicy {
            interval: Duration::from_secs(r.interval_secs.max(1) as u64),
            premake: r.premake.max(0) as u32,
            retention: Duration::from_secs(r.retention_secs.max(0) as u64),
        }
    })))
}

/// The partitions of `outbox` and `consumed_msg`, each table's in range order (empty for
/// the unpartitioned layout).
pub fn partitions(conn: &mut PgConnection) -> Result<Vec<Partition>> {
    let mut all = Vec::new();
    for table in &TABLES {
        all.extend(partitions_of(conn, table)?);
    }
    Ok(all)
}

/// Keeps the partitioned tables: creates the current partition and the policy's `premake`
/// after it (first, for every table, even while another run holds the maintenance lock),
/// finishes an interrupted detach, and detaches (`CONCURRENTLY`, so emits and claims
/// never wait) and drops every partition whose range ended `retention` ago. Rows are
/// never deleted, and no NEW or DEAD row leaves the claim's view: a partition that holds
/// one is kept (and reported) until it is sent, re-driven or purged; one that an open
/// transaction begun before its end may still write to is kept until that transaction
/// ends; one detached with such a row in it (a detach interrupted, a transaction that
/// committed while the detach waited for it) is attached back.
///
/// Does nothing on the unpartitioned layout. While another run holds the maintenance
/// lock (another relay: [`PartitionReport::busy`]) it makes the partitions ahead only. A
/// step that fails (a lock not granted in time) is reported in
/// [`PartitionReport::failed`] and tried again by the next run. Run it outside a
/// transaction: `DETACH .. CONCURRENTLY` cannot run inside one. A run whose process stops
/// (SIGSTOP, a paused VM) holds the maintenance lock for at most its statement's own
/// limit (a detach's 30 s) and 10 s more: the server then ends its idle session.
///
/// The relay ([`PgRelayStore`](crate::PgRelayStore)) runs it at its first claim and then
/// every quarter interval (at most every 10 minutes); `outbox partitions maintain` runs
/// it once, e.g. from cron.
pub fn maintain_partitions(conn: &mut PgConnection) -> Result<PartitionReport> {
    maintain(conn, MAINTENANCE_TRY_LOCK)
}

/// [`maintain_partitions`], taking the maintenance lock with `lock` (which waits, or tries).
fn maintain(conn: &mut PgConnection, lock: &str) -> Result<PartitionReport> {
    let Some(policy) = partition_policy(conn)? else {
        return Ok(PartitionReport::default());
    };
    let mut report = PartitionReport::default();
    // Every table's partitions ahead first, whoever holds the maintenance lock: its
    // holder may have stopped, and a DETACH below may wait for old transactions (up to
    // DETACH_TIMEOUT); an insert whose time has no partition fails.
    for table in &TABLES {
        let now = db_clock(conn)?;
        create_ahead(conn, table, &policy, now, &mut report);
    }
    // A stopped holder's idle session is ended by the server, and its lock with it.
    conn.batch_execute(&format!(
        "SET idle_session_timeout = {ms}; SET idle_in_transaction_session_timeout = {ms}",
        ms = IDLE_LIMIT.as_millis()
    ))?;
    let retired = match advisory_lock(conn, lock) {
        Ok(true) => {
            let retired = TABLES
                .iter()
                .try_for_each(|table| retire(conn, table, &policy, &mut report));
            advisory_lock(conn, MAINTENANCE_UNLOCK).and(retired)
        }
        Ok(false) => {
            report.busy = true;
            Ok(())
        }
        Err(e) => Err(e),
    };
    // The connection may go back to a pool: its sessions must not be ended when idle.
    let reset =
        conn.batch_execute("RESET idle_session_timeout; RESET idle_in_transaction_session_timeout");
    retired?;
    reset?;
    Ok(report)
}

/// Finishes interrupted detaches, settles detached leftovers, then detaches and drops the
/// expired partitions of `table`.
fn retire(
    conn: &mut PgConnection,
    table: &Table,
    policy: &PartitionPolicy,
    report: &mut PartitionReport,
) -> Result<()> {
    for p in partitions_of(conn, table)?.iter().filter(|p| p.detaching) {
        let finalize = format!(
            "ALTER TABLE {} DETACH PARTITION {} FINALIZE",
            table.name, p.name
        );
        if let Err(e) = with_statement_timeout(conn, DETACH_TIMEOUT, &finalize) {
            report.failed.push((p.name.clone(), error_text(&e)));
        }
    }
    if settle_orphans(conn, table, policy, report)? {
        // The partitions ahead that an orphan's name held back.
        let now = db_clock(conn)?;
        create_ahead(conn, table, policy, now, report);
    }
    let now = db_clock(conn)?;
    drop_expired(conn, table, policy, now, report)
}

/// Creates the partitions from the current one to `premake` after it, from where the
/// last one ends (a gap left while no maintenance ran is not filled: its time is past),
/// in one transaction under [`AHEAD_LOCK`]. Stops at the first that fails: the others
/// would wait for the same lock.
fn create_ahead(
    conn: &mut PgConnection,
    table: &Table,
    policy: &PartitionPolicy,
    now: DateTime<Utc>,
    report: &mut PartitionReport,
) {
    let made = conn.transaction(|c| {
        c.batch_execute(&format!(
            "SET LOCAL lock_timeout = {}; SET LOCAL idle_in_transaction_session_timeout = {}; \
             {AHEAD_LOCK}",
            LOCK_TIMEOUT.as_millis(),
            IDLE_LIMIT.as_millis()
        ))?;
        // Read under the lock: another maker may have made some since.
        for (name, (from, to)) in missing_ahead(c, table, policy, now)? {
            match c.transaction(|c| create_partition(c, table, &name, from, to)) {
                Ok(()) => report.created.push(name),
                Err(e) => {
                    report.failed.push((name, error_text(&e)));
                    break;
                }
            }
        }
        Ok::<_, Error>(())
    });
    if let Err(e) = made {
        report.failed.push((table.name.to_owned(), error_text(&e)));
    }
}

/// A partition's range: from, to (exclusive).
type Span = (DateTime<Utc>, DateTime<Utc>);

/// The partitions ahead that `table` lacks: `(name, (from, to))`, but those whose name an
/// orphan holds (the run that holds the maintenance lock settles it first).
fn missing_ahead(
    conn: &mut PgConnection,
    table: &Table,
    policy: &PartitionPolicy,
    now: DateTime<Utc>,
) -> Result<Vec<(String, Span)>> {
    let step = policy.interval.as_secs() as i64 * 1_000_000;
    let now_us = now.timestamp_micros();
    let current = now_us.div_euclid(step) * step;
    let until = current.saturating_add(step.saturating_mul(i64::from(policy.premake) + 1));
    let last_end = partitions_of(conn, table)?
        .iter()
        .filter_map(|p| p.to)
        .map(|to| to.timestamp_micros())
        .max();
    let mut from = last_end.map_or(current, |end| end.max(current));
    let orphans = orphans(conn, table)?;
    let mut missing = Vec::new();
    while from < until {
        let to = (from.div_euclid(step) + 1) * step;
        let (Some(start), Some(end)) = (micros(from), micros(to)) else {
            break;
        };
        let name = format!("{}_p{}", table.name, start.format("%Y%m%dt%H%M%S"));
        if !orphans.contains(&name) {
            missing.push((name, (start, end)));
        }
        from = to;
    }
    Ok(missing)
}

/// Creates `name` apart with its unique indexes, then attaches it (which takes only
/// `SHARE UPDATE EXCLUSIVE` on the parent, where `CREATE TABLE .. PARTITION OF` would
/// take `ACCESS EXCLUSIVE` and stop emits while it waits). Run in a transaction.
fn create_partition(
    conn: &mut PgConnection,
    table: &Table,
    name: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<()> {
    let mut sql = format!(
        "SET LOCAL lock_timeout = {}; CREATE TABLE {name} (LIKE {t} INCLUDING DEFAULTS);",
        LOCK_TIMEOUT.as_millis(),
        t = table.name
    );
    for (suffix, columns) in table.unique {
        sql += &format!(" CREATE UNIQUE INDEX {name}_{suffix} ON {name} ({columns});");
    }
    if let Some(suffix) = table.replica_identity {
        sql += &format!(" ALTER TABLE {name} REPLICA IDENTITY USING INDEX {name}_{suffix};");
    }
    sql += &format!(
        " ALTER TABLE {t} ATTACH PARTITION {name} FOR VALUES FROM ({}) TO ({});",
        literal(from),
        literal(to),
        t = table.name
    );
    conn.batch_execute(&sql)?;
    Ok(())
}

fn drop_expired(
    conn: &mut PgConnection,
    table: &Table,
    policy: &PartitionPolicy,
    now: DateTime<Utc>,
    report: &mut PartitionReport,
) -> Result<()> {
    let retention = chrono::Duration::from_std(policy.retention).unwrap_or(chrono::Duration::MAX);
    let cutoff = now
        .checked_sub_signed(retention)
        .unwrap_or(DateTime::<Utc>::MIN_UTC);
    let expired = partitions_of(conn, table)?
        .into_iter()
        .filter(|p| !p.detaching && p.to.is_some_and(|to| to <= cutoff));
    for p in expired {
        // Not detached under a transaction that may still write to it: the detach
        // would not wait for one that has not written yet, whose insert would then fail.
        let keep = match live_rows(conn, table, &p.name)? {
            Some(reason) => Some(reason),
            None => open_writer(conn, table, &p)?,
        };
        if let Some(reason) = keep {
            report.kept.push((p.name, reason));
            continue;
        }
        let detach = format!(
            "ALTER TABLE {} DETACH PARTITION {} CONCURRENTLY",
            table.name, p.name
        );
        match with_statement_timeout(conn, DETACH_TIMEOUT, &detach) {
            // What a transaction the look above did not see wrote goes back.
            Ok(()) => settle(conn, table, &p.name, p.from, p.to, report)?,
            Err(e) => report.failed.push((p.name, error_text(&e))),
        }
    }
    Ok(())
}

/// Why an open transaction may still write to partition `p` ([`OPEN_WRITER`]), if one may.
fn open_writer(conn: &mut PgConnection, table: &Table, p: &Partition) -> Result<Option<String>> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Nullable<Text>)]
        reason: Option<String>,
    }
    let Some(to) = p.to else { return Ok(None) };
    let row: Row = diesel::sql_query(OPEN_WRITER)
        .bind::<Text, _>(&p.name)
        .bind::<Timestamptz, _>(to)
        .bind::<Text, _>(table.name)
        .get_result(conn)?;
    Ok(row.reason)
}

/// A detached partition `name` of `table` (range `from`..`to`, `None` where unknown):
/// dropped if it holds no NEW and no DEAD row, else attached back, so that its rows are
/// claimed again. A step that fails (a lock not granted in time) is reported; the next
/// run finds the table as an orphan and settles it again.
fn settle(
    conn: &mut PgConnection,
    table: &Table,
    name: &str,
    from: Option<DateTime<Utc>>,
    to: Option<DateTime<Utc>>,
    report: &mut PartitionReport,
) -> Result<()> {
    let Some(reason) = live_rows(conn, table, name)? else {
        match with_lock_timeout(conn, &format!("DROP TABLE {name}")) {
            Ok(()) => report.dropped.push(name.to_owned()),
            Err(e) => report.failed.push((name.to_owned(), error_text(&e))),
        }
        return Ok(());
    };
    let Some(to) = to else {
        report.kept.push((
            name.to_owned(),
            format!("detached, {reason}: no range to attach it back to"),
        ));
        return Ok(());
    };
    let bound = |t: Option<DateTime<Utc>>| t.map_or("MINVALUE".to_owned(), literal);
    let attach = format!(
        "ALTER TABLE {} ATTACH PARTITION {name} FOR VALUES FROM ({}) TO ({})",
        table.name,
        bound(from),
        literal(to)
    );
    match with_lock_timeout(conn, &attach) {
        Ok(()) => report
            .kept
            .push((name.to_owned(), format!("attached back, {reason}"))),
        Err(e) => report.failed.push((name.to_owned(), error_text(&e))),
    }
    Ok(())
}

/// Settles the partitions a run detached but did not drop (its process ended in between,
/// or a transaction committed into a partition whose detach it held up): tables named as
/// this module names partitions that are no longer attached. Newest first, each attached
/// back up to the partition after it: its name gives its start (none for the legacy
/// table), the next attached partition its end. Whether there were any.
fn settle_orphans(
    conn: &mut PgConnection,
    table: &Table,
    policy: &PartitionPolicy,
    report: &mut PartitionReport,
) -> Result<bool> {
    let orphans = orphans(conn, table)?;
    for name in &orphans {
        let from = chrono::NaiveDateTime::parse_from_str(
            name.trim_start_matches(table.name).trim_start_matches("_p"),
            "%Y%m%dt%H%M%S",
        )
        .ok()
        .map(|t| t.and_utc());
        let next = partitions_of(conn, table)?
            .into_iter()
            .filter_map(|p| p.from)
            .filter(|&start| from.is_none_or(|from| start > from))
            .min();
        let interval = chrono::Duration::from_std(policy.interval).ok();
        let to = next.or_else(|| {
            from.zip(interval)
                .and_then(|(f, i)| f.checked_add_signed(i))
        });
        settle(conn, table, name, from, to, report)?;
    }
    Ok(!orphans.is_empty())
}

/// The tables of `table`'s schema named as its partitions but not attached, newest first.
fn orphans(conn: &mut PgConnection, table: &Table) -> Result<Vec<String>> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Text)]
        name: String,
    }
    let rows: Vec<Row> = diesel::sql_query(
        "SELECT c.relname::text AS name FROM pg_class c \
         WHERE c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = to_regclass($1)) \
         AND c.relkind = 'r' AND NOT c.relispartition \
         AND c.relname ~ ('^' || $1 || '_(p[0-9]{8}t[0-9]{6}|legacy)$') ORDER BY 1 DESC",
    )
    .bind::<Text, _>(table.name)
    .load(conn)?;
    Ok(rows.into_iter().map(|r| r.name).collect())
}

/// Why partition `name` must be kept: the NEW and DEAD rows it holds (counted on their
/// partial indexes); `None` if it holds neither.
///
/// In CDC mode (typed-outbox-cdc: a row in `outbox_cdc`) rows stay NEW once published:
/// a NEW row counts only if the CDC relay may not have published it, that is if it is
/// above the relayed watermark (`relayed_through`: every NEW row up to it was published
/// but the parked ones), in the backfill still to do, or parked for a retry
/// (`outbox_cdc_parked`). No per-row state is written for that.
fn live_rows(conn: &mut PgConnection, table: &Table, name: &str) -> Result<Option<String>> {
    if !table.has_status {
        return Ok(None);
    }
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = BigInt)]
        new: i64,
        #[diesel(sql_type = BigInt)]
        dead: i64,
    }
    let cdc = cdc_watermark(conn)?;
    let new = match cdc {
        None => format!("SELECT count(*) FROM {name} WHERE status = 0"),
        Some((through, from, upto)) => format!(
            "SELECT count(*) FROM {name} o WHERE status = 0 AND (id > {through} \
             OR (id > {from} AND id <= {upto}) \
             OR EXISTS (SELECT 1 FROM outbox_cdc_parked p WHERE p.id = o.id))"
        ),
    };
    let r: Row = diesel::sql_query(format!(
        "SELECT ({new}) AS new, (SELECT count(*) FROM {name} WHERE status = 2) AS dead"
    ))
    .get_result(conn)?;
    let what = if cdc.is_some() {
        "NEW rows the CDC relay has not published"
    } else {
        "NEW"
    };
    Ok((r.new + r.dead > 0).then(|| format!("holds {} {what} and {} DEAD rows", r.new, r.dead)))
}

/// In CDC mode, the relayed watermark and the backfill range still to do (see
/// [`live_rows`]); `None` otherwise.
fn cdc_watermark(conn: &mut PgConnection) -> Result<Option<(i64, i64, i64)>> {
    #[derive(QueryableByName)]
    struct Exists {
        #[diesel(sql_type = Bool)]
        cdc: bool,
    }
    #[derive(QueryableByName)]
    struct Mark {
        #[diesel(sql_type = BigInt)]
        relayed_through: i64,
        #[diesel(sql_type = BigInt)]
        backfill_from: i64,
        #[diesel(sql_type = BigInt)]
        backfill_upto: i64,
    }
    let exists: Exists = diesel::sql_query("SELECT to_regclass('outbox_cdc') IS NOT NULL AS cdc")
        .get_result(conn)?;
    if !exists.cdc {
        return Ok(None);
    }
    let marks: Vec<Mark> = diesel::sql_query(
        "SELECT relayed_through, backfill_from, backfill_upto FROM outbox_cdc LIMIT 1",
    )
    .load(conn)?;
    Ok(marks
        .first()
        .map(|m| (m.relayed_through, m.backfill_from, m.backfill_upto)))
}

fn partitions_of(conn: &mut PgConnection, table: &Table) -> Result<Vec<Partition>> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Text)]
        name: String,
        #[diesel(sql_type = Nullable<Timestamptz>)]
        range_from: Option<DateTime<Utc>>,
        #[diesel(sql_type = Nullable<Timestamptz>)]
        range_to: Option<DateTime<Utc>>,
        #[diesel(sql_type = Bool)]
        detaching: bool,
    }
    // The bounds as the server prints them, read back by the server (the same DateStyle).
    let rows: Vec<Row> = diesel::sql_query(
        "SELECT c.relname::text AS name, \
         (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \\(''([^'']+)''\\)'))[1]::timestamptz AS range_from, \
         (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \\(''([^'']+)''\\)'))[1]::timestamptz AS range_to, \
         i.inhdetachpending AS detaching \
         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = to_regclass($1) ORDER BY 3 NULLS FIRST, 2 NULLS FIRST",
    )
    .bind::<Text, _>(table.name)
    .load(conn)?;
    Ok(rows
        .into_iter()
        .map(|r| Partition {
            table: table.name,
            name: r.name,
            from: r.range_from,
            to: r.range_to,
            detaching: r.detaching,
        })
        .collect())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Plain,
    Partitioned,
}

/// Whether `table` (as the `search_path` finds it) is partitioned; `None` if missing.
fn kind(conn: &mut PgConnection, table: &str) -> Result<Option<Kind>> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Nullable<Bool>)]
        partitioned: Option<bool>,
    }
    let row: Row = diesel::sql_query(
        "SELECT (SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($1)) AS partitioned",
    )
    .bind::<Text, _>(table)
    .get_result(conn)?;
    Ok(row
        .partitioned
        .map(|p| if p { Kind::Partitioned } else { Kind::Plain }))
}

/// Renames an unpartitioned table and the indexes whose names the partitioned table
/// takes (its primary key and unique constraint keep theirs: they stay its own).
fn rename_to_legacy(conn: &mut PgConnection, table: &Table) -> Result<()> {
    let t = table.name;
    let mut sql =
        format!("LOCK TABLE {t} IN ACCESS EXCLUSIVE MODE; ALTER TABLE {t} RENAME TO {t}_legacy;");
    let indexes: &[&str] = if table.has_status {
        &["pending", "pending_key", "retrying", "dead", "sent"]
    } else {
        &["consumed_at"]
    };
    for index in indexes {
        sql += &format!(" ALTER INDEX IF EXISTS {t}_{index} RENAME TO {t}_legacy_{index};");
    }
    conn.batch_execute(&sql)?;
    Ok(())
}

/// Runs `sql` outside a transaction with a `statement_timeout`, then resets it (the
/// connection goes back to a pool).
fn with_statement_timeout(conn: &mut PgConnection, timeout: Duration, sql: &str) -> Result<()> {
    conn.batch_execute(&format!("SET statement_timeout = {}", timeout.as_millis()))?;
    let ran = conn.batch_execute(sql);
    let reset = conn.batch_execute("RESET statement_timeout");
    ran?;
    Ok(reset?)
}

/// Runs `sql` in a transaction of its own with a `lock_timeout` of [`LOCK_TIMEOUT`].
fn with_lock_timeout(conn: &mut PgConnection, sql: &str) -> Result<()> {
    let timeout = LOCK_TIMEOUT.as_millis();
    conn.transaction(|c| c.batch_execute(&format!("SET LOCAL lock_timeout = {timeout}; {sql}")))?;
    Ok(())
}

/// Runs `sql`, one of the `MAINTENANCE_*` statements.
fn advisory_lock(conn: &mut PgConnection, sql: &str) -> Result<bool> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Bool)]
        locked: bool,
    }
    let row: Row = diesel::sql_query(sql).get_result(conn)?;
    Ok(row.locked)
}

/// The server's clock now (not the transaction's start, as `now()` would give).
fn db_clock(conn: &mut PgConnection) -> Result<DateTime<Utc>> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Timestamptz)]
        now: DateTime<Utc>,
    }
    let row: Row = diesel::sql_query("SELECT clock_timestamp() AS now").get_result(conn)?;
    Ok(row.now)
}

fn micros(us: i64) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp_micros(us)
}

/// A `timestamptz` literal the server reads whatever its DateStyle (ISO 8601, UTC).
fn literal(t: DateTime<Utc>) -> String {
    format!("'{}'", t.to_rfc3339_opts(SecondsFormat::Micros, true))
}

fn error_text(e: &Error) -> String {
    outbox_core::error_chain(e).to_string()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::PartitionPolicy;

    #[test]
    fn policies_out_of_range_are_refused() {
        assert!(PartitionPolicy::default().validate().is_ok());
        let bad = [
            PartitionPolicy::default().with_interval(Duration::ZERO),
            PartitionPolicy::default().with_interval(Duration::from_millis(1500)),
            PartitionPolicy::default().with_interval(Duration::from_secs(101 * 365 * 86_400)),
            PartitionPolicy::default().with_retention(Duration::from_secs(101 * 365 * 86_400)),
            PartitionPolicy::default().with_premake(1001),
        ];
        for policy in bad {
            assert!(policy.validate().is_err(), "{policy:?}");
        }
    }
}
