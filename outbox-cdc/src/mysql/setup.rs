//! CDC mode on MySQL / MariaDB: the `outbox_cdc` tables, the start check of the server's
//! binlog settings and the user's privileges, the switch back to polling and the
//! recovery of a purged position.

use mysql_async::Conn;
use mysql_async::prelude::Queryable;

use super::GtidPosition;
use crate::{CdcConfig, CdcError, CdcMode, Result, SetupReport, SwitchReport};

/// The tables of CDC mode on MySQL / MariaDB, created by [`setup`]: the same two as on
/// PostgreSQL ([`crate::CDC_TABLES_SQL`]). `outbox_cdc.slot_name` holds the name of the
/// readers' lock (`GET_LOCK`), `publication` is unused, and `gtid_position` is the
/// relay's position: the binlog has no slot, so the relay stores it here once the broker
/// took the messages before it.
pub const MYSQL_CDC_TABLES_SQL: &str = r"
CREATE TABLE IF NOT EXISTS outbox_cdc (
    singleton             TINYINT      NOT NULL DEFAULT 1 PRIMARY KEY CHECK (singleton = 1),
    slot_name             VARCHAR(64)  NOT NULL,
    publication           VARCHAR(64)  NOT NULL DEFAULT '',
    since                 DATETIME(6)  NOT NULL,
    gtid_position         TEXT         NOT NULL,
    backfill_from         BIGINT       NOT NULL DEFAULT 0,
    backfill_upto         BIGINT       NOT NULL DEFAULT 0,
    relayed_through       BIGINT       NOT NULL DEFAULT 0,
    oldest_unconfirmed_at DATETIME(6)  NULL,
    reported_at           DATETIME(6)  NULL,
    report_every_ms       BIGINT       NOT NULL DEFAULT 10000
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
CREATE TABLE IF NOT EXISTS outbox_cdc_parked (
    seq     BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    id      BIGINT       NOT NULL UNIQUE,
    msg_key VARCHAR(255) NOT NULL,
    KEY outbox_cdc_parked_key (msg_key, seq)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
";

/// The settings the relay needs, with the value each must have.
const NEEDED_SETTINGS: [(&str, &str); 4] = [
    ("log_bin", "ON"),
    ("binlog_format", "ROW"),
    ("binlog_row_image", "FULL"),
    // The column names in the table maps (MariaDB 10.5+, MySQL 8.0.1+): without them
    // the rows come as `@0`, `@1`, ... and a schema change would shift them silently.
    ("binlog_row_metadata", "FULL"),
];

/// Checks that the server can serve the binlog relay: MariaDB (MySQL 8's GTIDs are not
/// read yet), `log_bin = ON`, `binlog_format = ROW`, `binlog_row_image = FULL`,
/// `binlog_row_metadata = FULL`, `log_bin_compress = OFF` (MariaDB's compressed row
/// events are not read), and a user with `REPLICATION SLAVE` and `BINLOG MONITOR` (or
/// `SUPER`, or all privileges).
pub async fn check_server(conn: &mut Conn) -> Result<()> {
    let version: String = conn
        .query_first("SELECT VERSION()")
        .await
        .map_err(CdcError::db)?
        .unwrap_or_default();
    if !version.contains("MariaDB") {
        return Err(setting(
            "server",
            &version,
            "MariaDB 10.5 or later",
            "MySQL's GTIDs are not read yet: use the polling relay on MySQL",
        ));
    }
    let vars: Vec<(String, String)> = conn
        .query(
            "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('log_bin', 'binlog_format', \
             'binlog_row_image', 'binlog_row_metadata', 'log_bin_compress')",
        )
        .await
        .map_err(CdcError::db)?;
    let get = |name: &str| {
        vars.iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.to_ascii_uppercase())
    };
    for (name, needed) in NEEDED_SETTINGS {
        let found = get(name).unwrap_or_else(|| "absent (MariaDB before 10.5)".into());
        if found != needed {
            return Err(setting(
                name,
                &found,
                needed,
                &format!("set {name} = {needed} in the server's configuration and restart it"),
            ));
        }
    }
    if let Some(on) = get("log_bin_compress").filter(|v| v != "OFF") {
        return Err(setting(
            "log_bin_compress",
            &on,
            "OFF",
            "MariaDB's compressed binlog events are not read: set log_bin_compress = OFF",
        ));
    }
    check_privileges(conn).await
}

fn setting(name: &str, found: &str, needed: &str, fix: &str) -> CdcError {
    CdcError::BinlogSetting {
        setting: name.into(),
        found: found.into(),
        needed: needed.into(),
        fix: fix.into(),
    }
}

/// The user needs `REPLICATION SLAVE` (the binlog dump), `BINLOG MONITOR` (the
/// binlog's position) and `PROCESS` (the open transactions in
/// `information_schema.INNODB_TRX`, for the watermark the relay reports), each also
/// granted by `SUPER` (not `PROCESS`) or all privileges on `*.*`.
async fn check_privileges(conn: &mut Conn) -> Result<()> {
    let grants: Vec<String> = conn.query("SHOW GRANTS").await.map_err(CdcError::db)?;
    let grants = grants.join("\n").to_ascii_uppercase();
    let global = |p: &str| {
        grants
            .lines()
            .any(|g| g.contains(" ON *.* ") && (g.contains(p) || g.contains("ALL PRIVILEGES")))
    };
    let user: String = conn
        .query_first("SELECT CURRENT_USER()")
        .await
        .map_err(CdcError::db)?
        .unwrap_or_default();
    for (privilege, or) in [
        ("REPLICATION SLAVE", "REPLICATION REPLICA"),
        ("BINLOG MONITOR", "SUPER"),
        ("PROCESS", "ALL PRIVILEGES"),
    ] {
        if !global(privilege) && !global(or) {
            return Err(CdcError::MissingPrivilege {
                user,
                privilege: privilege.into(),
            });
        }
    }
    Ok(())
}

/// CDC mode as recorded (the `outbox_cdc` row) and the stored position; `None` when it
/// is off. The polling relay (`outbox_diesel::MysqlRelayStore`) refuses to start while
/// it is on.
pub async fn cdc_mode(conn: &mut Conn) -> Result<Option<(CdcMode, GtidPosition)>> {
    let exists: Option<i64> = conn
        .query_first(
            "SELECT COUNT(*) FROM information_schema.tables \
             WHERE table_schema = DATABASE() AND table_name = 'outbox_cdc'",
        )
        .await
        .map_err(CdcError::db)?;
    if exists.unwrap_or(0) == 0 {
        return Ok(None);
    }
    type ModeRow = (String, String, String, String, i64, i64, i64);
    let row: Option<ModeRow> = conn
        .query_first(
            "SELECT slot_name, publication, DATE_FORMAT(since, '%Y-%m-%d %H:%i:%s.%f+00'), \
             gtid_position, backfill_from, backfill_upto, relayed_through FROM outbox_cdc",
        )
        .await
        .map_err(CdcError::db)?;
    let Some((slot, publication, since, position, from, upto, relayed_through)) = row else {
        return Ok(None);
    };
    let since = chrono::DateTime::parse_from_str(&since, "%Y-%m-%d %H:%M:%S%.f%#z")
        .map(|t| t.with_timezone(&chrono::Utc))
        .unwrap_or_default();
    let mode = CdcMode {
        slot,
        publication,
        since,
        backfill: (from, upto),
        relayed_through,
    };
    Ok(Some((mode, position.parse()?)))
}

/// The server's binlog position now (`@@gtid_binlog_pos`).
pub(crate) async fn binlog_position(conn: &mut Conn) -> Result<GtidPosition> {
    let pos: Option<String> = conn
        .query_first("SELECT @@GLOBAL.gtid_binlog_pos")
        .await
        .map_err(CdcError::db)?;
    pos.unwrap_or_default().parse()
}

/// The binlog position now and the highest id of a row committed before it: the NEW rows
/// up to that id are the backfill, the later ones come from the binlog after the
/// position.
///
/// The position is read first. A transaction is written to the binlog before InnoDB
/// makes it visible, so a transaction inside the position may still be invisible to a
/// plain read; the locking read of the last row waits for a prepared insert above the
/// last visible row, so every row of a transaction inside the position has an id up to
/// the one returned (rows below it that become visible later are found by the backfill,
/// which runs later).
async fn position_and_max_id(conn: &mut Conn) -> Result<(GtidPosition, i64)> {
    let position = binlog_position(conn).await?;
    let mut tx = conn
        .start_transaction(mysql_async::TxOpts::default())
        .await
        .map_err(CdcError::db)?;
    let max: Option<i64> = tx
        .query_first("SELECT id FROM outbox ORDER BY id DESC LIMIT 1 LOCK IN SHARE MODE")
        .await
        .map_err(CdcError::db)?;
    tx.commit().await.map_err(CdcError::db)?;
    Ok((position, max.unwrap_or(0)))
}

/// Sets CDC mode up on MySQL / MariaDB (what `outbox migrate --cdc` runs on a mysql://
/// URL); idempotent. Run it after the outbox migration ([`outbox_diesel::migrate`]).
///
/// It checks the server ([`check_server`]), creates the CDC tables
/// ([`MYSQL_CDC_TABLES_SQL`]) and records the mode in `outbox_cdc`: the binlog position
/// now, which the relay starts from, and the backfill, the NEW rows committed before it.
/// From then on a polling relay refuses to start. Run again, it changes nothing.
pub async fn setup(conn: &mut Conn, config: &CdcConfig) -> Result<SetupReport> {
    config.validate()?;
    check_server(conn).await?;
    conn.query_drop(MYSQL_CDC_TABLES_SQL)
        .await
        .map_err(CdcError::db)?;
    let mut report = SetupReport::default();
    if let Some((mode, _)) = cdc_mode(conn).await? {
        if mode.slot != config.slot {
            return Err(CdcError::SlotMismatch {
                configured: config.slot.clone(),
                recorded: mode.slot,
            });
        }
        report.backfill = mode.backfill;
        return Ok(report);
    }
    let (position, upto) = position_and_max_id(conn).await?;
    conn.exec_drop(
        "INSERT INTO outbox_cdc (slot_name, since, gtid_position, backfill_from, backfill_upto) \
         VALUES (?, UTC_TIMESTAMP(6), ?, 0, ?)",
        (config.slot.as_str(), position.to_string(), upto),
    )
    .await
    .map_err(CdcError::db)?;
    report.slot_created = true;
    report.backfill = (0, upto);
    Ok(report)
}

/// After [`CdcError::PositionLost`] (the binlog holding the stored position was purged):
/// moves the position to the binlog's position now and sets the backfill to the NEW
/// rows above the relayed watermark up to the highest id now, as
/// [`recover_lost_slot`](crate::recover_lost_slot) does on PostgreSQL. Stop the relays
/// first.
pub async fn recover_lost_position(conn: &mut Conn) -> Result<SetupReport> {
    let (mode, _) = cdc_mode(conn).await?.ok_or(CdcError::NotSetUp)?;
    let (position, upto) = position_and_max_id(conn).await?;
    let (start, end) = mode.backfill;
    let from = if start < end {
        start.min(mode.relayed_through)
    } else {
        mode.relayed_through
    };
    conn.exec_drop(
        "UPDATE outbox_cdc SET gtid_position = ?, backfill_from = ?, backfill_upto = ?",
        (position.to_string(), from, upto),
    )
    .await
    .map_err(CdcError::db)?;
    Ok(SetupReport {
        slot_created: true,
        backfill: (from, upto),
        ..SetupReport::default()
    })
}

/// Switches CDC mode off on MySQL / MariaDB, as [`crate::switch_to_polling`] does on
/// PostgreSQL: marks SENT the NEW rows the relay published (up to its watermark, but the
/// parked ones and the backfill not done), empties the parked list and deletes the
/// `outbox_cdc` row. Refused while a relay holds the readers' lock: stop them first.
pub async fn switch_to_polling(conn: &mut Conn) -> Result<SwitchReport> {
    let Some((mode, _)) = cdc_mode(conn).await? else {
        return Ok(SwitchReport::default());
    };
    let holder: Option<Option<i64>> = conn
        .exec_first("SELECT IS_USED_LOCK(?)", (mode.slot.as_str(),))
        .await
        .map_err(CdcError::db)?;
    if let Some(Some(id)) = holder {
        return Err(CdcError::SwitchTimeout(format!(
            "lock `{}` is held by connection {id}: stop the CDC relays first",
            mode.slot
        )));
    }
    let mut tx = conn
        .start_transaction(mysql_async::TxOpts::default())
        .await
        .map_err(CdcError::db)?;
    tx.exec_drop(
        "UPDATE outbox SET status = 1, sent_at = UTC_TIMESTAMP(6) WHERE status = 0 \
         AND retries = 0 AND id <= ? AND NOT (id > ? AND id <= ?) \
         AND id NOT IN (SELECT id FROM outbox_cdc_parked)",
        (mode.relayed_through, mode.backfill.0, mode.backfill.1),
    )
    .await
    .map_err(CdcError::db)?;
    let marked_sent = row_count(&mut tx).await?;
    tx.query_drop("DELETE FROM outbox_cdc_parked")
        .await
        .map_err(CdcError::db)?;
    let parked = row_count(&mut tx).await?;
    tx.query_drop("DELETE FROM outbox_cdc")
        .await
        .map_err(CdcError::db)?;
    tx.commit().await.map_err(CdcError::db)?;
    Ok(SwitchReport {
        marked_sent,
        relayed_through: mode.relayed_through,
        parked,
    })
}

/// The rows the last statement on `conn` changed.
pub(crate) async fn row_count(conn: &mut impl Queryable) -> Result<u64> {
    let n: Option<i64> = conn
        .query_first("SELECT ROW_COUNT()")
        .await
        .map_err(CdcError::db)?;
    Ok(u64::try_from(n.unwrap_or(0)).unwrap_or(0))
}
