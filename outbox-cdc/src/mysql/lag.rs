//! What the binlog relay has not confirmed, for the operator (`outbox status`, `/readyz`):
//! the counterpart of [`crate::lag`], read from what the relay reports in `outbox_cdc`
//! and from the server's binlog position.

use std::time::Duration;

use mysql_async::Conn;
use mysql_async::prelude::Queryable as _;

use super::GtidPosition;
use super::setup::{binlog_position, cdc_mode};
use crate::{CdcError, Result};

/// Opens a session on the MariaDB at `database_url` (`mysql://user:password@host:port/db`,
/// with diesel's TLS and socket parameters as the relay takes them), for
/// [`setup`](super::setup), [`lag`] and the other functions of CDC mode.
pub async fn connect(database_url: &str) -> Result<Conn> {
    Conn::new(super::url::opts(database_url)?)
        .await
        .map_err(CdcError::db)
}

/// The binlog relay's backlog: what it has not confirmed. See [`lag`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BinlogLag {
    /// The lock the relays share ([`CdcConfig::slot`](crate::CdcConfig)).
    pub lock: String,
    /// The relay's stored position (`outbox_cdc.gtid_position`): every transaction up to
    /// it was published, or touched no outbox row.
    pub position: GtidPosition,
    /// The server's binlog position now (`@@gtid_binlog_pos`).
    pub server_position: GtidPosition,
    /// Transactions the server logged past the stored position, summed over domains,
    /// but the one that stored it (always past it: the position is read before it is
    /// written). Other tables' transactions count too: an idle relay stores the position
    /// it read to with each report, so this falls to zero within a report interval
    /// (while the relay is busy, its reports that keep the position count too).
    pub transactions_behind: u64,
    /// The age of the oldest commit the relay has read and not yet confirmed, as it last
    /// reported it; when no relay has reported for three of its intervals and the
    /// position is behind, at least the time since the last report.
    pub oldest_unconfirmed_age: Option<Duration>,
    /// Whether a relay reported within three of its intervals.
    pub relay_reporting: bool,
    /// The server connection holding the lock (the reading relay's), if any.
    pub holder: Option<u64>,
    /// Messages parked for a retry (refused ones and the later messages of their keys).
    pub parked: u64,
    /// NEW rows still to backfill, at most (the backfill's id range).
    pub backfill_left: u64,
    /// The binlog no longer holds the stored position: its oldest file starts past it
    /// (purged). A relay stops on it with [`CdcError::PositionLost`]; recover with
    /// [`recover_lost_position`](super::recover_lost_position). `false` when the user
    /// may not list the binlogs (`BINLOG MONITOR`).
    pub position_lost: bool,
}

/// The report row, with the server's clock differences in milliseconds.
type ReportRow = (Option<i64>, Option<i64>, i64, Option<u64>, i64, i64);

/// The binlog relay's lag, as [`crate::lag`] reads the slot's on PostgreSQL:
/// [`CdcError::NotSetUp`] when CDC mode is off.
pub async fn lag(conn: &mut Conn) -> Result<BinlogLag> {
    let (mode, position) = cdc_mode(conn).await?.ok_or(CdcError::NotSetUp)?;
    let server_position = binlog_position(conn).await?;
    let row: Option<ReportRow> = conn
        .query_first(
            "SELECT TIMESTAMPDIFF(MICROSECOND, c.oldest_unconfirmed_at, UTC_TIMESTAMP(6)) DIV 1000, \
             TIMESTAMPDIFF(MICROSECOND, c.reported_at, UTC_TIMESTAMP(6)) DIV 1000, \
             c.report_every_ms, IS_USED_LOCK(c.slot_name), \
             (SELECT COUNT(*) FROM outbox_cdc_parked), \
             GREATEST(c.backfill_upto - c.backfill_from, 0) FROM outbox_cdc c",
        )
        .await
        .map_err(CdcError::db)?;
    let (unconfirmed_ms, silent_ms, every_ms, holder, parked, backfill_left) =
        row.ok_or(CdcError::NotSetUp)?;
    // The write of the stored position is logged after it: not a transaction to relay.
    let transactions_behind = position.behind(&server_position).saturating_sub(1);
    let reporting = silent_ms.is_some_and(|s| s <= every_ms.saturating_mul(3));
    let position_lost = purged_through(conn)
        .await
        .is_some_and(|purged| !position.covers(&purged));
    Ok(BinlogLag {
        lock: mode.slot,
        position,
        server_position,
        transactions_behind,
        oldest_unconfirmed_age: oldest(unconfirmed_ms, silent_ms, reporting, transactions_behind),
        relay_reporting: reporting,
        holder,
        parked: u64::try_from(parked).unwrap_or(0),
        backfill_left: u64::try_from(backfill_left).unwrap_or(0),
        position_lost,
    })
}

/// The GTID position the oldest binlog file starts after (its `Gtid_list`): every
/// transaction up to it was purged. `None` when it cannot be read (no binlog, or the
/// user lacks `BINLOG MONITOR`): the status then shows no loss, and the relay still
/// stops on one.
async fn purged_through(conn: &mut Conn) -> Option<GtidPosition> {
    let oldest: Option<mysql_async::Row> = match conn.query_first("SHOW BINARY LOGS").await {
        Ok(row) => row,
        Err(e) => {
            tracing::debug!(error = %e, "the binlogs cannot be listed");
            return None;
        }
    };
    let file: String = oldest?.get(0)?;
    let start: Option<Option<String>> = conn
        .exec_first("SELECT BINLOG_GTID_POS(?, 4)", (file,))
        .await
        .ok()?;
    start.flatten()?.parse().ok()
}

/// The reported age while a relay reports; when none does and the position is behind,
/// at least the silence (a stopped relay's backlog ages); else none.
fn oldest(
    unconfirmed_ms: Option<i64>,
    silent_ms: Option<i64>,
    reporting: bool,
    behind: u64,
) -> Option<Duration> {
    let ms = |v: i64| Duration::from_millis(u64::try_from(v).unwrap_or(0));
    match (unconfirmed_ms, reporting) {
        (reported, true) => reported.map(ms),
        (reported, false) if behind > 0 => reported.map(ms).max(silent_ms.map(ms)),
        (_, false) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_silent_relay_behind_ages_by_its_silence() {
        let s = Duration::from_secs;
        assert_eq!(oldest(Some(2000), Some(500), true, 3), Some(s(2)));
        assert_eq!(oldest(None, Some(500), true, 3), None);
        assert_eq!(oldest(Some(2000), Some(60_000), false, 3), Some(s(60)));
        assert_eq!(oldest(None, None, false, 3), None);
        assert_eq!(oldest(Some(2000), Some(60_000), false, 0), None);
    }
}
