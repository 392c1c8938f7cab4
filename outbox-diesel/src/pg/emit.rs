//! Emit: the outbox rows inserted, in the NOTIFY modes, duplicates refused.

use std::collections::HashSet;
use std::marker::PhantomData;

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId, SqlQuery};
use diesel::result::QueryResult;
use diesel::sql_types::{BigInt, Integer, Nullable, Text};
use diesel::{PgConnection, RunQueryDsl};
use outbox_core::{Envelope, MsgId};

use crate::backend::{Row, chunks, in_list};
use crate::{EmitOptions, Notify, Result};

pub(super) const INSERT_HEAD: &str = "INSERT INTO outbox \
    (msg_id, topic, event_type, msg_key, schema_version, payload, headers) VALUES ";

/// The hot path: one row. A plain `INSERT .. ON CONFLICT DO NOTHING`, prepared
/// once per connection and mode (static query id). `ON CONFLICT` turns a duplicate into
/// "0 rows" instead of an error, which on PostgreSQL would abort the caller's
/// transaction. With NOTIFY, the [wake-up expression](Mode::push_wake) (an empty text)
/// is prepended to the headers in the `VALUES` list: one plain statement, without the CTE
/// of [`Insert`] and without a `RETURNING` list (a result row per execution), each of
/// which costs an emitting transaction more CPU than the expression in `VALUES`
/// (BENCHMARKS.md, "The emit's statement"). The price: the
/// expression runs before the conflict check, so a duplicate may wake a parked relay
/// too (it finds nothing new and parks again).
pub(super) struct PlainInsert<'a, M> {
    pub(super) row: &'a Row<'a>,
    pub(super) wake: Wake<'a>,
    pub(super) mode: PhantomData<M>,
}

impl<M: Mode> QueryId for PlainInsert<'_, M> {
    type QueryId = PlainInsert<'static, M>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<M: Mode> QueryFragment<Pg> for PlainInsert<'_, M> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(INSERT_HEAD);
        out.push_sql("(");
        crate::backend::push_before_headers(self.row, &mut out, "::jsonb")?;
        if M::NOTIFIES {
            out.push_sql("(");
            M::push_wake(&mut out, &self.wake)?;
            out.push_sql(" || ");
        }
        out.push_bind_param::<Text, str>(&self.row.headers)?;
        out.push_sql(if M::NOTIFIES { ")::jsonb)" } else { "::jsonb)" });
        out.push_sql(" ON CONFLICT DO NOTHING");
        Ok(())
    }
}

impl<Conn, M> RunQueryDsl<Conn> for PlainInsert<'_, M> {}

/// Inserts one row with `notify`; whether it was new.
pub(super) fn insert_one(
    conn: &mut PgConnection,
    notify: Notify,
    row: &Row<'_>,
    channel: &str,
) -> QueryResult<bool> {
    fn q<M: Mode>(conn: &mut PgConnection, row: &Row<'_>, channel: &str) -> QueryResult<bool> {
        let insert = PlainInsert::<M> {
            row,
            wake: Wake::new(channel),
            mode: PhantomData,
        };
        Ok(insert.execute(conn)? == 1)
    }
    match notify {
        Notify::Never => q::<NoNotify>(conn, row, channel),
        Notify::Always => q::<Always>(conn, row, channel),
        Notify::WhenRelayIdle => q::<WhenIdle>(conn, row, channel),
    }
}

/// NOTIFY variants, as types so that each SQL text has its own static query id.
pub(super) trait Mode: Send + Sync + 'static {
    /// Whether the statement has a wake-up expression (`Never` has none).
    const NOTIFIES: bool;
    /// The wake-up expression: an empty text whose evaluation sends the NOTIFY (or not).
    fn push_wake<'b>(out: &mut AstPass<'_, 'b, Pg>, wake: &'b Wake<'b>) -> QueryResult<()>;
}
pub(super) struct NoNotify;
pub(super) struct Always;
pub(super) struct WhenIdle;
impl Mode for NoNotify {
    const NOTIFIES: bool = false;
    fn push_wake<'b>(out: &mut AstPass<'_, 'b, Pg>, _: &'b Wake<'b>) -> QueryResult<()> {
        out.push_sql("''::text");
        Ok(())
    }
}
impl Mode for Always {
    const NOTIFIES: bool = true;
    fn push_wake<'b>(out: &mut AstPass<'_, 'b, Pg>, wake: &'b Wake<'b>) -> QueryResult<()> {
        out.push_sql("pg_notify(");
        out.push_bind_param::<Text, str>(wake.channel)?;
        out.push_sql(", '')::text");
        Ok(())
    }
}
/// A shared try of the channel's [wake-up lock](crate::wake_lock_key): it fails only while a relay
/// holds the lock exclusively (it is parked) or waits for it (it is about to park), and
/// then the emit notifies. A lock-manager call, no table: an `EXISTS` on a table of
/// parked relays would set up a scan per statement (relation lock, `heap_beginscan`, an
/// `lseek` for the size; BENCHMARKS.md, "The emit's statement"). Held to the end of the emitting transaction, so that a relay about to
/// park waits for the transactions that emitted without a NOTIFY before it looks for
/// due rows (see `pg::listen`).
impl Mode for WhenIdle {
    const NOTIFIES: bool = true;
    fn push_wake<'b>(out: &mut AstPass<'_, 'b, Pg>, wake: &'b Wake<'b>) -> QueryResult<()> {
        out.push_sql("CASE WHEN pg_try_advisory_xact_lock_shared(");
        out.push_bind_param::<Integer, i32>(&wake.lock.0)?;
        out.push_sql(", ");
        out.push_bind_param::<Integer, i32>(&wake.lock.1)?;
        out.push_sql(") THEN '' ELSE pg_notify(");
        out.push_bind_param::<Text, str>(wake.channel)?;
        out.push_sql(", '')::text END");
        Ok(())
    }
}

/// The NOTIFY channel of an emit, and its wake-up lock.
pub(super) struct Wake<'a> {
    pub(super) channel: &'a str,
    pub(super) lock: (i32, i32),
}

impl<'a> Wake<'a> {
    pub(super) fn new(channel: &'a str) -> Self {
        Self {
            channel,
            lock: crate::wake_lock_key(channel),
        }
    }
}

/// `WITH ins AS (INSERT .. ON CONFLICT DO NOTHING RETURNING id, msg_id) SELECT id, msg_id,
/// <wake> FROM ins`: one statement that also reports which rows were inserted. The
/// wake-up expression is evaluated only for inserted rows, so a duplicate notifies
/// nobody; repeated notifications in one transaction are folded into one by PostgreSQL.
/// For `emit_all` (one row goes through [`PlainInsert`]).
pub(super) struct Insert<'a, M> {
    pub(super) rows: &'a [Row<'a>],
    pub(super) wake: Wake<'a>,
    pub(super) mode: PhantomData<M>,
}

impl<M: Mode> QueryId for Insert<'_, M> {
    type QueryId = Insert<'static, M>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<M: Mode> Query for Insert<'_, M> {
    type SqlType = (BigInt, Text, Nullable<Text>);
}

impl<M: Mode> QueryFragment<Pg> for Insert<'_, M> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        if self.rows.len() != 1 {
            // The text depends on the row count: never cache it.
            out.unsafe_to_cache_prepared();
        }
        out.push_sql("WITH ins AS (");
        out.push_sql(INSERT_HEAD);
        crate::backend::push_values(self.rows, &mut out, "::jsonb", "")?;
        out.push_sql(" ON CONFLICT DO NOTHING RETURNING id, msg_id) SELECT id, msg_id, ");
        M::push_wake(&mut out, &self.wake)?;
        out.push_sql(" AS notified FROM ins");
        Ok(())
    }
}

impl<Conn, M> RunQueryDsl<Conn> for Insert<'_, M> {}

pub(super) type Inserted = (i64, String, Option<String>);

pub(super) fn load_chunk(
    conn: &mut PgConnection,
    notify: Notify,
    rows: &[Row<'_>],
    channel: &str,
) -> QueryResult<Vec<Inserted>> {
    fn q<M: Mode>(
        conn: &mut PgConnection,
        rows: &[Row<'_>],
        channel: &str,
    ) -> QueryResult<Vec<Inserted>> {
        Insert::<M> {
            rows,
            wake: Wake::new(channel),
            mode: PhantomData,
        }
        .load(conn)
    }
    match notify {
        Notify::Never => q::<NoNotify>(conn, rows, channel),
        Notify::Always => q::<Always>(conn, rows, channel),
        Notify::WhenRelayIdle => q::<WhenIdle>(conn, rows, channel),
    }
}

pub(super) fn insert(
    conn: &mut PgConnection,
    options: &EmitOptions,
    envelopes: &[Envelope],
) -> Result<()> {
    let rows = envelopes.iter().map(Row::new).collect::<Result<Vec<_>>>()?;
    if let [row] = rows.as_slice() {
        let new = insert_one(conn, options.notify, row, &options.channel)?;
        return one_inserted(new, row);
    }
    let mut inserted = Vec::new();
    for chunk in chunks(&rows) {
        let got = load_chunk(conn, options.notify, chunk, &options.channel)?;
        if let Some(dup) = note_chunk(&mut inserted, chunk, &got) {
            if let Some(take_back) = take_back(&inserted) {
                take_back.execute(conn)?;
            }
            return duplicate(dup);
        }
    }
    Ok(())
}

/// The outcome of [`PlainInsert`]: `new` is false when the row's msg_id was there.
pub(super) fn one_inserted(new: bool, row: &Row<'_>) -> Result<()> {
    if new { Ok(()) } else { duplicate(row.msg_id) }
}

/// The duplicate msg_id error.
pub(super) fn duplicate(msg_id: &str) -> Result<()> {
    Err(outbox_core::Error::Duplicate(MsgId::new(msg_id)?).into())
}

/// Adds the ids of a chunk's inserted rows (`got`) to `inserted`; the msg_id of a row
/// of `chunk` that `ON CONFLICT` skipped, if any.
pub(super) fn note_chunk<'a>(
    inserted: &mut Vec<i64>,
    chunk: &[Row<'a>],
    got: &[Inserted],
) -> Option<&'a str> {
    inserted.extend(got.iter().map(|r| r.0));
    if got.len() == chunk.len() {
        return None;
    }
    let got: HashSet<&str> = got.iter().map(|r| r.1.as_str()).collect();
    let dup = chunk
        .iter()
        .find(|r| !got.contains(r.msg_id))
        .map_or(chunk[0].msg_id, |r| r.msg_id);
    Some(dup)
}

/// All or nothing, without aborting the caller's transaction: the statement that takes
/// back the rows an `emit_all` did insert before its duplicate (none: nothing to do).
pub(super) fn take_back(inserted: &[i64]) -> Option<SqlQuery> {
    (!inserted.is_empty()).then(|| {
        diesel::sql_query(format!(
            "DELETE FROM outbox WHERE id IN ({})",
            in_list(inserted)
        ))
    })
}
