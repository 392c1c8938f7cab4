//! The rows the listings return ([`OutboxRecord`], or [`UnreadableRecord`] for a row
//! that does not decode), and the listings.

use chrono::{DateTime, Utc};
use outbox_core::{Envelope, Status};

use crate::backend::{Database as _, RecordRow};
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

/// An outbox row whose stored fields do not decode into an [`OutboxRecord`], as stored,
/// with the reason.
///
/// Such a row was written around this library (by hand, or by a foreign producer): a
/// msg_id with whitespace, headers that are not a JSON object of strings, an unknown
/// status, a timestamp out of range. The relay dead-letters it on its first claim
/// (`last_error` starts with `unreadable row:`), and the listings return it as
/// [`OutboxRow::Unreadable`] so that it can be seen and purged. [`redrive`](crate::redrive) refuses it:
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
    list_rows(conn, Some(Status::Dead), after_id, limit)
}

/// Rows of any status (or of `status`) with `id > after_id`, in id order, at most `limit`,
/// unreadable ones included as [`OutboxRow::Unreadable`].
pub fn list_rows<C: OutboxConnection>(
    conn: &mut C,
    status: Option<Status>,
    after_id: i64,
    limit: usize,
) -> Result<Vec<OutboxRow>> {
    let filter = status.map_or(String::new(), |s| format!("status = {} AND ", s.as_i16()));
    let sql = format!(
        "SELECT {} FROM outbox WHERE {filter}id > {after_id} ORDER BY id LIMIT {limit}",
        C::Db::DIALECT.columns
    );
    let rows: Vec<RecordRow> = conn.db().load(&sql, None)?;
    Ok(rows.into_iter().map(RecordRow::into_row).collect())
}

/// Like [`list_rows`], decoded: fails with [`Error::CorruptRow`](crate::Error::CorruptRow)
/// on the first row that does not decode.
pub fn list_messages<C: OutboxConnection>(
    conn: &mut C,
    status: Option<Status>,
    after_id: i64,
    limit: usize,
) -> Result<Vec<OutboxRecord>> {
    list_rows(conn, status, after_id, limit)?
        .into_iter()
        .map(OutboxRow::into_record)
        .collect()
}

/// The row with this msg_id, whatever its status, compared as stored: an unreadable
/// row's msg_id (`"acc bad id"`) finds it too.
pub fn find_row<C: OutboxConnection>(conn: &mut C, msg_id: &str) -> Result<Option<OutboxRow>> {
    let d = &C::Db::DIALECT;
    let sql = format!("SELECT {} FROM outbox WHERE msg_id = {}", d.columns, d.ph);
    let rows: Vec<RecordRow> = conn.db().load(&sql, Some(msg_id))?;
    // msg_id is unique: at most one row.
    Ok(rows.into_iter().next().map(RecordRow::into_row))
}

/// Like [`find_row`], decoded: fails with [`Error::CorruptRow`](crate::Error::CorruptRow)
/// if the row does not decode.
pub fn find_message<C: OutboxConnection>(
    conn: &mut C,
    msg_id: &str,
) -> Result<Option<OutboxRecord>> {
    find_row(conn, msg_id)?
        .map(OutboxRow::into_record)
        .transpose()
}
