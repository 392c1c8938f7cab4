//! Backend-specific SQL. Statements shared by every backend are written once in
//! [`common_methods!`] over a [`Dialect`]; emit, the claim's transaction and the inbox
//! insert are per backend.

use std::borrow::Cow;

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Integer, Nullable, SmallInt, Text};
use outbox_core::{Envelope, Headers, MsgId, Status};

use crate::{Error, OutboxConnection, OutboxRecord, Result};

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod pg;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;

#[cfg(feature = "postgres")]
pub(crate) use pg::NOTIFY_IDLE_SLACK;

/// Column limits of the shipped tables (characters).
pub(crate) const TOPIC_LEN: usize = 128;
pub(crate) const EVENT_TYPE_LEN: usize = 128;
pub(crate) const KEY_LEN: usize = 255;
pub(crate) const GROUP_LEN: usize = 64;
/// `last_error` is cut to this many characters.
const LAST_ERROR_LEN: usize = 2000;
/// Rows per INSERT statement in `emit_all`; well under every backend's bind limit.
const CHUNK_ROWS: usize = 1000;
/// Payload bytes per INSERT statement in `emit_all` (MySQL's max_allowed_packet).
const CHUNK_BYTES: usize = 4 << 20;

/// One outbox row ready to bind.
pub(crate) struct Row<'a> {
    pub(crate) msg_id: &'a str,
    pub(crate) topic: &'a str,
    pub(crate) event_type: &'a str,
    pub(crate) key: &'a str,
    pub(crate) schema_version: i32,
    pub(crate) payload: &'a str,
    pub(crate) headers: Cow<'a, str>,
}

fn check_len(msg_id: &MsgId, field: &'static str, value: &str, limit: usize) -> Result<()> {
    // Byte length bounds the character count from above: count only when it may be over.
    if value.len() > limit {
        let len = value.chars().count();
        if len > limit {
            return Err(Error::FieldTooLong {
                msg_id: msg_id.clone(),
                field,
                len,
                limit,
            });
        }
    }
    Ok(())
}

pub(crate) fn check_group(group: &str, msg_id: &MsgId) -> Result<()> {
    check_len(msg_id, "consumer_group", group, GROUP_LEN)
}

impl<'a> Row<'a> {
    pub(crate) fn new(e: &'a Envelope) -> Result<Self> {
        check_len(&e.msg_id, "topic", &e.topic, TOPIC_LEN)?;
        check_len(&e.msg_id, "event_type", &e.event_type, EVENT_TYPE_LEN)?;
        check_len(&e.msg_id, "key", &e.key, KEY_LEN)?;
        let headers = if e.headers.is_empty() {
            Cow::Borrowed("{}")
        } else {
            Cow::Owned(
                serde_json::to_string(&e.headers).map_err(|source| Error::Serialize {
                    msg_id: e.msg_id.clone(),
                    source,
                })?,
            )
        };
        Ok(Self {
            msg_id: e.msg_id.as_str(),
            topic: &e.topic,
            event_type: &e.event_type,
            key: &e.key,
            schema_version: i32::try_from(e.schema_version).unwrap_or(i32::MAX),
            payload: &e.payload,
            headers,
        })
    }
}

/// Splits rows into statements of bounded size.
pub(crate) fn chunks<'r, 'a>(rows: &'r [Row<'a>]) -> impl Iterator<Item = &'r [Row<'a>]> {
    let mut rest = rows;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut bytes = 0;
        let mut n = 0;
        while n < rest.len()
            && n < CHUNK_ROWS
            && (n == 0 || bytes + rest[n].payload.len() <= CHUNK_BYTES)
        {
            bytes += rest[n].payload.len();
            n += 1;
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Some(head)
    })
}

/// An outbox row as the shared queries read it: timestamps as Unix microseconds, JSON
/// as text, so that one struct reads every backend.
#[derive(QueryableByName)]
pub(crate) struct RecordRow {
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
    #[diesel(sql_type = SmallInt)]
    status: i16,
    #[diesel(sql_type = Integer)]
    retries: i32,
    #[diesel(sql_type = BigInt)]
    next_retry_us: i64,
    #[diesel(sql_type = BigInt)]
    created_us: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    sent_us: Option<i64>,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
}

fn from_micros(us: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(us).unwrap_or_default()
}

impl RecordRow {
    pub(crate) fn into_record(self) -> Result<OutboxRecord> {
        let corrupt = |reason: String| Error::CorruptRow {
            id: self.id,
            reason,
        };
        let msg_id = MsgId::new(self.msg_id.clone()).map_err(|e| corrupt(e.to_string()))?;
        let headers: Headers = serde_json::from_str(&self.headers)
            .map_err(|e| corrupt(format!("headers are not a JSON object of strings: {e}")))?;
        let status = Status::try_from(self.status).map_err(|e| corrupt(e.to_string()))?;
        Ok(OutboxRecord {
            id: self.id,
            status,
            retries: u32::try_from(self.retries).unwrap_or(0),
            next_retry_at: from_micros(self.next_retry_us),
            sent_at: self.sent_us.map(from_micros),
            last_error: self.last_error,
            envelope: Envelope {
                msg_id,
                topic: self.topic,
                event_type: self.event_type,
                key: self.msg_key,
                schema_version: u32::try_from(self.schema_version).unwrap_or(0),
                payload: self.payload,
                headers,
                created_at: from_micros(self.created_us),
            },
        })
    }
}

/// The `VALUES` tuples of an outbox insert, the same on every backend: `(msg_id, topic,
/// event_type, msg_key, schema_version, payload{json}, headers{json}{tail})`, where `json`
/// casts the JSON columns (PostgreSQL) and `tail` adds columns the backend fills itself.
pub(crate) fn push_values<'b, DB>(
    rows: &'b [Row<'_>],
    out: &mut diesel::query_builder::AstPass<'_, 'b, DB>,
    json: &'static str,
    tail: &'static str,
) -> diesel::QueryResult<()>
where
    DB: diesel::backend::Backend
        + diesel::sql_types::HasSqlType<Text>
        + diesel::sql_types::HasSqlType<Integer>,
    str: diesel::serialize::ToSql<Text, DB>,
    i32: diesel::serialize::ToSql<Integer, DB>,
{
    for (i, r) in rows.iter().enumerate() {
        out.push_sql(if i == 0 { "(" } else { ", (" });
        for text in [r.msg_id, r.topic, r.event_type, r.key] {
            out.push_bind_param::<Text, str>(text)?;
            out.push_sql(", ");
        }
        out.push_bind_param::<Integer, i32>(&r.schema_version)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, str>(r.payload)?;
        out.push_sql(json);
        out.push_sql(", ");
        out.push_bind_param::<Text, str>(&r.headers)?;
        out.push_sql(json);
        out.push_sql(tail);
        out.push_sql(")");
    }
    Ok(())
}

/// Claimed rows as records. A row that cannot be read (written around this library, with
/// an invalid msg_id or headers) is marked DEAD with the reason in the claim's own
/// transaction, instead of failing every claim, and so the whole relay, forever.
pub(crate) fn claimed<C: OutboxConnection>(
    conn: &mut C,
    rows: Vec<RecordRow>,
) -> Result<Vec<OutboxRecord>> {
    let mut records = Vec::with_capacity(rows.len());
    let mut dead = Vec::new();
    for row in rows {
        match row.into_record() {
            Ok(record) => records.push(record),
            Err(Error::CorruptRow { id, reason }) => {
                tracing::error!(id, %reason, "unreadable outbox row dead-lettered");
                dead.push((id, format!("unreadable row: {reason}")));
            }
            Err(e) => return Err(e),
        }
    }
    if !dead.is_empty() {
        conn.__complete(&outbox_core::BatchOutcome {
            dead,
            ..Default::default()
        })?;
    }
    Ok(records)
}

/// The first of some msg_ids already in the outbox (which one a multi-row insert hit).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) const FIND_ONE: &str = "SELECT msg_id FROM outbox WHERE msg_id IN ({ids}) LIMIT 1";

/// Takes back the rows an `emit_all` inserted before it hit a duplicate: all or nothing.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) const TAKE_BACK: &str = "DELETE FROM outbox WHERE msg_id IN ({ids})";

/// `sql` with its `{ids}` replaced by one `?` per msg_id, each bound as text: the
/// duplicate lookup and take-back of `emit_all` on MySQL and SQLite.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn with_msg_ids<'a, DB>(
    sql: &str,
    msg_ids: &[&'a str],
) -> diesel::query_builder::BoxedSqlQuery<'a, DB, diesel::query_builder::SqlQuery>
where
    DB: diesel::backend::Backend + diesel::sql_types::HasSqlType<Text>,
    &'a str: diesel::serialize::ToSql<Text, DB>,
{
    let sql = sql.replace("{ids}", &vec!["?"; msg_ids.len()].join(", "));
    msg_ids
        .iter()
        .fold(diesel::sql_query(sql).into_boxed::<DB>(), |q, id| {
            q.bind::<Text, _>(*id)
        })
}

#[derive(QueryableByName)]
pub(crate) struct BacklogRow {
    #[diesel(sql_type = BigInt)]
    pub(crate) due: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) oldest_us: Option<i64>,
    #[diesel(sql_type = BigInt)]
    pub(crate) dead: i64,
}

impl BacklogRow {
    pub(crate) fn into_backlog(self) -> outbox_core::Backlog {
        outbox_core::Backlog {
            due: u64::try_from(self.due).unwrap_or(0),
            oldest_due_age: self
                .oldest_us
                .map(|us| std::time::Duration::from_micros(u64::try_from(us).unwrap_or(0))),
            dead: u64::try_from(self.dead).unwrap_or(0),
        }
    }
}

#[cfg(any(feature = "mysql", feature = "sqlite"))]
#[derive(QueryableByName)]
pub(crate) struct MsgIdRow {
    #[diesel(sql_type = Text)]
    pub(crate) msg_id: String,
}

/// The differences between backends in the shared statements. Integers (ids, limits,
/// statuses) are inlined as literals: they are Rust integers, so this is safe, and a
/// literal status lets PostgreSQL match its partial indexes and the planner see the real
/// LIMIT (a generic plan for `LIMIT $1` fell back to a full scan).
pub(crate) struct Dialect {
    /// The select list producing a [`RecordRow`].
    pub(crate) columns: &'static str,
    /// The database clock, UTC.
    pub(crate) now: &'static str,
    /// The single bind placeholder.
    pub(crate) ph: &'static str,
    /// Row locks for the claim.
    pub(crate) lock: &'static str,
    /// `due`, `oldest_us`, `dead` in one row.
    pub(crate) backlog: &'static str,
    /// The database clock plus this many microseconds.
    pub(crate) later: fn(i64) -> String,
    /// The database clock minus this many microseconds.
    pub(crate) ago: fn(i64) -> String,
    /// `DELETE .. LIMIT n` of rows matching `where` (table, where, order column, n).
    pub(crate) delete_limited: fn(&str, &str, &str, usize) -> String,
}

pub(crate) fn in_list(ids: &[i64]) -> String {
    let mut s = String::with_capacity(ids.len() * 8);
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&id.to_string());
    }
    s
}

/// The retry delay that ends at `at`, in microseconds (0 if `at` has passed).
///
/// The relay picks `at` on its own clock, but the claim compares `next_retry_at` with the
/// database's: a relay whose clock is off would make retries due early or late by the
/// difference. Both ends of the delay are on the relay's clock, so the store writes the
/// database's clock plus the delay. (The outcome is completed right after it is decided,
/// so `at` minus now is the delay the relay chose, less a few milliseconds.)
pub(crate) fn retry_delay_us(at: DateTime<Utc>) -> i64 {
    (at - Utc::now())
        .num_microseconds()
        .unwrap_or(i64::MAX)
        .max(0)
}

pub(crate) fn truncate(s: &str) -> &str {
    match s.char_indices().nth(LAST_ERROR_LEN) {
        Some((at, _)) => &s[..at],
        None => s,
    }
}

/// SQL that is true when two `msg_key` expressions are the same key: byte for byte, as
/// Rust compares them. A plain `=` on PostgreSQL (deterministic collations break ties
/// by bytes) and SQLite (BINARY).
#[cfg(feature = "sqlite")]
pub(crate) fn same_key(a: &str, b: &str) -> String {
    format!("{a} = {b}")
}

/// The per-key claim's filter on candidate rows: the oldest NEW row of the row's key (its
/// "head", possibly the row itself) is due. A key whose head waits for its retry time
/// thus stays out of the batch altogether, so its later rows do not crowd other keys out
/// of the LIMIT. Not needed for correctness (the probe after the lock decides), only for
/// progress. One index probe per candidate on the NEW rows by `(msg_key, id)`.
/// `same_key` compares keys (see `same_key`). (PostgreSQL's claim walks instead: see
/// `pg::per_key_claim_sql`.)
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn head_is_due(d: &Dialect, table: &str, same_key: fn(&str, &str) -> String) -> String {
    format!(
        "(SELECT h.next_retry_at FROM outbox h WHERE h.status = 0 AND {key} \
         ORDER BY h.id LIMIT 1) <= {now}",
        key = same_key("h.msg_key", &format!("{table}.msg_key")),
        now = d.now
    )
}

/// The per-key probe over the locked set `L` (given as a subquery or an id list): for
/// each key of `L`, the first NEW row of that key outside `L` and below the key's last
/// row in `L`, if any. A row of `L` may be published only below it. This is ARCHITECTURE.md's
/// "no NEW row p outside L with p.key = o.key AND p.id < o.id", asked once per key
/// rather than once per row, so that a key with many rows in the batch costs a walk
/// over its rows instead of a walk per row.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn first_outside_sql(
    keys_of_l: &str,
    ids_of_l: &str,
    same_key: fn(&str, &str) -> String,
) -> String {
    format!(
        "SELECT k.msg_key, (SELECT p.id FROM outbox p WHERE p.status = 0 \
         AND {key} AND p.id < k.last AND p.id NOT IN ({ids_of_l}) \
         ORDER BY p.id LIMIT 1) AS first_out FROM ({keys_of_l}) k",
        key = same_key("p.msg_key", "k.msg_key"),
    )
}

/// The per-key claim in one statement on SQLite (PostgreSQL has its own, with walks
/// instead of probes: `pg::per_key_claim_sql`):
/// lock the due NEW rows in id order whose key's head is due (`L`), then return the rows
/// of `L` that no NEW row outside `L` precedes within their key, in id order.
///
/// `g` is materialized so that each key is probed once: inlined, PostgreSQL evaluated
/// the probe once per row of `L` (a hot key of 500 rows: 250,000 index entries, 91 ms
/// instead of 10 ms).
///
/// `in_l` tests `id` for membership in `L`: on PostgreSQL `= ANY(ARRAY(..))`, which
/// reads the rows by primary key (a plain `IN (SELECT ..)` was planned as a hash semi
/// join over a scan of the whole table).
#[cfg(feature = "sqlite")]
pub(crate) fn per_key_claim_sql(d: &Dialect, limit: usize, in_l: &str) -> String {
    format!(
        "WITH l AS MATERIALIZED (SELECT id, msg_key FROM outbox o \
           WHERE status = 0 AND next_retry_at <= {now} AND {head} \
           ORDER BY id LIMIT {limit}{lock}), \
         g AS MATERIALIZED ({gaps}) \
         SELECT {columns} FROM outbox WHERE id {in_l} \
           AND NOT EXISTS (SELECT 1 FROM g WHERE g.msg_key = outbox.msg_key AND g.first_out < outbox.id) \
         ORDER BY id",
        now = d.now,
        head = head_is_due(d, "o", same_key),
        lock = d.lock,
        gaps = first_outside_sql(
            "SELECT msg_key, max(id) AS last FROM l GROUP BY msg_key",
            "SELECT id FROM l",
            same_key,
        ),
        columns = d.columns,
    )
}

/// A row of [`first_outside_sql`].
#[cfg(feature = "mysql")]
#[derive(QueryableByName)]
pub(crate) struct FirstOutside {
    #[diesel(sql_type = Text)]
    pub(crate) msg_key: String,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) first_out: Option<i64>,
}

/// `SELECT MAX(version) AS version FROM outbox_migrations`.
#[derive(QueryableByName)]
pub(crate) struct VersionRow {
    #[diesel(sql_type = Nullable<Integer>)]
    pub(crate) version: Option<i32>,
}

/// Whether `e` says that `table` does not exist, in PostgreSQL's (`relation "t" does not
/// exist`), MySQL's and MariaDB's (`Table 'db.t' doesn't exist`) or SQLite's (`no such
/// table: t`) words.
pub(crate) fn is_missing_table(e: &diesel::result::Error, table: &str) -> bool {
    let diesel::result::Error::DatabaseError(_, info) = e else {
        return false;
    };
    let message = info.message();
    message.contains(table)
        && (message.contains("does not exist")
            || message.contains("doesn't exist")
            || message.contains("no such table"))
}

/// The methods of `OutboxConnection` whose SQL differs only by [`Dialect`].
macro_rules! common_methods {
    ($d:expr) => {
        fn __claim_sql(limit: usize) -> String {
            let d: &$crate::backend::Dialect = &$d;
            format!(
                "SELECT {} FROM outbox WHERE status = 0 AND next_retry_at <= {} ORDER BY id LIMIT {}{}",
                d.columns, d.now, limit, d.lock
            )
        }

        fn __claim(&mut self, limit: usize) -> $crate::Result<Vec<$crate::OutboxRecord>> {
            use diesel::RunQueryDsl as _;
            let rows = diesel::sql_query(Self::__claim_sql(limit)).load(self)?;
            $crate::backend::claimed(self, rows)
        }

        fn __complete(&mut self, outcome: &outbox_core::BatchOutcome) -> $crate::Result<()> {
            use diesel::RunQueryDsl as _;
            let d: &$crate::backend::Dialect = &$d;
            if !outcome.sent.is_empty() {
                // One statement for the whole batch; `status = 0` keeps status moving forward.
                diesel::sql_query(format!(
                    "UPDATE outbox SET status = 1, sent_at = {} WHERE status = 0 AND id IN ({})",
                    d.now,
                    $crate::backend::in_list(&outcome.sent)
                ))
                .execute(self)?;
            }
            for (id, at, error) in &outcome.retry {
                diesel::sql_query(format!(
                    "UPDATE outbox SET retries = retries + 1, next_retry_at = {}, last_error = {} WHERE status = 0 AND id = {}",
                    (d.later)($crate::backend::retry_delay_us(*at)),
                    d.ph,
                    id
                ))
                .bind::<diesel::sql_types::Text, _>($crate::backend::truncate(error))
                .execute(self)?;
            }
            for (id, error) in &outcome.dead {
                diesel::sql_query(format!(
                    "UPDATE outbox SET retries = retries + 1, status = 2, last_error = {} WHERE status = 0 AND id = {}",
                    d.ph, id
                ))
                .bind::<diesel::sql_types::Text, _>($crate::backend::truncate(error))
                .execute(self)?;
            }
            Ok(())
        }

        fn __backlog(&mut self) -> $crate::Result<outbox_core::Backlog> {
            use diesel::RunQueryDsl as _;
            let d: &$crate::backend::Dialect = &$d;
            Ok(diesel::sql_query(d.backlog)
                .get_result::<$crate::backend::BacklogRow>(self)?
                .into_backlog())
        }

        fn __list(
            &mut self,
            status: Option<outbox_core::Status>,
            after_id: i64,
            limit: usize,
        ) -> $crate::Result<Vec<$crate::OutboxRecord>> {
            use diesel::RunQueryDsl as _;
            let d: &$crate::backend::Dialect = &$d;
            let filter = status.map_or(String::new(), |s| format!("status = {} AND ", s.as_i16()));
            diesel::sql_query(format!(
                "SELECT {} FROM outbox WHERE {filter}id > {after_id} ORDER BY id LIMIT {limit}",
                d.columns
            ))
            .load::<$crate::backend::RecordRow>(self)?
            .into_iter()
            .map($crate::backend::RecordRow::into_record)
            .collect()
        }

        fn __find(&mut self, msg_id: &str) -> $crate::Result<Option<$crate::OutboxRecord>> {
            use diesel::{OptionalExtension as _, RunQueryDsl as _};
            let d: &$crate::backend::Dialect = &$d;
            diesel::sql_query(format!("SELECT {} FROM outbox WHERE msg_id = {}", d.columns, d.ph))
                .bind::<diesel::sql_types::Text, _>(msg_id)
                .get_result::<$crate::backend::RecordRow>(self)
                .optional()?
                .map($crate::backend::RecordRow::into_record)
                .transpose()
        }

        fn __redrive(&mut self, ids: Option<&[i64]>) -> $crate::Result<usize> {
            use diesel::RunQueryDsl as _;
            let d: &$crate::backend::Dialect = &$d;
            let only = match ids {
                Some([]) => return Ok(0),
                Some(ids) => format!(" AND id IN ({})", $crate::backend::in_list(ids)),
                None => String::new(),
            };
            Ok(diesel::sql_query(format!(
                "UPDATE outbox SET status = 0, retries = 0, next_retry_at = {}, last_error = NULL WHERE status = 2{only}",
                d.now
            ))
            .execute(self)?)
        }

        fn __purge_dead(&mut self, ids: &[i64]) -> $crate::Result<usize> {
            use diesel::RunQueryDsl as _;
            if ids.is_empty() {
                return Ok(0);
            }
            Ok(diesel::sql_query(format!(
                "DELETE FROM outbox WHERE status = 2 AND id IN ({})",
                $crate::backend::in_list(ids)
            ))
            .execute(self)?)
        }

        fn __purge_sent(&mut self, older_than_us: i64, batch: usize) -> $crate::Result<usize> {
            use diesel::RunQueryDsl as _;
            let d: &$crate::backend::Dialect = &$d;
            let filter = format!("status = 1 AND sent_at < {}", (d.ago)(older_than_us));
            // Oldest first, through the `outbox_sent` index.
            Ok(diesel::sql_query((d.delete_limited)("outbox", &filter, "sent_at", batch)).execute(self)?)
        }

        fn __purge_consumed(&mut self, older_than_us: i64, batch: usize) -> $crate::Result<usize> {
            use diesel::RunQueryDsl as _;
            let d: &$crate::backend::Dialect = &$d;
            let filter = format!("consumed_at < {}", (d.ago)(older_than_us));
            Ok(diesel::sql_query((d.delete_limited)("consumed_msg", &filter, "consumed_at", batch))
                .execute(self)?)
        }

        fn __migration_version(&mut self) -> $crate::Result<Option<i32>> {
            use diesel::{Connection as _, RunQueryDsl as _};
            // In a transaction (a savepoint inside the caller's): on PostgreSQL a failed
            // statement would otherwise abort a transaction the caller has open.
            let probe = self.transaction(|c| {
                diesel::sql_query("SELECT MAX(version) AS version FROM outbox_migrations")
                    .get_result::<$crate::backend::VersionRow>(c)
            });
            match probe {
                Ok(row) => Ok(row.version),
                Err(e) if $crate::backend::is_missing_table(&e, "outbox_migrations") => Ok(None),
                Err(e) => Err(e.into()),
            }
        }
    };
}
pub(crate) use common_methods;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_bound_rows_and_bytes() {
        let big = "x".repeat(3 << 20);
        let row = |payload: &'static str| Row {
            msg_id: "a:B",
            topic: "t",
            event_type: "B",
            key: "a",
            schema_version: 1,
            payload,
            headers: Cow::Borrowed("{}"),
        };
        let small: Vec<Row<'_>> = (0..2500).map(|_| row("{}")).collect();
        let sizes: Vec<usize> = chunks(&small).map(<[_]>::len).collect();
        assert_eq!(sizes, [1000, 1000, 500]);
        let big: &'static str = Box::leak(big.into_boxed_str());
        let large = vec![row(big), row(big), row("{}")];
        let sizes: Vec<usize> = chunks(&large).map(<[_]>::len).collect();
        assert_eq!(sizes, [1, 2]);
    }

    #[test]
    fn last_error_is_cut_on_a_char_boundary() {
        let long = "é".repeat(LAST_ERROR_LEN + 10);
        assert_eq!(truncate(&long).chars().count(), LAST_ERROR_LEN);
        assert_eq!(truncate("short"), "short");
    }
}
