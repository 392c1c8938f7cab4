use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::{Backlog, Envelope, Status};

use crate::{OutboxConnection, Result};

/// An outbox row with its delivery state, as the operations queries return it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxRecord {
    /// The row id.
    pub id: i64,
    /// NEW, SENT or DEAD.
    pub status: Status,
    /// Failed publish attempts.
    pub retries: u32,
    /// When the row is due (again).
    pub next_retry_at: DateTime<Utc>,
    /// When it was published.
    pub sent_at: Option<DateTime<Utc>>,
    /// The last publish error.
    pub last_error: Option<String>,
    /// The message.
    pub envelope: Envelope,
}

/// Retentions are capped at 1000 years: nothing stored is older, and `now()` minus a
/// longer time overflows PostgreSQL's timestamps (`timestamp out of range`).
const MAX_RETENTION: Duration = Duration::from_secs(1000 * 365 * 24 * 3600);

fn micros(d: Duration) -> i64 {
    i64::try_from(d.min(MAX_RETENTION).as_micros()).unwrap_or(i64::MAX)
}

/// Backlog statistics: due NEW rows, the age of the oldest of them, DEAD rows. Both
/// counts are served by indexes holding only NEW (DEAD) rows.
pub fn backlog<C: OutboxConnection>(conn: &mut C) -> Result<Backlog> {
    conn.__backlog()
}

/// One topic's NEW and DEAD messages, as [`topic_counts`] returns them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TopicCounts {
    /// The topic.
    pub topic: String,
    /// NEW messages (due or waiting for a retry).
    pub new: u64,
    /// DEAD messages.
    pub dead: u64,
}

/// NEW and DEAD messages per topic, in topic order (one `GROUP BY`; topics with only SENT
/// messages are left out, and SENT rows are not counted: that would read the whole table).
pub fn topic_counts<C: OutboxConnection>(conn: &mut C) -> Result<Vec<TopicCounts>> {
    let mut counts: Vec<TopicCounts> = Vec::new();
    for row in conn.topic_rows()? {
        if counts.last().is_none_or(|c| c.topic != row.topic) {
            counts.push(TopicCounts {
                topic: row.topic.clone(),
                ..TopicCounts::default()
            });
        }
        let n = u64::try_from(row.n).unwrap_or(0);
        if let Some(c) = counts.last_mut() {
            if row.status == Status::Dead.as_i16() {
                c.dead += n;
            } else {
                c.new += n;
            }
        }
    }
    Ok(counts)
}

/// DEAD rows with `id > after_id`, in id order, at most `limit`: page with the last id.
pub fn dead_letters<C: OutboxConnection>(
    conn: &mut C,
    after_id: i64,
    limit: usize,
) -> Result<Vec<OutboxRecord>> {
    conn.__list(Some(Status::Dead), after_id, limit)
}

/// Rows of any status (or of `status`) with `id > after_id`, in id order, at most `limit`.
pub fn list_messages<C: OutboxConnection>(
    conn: &mut C,
    status: Option<Status>,
    after_id: i64,
    limit: usize,
) -> Result<Vec<OutboxRecord>> {
    conn.__list(status, after_id, limit)
}

/// The row with this msg_id, whatever its status.
pub fn find_message<C: OutboxConnection>(
    conn: &mut C,
    msg_id: &str,
) -> Result<Option<OutboxRecord>> {
    conn.__find(msg_id)
}

/// Re-drives DEAD rows: back to NEW with retries reset, due now, last error cleared.
/// Ids that are not DEAD are left alone. Returns how many rows changed.
pub fn redrive<C: OutboxConnection>(conn: &mut C, ids: &[i64]) -> Result<usize> {
    conn.__redrive(Some(ids))
}

/// Re-drives every DEAD row; see [`redrive`].
pub fn redrive_all<C: OutboxConnection>(conn: &mut C) -> Result<usize> {
    conn.__redrive(None)
}

/// Deletes these DEAD rows (others are left alone). Returns how many were deleted.
pub fn purge_dead<C: OutboxConnection>(conn: &mut C, ids: &[i64]) -> Result<usize> {
    conn.__purge_dead(ids)
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
    purge(batch_size, |n| conn.__purge_sent(micros(older_than), n))
}

/// Deletes `consumed_msg` rows recorded more than `older_than` ago (choose it beyond the
/// broker's redelivery horizon), in batches like [`purge_sent`].
pub fn purge_consumed<C: OutboxConnection>(
    conn: &mut C,
    older_than: Duration,
    batch_size: usize,
) -> Result<u64> {
    purge(batch_size, |n| conn.__purge_consumed(micros(older_than), n))
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
