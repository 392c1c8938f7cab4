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

/// One minute of publishing, as [`published_per_minute`] returns it.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct PublishedMinute {
    /// How many minutes ago it began, by the database clock (0: the current minute).
    pub minutes_ago: u32,
    /// Messages published (marked SENT) in it.
    pub published: u64,
    /// Their mean commit→publish latency (`sent_at - created_at`) in seconds; `None`
    /// when none was published. Negative only if the clocks that stamped the two
    /// columns disagree.
    pub avg_latency_seconds: Option<f64>,
}

/// Messages published in each of the last `minutes` minutes, oldest first, empty minutes
/// included (so the result has `minutes` entries). Reads the SENT rows of that window
/// (one `GROUP BY` over `sent_at`), so its cost grows with the publish rate, not with
/// the table; SENT rows already purged are not counted.
///
/// ```no_run
/// use diesel::Connection as _;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let mut conn = diesel::PgConnection::establish("postgres://localhost/app")?;
/// for m in outbox_diesel::published_per_minute(&mut conn, 15)? {
///     println!("{} min ago: {} published", m.minutes_ago, m.published);
/// }
/// # Ok(())
/// # }
/// ```
pub fn published_per_minute<C: OutboxConnection>(
    conn: &mut C,
    minutes: u32,
) -> Result<Vec<PublishedMinute>> {
    let rows = conn.minute_rows(minutes)?;
    Ok((0..minutes)
        .rev()
        .map(|ago| {
            let row = rows.iter().find(|r| r.minutes_ago == i64::from(ago));
            PublishedMinute {
                minutes_ago: ago,
                published: row.map_or(0, |r| u64::try_from(r.n).unwrap_or_default()),
                avg_latency_seconds: row.and_then(|r| r.latency),
            }
        })
        .collect())
}

/// A relay parked on PostgreSQL, waiting for work, as [`parked_relays`] returns it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedRelay {
    /// The process id of its LISTEN session.
    pub pid: i32,
    /// The session's client address; `None` over a Unix socket.
    pub client_addr: Option<String>,
    /// The session's `application_name`, if set.
    pub application_name: Option<String>,
    /// When the session last changed state (`pg_stat_activity.state_change`, in
    /// PostgreSQL's text form and the session's time zone).
    pub state_change: Option<String>,
}

/// The relays parked now on this database, in pid order: the sessions holding a
/// [wake-up lock](crate::wake_lock_key) exclusively, which a PostgreSQL relay takes on
/// its LISTEN session while it waits for work (a relay at work holds none, so it is
/// not listed). `None` on MySQL and SQLite, where relays park without such a lock.
///
/// Reads `pg_locks` and `pg_stat_activity`; a role that may not see other roles'
/// sessions (without `pg_read_all_stats`) sees only its own.
pub fn parked_relays<C: OutboxConnection>(conn: &mut C) -> Result<Option<Vec<ParkedRelay>>> {
    Ok(conn.parked_relay_rows()?.map(|rows| {
        rows.into_iter()
            .map(|r| ParkedRelay {
                pid: r.pid,
                client_addr: r.client_addr,
                application_name: r.application_name,
                state_change: r.state_change,
            })
            .collect()
    }))
}

/// An outbox row whose stored fields do not decode into an [`OutboxRecord`], as stored,
/// with the reason.
///
/// Such a row was written around this library (by hand, or by a foreign producer): a
/// msg_id with whitespace, headers that are not a JSON object of strings, an unknown
/// status, a timestamp out of range. The relay dead-letters it on its first claim
/// (`last_error` starts with `unreadable row:`), and the listings return it as
/// [`OutboxRow::Unreadable`] so that it can be seen and purged. [`redrive`] refuses it:
/// fix the row first.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct UnreadableRecord {
    /// The row id.
    pub id: i64,
    /// The stored status (`2` for DEAD; see [`status`](Self::status)).
    pub status: i16,
    /// The stored msg_id, which need not be a valid [`MsgId`](outbox_core::MsgId).
    pub msg_id: String,
    /// The stored topic.
    pub topic: String,
    /// The stored event type.
    pub event_type: String,
    /// The stored ordering key.
    pub key: String,
    /// The stored schema version.
    pub schema_version: i32,
    /// The stored payload, as text.
    pub payload: String,
    /// The stored headers, as text.
    pub headers: String,
    /// The stored retry count.
    pub retries: i32,
    /// When the row is due (again); `None` if the stored value is out of range.
    pub next_retry_at: Option<DateTime<Utc>>,
    /// When the row was created; `None` if the stored value is out of range.
    pub created_at: Option<DateTime<Utc>>,
    /// When it was published, if it was and the value is in range.
    pub sent_at: Option<DateTime<Utc>>,
    /// The last publish error (the relay's `unreadable row: …` once it dead-lettered it).
    pub last_error: Option<String>,
    /// Why the row does not decode: the first field found wrong.
    pub reason: String,
}

impl UnreadableRecord {
    /// The stored status, if it is a known one.
    pub fn status(&self) -> Option<Status> {
        Status::try_from(self.status).ok()
    }
}

/// An outbox row as the operations listings return it: decoded, or as stored with the
/// reason it does not decode.
///
/// ```no_run
/// use diesel::Connection as _;
/// use outbox_diesel::OutboxRow;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let mut conn = diesel::PgConnection::establish("postgres://localhost/app")?;
/// for row in outbox_diesel::dead_letters(&mut conn, 0, 100)? {
///     match row {
///         OutboxRow::Readable(r) => println!("{} {}", r.id, r.envelope.msg_id),
///         OutboxRow::Unreadable(u) => println!("{} {:?} unreadable: {}", u.id, u.msg_id, u.reason),
///     }
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutboxRow {
    /// A row that decodes.
    Readable(OutboxRecord),
    /// A row that does not.
    Unreadable(UnreadableRecord),
}

impl OutboxRow {
    /// The row id.
    pub fn id(&self) -> i64 {
        match self {
            Self::Readable(r) => r.id,
            Self::Unreadable(u) => u.id,
        }
    }

    /// The row's status, `None` for an unreadable row's unknown one.
    pub fn status(&self) -> Option<Status> {
        match self {
            Self::Readable(r) => Some(r.status),
            Self::Unreadable(u) => u.status(),
        }
    }

    /// The decoded record, or [`Error::CorruptRow`](crate::Error::CorruptRow) with the
    /// reason for an unreadable row.
    pub fn into_record(self) -> Result<OutboxRecord> {
        match self {
            Self::Readable(r) => Ok(r),
            Self::Unreadable(u) => Err(crate::Error::CorruptRow {
                id: u.id,
                reason: u.reason,
            }),
        }
    }
}

/// DEAD rows with `id > after_id`, in id order, at most `limit`: page with the last id.
/// A row that does not decode (the relay dead-letters such rows) is returned as
/// [`OutboxRow::Unreadable`] rather than failing the listing.
pub fn dead_letters<C: OutboxConnection>(
    conn: &mut C,
    after_id: i64,
    limit: usize,
) -> Result<Vec<OutboxRow>> {
    conn.__list(Some(Status::Dead), after_id, limit)
}

/// Rows of any status (or of `status`) with `id > after_id`, in id order, at most `limit`,
/// unreadable ones included as [`OutboxRow::Unreadable`].
pub fn list_rows<C: OutboxConnection>(
    conn: &mut C,
    status: Option<Status>,
    after_id: i64,
    limit: usize,
) -> Result<Vec<OutboxRow>> {
    conn.__list(status, after_id, limit)
}

/// Like [`list_rows`], decoded: fails with [`Error::CorruptRow`](crate::Error::CorruptRow)
/// on the first row that does not decode.
pub fn list_messages<C: OutboxConnection>(
    conn: &mut C,
    status: Option<Status>,
    after_id: i64,
    limit: usize,
) -> Result<Vec<OutboxRecord>> {
    conn.__list(status, after_id, limit)?
        .into_iter()
        .map(OutboxRow::into_record)
        .collect()
}

/// The row with this msg_id, whatever its status, compared as stored: an unreadable
/// row's msg_id (`"acc bad id"`) finds it too.
pub fn find_row<C: OutboxConnection>(conn: &mut C, msg_id: &str) -> Result<Option<OutboxRow>> {
    conn.__find(msg_id)
}

/// Like [`find_row`], decoded: fails with [`Error::CorruptRow`](crate::Error::CorruptRow)
/// if the row does not decode.
pub fn find_message<C: OutboxConnection>(
    conn: &mut C,
    msg_id: &str,
) -> Result<Option<OutboxRecord>> {
    conn.__find(msg_id)?.map(OutboxRow::into_record).transpose()
}

/// Re-drives DEAD rows: back to NEW with retries reset, due now, last error cleared.
/// Ids that are not DEAD are left alone. Returns how many rows changed.
///
/// On PostgreSQL each row gets a new id from the id sequence (in the order of the old
/// ones; find it again by its msg_id): the relay's claim walks from a floor that has
/// passed the old ids, and claims the rows at its next claim, after the messages emitted
/// before them. Their keys moved on when they went DEAD. Elsewhere the ids stay.
///
/// Fails with [`Error::UnreadableRow`](crate::Error::UnreadableRow), and changes nothing,
/// if one of them does not decode ([`OutboxRow::Unreadable`]): the relay would only
/// dead-letter it again. Fix such a row, or [`purge_dead`] it.
pub fn redrive<C: OutboxConnection>(conn: &mut C, ids: &[i64]) -> Result<usize> {
    conn.__redrive(Some(ids))
}

/// Re-drives every DEAD row that decodes (see [`redrive`]), a page of rows at a time;
/// unreadable rows stay DEAD. Returns how many rows changed.
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
