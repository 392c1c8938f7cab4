//! Retention: SENT rows and dedup rows past their time, deleted in batches.

use std::time::Duration;

use crate::backend::Database as _;
use crate::{OutboxConnection, Result};

/// Retentions are capped at 1000 years: nothing stored is older, and `now()` minus a
/// longer time overflows PostgreSQL's timestamps (`timestamp out of range`).
const MAX_RETENTION: Duration = Duration::from_secs(1000 * 365 * 24 * 3600);

fn micros(d: Duration) -> i64 {
    i64::try_from(d.min(MAX_RETENTION).as_micros()).unwrap_or(i64::MAX)
}

/// Deletes SENT rows published more than `older_than` ago, `batch_size` rows per
/// statement until none is left, and returns how many were deleted. Outside a
/// transaction each batch commits on its own, so locks stay short. NEW and DEAD rows are
/// never touched. An `older_than` beyond 1000 years is taken as 1000 years.
pub fn purge_sent<C: OutboxConnection>(
    conn: &mut C,
    older_than: Duration,
    batch_size: usize,
) -> Result<u64> {
    let d = &C::Db::DIALECT;
    let filter = format!("status = 1 AND sent_at < {}", (d.ago)(micros(older_than)));
    // Oldest first, through the `outbox_sent` index.
    let sql = |n| (d.delete_limited)("outbox", &filter, "sent_at", n);
    purge(batch_size, |n| Ok(conn.db().execute(&sql(n), None)?))
}

/// Deletes `consumed_msg` rows recorded more than `older_than` ago (choose it beyond the
/// broker's redelivery horizon), in batches like [`purge_sent`].
pub fn purge_consumed<C: OutboxConnection>(
    conn: &mut C,
    older_than: Duration,
    batch_size: usize,
) -> Result<u64> {
    let d = &C::Db::DIALECT;
    let filter = format!("consumed_at < {}", (d.ago)(micros(older_than)));
    let sql = |n| (d.delete_limited)("consumed_msg", &filter, "consumed_at", n);
    purge(batch_size, |n| Ok(conn.db().execute(&sql(n), None)?))
}

fn purge(batch_size: usize, mut batch: impl FnMut(usize) -> Result<usize>) -> Result<u64> {
    let batch_size = batch_size.max(1);
    let mut total = 0u64;
    loop {
        let n = batch(batch_size)?;
        total += n as u64;
        if n < batch_size {
            return Ok(total);
        }
    }
}
