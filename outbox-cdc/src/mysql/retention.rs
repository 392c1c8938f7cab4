//! Retention in CDC mode on MySQL / MariaDB: the rows the binlog relay published stay
//! NEW (it writes no UPDATE per message), so `outbox purge sent` cannot tell them by
//! their status; the relayed watermark (`outbox_cdc.relayed_through`, see
//! `watermark.rs`) does.

use std::time::Duration;

use mysql_async::Conn;
use mysql_async::prelude::Queryable as _;

use super::setup::cdc_mode;
use crate::{CdcError, Result};

/// The rows a purge may delete, as a condition on `outbox o`: emitted before the cut
/// (`?`, microseconds ago), and either SENT (published before CDC mode, or by the retry
/// round) or NEW and known to be published: up to the relayed watermark, not in the
/// backfill still to do, not parked, and never refused (`retries = 0`, as
/// [`switch_to_polling`](super::switch_to_polling) counts them). DEAD rows stay. The
/// mode is read in the statement itself, so a concurrent report or recovery cannot make
/// it use a stale range.
const PURGEABLE: &str = "o.created_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
     AND (o.status = 1 OR (o.status = 0 AND o.retries = 0 \
     AND EXISTS (SELECT 1 FROM outbox_cdc c WHERE o.id <= c.relayed_through \
     AND NOT (o.id > c.backfill_from AND o.id <= c.backfill_upto)) \
     AND NOT EXISTS (SELECT 1 FROM outbox_cdc_parked p WHERE p.id = o.id)))";

/// Retention in CDC mode on MySQL / MariaDB (what `outbox purge sent` calls on a
/// mysql:// URL in CDC mode), as [`crate::purge_relayed`] on PostgreSQL: deletes up to
/// `limit` rows the binlog relay published (NEW, up to the relayed watermark, not parked,
/// not refused, not in the backfill still to do) that were emitted more than
/// `older_than` ago, oldest first, and SENT rows as old. DEAD rows stay; a row the
/// broker has not taken (relay stopped, broker down, parked) is above the watermark or
/// parked, and stays. Returns how many rows were deleted; call it until it returns less
/// than `limit`.
///
/// [`CdcError::NotSetUp`] when CDC mode is off; a `limit` of 0 is
/// [`CdcError::Config`]. The rows are chosen by a plain read and deleted by id with the
/// condition checked again, so the statement locks the deleted rows only, not every row
/// a scan of the table passes (emits and the relay's writes go on).
pub async fn purge_relayed(conn: &mut Conn, older_than: Duration, limit: u32) -> Result<u64> {
    if limit == 0 {
        return Err(outbox_core::InvalidConfig::new("limit", "must be at least 1").into());
    }
    cdc_mode(conn).await?.ok_or(CdcError::NotSetUp)?;
    let micros =
        i64::try_from(older_than.min(crate::setup::MAX_RETENTION).as_micros()).unwrap_or(i64::MAX);
    let ids: Vec<i64> = conn
        .exec(
            format!("SELECT o.id FROM outbox o WHERE {PURGEABLE} ORDER BY o.id LIMIT ?"),
            (micros, limit),
        )
        .await
        .map_err(CdcError::db)?;
    if ids.is_empty() {
        return Ok(0);
    }
    let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    conn.exec_drop(
        format!("DELETE o FROM outbox o WHERE o.id IN ({list}) AND {PURGEABLE}"),
        (micros,),
    )
    .await
    .map_err(CdcError::db)?;
    Ok(conn.affected_rows())
}
