//! Setting CDC mode up and down: the publication, the slot, the `outbox_cdc` tables; the
//! start check; the lag; the switch back to the polling relay.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::connection::SimpleConnection as _;
use diesel::sql_types::{BigInt, Bool, Nullable, Text, Timestamptz};
use diesel::{PgConnection, QueryableByName, RunQueryDsl as _};

use crate::{CdcConfig, CdcError, Result};

/// The tables of CDC mode, created by [`setup`]. Idempotent.
///
/// `outbox_cdc` holds one row while CDC mode is on: its slot and publication (the
/// polling relay refuses to start while it exists), the backfill still to do, the
/// relayed watermark, and the running relay's last report. `outbox_cdc_parked` holds the
/// messages handed from the stream to the retry loop, in the order they must be
/// published: each refused message, and the later messages of its key.
pub const CDC_TABLES_SQL: &str = r"
SELECT pg_advisory_xact_lock(7362291004541029);
CREATE TABLE IF NOT EXISTS outbox_cdc (
    singleton             BOOLEAN     PRIMARY KEY DEFAULT true CHECK (singleton),
    slot_name             TEXT        NOT NULL,
    publication           TEXT        NOT NULL,
    since                 TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- Rows with backfill_from < id <= backfill_upto that are NEW are published by the
    -- relay before it reads the slot: they committed before the slot existed.
    backfill_from         BIGINT      NOT NULL DEFAULT 0,
    backfill_upto         BIGINT      NOT NULL DEFAULT 0,
    -- Every NEW row with id <= relayed_through was published, but those in
    -- outbox_cdc_parked (and DEAD ones): what retention and the switch back trust.
    relayed_through       BIGINT      NOT NULL DEFAULT 0,
    -- The holding relay's last report (every lag_interval).
    oldest_unconfirmed_at TIMESTAMPTZ,
    reported_at           TIMESTAMPTZ,
    report_every_ms       BIGINT      NOT NULL DEFAULT 10000
);
CREATE TABLE IF NOT EXISTS outbox_cdc_parked (
    seq     BIGSERIAL    PRIMARY KEY,
    id      BIGINT       NOT NULL UNIQUE,
    msg_key VARCHAR(255) NOT NULL
);
CREATE INDEX IF NOT EXISTS outbox_cdc_parked_key ON outbox_cdc_parked (msg_key, seq);
";

/// Serialises [`setup`], [`recover_lost_slot`] and [`switch_to_polling`] runs.
const SETUP_LOCK: &str = "SELECT pg_advisory_lock(7362291004541030)";
const SETUP_UNLOCK: &str = "SELECT pg_advisory_unlock(7362291004541030)";

/// Runs `f` holding [`SETUP_LOCK`] on `conn`; the lock is released whatever `f`
/// returns (its error first, then the unlock's).
fn under_setup_lock<T>(
    conn: &mut PgConnection,
    f: impl FnOnce(&mut PgConnection) -> Result<T>,
) -> Result<T> {
    conn.batch_execute(SETUP_LOCK)?;
    let done = f(conn);
    let unlocked = conn.batch_execute(SETUP_UNLOCK);
    let done = done?;
    unlocked?;
    Ok(done)
}

/// What [`setup`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SetupReport {
    /// The publication was created, or changed to publish what the relay reads (the
    /// outbox's inserts, updates, deletes and truncates), or a partition's replica
    /// identity was set.
    pub publication_created: bool,
    /// The slot was created now.
    pub slot_created: bool,
    /// The table is the partitioned layout.
    pub partitioned: bool,
    /// The NEW rows with ids in `backfill.0 < id <= backfill.1` are published by the
    /// relay before the slot's stream: they committed before the slot existed.
    pub backfill: (i64, i64),
}

/// CDC mode as [`setup`] recorded it (the `outbox_cdc` row).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CdcMode {
    /// The slot.
    pub slot: String,
    /// The publication.
    pub publication: String,
    /// When CDC mode was set up.
    pub since: DateTime<Utc>,
    /// The backfill still to do: NEW rows with `backfill.0 < id <= backfill.1`.
    pub backfill: (i64, i64),
    /// Every NEW row with an id up to this was published, except parked and DEAD ones.
    pub relayed_through: i64,
}

#[derive(QueryableByName)]
struct ModeRow {
    #[diesel(sql_type = Text)]
    slot_name: String,
    #[diesel(sql_type = Text)]
    publication: String,
    #[diesel(sql_type = Timestamptz)]
    since: DateTime<Utc>,
    #[diesel(sql_type = BigInt)]
    backfill_from: i64,
    #[diesel(sql_type = BigInt)]
    backfill_upto: i64,
    #[diesel(sql_type = BigInt)]
    relayed_through: i64,
}

#[derive(QueryableByName)]
struct One {
    #[diesel(sql_type = Text)]
    v: String,
}

/// One text value of `sql` (column `v`).
pub(crate) fn text(conn: &mut PgConnection, sql: &str) -> Result<String> {
    Ok(diesel::sql_query(sql).get_result::<One>(conn)?.v)
}

/// CDC mode as recorded, `None` when it is off (no `outbox_cdc` table or row). The
/// polling relay ([`outbox_diesel::PgRelayStore`]) refuses to start while it is on.
pub fn cdc_mode(conn: &mut PgConnection) -> Result<Option<CdcMode>> {
    if text(
        conn,
        "SELECT (to_regclass('outbox_cdc') IS NOT NULL)::text AS v",
    )? != "true"
    {
        return Ok(None);
    }
    let rows: Vec<ModeRow> = diesel::sql_query(
        "SELECT slot_name, publication, since, backfill_from, backfill_upto, relayed_through \
         FROM outbox_cdc",
    )
    .load(conn)?;
    let Some(r) = rows.into_iter().next() else {
        return Ok(None);
    };
    // Both go into SQL as they are (setup, recovery, the switch back): a name nobody's
    // config could have written is refused, not run.
    for (field, name) in [
        ("outbox_cdc.slot_name", &r.slot_name),
        ("outbox_cdc.publication", &r.publication),
    ] {
        if !crate::config::is_name(name) {
            return Err(outbox_core::InvalidConfig::new(
                field,
                format!("`{name}` is no slot or publication name this relay makes"),
            )
            .into());
        }
    }
    Ok(Some(CdcMode {
        slot: r.slot_name,
        publication: r.publication,
        since: r.since,
        backfill: (r.backfill_from, r.backfill_upto),
        relayed_through: r.relayed_through,
    }))
}

/// Sets CDC mode up (what `outbox migrate --cdc` runs); idempotent. Run it after the
/// outbox migration ([`outbox_diesel::migrate`] or [`outbox_diesel::migrate_partitioned`])
/// and outside a transaction, with a role that has the `REPLICATION` attribute.
///
/// It checks the server ([`check_server`]), creates the CDC tables ([`CDC_TABLES_SQL`]),
/// the publication of the `outbox` table's inserts (`publish_via_partition_root = true`,
/// so the partitioned layout's rows come as rows of `outbox`), the logical slot
/// (`pgoutput`), and records the mode in `outbox_cdc` with the backfill: the NEW rows
/// that committed before the slot existed. From then on a polling relay refuses to
/// start. Run again, it repairs a publication that no longer covers `outbox` (after
/// `outbox migrate --partitioned`) and changes nothing else; a slot that is missing or
/// invalidated is an error ([`recover_lost_slot`] recreates it).
pub fn setup(conn: &mut PgConnection, config: &CdcConfig) -> Result<SetupReport> {
    config.validate()?;
    check_server(conn)?;
    under_setup_lock(conn, |c| setup_locked(c, config))
}

fn setup_locked(conn: &mut PgConnection, config: &CdcConfig) -> Result<SetupReport> {
    if text(
        conn,
        "SELECT (to_regclass('outbox') IS NOT NULL)::text AS v",
    )? != "true"
    {
        return Err(CdcError::PublicationUnusable {
            publication: config.publication.clone(),
            detail: "there is no `outbox` table: run `outbox migrate` first".into(),
        });
    }
    conn.batch_execute(&format!("BEGIN; {CDC_TABLES_SQL} COMMIT;"))?;
    let mut report = SetupReport {
        partitioned: text(
            conn,
            "SELECT (relkind = 'p')::text AS v FROM pg_class WHERE oid = to_regclass('outbox')",
        )? == "true",
        // Before the publication publishes updates and deletes: from then on, a
        // partition without one refuses them.
        publication_created: ensure_replica_identity(conn)?
            | ensure_publication(conn, &config.publication)?,
        ..SetupReport::default()
    };
    if let Some(mode) = cdc_mode(conn)? {
        if mode.slot != config.slot {
            return Err(CdcError::SlotMismatch {
                configured: config.slot.clone(),
                recorded: mode.slot,
            });
        }
        slot_state(conn, &mode.slot)?;
        report.backfill = mode.backfill;
        return Ok(report);
    }
    report.slot_created = create_slot(conn, &config.slot)?;
    let upto = max_id(conn)?;
    diesel::sql_query(
        "INSERT INTO outbox_cdc (slot_name, publication, backfill_from, backfill_upto) \
         VALUES ($1, $2, 0, $3)",
    )
    .bind::<Text, _>(&config.slot)
    .bind::<Text, _>(&config.publication)
    .bind::<BigInt, _>(upto)
    .execute(conn)?;
    report.backfill = (0, upto);
    Ok(report)
}

/// The outbox's partitions without a replica identity (no primary key, none set), and
/// each one's unique index on `id`, if it has one. Once the publication publishes
/// updates and deletes, PostgreSQL refuses them on such a partition; it does not carry
/// the parent's replica identity to partitions (`outbox partitions maintain` sets it on
/// those it creates).
fn partitions_without_replica_identity(
    conn: &mut PgConnection,
) -> Result<Vec<(String, Option<String>)>> {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = Text)]
        part: String,
        #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
        idx: Option<String>,
    }
    let rows: Vec<Row> = diesel::sql_query(
        "SELECT c.oid::regclass::text AS part,            (SELECT i.indexrelid::regclass::text FROM pg_index i             WHERE i.indrelid = c.oid AND i.indisunique AND i.indpred IS NULL             AND i.indimmediate AND i.indnatts = 1 AND i.indkey[0] =               (SELECT attnum FROM pg_attribute WHERE attrelid = c.oid AND attname = 'id')             LIMIT 1) AS idx          FROM pg_inherits h JOIN pg_class c ON c.oid = h.inhrelid          WHERE h.inhparent = to_regclass('outbox') AND (c.relreplident = 'n' OR            (c.relreplident = 'd' AND NOT EXISTS              (SELECT 1 FROM pg_index p WHERE p.indrelid = c.oid AND p.indisprimary)))",
    )
    .load(conn)?;
    Ok(rows.into_iter().map(|r| (r.part, r.idx)).collect())
}

/// Gives each outbox partition without a replica identity its unique index on `id` as
/// one (partitions made by versions before issue 35). Whether it changed any.
fn ensure_replica_identity(conn: &mut PgConnection) -> Result<bool> {
    let missing = partitions_without_replica_identity(conn)?;
    for (part, idx) in &missing {
        let Some(idx) = idx else {
            return Err(no_replica_identity(part));
        };
        conn.batch_execute(&format!(
            "ALTER TABLE {part} REPLICA IDENTITY USING INDEX {idx}"
        ))?;
    }
    Ok(!missing.is_empty())
}

fn no_replica_identity(part: &str) -> CdcError {
    CdcError::PublicationUnusable {
        publication: "outbox".into(),
        detail: format!(
            "partition {part} of `outbox` has no replica identity (no primary key, no \
             unique index on id): updates and deletes of it would fail once published; \
             run `outbox migrate --cdc` (which sets one) or give it one"
        ),
    }
}

/// The highest id of the outbox, read after the slot was created: every row that
/// committed before the slot's consistent point has an id up to it (see
/// [`setup`]'s backfill).
fn max_id(conn: &mut PgConnection) -> Result<i64> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = BigInt)]
        v: i64,
    }
    Ok(
        diesel::sql_query("SELECT coalesce(max(id), 0) AS v FROM outbox")
            .get_result::<Row>(conn)?
            .v,
    )
}

/// What a publication must publish of the `outbox` table, as SQL over
/// `pg_publication p` and `pg_publication_tables t`: its inserts, and its updates,
/// deletes and truncates (a row updated, deleted or truncated by the transaction that
/// inserted it is published as committed, issue 35), with `status` among its columns
/// from PostgreSQL 15 on.
fn publishes_enough(version: i32) -> &'static str {
    if version >= 150_000 {
        "p.pubinsert AND p.pubupdate AND p.pubdelete AND p.pubtruncate \
         AND (t.attnames IS NULL OR 'status' = ANY (t.attnames))"
    } else {
        "p.pubinsert AND p.pubupdate AND p.pubdelete AND p.pubtruncate"
    }
}

/// Whether publication `name` publishes the `outbox` table with `what` (SQL over
/// `pg_publication p` and `pg_publication_tables t`) true.
fn publication_covers(conn: &mut PgConnection, name: &str, what: &str) -> Result<bool> {
    Ok(text(
        conn,
        &format!(
            "SELECT EXISTS (SELECT 1 FROM pg_publication p JOIN pg_publication_tables t \
             ON t.pubname = p.pubname WHERE p.pubname = '{}' AND {what} \
             AND t.tablename = 'outbox')::text AS v",
            name.replace('\'', "''")
        ),
    )? == "true")
}

fn server_version(conn: &mut PgConnection) -> Result<i32> {
    Ok(
        text(conn, "SELECT current_setting('server_version_num') AS v")?
            .parse()
            .unwrap_or(0),
    )
}

/// Creates the publication, or makes an existing one publish the outbox's inserts,
/// updates, deletes and truncates (those made by earlier versions published less).
/// Whether it changed anything.
fn ensure_publication(conn: &mut PgConnection, name: &str) -> Result<bool> {
    let exists = text(
        conn,
        &format!(
            "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = '{name}')::text AS v"
        ),
    )? == "true";
    let version = server_version(conn)?;
    let covers = publication_covers(
        conn,
        name,
        &format!(
            "{} AND p.pubviaroot AND t.schemaname = (SELECT relnamespace::regnamespace::text \
             FROM pg_class WHERE oid = to_regclass('outbox'))",
            publishes_enough(version)
        ),
    )?;
    if covers {
        return Ok(false);
    }
    // From PostgreSQL 15 on, only the columns the relay reads (`decode.rs`): the WAL
    // sender then converts and sends nothing else of each row (the retry and send
    // times, the last error). They include the primary key, as a column list must when
    // updates and deletes are published.
    let columns = if version >= 150_000 {
        // Those a message needs, and `status`, to skip rows inserted or updated as
        // SENT or DEAD as the polling relay does.
        format!(" ({}, status)", crate::decode::NEEDED.join(", "))
    } else {
        String::new()
    };
    let table = format!(
        "{}{columns}",
        text(conn, "SELECT to_regclass('outbox')::text AS v")?
    );
    let options = "publish = 'insert, update, delete, truncate', publish_via_partition_root = true";
    conn.batch_execute(&if exists {
        format!(
            // The options first: a column list on a partitioned table needs
            // publish_via_partition_root.
            "ALTER PUBLICATION \"{name}\" SET ({options}); ALTER PUBLICATION \"{name}\" SET TABLE {table}"
        )
    } else {
        format!("CREATE PUBLICATION \"{name}\" FOR TABLE {table} WITH ({options})")
    })?;
    Ok(true)
}

/// Creates the logical slot if it does not exist. Whether it did.
fn create_slot(conn: &mut PgConnection, slot: &str) -> Result<bool> {
    let exists = text(
        conn,
        &format!(
            "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = '{slot}')::text AS v"
        ),
    )? == "true";
    if exists {
        slot_state(conn, slot)?;
        return Ok(false);
    }
    // Waits for the transactions running now to end (the slot's consistent point).
    text(
        conn,
        &format!(
            "SELECT lsn::text AS v FROM pg_create_logical_replication_slot('{slot}', 'pgoutput')"
        ),
    )?;
    Ok(true)
}

/// Checks that the server can serve the relay: `wal_level = logical`, and a role with
/// the `REPLICATION` attribute (or superuser).
pub fn check_server(conn: &mut PgConnection) -> Result<()> {
    let level = text(conn, "SELECT current_setting('wal_level') AS v")?;
    if level != "logical" {
        return Err(CdcError::WalLevelNotLogical { found: level });
    }
    #[derive(QueryableByName)]
    struct Role {
        #[diesel(sql_type = Text)]
        role: String,
        #[diesel(sql_type = Bool)]
        ok: bool,
    }
    let role: Role = diesel::sql_query(
        "SELECT current_user::text AS role, (rolreplication OR rolsuper) AS ok \
         FROM pg_roles WHERE rolname = current_user",
    )
    .get_result(conn)?;
    if !role.ok {
        return Err(CdcError::MissingReplicationPrivilege { role: role.role });
    }
    Ok(())
}

/// The replication slot as the server reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SlotState {
    /// The slot's name.
    pub slot: String,
    /// The server process reading it, if a relay holds it now.
    pub active_pid: Option<i32>,
    /// The position the relays confirmed (`confirmed_flush_lsn`), as text (`0/16B3748`).
    pub confirmed_flush_lsn: Option<String>,
    /// `wal_status`: `reserved`, `extended`, `unreserved` (about to be lost) or `lost`.
    pub wal_status: Option<String>,
}

#[derive(QueryableByName)]
struct SlotRow {
    #[diesel(sql_type = Nullable<Text>)]
    plugin: Option<String>,
    #[diesel(sql_type = Text)]
    slot_type: String,
    #[diesel(sql_type = Bool)]
    this_db: bool,
    #[diesel(sql_type = Nullable<diesel::sql_types::Integer>)]
    active_pid: Option<i32>,
    #[diesel(sql_type = Nullable<Text>)]
    confirmed: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    wal_status: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    invalidation_reason: Option<String>,
}

/// The slot's state, or why it cannot serve: missing, not a pgoutput slot of this
/// database, invalidated.
pub(crate) fn slot_state(conn: &mut PgConnection, slot: &str) -> Result<SlotState> {
    // `invalidation_reason` is PostgreSQL 17's; read through to_jsonb so that older
    // servers (which only have wal_status = 'lost') answer NULL instead of an error.
    let rows: Vec<SlotRow> = diesel::sql_query(
        "SELECT plugin::text, slot_type::text, database = current_database() AS this_db, \
         active_pid, confirmed_flush_lsn::text AS confirmed, wal_status::text, \
         to_jsonb(s) ->> 'invalidation_reason' AS invalidation_reason \
         FROM pg_replication_slots s WHERE slot_name = $1",
    )
    .bind::<Text, _>(slot)
    .load(conn)?;
    let Some(r) = rows.into_iter().next() else {
        return Err(CdcError::SlotMissing { slot: slot.into() });
    };
    if r.slot_type != "logical" || r.plugin.as_deref() != Some("pgoutput") || !r.this_db {
        return Err(CdcError::SlotUnusable {
            slot: slot.into(),
            detail: format!(
                "type {}, plugin {}, {}",
                r.slot_type,
                r.plugin.as_deref().unwrap_or("none"),
                if r.this_db {
                    "this database"
                } else {
                    "another database"
                }
            ),
        });
    }
    if let Some(reason) = r.invalidation_reason {
        return Err(CdcError::SlotInvalidated {
            slot: slot.into(),
            reason,
        });
    }
    if r.wal_status.as_deref() == Some("lost") {
        return Err(CdcError::SlotInvalidated {
            slot: slot.into(),
            reason: "wal_status = lost: the WAL it needs was removed (max_slot_wal_keep_size)"
                .into(),
        });
    }
    Ok(SlotState {
        slot: slot.into(),
        active_pid: r.active_pid,
        confirmed_flush_lsn: r.confirmed,
        wal_status: r.wal_status,
    })
}

/// The start check the relay runs at every start and reconnect: the server
/// ([`check_server`]), CDC mode set up ([`cdc_mode`]), its publication covering the
/// outbox and its slot usable. Returns the mode and the slot's state.
pub fn check(conn: &mut PgConnection) -> Result<(CdcMode, SlotState)> {
    check_server(conn)?;
    let mode = cdc_mode(conn)?.ok_or(CdcError::NotSetUp)?;
    if !publication_covers(conn, &mode.publication, "p.pubinsert")? {
        return Err(CdcError::PublicationUnusable {
            publication: mode.publication,
            detail: "it does not publish the inserts of the `outbox` table".into(),
        });
    }
    let version = server_version(conn)?;
    if !publication_covers(conn, &mode.publication, publishes_enough(version))? {
        // Made by an earlier version: a row its transaction updated, deleted or
        // truncated before committing would be published as first inserted (issue 35).
        return Err(CdcError::PublicationUnusable {
            publication: mode.publication,
            detail: "it does not publish the updates, deletes and truncates of the \
                     `outbox` table (and its `status` column), as those made by earlier \
                     versions did not: run `outbox migrate --cdc` once to alter it"
                .into(),
        });
    }
    if let Some((part, _)) = partitions_without_replica_identity(conn)?.first() {
        return Err(no_replica_identity(part));
    }
    let slot = slot_state(conn, &mode.slot)?;
    Ok((mode, slot))
}

/// Recreates an invalidated (or dropped) slot, after [`CdcError::SlotInvalidated`] or
/// [`CdcError::SlotMissing`]: drops the old one, creates a new one, and sets the backfill
/// to the NEW rows above the relayed watermark (`relayed_through`) up to the highest id
/// now. The relay then publishes those before it reads the new slot: what committed
/// while the old slot was lost is published (some rows it had published already, up to a
/// few `lag_interval`s' worth, again: the consumers' inbox absorbs them). Stop the relays
/// first.
pub fn recover_lost_slot(conn: &mut PgConnection) -> Result<SetupReport> {
    check_server(conn)?;
    under_setup_lock(conn, recover_locked)
}

fn recover_locked(conn: &mut PgConnection) -> Result<SetupReport> {
    let mode = cdc_mode(conn)?.ok_or(CdcError::NotSetUp)?;
    match slot_state(conn, &mode.slot) {
        Ok(_) => {
            return Err(CdcError::SlotUnusable {
                slot: mode.slot,
                detail: "the slot is usable: there is nothing to recover".into(),
            });
        }
        Err(CdcError::SlotMissing { .. }) => {}
        Err(CdcError::SlotInvalidated { .. }) => {
            text(
                conn,
                &format!(
                    "SELECT pg_drop_replication_slot('{}')::text AS v",
                    mode.slot
                ),
            )?;
        }
        Err(e) => return Err(e),
    }
    let slot_created = create_slot(conn, &mode.slot)?;
    let upto = max_id(conn)?;
    // A backfill not finished is kept: it starts at the lower of its start and the
    // watermark.
    let (start, end) = mode.backfill;
    let from = if start < end {
        start.min(mode.relayed_through)
    } else {
        mode.relayed_through
    };
    diesel::sql_query("UPDATE outbox_cdc SET backfill_from = $1, backfill_upto = $2")
        .bind::<BigInt, _>(from)
        .bind::<BigInt, _>(upto)
        .execute(conn)?;
    Ok(SetupReport {
        slot_created,
        backfill: (from, upto),
        ..SetupReport::default()
    })
}

/// What [`switch_to_polling`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SwitchReport {
    /// NEW rows marked SENT: those the CDC relay published (up to the watermark).
    pub marked_sent: u64,
    /// The watermark: rows above it stay NEW and the polling relay publishes them
    /// (again, for those the CDC relay published after its last report).
    pub relayed_through: i64,
    /// Messages that were parked for a retry: they stay NEW for the polling relay.
    pub parked: u64,
}

/// Switches CDC mode off, back to the polling relay, losing nothing: marks SENT the NEW
/// rows the CDC relay published (those up to its watermark that are not waiting for a
/// retry), empties the parked list, drops the slot and the publication and the
/// `outbox_cdc` row. The polling relay then publishes every row still NEW: the parked
/// messages, the backfill not done, and whatever committed above the watermark (some of
/// it a second time, absorbed by the consumers' inbox). Stop every CDC relay first: a
/// slot still in use is refused.
pub fn switch_to_polling(conn: &mut PgConnection) -> Result<SwitchReport> {
    under_setup_lock(conn, switch_locked)
}

fn switch_locked(conn: &mut PgConnection) -> Result<SwitchReport> {
    let Some(mode) = cdc_mode(conn)? else {
        return Ok(SwitchReport::default());
    };
    match slot_state(conn, &mode.slot) {
        Ok(SlotState {
            active_pid: Some(pid),
            ..
        }) => {
            return Err(CdcError::SwitchTimeout(format!(
                "slot `{}` is in use by server process {pid}: stop the CDC relays first",
                mode.slot
            )));
        }
        Ok(_) => {
            text(
                conn,
                &format!(
                    "SELECT pg_drop_replication_slot('{}')::text AS v",
                    mode.slot
                ),
            )?;
        }
        Err(CdcError::SlotMissing { .. } | CdcError::SlotInvalidated { .. }) => {}
        Err(e) => return Err(e),
    }
    use diesel::Connection as _;
    conn.transaction(|c| {
        // The rows the CDC relay published, as the polling relay would have left them.
        let marked_sent = diesel::sql_query(
            "UPDATE outbox SET status = 1, sent_at = now() WHERE status = 0 AND retries = 0 \
             AND id <= $1 AND NOT (id > $2 AND id <= $3) \
             AND id NOT IN (SELECT id FROM outbox_cdc_parked)",
        )
        .bind::<BigInt, _>(mode.relayed_through)
        .bind::<BigInt, _>(mode.backfill.0)
        .bind::<BigInt, _>(mode.backfill.1)
        .execute(c)? as u64;
        let parked = diesel::sql_query("DELETE FROM outbox_cdc_parked").execute(c)? as u64;
        diesel::sql_query("DELETE FROM outbox_cdc").execute(c)?;
        c.batch_execute(&format!(
            "DROP PUBLICATION IF EXISTS \"{}\"",
            mode.publication
        ))?;
        Ok::<_, CdcError>(SwitchReport {
            marked_sent,
            relayed_through: mode.relayed_through,
            parked,
        })
    })
}

/// How far the relay is behind ([`lag`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Lag {
    /// WAL bytes between the server's current position and the slot's confirmed
    /// position (`pg_current_wal_lsn() - confirmed_flush_lsn`): what a slot that falls
    /// behind keeps on disk. `None` if the slot is missing.
    pub bytes: Option<u64>,
    /// The age of the oldest commit the relay has read and not yet confirmed, as the
    /// relay last reported it; when the relay has not reported for three of its
    /// intervals (none runs, or it is stuck) and the slot is behind, at least the time
    /// since its last report.
    pub oldest_unconfirmed_age: Option<Duration>,
    /// Whether a relay reported within three of its intervals.
    pub relay_reporting: bool,
    /// The server process holding the slot, if any.
    pub active_pid: Option<i32>,
    /// The slot's `wal_status` (`lost`: invalidated).
    pub wal_status: Option<String>,
    /// Messages parked for a retry (refused ones and the later messages of their keys).
    pub parked: u64,
    /// NEW rows still to backfill, at most (the backfill's id range).
    pub backfill_left: u64,
}

#[derive(QueryableByName)]
struct LagRow {
    #[diesel(sql_type = Nullable<BigInt>)]
    bytes: Option<i64>,
    #[diesel(sql_type = Nullable<diesel::sql_types::Integer>)]
    active_pid: Option<i32>,
    #[diesel(sql_type = Nullable<Text>)]
    wal_status: Option<String>,
    #[diesel(sql_type = Nullable<BigInt>)]
    unconfirmed_ms: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    silent_ms: Option<i64>,
    #[diesel(sql_type = BigInt)]
    report_every_ms: i64,
    #[diesel(sql_type = BigInt)]
    parked: i64,
    #[diesel(sql_type = BigInt)]
    backfill_left: i64,
}

/// How far the relay is behind: the slot's lag in bytes, the age of the oldest
/// unconfirmed commit, the parked messages; for `outbox status`, the page and
/// `/readyz`. [`CdcError::NotSetUp`] when CDC mode is off.
pub fn lag(conn: &mut PgConnection) -> Result<Lag> {
    if cdc_mode(conn)?.is_none() {
        return Err(CdcError::NotSetUp);
    }
    let r: LagRow = diesel::sql_query(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint AS bytes, \
         s.active_pid, s.wal_status::text, \
         (extract(epoch FROM now() - c.oldest_unconfirmed_at) * 1000)::bigint AS unconfirmed_ms, \
         (extract(epoch FROM now() - c.reported_at) * 1000)::bigint AS silent_ms, \
         c.report_every_ms, \
         (SELECT count(*) FROM outbox_cdc_parked) AS parked, \
         greatest(c.backfill_upto - c.backfill_from, 0) AS backfill_left \
         FROM outbox_cdc c LEFT JOIN pg_replication_slots s ON s.slot_name = c.slot_name",
    )
    .get_result(conn)?;
    let ms = |v: i64| Duration::from_millis(u64::try_from(v).unwrap_or(0));
    let reporting = r
        .silent_ms
        .is_some_and(|s| s <= r.report_every_ms.saturating_mul(3));
    let behind = r.bytes.is_some_and(|b| b > 0);
    let oldest = match (r.unconfirmed_ms, reporting) {
        (Some(age), true) => Some(ms(age)),
        (None, true) => None,
        (reported, false) if behind => {
            let silent = r.silent_ms.map(ms);
            reported.map(ms).max(silent)
        }
        (_, false) => None,
    };
    Ok(Lag {
        bytes: r.bytes.map(|b| u64::try_from(b).unwrap_or(0)),
        oldest_unconfirmed_age: oldest,
        relay_reporting: reporting,
        active_pid: r.active_pid,
        wal_status: r.wal_status,
        parked: u64::try_from(r.parked).unwrap_or(0),
        backfill_left: u64::try_from(r.backfill_left).unwrap_or(0),
    })
}

/// Re-drives DEAD rows in CDC mode: back to NEW with retries reset, due now, last error
/// cleared, a new id, and parked (`outbox_cdc_parked`), so that the CDC relay's retry
/// round publishes them, each after the parked messages of its key: the log never shows
/// the UPDATE. [`outbox_diesel::redrive`] and [`outbox_diesel::redrive_all`] do the same
/// on their own in CDC mode (what `outbox dead redrive` and the page call); this one
/// refuses when CDC is not set up. `None` re-drives every DEAD row that decodes (an
/// unreadable one stays DEAD). Returns how many rows changed.
pub fn redrive(conn: &mut PgConnection, ids: Option<&[i64]>) -> Result<u64> {
    if cdc_mode(conn)?.is_none() {
        return Err(CdcError::NotSetUp);
    }
    let changed = match ids {
        Some(ids) => outbox_diesel::redrive(conn, ids)?,
        None => outbox_diesel::redrive_all(conn)?,
    };
    Ok(changed as u64)
}

/// Retentions are capped at 1000 years, as `outbox_diesel::purge_sent`'s: nothing
/// stored is older, and a longer interval leaves the timestamps' range (PostgreSQL
/// refuses the cut; on MariaDB it would be NULL and match nothing, silently).
pub(crate) const MAX_RETENTION: Duration = Duration::from_secs(1000 * 365 * 24 * 3600);

/// Retention of the unpartitioned layout in CDC mode (what `outbox purge` must call
/// then): deletes up to `limit` rows the CDC relay published (NEW, up to the relayed
/// watermark, not parked, not in the backfill still to do) that were emitted more than
/// `older_than` ago, oldest first, and SENT rows as old (published before CDC mode).
/// DEAD rows stay. Returns how many rows were deleted; call it until it returns less than
/// `limit` (at least 1). On the partitioned layout dropping partitions does this without
/// deletes ([`outbox_diesel::maintain_partitions`]).
pub fn purge_relayed(conn: &mut PgConnection, older_than: Duration, limit: u32) -> Result<u64> {
    if limit == 0 {
        return Err(outbox_core::InvalidConfig::new("limit", "must be at least 1").into());
    }
    let Some(mode) = cdc_mode(conn)? else {
        return Err(CdcError::NotSetUp);
    };
    let secs = i64::try_from(older_than.min(MAX_RETENTION).as_secs()).unwrap_or(i64::MAX);
    Ok(diesel::sql_query(
        "DELETE FROM outbox WHERE id IN (SELECT o.id FROM outbox o \
         WHERE o.created_at < now() - make_interval(secs => $1) \
         AND (o.status = 1 OR (o.status = 0 AND o.id <= $2 AND NOT (o.id > $3 AND o.id <= $4) \
         AND NOT EXISTS (SELECT 1 FROM outbox_cdc_parked p WHERE p.id = o.id))) \
         ORDER BY o.id LIMIT $5)",
    )
    .bind::<BigInt, _>(secs)
    .bind::<BigInt, _>(mode.relayed_through)
    .bind::<BigInt, _>(mode.backfill.0)
    .bind::<BigInt, _>(mode.backfill.1)
    .bind::<BigInt, _>(i64::from(limit))
    .execute(conn)? as u64)
}
