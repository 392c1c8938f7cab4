//! Reading rows: the one struct every backend's shared queries load, and its decoding
//! into an [`OutboxRecord`] or a relay's [`StoredMessage`].

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Integer, Nullable, SmallInt, Text};
use outbox_core::{Envelope, Headers, MsgId, Status, StoredMessage};

use super::Database;
use crate::{Error, OutboxRecord, OutboxRow, Result, UnreadableRecord};

/// The columns of a relay's message ([`StoredMessage`]) but its creation time, which
/// the two row types below read each in their own form.
#[derive(Debug, QueryableByName)]
pub(crate) struct MessageColumns {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Text)]
    msg_id: String,
    #[diesel(sql_type = Text)]
    topic: String,
    #[diesel(sql_type = Text)]
    event_type: String,
    #[diesel(sql_type = Text)]
    msg_key: String,
    #[diesel(sql_type = Integer)]
    schema_version: i32,
    #[diesel(sql_type = Text)]
    payload: String,
    #[diesel(sql_type = Text)]
    headers: String,
    #[diesel(sql_type = Integer)]
    retries: i32,
}

// Decoding the columns alone serves PostgreSQL's claim row; the others decode a whole
// `RecordRow`.
#[cfg(feature = "postgres")]
impl MessageColumns {
    fn corrupt(&self, reason: String) -> Error {
        Error::CorruptRow {
            id: self.id,
            reason,
        }
    }

    /// The row's message, created at `created_at`, or why it cannot be read
    /// ([`Error::CorruptRow`]).
    fn into_stored(self, created_at: DateTime<Utc>) -> Result<StoredMessage> {
        let id = self.id;
        let corrupt = |reason: String| Error::CorruptRow { id, reason };
        let msg_id = MsgId::new(self.msg_id).map_err(|e| corrupt(e.to_string()))?;
        let headers: Headers = serde_json::from_str(&self.headers)
            .map_err(|e| corrupt(format!("headers are not a JSON object of strings: {e}")))?;
        Ok(StoredMessage {
            id,
            retries: u32::try_from(self.retries).unwrap_or(0),
            envelope: Envelope {
                msg_id,
                topic: self.topic,
                event_type: self.event_type,
                key: self.msg_key,
                schema_version: u32::try_from(self.schema_version).unwrap_or(0),
                payload: self.payload,
                headers,
                created_at,
            },
        })
    }
}

/// An outbox row as the shared queries read it: timestamps as Unix microseconds, JSON
/// as text, so that one struct reads every backend. A timestamp the backend cannot turn
/// into microseconds chrono holds comes as NULL and makes the row unreadable.
#[derive(QueryableByName)]
pub(crate) struct RecordRow {
    #[diesel(embed)]
    message: MessageColumns,
    #[diesel(sql_type = SmallInt)]
    status: i16,
    #[diesel(sql_type = Nullable<BigInt>)]
    next_retry_us: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    created_us: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    sent_us: Option<i64>,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
}

/// The fields of a [`RecordRow`] that must decode, decoded.
struct Decoded {
    status: Status,
    created_at: DateTime<Utc>,
    next_retry_at: DateTime<Utc>,
    msg_id: MsgId,
    headers: Headers,
}

fn from_micros(us: i64) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp_micros(us)
}

impl RecordRow {
    pub(crate) fn into_record(self) -> Result<OutboxRecord> {
        match self.into_row() {
            OutboxRow::Readable(record) => Ok(record),
            OutboxRow::Unreadable(raw) => Err(Error::CorruptRow {
                id: raw.id,
                reason: raw.reason,
            }),
        }
    }

    /// The row decoded, or as stored with the reason it does not decode.
    pub(crate) fn into_row(self) -> OutboxRow {
        let Decoded {
            status,
            created_at,
            next_retry_at,
            msg_id,
            headers,
        } = match self.decoded_parts() {
            Ok(parts) => parts,
            Err(reason) => return OutboxRow::Unreadable(self.into_unreadable(reason)),
        };
        // The text columns (the payload above all) are moved, not copied: the relay's
        // claim reads its rows through here on MySQL and SQLite.
        let m = self.message;
        OutboxRow::Readable(OutboxRecord {
            id: m.id,
            status,
            retries: u32::try_from(m.retries).unwrap_or(0),
            next_retry_at,
            sent_at: self.sent_us.and_then(from_micros),
            last_error: self.last_error,
            envelope: Envelope {
                msg_id,
                topic: m.topic,
                event_type: m.event_type,
                key: m.msg_key,
                schema_version: u32::try_from(m.schema_version).unwrap_or(0),
                payload: m.payload,
                headers,
                created_at,
            },
        })
    }

    /// The fields that must decode, or why one does not (the first found).
    fn decoded_parts(&self) -> std::result::Result<Decoded, String> {
        let status = Status::try_from(self.status).map_err(|e| e.to_string())?;
        let at = |us: Option<i64>, column: &str| {
            us.and_then(from_micros)
                .ok_or_else(|| format!("{column} is out of range"))
        };
        let created_at = at(self.created_us, "created_at")?;
        let next_retry_at = at(self.next_retry_us, "next_retry_at")?;
        let msg_id = MsgId::new(self.message.msg_id.clone()).map_err(|e| e.to_string())?;
        let headers: Headers = serde_json::from_str(&self.message.headers)
            .map_err(|e| format!("headers are not a JSON object of strings: {e}"))?;
        Ok(Decoded {
            status,
            created_at,
            next_retry_at,
            msg_id,
            headers,
        })
    }

    fn into_unreadable(self, reason: String) -> UnreadableRecord {
        let m = self.message;
        UnreadableRecord {
            id: m.id,
            status: self.status,
            msg_id: m.msg_id,
            topic: m.topic,
            event_type: m.event_type,
            key: m.msg_key,
            schema_version: m.schema_version,
            payload: m.payload,
            headers: m.headers,
            retries: m.retries,
            next_retry_at: self.next_retry_us.and_then(from_micros),
            created_at: self.created_us.and_then(from_micros),
            sent_at: self.sent_us.and_then(from_micros),
            last_error: self.last_error,
            reason,
        }
    }
}

/// A claimed row, as the relay gets it: [`RecordRow`] on every backend, [`PgMessageRow`]
/// on PostgreSQL.
pub(crate) trait ClaimedRow {
    /// The row as the relay's message, or why it cannot be read.
    fn into_stored(self) -> Result<StoredMessage>;
}

impl ClaimedRow for RecordRow {
    fn into_stored(self) -> Result<StoredMessage> {
        let r = self.into_record()?;
        Ok(StoredMessage {
            id: r.id,
            retries: r.retries,
            envelope: r.envelope,
        })
    }
}

/// An outbox row as a relay reads it on PostgreSQL: the columns of a [`StoredMessage`]
/// only, `created_at` decoded by diesel from PostgreSQL's binary timestamp instead of
/// converted to microseconds by the server (`extract(epoch ..)` on every row, the
/// claim's costliest expression), and without the status, retry time, send time and
/// last error that a relay never reads.
///
/// The polling relay's claim reads its rows with it, and so does any other reader of
/// rows to publish (the CDC relay's backfill and retry round, in `typed-outbox-cdc`):
/// select [`COLUMNS`](Self::COLUMNS) from the outbox table aliased `o`, load with
/// diesel's `sql_query`, and decode each row with [`into_message`](Self::into_message).
///
/// ```no_run
/// use diesel::RunQueryDsl as _;
/// use outbox_diesel::PgMessageRow;
///
/// # fn read(conn: &mut diesel::PgConnection) -> Result<(), Box<dyn std::error::Error>> {
/// let rows: Vec<PgMessageRow> = diesel::sql_query(format!(
///     "SELECT {} FROM outbox o WHERE o.status = 0 ORDER BY o.id LIMIT 10",
///     PgMessageRow::COLUMNS
/// ))
/// .load(conn)?;
/// for row in rows {
///     let message = row.into_message()?;
///     println!("{} {}", message.id, message.envelope.msg_id);
/// }
/// # Ok(()) }
/// # fn main() { let _ = read; }
/// ```
#[cfg(feature = "postgres")]
#[derive(Debug, QueryableByName)]
pub struct PgMessageRow {
    #[diesel(embed)]
    message: MessageColumns,
    /// Microseconds since 2000-01-01 UTC, PostgreSQL's own form: decoding into chrono
    /// here would fail the whole query on a value chrono cannot hold (PostgreSQL takes
    /// years up to 294276, and `infinity`), instead of dead-lettering that one row.
    #[diesel(sql_type = diesel::sql_types::Timestamptz)]
    created_at: diesel::data_types::PgTimestamp,
}

#[cfg(feature = "postgres")]
impl PgMessageRow {
    /// The select list that reads a row, over the outbox table aliased `o` (either
    /// layout: plain or partitioned).
    pub const COLUMNS: &'static str = "o.id, o.msg_id, o.topic, o.event_type, \
        o.msg_key, o.schema_version, o.payload::text AS payload, \
        o.headers::text AS headers, o.retries, o.created_at";

    /// The row's id.
    pub fn id(&self) -> i64 {
        self.message.id
    }

    /// The row as a relay's message, or why it cannot be read ([`Error::CorruptRow`]:
    /// a msg_id or headers written around this library, a `created_at` out of chrono's
    /// range).
    pub fn into_message(self) -> Result<StoredMessage> {
        /// 2000-01-01 (PostgreSQL's epoch) in Unix microseconds.
        const PG_EPOCH_US: i64 = 946_684_800_000_000;
        let created_at = self
            .created_at
            .0
            .checked_add(PG_EPOCH_US)
            .and_then(DateTime::from_timestamp_micros);
        match created_at {
            Some(at) => self.message.into_stored(at),
            None => Err(self.message.corrupt("created_at is out of range".into())),
        }
    }
}

#[cfg(feature = "postgres")]
impl ClaimedRow for PgMessageRow {
    fn into_stored(self) -> Result<StoredMessage> {
        self.into_message()
    }
}

/// Claimed rows as the relay's messages. A row that cannot be read (written around this
/// library, with an invalid msg_id or headers) is marked DEAD with the reason in the
/// claim's own transaction, instead of failing every claim, and so the whole relay,
/// forever.
pub(crate) fn claimed<D: Database, R: ClaimedRow>(
    conn: &mut D,
    rows: Vec<R>,
) -> Result<Vec<StoredMessage>> {
    let mut messages = Vec::with_capacity(rows.len());
    let mut dead = Vec::new();
    for row in rows {
        match row.into_stored() {
            Ok(message) => messages.push(message),
            Err(Error::CorruptRow { id, reason }) => {
                tracing::error!(id, %reason, "unreadable outbox row dead-lettered");
                dead.push(outbox_core::DeadRow {
                    id,
                    error: format!("unreadable row: {reason}"),
                });
            }
            Err(e) => return Err(e),
        }
    }
    if !dead.is_empty() {
        let dead = outbox_core::RelayBatchOutcome {
            dead,
            ..Default::default()
        };
        super::complete(conn, &dead)?;
    }
    Ok(messages)
}

#[cfg(any(feature = "mysql", feature = "sqlite"))]
#[derive(QueryableByName)]
pub(crate) struct MsgIdRow {
    #[diesel(sql_type = Text)]
    pub(crate) msg_id: String,
}
