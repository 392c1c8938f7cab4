//! CDC mode as the operator sees it (`outbox status`, the page, `/readyz`): the backlog is
//! what the slot has not confirmed, not the NEW rows (which stay NEW under the CDC relay).

use std::io::{self, Write};
use std::time::Duration;

use diesel::PgConnection;
use outbox_cdc::CdcError;
use serde::Serialize;

use crate::output::age;

/// What to do about a slot that is gone or invalidated.
pub(crate) const LOST_SLOT_HINT: &str = "the replication slot is lost (invalidated by \
     max_slot_wal_keep_size, or dropped): stop the CDC relays, run `outbox migrate --cdc \
     --recover-slot` (it recreates the slot and publishes from the table what committed \
     since the old one's position), then start them again; see docs/cdc.md, \"A lost slot\"";

/// The CDC relay's state: `outbox status --json`'s `cdc`, the page's and `/readyz`'s.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct CdcStatus {
    /// The slot's name.
    pub(crate) slot: String,
    /// WAL the slot holds back: the server's position minus the confirmed one (`null`
    /// when the slot is missing).
    pub(crate) lag_bytes: Option<u64>,
    /// Age of the oldest commit read and not yet confirmed (`null`: none).
    pub(crate) oldest_unconfirmed_age_seconds: Option<f64>,
    /// Whether a relay reported within three of its intervals.
    pub(crate) relay_reporting: bool,
    /// The server process reading the slot (the holding relay's walsender), if any.
    pub(crate) holder_pid: Option<i32>,
    /// The slot's `wal_status` (`reserved`, `extended`, `unreserved`, `lost`).
    pub(crate) wal_status: Option<String>,
    /// Messages parked for a retry (refused ones and the later messages of their keys).
    pub(crate) parked: u64,
    /// NEW rows still to backfill (committed before the slot existed), at most.
    pub(crate) backfill_left: u64,
    /// The slot is missing or invalidated: nothing is relayed until it is recovered.
    pub(crate) lost: bool,
    /// What to do when `lost`.
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
}

/// CDC mode's state, `None` when CDC mode is off (`outbox migrate --cdc` never ran).
pub(crate) fn status(conn: &mut PgConnection) -> Result<Option<CdcStatus>, CdcError> {
    let Some(mode) = outbox_cdc::cdc_mode(conn)? else {
        return Ok(None);
    };
    let lag = outbox_cdc::lag(conn)?;
    let lost = lag.bytes.is_none() || lag.wal_status.as_deref() == Some("lost");
    Ok(Some(CdcStatus {
        slot: mode.slot,
        lag_bytes: lag.bytes,
        oldest_unconfirmed_age_seconds: lag.oldest_unconfirmed_age.map(|d| d.as_secs_f64()),
        relay_reporting: lag.relay_reporting,
        holder_pid: lag.active_pid,
        wal_status: lag.wal_status,
        parked: lag.parked,
        backfill_left: lag.backfill_left,
        lost,
        hint: lost.then_some(LOST_SLOT_HINT),
    }))
}

/// `outbox status` in CDC mode, for people.
pub(crate) fn print(w: &mut impl Write, s: &CdcStatus) -> io::Result<()> {
    writeln!(w, "relay:             CDC (slot {})", s.slot)?;
    let bytes = s
        .lag_bytes
        .map_or_else(|| "- (slot missing)".to_owned(), bytes);
    writeln!(w, "slot lag:          {bytes}")?;
    let oldest = s
        .oldest_unconfirmed_age_seconds
        .map_or_else(|| "-".to_owned(), |a| age(Duration::from_secs_f64(a)));
    writeln!(w, "oldest unconfirmed: {oldest}")?;
    let holder = match (s.holder_pid, s.relay_reporting) {
        (Some(pid), _) => format!("walsender pid {pid}"),
        (None, true) => "none now (a relay reported recently)".to_owned(),
        (None, false) => "none (no relay is reading the slot)".to_owned(),
    };
    writeln!(w, "slot holder:       {holder}")?;
    writeln!(
        w,
        "wal_status:        {}",
        s.wal_status.as_deref().unwrap_or("-")
    )?;
    writeln!(w, "parked messages:   {}", s.parked)?;
    writeln!(w, "backfill left:     {}", s.backfill_left)?;
    if let Some(hint) = s.hint {
        writeln!(w, "LOST SLOT: {hint}")?;
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
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(lost: bool, oldest: Option<f64>) -> CdcStatus {
        CdcStatus {
            slot: "outbox_cdc".into(),
            lag_bytes: (!lost).then_some(10),
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

    #[test]
    fn a_lost_slot_is_printed_with_its_recovery() {
        let mut out = Vec::new();
        print(&mut out, &status(true, None)).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("slot missing"), "{text}");
        assert!(text.contains("--recover-slot"), "{text}");
    }
}
