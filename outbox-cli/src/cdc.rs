//! CDC mode as the operator sees it (`outbox status`, the page, `/readyz`): the backlog is
//! what the slot (PostgreSQL) or the binlog relay's stored position (MariaDB) has not
//! confirmed, not the NEW rows (which stay NEW under the CDC relay).

use std::io::{self, Write};
use std::time::Duration;

use diesel::{MysqlConnection, PgConnection};
use outbox_cdc::CdcError;
use outbox_cdc::mysql::BinlogLag;
use serde::Serialize;

use crate::error::CliError;
use crate::output::age;

/// What to do about a slot that is gone or invalidated.
pub(crate) const LOST_SLOT_HINT: &str = "the replication slot is lost (invalidated by \
     max_slot_wal_keep_size, or dropped): stop the CDC relays, run `outbox migrate --cdc \
     --recover-slot` (it recreates the slot and publishes from the table what committed \
     since the old one's position), then start them again; see docs/cdc.md, \"A lost slot\"";

/// What to do about a binlog position the server purged.
pub(crate) const LOST_POSITION_HINT: &str = "the binlog no longer holds the relay's \
     position (purged by binlog_expire_logs_seconds or PURGE BINARY LOGS): stop the CDC \
     relays, run `outbox migrate --cdc --recover-slot` (it moves the position to the \
     binlog's now and publishes from the table what committed since the old one), then \
     start them again; see docs/cdc.md";

/// What to do when the relays report nothing and the binlog position falls behind.
pub(crate) const SILENT_BINLOG_HINT: &str = "no CDC relay reported within three of its \
     intervals and the binlog is past its position: start `outbox relay --cdc`; if one \
     stopped on a purged position (PositionLost in its log), stop the CDC relays, run \
     `outbox migrate --cdc --recover-slot` (it moves the position to the binlog's now and \
     publishes from the table what committed since the old one), then start them again; \
     see docs/cdc.md";

/// The CDC relay's state: `outbox status --json`'s `cdc`, the page's and `/readyz`'s.
/// Fields of one database only are `null` on the other.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct CdcStatus {
    /// The log read: `postgresql` (the WAL, through a slot) or `mariadb` (the binlog).
    pub(crate) database: &'static str,
    /// The slot's name (PostgreSQL), or the readers' lock's (MariaDB's `GET_LOCK`).
    pub(crate) slot: String,
    /// PostgreSQL: WAL the slot holds back, the server's position minus the confirmed
    /// one (`null` when the slot is missing).
    pub(crate) lag_bytes: Option<u64>,
    /// MariaDB: transactions the server logged past the relay's stored GTID position,
    /// but the relay's write of it (other tables' count too; an idle relay catches up
    /// within a report interval).
    pub(crate) lag_transactions: Option<u64>,
    /// MariaDB: the relay's stored GTID position.
    pub(crate) position: Option<String>,
    /// MariaDB: the server's binlog position now (`@@gtid_binlog_pos`).
    pub(crate) server_position: Option<String>,
    /// Age of the oldest commit read and not yet confirmed (`null`: none).
    pub(crate) oldest_unconfirmed_age_seconds: Option<f64>,
    /// Whether a relay reported within three of its intervals.
    pub(crate) relay_reporting: bool,
    /// The server process reading the slot (PostgreSQL: the holding relay's walsender),
    /// or the connection holding the readers' lock (MariaDB), if any.
    pub(crate) holder_pid: Option<u64>,
    /// PostgreSQL: the slot's `wal_status` (`reserved`, `extended`, `unreserved`, `lost`).
    pub(crate) wal_status: Option<String>,
    /// Messages parked for a retry (refused ones and the later messages of their keys).
    pub(crate) parked: u64,
    /// NEW rows still to backfill (committed before the slot existed), at most.
    pub(crate) backfill_left: u64,
    /// The slot is missing or invalidated (PostgreSQL), or the binlog no longer holds
    /// the stored position (MariaDB: its oldest file starts past it; `false` when the
    /// user may not list the binlogs): nothing is relayed until it is recovered.
    pub(crate) lost: bool,
    /// What to do when `lost` (PostgreSQL), or when no relay reports and the position
    /// is behind (MariaDB).
    pub(crate) hint: Option<&'static str>,
}

impl CdcStatus {
    /// Ready: the slot is usable and its oldest unconfirmed commit younger than
    /// `max_age`.
    pub(crate) fn ready(&self, max_age: Duration) -> bool {
        !self.lost
            && self
                .oldest_unconfirmed_age_seconds
                .is_none_or(|s| s <= max_age.as_secs_f64())
    }

    /// MariaDB's state, from what the binlog relay reports.
    fn binlog(lag: BinlogLag) -> Self {
        let stalled = !lag.relay_reporting && lag.transactions_behind > 0;
        let lost = lag.position_lost;
        Self {
            database: "mariadb",
            slot: lag.lock,
            lag_bytes: None,
            lag_transactions: Some(lag.transactions_behind),
            position: Some(lag.position.to_string()),
            server_position: Some(lag.server_position.to_string()),
            oldest_unconfirmed_age_seconds: lag.oldest_unconfirmed_age.map(|d| d.as_secs_f64()),
            relay_reporting: lag.relay_reporting,
            holder_pid: lag.holder,
            wal_status: None,
            parked: lag.parked,
            backfill_left: lag.backfill_left,
            lost,
            hint: if lost {
                Some(LOST_POSITION_HINT)
            } else {
                stalled.then_some(SILENT_BINLOG_HINT)
            },
        }
    }
}

/// CDC mode's state, `None` when CDC mode is off (`outbox migrate --cdc` never ran).
pub(crate) fn status(conn: &mut PgConnection) -> Result<Option<CdcStatus>, CdcError> {
    let Some(mode) = outbox_cdc::cdc_mode(conn)? else {
        return Ok(None);
    };
    let lag = outbox_cdc::lag(conn)?;
    let lost = lag.bytes.is_none() || lag.wal_status.as_deref() == Some("lost");
    Ok(Some(CdcStatus {
        database: "postgresql",
        slot: mode.slot,
        lag_bytes: lag.bytes,
        lag_transactions: None,
        position: None,
        server_position: None,
        oldest_unconfirmed_age_seconds: lag.oldest_unconfirmed_age.map(|d| d.as_secs_f64()),
        relay_reporting: lag.relay_reporting,
        holder_pid: lag.active_pid.and_then(|p| u64::try_from(p).ok()),
        wal_status: lag.wal_status,
        parked: lag.parked,
        backfill_left: lag.backfill_left,
        lost,
        hint: lost.then_some(LOST_SLOT_HINT),
    }))
}

/// CDC mode's state on the MariaDB at `url` (blocking), `None` when it is off. Whether
/// it is on is read on `conn`, the connection in hand: the binlog library's own session
/// (and a thread to run it) is opened only then, not at every probe of a polling setup.
pub(crate) fn binlog_status(
    conn: &mut MysqlConnection,
    url: &str,
) -> Result<Option<CdcStatus>, CliError> {
    use outbox_cdc::mysql;
    if outbox_diesel::mysql_cdc_lock(conn)?.is_none() {
        return Ok(None);
    }
    let status = block_on(async move {
        let mut conn = mysql::connect(url).await?;
        if mysql::cdc_mode(&mut conn).await?.is_none() {
            return Ok::<_, CdcError>(None);
        }
        Ok(Some(CdcStatus::binlog(mysql::lag(&mut conn).await?)))
    })??;
    Ok(status)
}

/// Runs `work` to completion on a runtime of its own, on a thread of its own: the
/// synchronous commands and the blocking tasks of the admin endpoint and the page call
/// the binlog library, which is async (a thread of its own: a blocking task of another
/// runtime cannot start one).
pub(crate) fn block_on<T: Send>(work: impl Future<Output = T> + Send) -> Result<T, CliError> {
    std::thread::scope(|s| {
        s.spawn(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(CliError::Runtime)?;
            Ok(runtime.block_on(work))
        })
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// `outbox status` in CDC mode, for people.
pub(crate) fn print(w: &mut impl Write, s: &CdcStatus) -> io::Result<()> {
    let binlog = s.database == "mariadb";
    if binlog {
        writeln!(
            w,
            "relay:             CDC on the MariaDB binlog (lock {})",
            s.slot
        )?;
        let behind = s.lag_transactions.unwrap_or(0);
        writeln!(w, "position lag:      {behind} transaction(s)")?;
        let at = |p: &Option<String>| p.clone().filter(|p| !p.is_empty());
        let position = at(&s.position).unwrap_or_else(|| "(empty)".into());
        let server = at(&s.server_position).unwrap_or_else(|| "(empty)".into());
        writeln!(w, "position:          {position} (server at {server})")?;
    } else {
        writeln!(w, "relay:             CDC (slot {})", s.slot)?;
        let bytes = s
            .lag_bytes
            .map_or_else(|| "- (slot missing)".to_owned(), bytes);
        writeln!(w, "slot lag:          {bytes}")?;
    }
    let oldest = s
        .oldest_unconfirmed_age_seconds
        .map_or_else(|| "-".to_owned(), |a| age(Duration::from_secs_f64(a)));
    writeln!(w, "oldest unconfirmed: {oldest}")?;
    let holder = match (s.holder_pid, s.relay_reporting) {
        (Some(id), _) if binlog => format!("connection {id}"),
        (Some(pid), _) => format!("walsender pid {pid}"),
        (None, true) => "none now (a relay reported recently)".to_owned(),
        (None, false) => "none (no relay is reading the log)".to_owned(),
    };
    writeln!(
        w,
        "{:<19}{holder}",
        if binlog {
            "lock holder:"
        } else {
            "slot holder:"
        }
    )?;
    if !binlog {
        let wal = s.wal_status.as_deref().unwrap_or("-");
        writeln!(w, "wal_status:        {wal}")?;
    }
    writeln!(w, "parked messages:   {}", s.parked)?;
    writeln!(w, "backfill left:     {}", s.backfill_left)?;
    match s.hint {
        Some(hint) if s.lost && binlog => writeln!(w, "LOST POSITION: {hint}")?,
        Some(hint) if s.lost => writeln!(w, "LOST SLOT: {hint}")?,
        Some(hint) => writeln!(w, "NO RELAY: {hint}")?,
        None => {}
    }
    Ok(())
}

/// `1.5 MiB`-style.
pub(crate) fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Advice for the CDC errors an operator fixes.
pub(crate) fn hint(e: &CdcError) -> Option<&'static str> {
    match e {
        CdcError::NotSetUp => Some("run `outbox migrate --cdc` first (docs/cdc.md, \"Setup\")"),
        CdcError::WalLevelNotLogical { .. } => Some(
            "set wal_level = logical (self-hosted: postgresql.conf and a restart; RDS/Aurora: \
             rds.logical_replication = 1; Cloud SQL: cloudsql.logical_decoding = on), see \
             docs/cdc.md",
        ),
        CdcError::MissingReplicationPrivilege { .. } => Some(
            "give the role REPLICATION (`ALTER ROLE .. WITH REPLICATION`; RDS: \
             `GRANT rds_replication TO ..`)",
        ),
        CdcError::SlotInvalidated { .. } | CdcError::SlotMissing { .. } => Some(LOST_SLOT_HINT),
        CdcError::PositionLost { .. } => Some(LOST_POSITION_HINT),
        CdcError::BinlogSetting { .. } | CdcError::MissingPrivilege { .. } => Some(
            "the binlog CDC relay needs MariaDB 10.5+ with log_bin, binlog_format = ROW, \
             binlog_row_image = FULL, binlog_row_metadata = FULL, and a user with \
             REPLICATION SLAVE, BINLOG MONITOR and PROCESS; MySQL uses the polling relay \
             (docs/cdc.md, \"MySQL and MariaDB\")",
        ),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(lost: bool, oldest: Option<f64>) -> CdcStatus {
        CdcStatus {
            database: "postgresql",
            slot: "outbox_cdc".into(),
            lag_bytes: (!lost).then_some(10),
            lag_transactions: None,
            position: None,
            server_position: None,
            oldest_unconfirmed_age_seconds: oldest,
            relay_reporting: true,
            holder_pid: None,
            wal_status: Some(if lost { "lost" } else { "reserved" }.into()),
            parked: 0,
            backfill_left: 0,
            lost,
            hint: lost.then_some(LOST_SLOT_HINT),
        }
    }

    #[test]
    fn ready_until_the_oldest_unconfirmed_commit_is_too_old_or_the_slot_is_lost() {
        let max = Duration::from_secs(60);
        assert!(status(false, None).ready(max));
        assert!(status(false, Some(59.0)).ready(max));
        assert!(!status(false, Some(61.0)).ready(max));
        assert!(!status(true, None).ready(max));
    }

    #[test]
    fn bytes_are_in_binary_units() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
    }

    fn binlog(lost: bool) -> CdcStatus {
        CdcStatus {
            database: "mariadb",
            lag_bytes: None,
            lag_transactions: Some(2),
            position: Some("0-1-5".into()),
            server_position: Some("0-1-8".into()),
            holder_pid: Some(42),
            wal_status: None,
            lost,
            hint: lost.then_some(LOST_POSITION_HINT),
            ..status(false, Some(1.0))
        }
    }

    #[test]
    fn the_binlog_relay_is_printed_with_its_position_and_lock() {
        let mut out = Vec::new();
        print(&mut out, &binlog(false)).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("CDC on the MariaDB binlog (lock outbox_cdc)"),
            "{text}"
        );
        assert!(
            text.contains("position lag:      2 transaction(s)"),
            "{text}"
        );
        assert!(text.contains("0-1-5 (server at 0-1-8)"), "{text}");
        assert!(text.contains("lock holder:       connection 42"), "{text}");
        assert!(!text.contains("wal_status"), "{text}");
        let mut out = Vec::new();
        print(&mut out, &binlog(true)).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("LOST POSITION:"), "{text}");
        assert!(text.contains("--recover-slot"), "{text}");
    }

    #[test]
    fn a_lost_slot_is_printed_with_its_recovery() {
        let mut out = Vec::new();
        print(&mut out, &status(true, None)).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("slot missing"), "{text}");
        assert!(text.contains("--recover-slot"), "{text}");
    }
}
