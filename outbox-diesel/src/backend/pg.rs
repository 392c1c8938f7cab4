use std::collections::HashSet;
use std::marker::PhantomData;
use std::time::Duration;

use diesel::connection::{AnsiTransactionManager, SimpleConnection as _};
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId, SqlQuery};
use diesel::result::QueryResult;
use diesel::sql_types::{Array, BigInt, Integer, Nullable, Text};
use diesel::{IntoSql as _, PgConnection, RunQueryDsl};
use outbox_core::{Envelope, MsgId, StoredMessage};

use super::{Backend, BacklogRow, ClaimRow, RecordRow, VersionRow};
use super::{Dialect, Row, chunks, in_list};
use crate::{EmitOptions, Notify, Result};

/// Unix microseconds of a timestamp column, NULL where chrono cannot hold it (PostgreSQL
/// takes `infinity` and years up to 294276): such a row is listed as unreadable instead of
/// failing the whole statement on the cast.
macro_rules! us {
    ($col:literal) => {
        concat!(
            "CASE WHEN isfinite(",
            $col,
            ") AND ",
            $col,
            " < '262000-01-01' THEN (extract(epoch FROM ",
            $col,
            ") * 1000000)::bigint END"
        )
    };
}

pub(super) const DIALECT: Dialect = Dialect {
    columns: concat!(
        "id, msg_id, topic, event_type, msg_key, schema_version, \
         payload::text AS payload, headers::text AS headers, status, retries, ",
        us!("next_retry_at"),
        " AS next_retry_us, ",
        us!("created_at"),
        " AS created_us, ",
        us!("sent_at"),
        " AS sent_us, last_error"
    ),
    now: "now()",
    ph: "$1",
    lock: " FOR UPDATE SKIP LOCKED",
    backlog: "SELECT \
        (SELECT count(*) FROM outbox WHERE status = 0 AND next_retry_at <= now()) AS due, \
        (SELECT (extract(epoch FROM now() - min(created_at)) * 1000000)::bigint \
           FROM outbox WHERE status = 0 AND next_retry_at <= now()) AS oldest_us, \
        (SELECT count(*) FROM outbox WHERE status = 2) AS dead",
    // The statement's start, not the transaction's: the claim's transaction began
    // before the batch was published.
    later: |us| format!("(statement_timestamp() + interval '{us} microseconds')"),
    ago: |us| format!("(now() - interval '{us} microseconds')"),
    delete_limited: |table, filter, order, n| {
        format!(
            "DELETE FROM {table} WHERE ctid = ANY(ARRAY(\
             SELECT ctid FROM {table} WHERE {filter} ORDER BY {order} LIMIT {n}))"
        )
    },
    // The claim commits without waiting for its flush (`COMMIT_SETTINGS`), but a
    // DEAD mark frees its key: it must be on disk before a later message of the key
    // can be published, or a crash could bring the dead message back behind it.
    // (`on` where the server is set to `remote_apply` still waits for the synchronous
    // standbys' flush, which is what a failover needs.)
    durable_dead: Some("SET LOCAL synchronous_commit = on"),
};

/// The claim's `BEGIN`, in one round trip: READ COMMITTED whatever the database's
/// default (under REPEATABLE READ, locking a row that another relay has marked SENT
/// since the claim's snapshot is a serialization failure, not a skip), a commit that
/// does not wait for its WAL flush ([`COMMIT_SETTINGS`]), planner settings that keep
/// the claim's plan off the table's statistics ([`PLAN_SETTINGS`]), and, unless `stall`
/// is zero, bounds for a relay that stalls while it holds the batch (see
/// `PgRelayStore`). All `SET LOCAL`, so they end with the transaction.
fn begin_claim_sql(stall: Duration) -> String {
    const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";
    if stall.is_zero() {
        return format!("{BEGIN}; {COMMIT_SETTINGS}; {PLAN_SETTINGS}");
    }
    // Milliseconds, at least 1 (0 would disable the timeouts), at most PostgreSQL's limit.
    let ms = stall.as_millis().clamp(1, i32::MAX as u128);
    format!(
        "{BEGIN}; {COMMIT_SETTINGS}; {PLAN_SETTINGS}; \
         SET LOCAL idle_in_transaction_session_timeout = {ms}; SET LOCAL lock_timeout = {ms}"
    )
}

/// The claim's commit setting, for its transaction only: `synchronous_commit = off`.
///
/// A claim's transaction only records what the relay did with rows that are already
/// durable (SENT, a retry): it writes no message. Should the server crash, or fail over
/// to a standby, before such a commit reached the disk or the standby, the rows are
/// back as they were: a row SENT is published once more (a duplicate on the stream,
/// which the consumers' deduplication absorbs, as after a relay killed between its XADD
/// and its commit); a retry comes early and counts one attempt fewer. WAL is replayed
/// (and streamed) in order, so a later batch's marks never survive an earlier one's.
/// Marking a row DEAD is the exception: it frees the row's key for the next message, so
/// a batch with dead letters commits durably ([`DIALECT`]'s `durable_dead`). What it
/// saves is the flush on the relay's path: on a disk whose flush takes 3 ms, a relay
/// woken at 1,000 messages/s spent most of its time waiting for its previous batch's
/// commit (commit → XADD p50 3.8 ms, measured). Emits and the consumers' deduplication
/// are the users' own transactions, untouched: their commits stay as durable as the
/// server is set up to make them.
pub(crate) const COMMIT_SETTINGS: &str = "SET LOCAL synchronous_commit = off";

/// The claim's planner settings, for its transaction only.
///
/// A claim is a walk of `outbox_pending` in id order that stops after `LIMIT` rows. The
/// planner picks that walk only while it knows the backlog is large: on a table without
/// statistics (never analyzed: autovacuum off, or a fresh table in its first minute) it
/// guesses a few hundred NEW rows and reads them all with a bitmap scan, then sorts them
/// (measured at 150,000 NEW rows: 267 ms per 500-row per-key claim, 194 ms unordered,
/// against 4.6 ms once analyzed). No claim needs a sort: every ordered step is an index
/// walk (`l` and the unordered claim on `outbox_pending`, `r` on `outbox_retrying`) and
/// the relay orders the final rows itself. So `enable_sort = off` leaves the planner
/// only the walks, whatever it believes about the row counts; the settings that would
/// name the walk instead (`enable_bitmapscan`, `enable_hashjoin`) leave a sort after a
/// hash anti join over `r`.
///
/// `enable_nestloop = off`: the one join left, the per-key claim's last step (a row of
/// `l` against the keys of `b`), is then a hash anti join. On statistics that promised
/// few rows it was a nested loop comparing every row of `l` with every row of `b`
/// (250,000 comparisons, 22 ms of a 41 ms claim at 500 rows).
///
/// `enable_seqscan = off`: the statements that record the batch (SENT by
/// `id = ANY(..)`, a retry, DEAD) find their rows by primary key. `MarkSent` is a
/// prepared statement, whose generic plan PostgreSQL keeps until the table's statistics
/// change: planned while the table was empty (a fresh table, before autovacuum's first
/// analyze), it was a sequential scan, and stayed one as the table grew (measured at
/// 1,000 messages/s on a new table: 2,479 scans reading 3.9 million rows in 8 s, the
/// primary key never used, commit → XADD p50 about 3 ms). The mark of a batch sent in
/// full ([`mark_sent_and_commit_sql`]) is planned for each batch, on whatever the
/// statistics say then: an empty table's as well.
///
/// `jit = off`: a claim is a short walk, which JIT compilation (tens to hundreds of ms)
/// never pays back; and should a sort ever be unavoidable, its disabled cost (10^10)
/// would pass `jit_above_cost` and compile the plan (+389 ms measured).
pub(crate) const PLAN_SETTINGS: &str = "SET LOCAL enable_sort = off; SET LOCAL jit = off; \
     SET LOCAL enable_nestloop = off; SET LOCAL enable_seqscan = off";

/// The per-key claim (ARCHITECTURE.md, "Order per key") in one statement, with walks instead of a
/// probe per row:
///
/// - `r`: the keys whose NEW rows wait for a retry, with the first waiting id of each,
///   from the small `outbox_retrying` index (NEW rows that failed before). The lock step
///   skips a key's rows after its waiting one, so that they do not crowd other keys out
///   of the LIMIT (progress only: the next step decides order);
/// - `l`: the due NEW rows in id order, `LIMIT n FOR UPDATE SKIP LOCKED`; while any key
///   waits (`r` is not empty, looked at once per claim), each candidate is probed on
///   `outbox_retrying` for a waiting row of its key before it. (An anti join over `r`
///   became a nested loop comparing every candidate with every row of `r`: 241 ms per
///   claim with 500 keys waiting for a retry, as after a Redis outage, against 8–12 ms
///   now; a hashed `NOT IN (SELECT msg_key FROM r)` in front of the probe fell back to
///   re-reading `r` per candidate when the statistics promised a large `r`. 1.1 ms
///   either way with none waiting.)
/// - `b`: the NEW rows below `l`'s last id that `l` does not hold (held by another relay,
///   or waiting for a retry), with the first id of each key: one walk of the range the
///   lock step walked, on `outbox_pending`;
/// - a row of `l` goes out only if no row of `b` with its key comes before it.
///
/// This replaced two index probes per row (a head probe per candidate, a gap probe per
/// key): measured on 100,000 NEW rows over 1,000 keys, 500 rows per claim, 2.7 ms
/// instead of 6.5 ms, the unordered claim taking 1.7 ms.
///
/// The plan must not depend on the table's statistics (see [`PLAN_SETTINGS`], under
/// which the claim runs): `r` is a `DISTINCT ON` in `(msg_key, id)` order, which only an
/// index on `(msg_key, id)` gives without a sort, and `outbox_retrying` is the smallest
/// one and needs no filter on `retries`. (As `GROUP BY msg_key`, on statistics taken
/// while every row was SENT, the planner walked the whole backlog on `outbox_pending`
/// instead: 46-58 ms per claim at 150,000 NEW rows.) The statement has no final
/// `ORDER BY`: the relay sorts the kept rows by id ([`claim_per_key`]), which leaves no
/// sort in the plan.
///
/// A claim ahead leaves the rows of the batch in hand (`held`) out of `b` too: the
/// relay publishes them first. (A constant list: PostgreSQL hashes it.)
fn per_key_claim_sql(limit: usize, held: &[i64]) -> String {
    let not_held = if held.is_empty() {
        String::new()
    } else {
        format!(" AND p.id NOT IN ({})", super::in_list(held))
    };
    format!(
        "WITH r AS MATERIALIZED (SELECT DISTINCT ON (w.msg_key) w.msg_key, w.id AS first_wait \
           FROM outbox w WHERE w.status = 0 AND w.retries > 0 AND w.next_retry_at > now() \
           ORDER BY w.msg_key, w.id), \
         l AS MATERIALIZED (SELECT {columns} FROM outbox o \
           WHERE status = 0 AND next_retry_at <= now() \
           AND (NOT EXISTS (SELECT FROM r) OR NOT EXISTS (SELECT 1 FROM outbox w \
             WHERE w.status = 0 AND w.retries > 0 AND w.msg_key = o.msg_key AND w.id < o.id \
             AND w.next_retry_at > now() OFFSET 0)) \
           ORDER BY id LIMIT {limit} FOR UPDATE SKIP LOCKED), \
         b AS MATERIALIZED (SELECT p.msg_key, min(p.id) AS first_out FROM outbox p \
           WHERE p.status = 0 AND p.id < (SELECT max(id) FROM l) \
           AND p.id NOT IN (SELECT id FROM l){not_held} GROUP BY p.msg_key) \
         SELECT l.* FROM l WHERE NOT EXISTS \
           (SELECT 1 FROM b WHERE b.msg_key = l.msg_key AND b.first_out < l.id)",
        columns = ClaimRow::COLUMNS,
    )
}

/// Runs [`per_key_claim_sql`] and puts the kept rows in id order.
fn claim_per_key(
    conn: &mut PgConnection,
    limit: usize,
    held: &[i64],
) -> Result<Vec<StoredMessage>> {
    let mut rows: Vec<ClaimRow> = diesel::sql_query(per_key_claim_sql(limit, held)).load(conn)?;
    rows.sort_unstable_by_key(ClaimRow::id);
    super::claimed(conn, rows)
}

/// The unordered claim: due NEW rows in id order, `LIMIT n FOR UPDATE SKIP LOCKED`, as
/// [`ClaimRow`]s (the relay's columns only, `created_at` as PostgreSQL's binary
/// timestamp).
///
/// `held`: a claim ahead leaves the rows of the batch in hand out by id (`o.id <>
/// ALL($1)`, the ids bound as one array, which the planner hashes) before it tries their
/// locks. They are locked by that batch's transaction, so `SKIP LOCKED` would skip them
/// anyway, but only after a heap fetch and two lock-manager calls each (the tuple lock,
/// then the holder's transaction lock): the claim ahead walks past all of them, since
/// the batch in hand is the front of the backlog. The filter leaves out exactly those
/// rows and no other, so a row below them that is due (a retry) is claimed as before.
fn claim_sql(limit: usize, held: bool) -> String {
    format!(
        "SELECT {} FROM outbox o WHERE o.status = 0 AND o.next_retry_at <= now(){} \
         ORDER BY o.id LIMIT {limit} FOR UPDATE SKIP LOCKED",
        ClaimRow::COLUMNS,
        if held { " AND o.id <> ALL($1)" } else { "" },
    )
}

/// Runs [`claim_sql`].
fn claim(conn: &mut PgConnection, limit: usize, held: &[i64]) -> Result<Vec<StoredMessage>> {
    let query = diesel::sql_query(claim_sql(limit, !held.is_empty()));
    let rows: Vec<ClaimRow> = if held.is_empty() {
        query.load(conn)?
    } else {
        query.bind::<Array<BigInt>, _>(held).load(conn)?
    };
    super::claimed(conn, rows)
}

/// `UPDATE outbox SET status = 1, sent_at = now() WHERE status = 0 AND id = ANY($1)`:
/// a batch's rows marked SENT, the ids bound as one array, so that the text is the same
/// for every batch and the statement is prepared once per connection (static query id).
/// Against an `IN (..)` list of 500 literals the server neither parses nor plans the
/// list for each batch. Now only for a batch that also records retries or dead letters:
/// one sent in full, the usual batch, goes with its COMMIT in one string
/// ([`mark_sent_and_commit_sql`]), parsed and planned each time.
struct MarkSent<'a> {
    ids: &'a [i64],
}

impl QueryId for MarkSent<'_> {
    type QueryId = MarkSent<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

/// The SENT mark up to its array of ids, for [`MarkSent`] and
/// [`mark_sent_and_commit_sql`].
const MARK_SENT_HEAD: &str =
    "UPDATE outbox SET status = 1, sent_at = now() WHERE status = 0 AND id = ANY(";

impl QueryFragment<Pg> for MarkSent<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(MARK_SENT_HEAD);
        out.push_bind_param::<Array<BigInt>, [i64]>(self.ids)?;
        out.push_sql(")");
        Ok(())
    }
}

impl<Conn> RunQueryDsl<Conn> for MarkSent<'_> {}

const INSERT_HEAD: &str = "INSERT INTO outbox \
    (msg_id, topic, event_type, msg_key, schema_version, payload, headers) VALUES ";

/// The hot path: one row. A plain `INSERT .. ON CONFLICT DO NOTHING`, prepared
/// once per connection and mode (static query id). `ON CONFLICT` turns a duplicate into
/// "0 rows" instead of an error, which on PostgreSQL would abort the caller's
/// transaction. With NOTIFY, the [wake-up expression](Mode::push_wake) (an empty text)
/// is prepended to the headers in the `VALUES` list: one plain statement, without the CTE
/// of [`Insert`] (at 8 connections on 2 cores the CTE cost the default `WhenRelayIdle`
/// about 10% of its throughput) and without a `RETURNING` list (a result row per
/// execution: about 8% more CPU per emitting transaction than none at 8 connections, in
/// interleaved pgbench runs; the same check in the `VALUES` list: 0–3.5%). The price: the
/// expression runs before the conflict check, so a duplicate may wake a parked relay
/// too (it finds nothing new and parks again).
struct PlainInsert<'a, M> {
    row: &'a Row<'a>,
    wake: Wake<'a>,
    mode: PhantomData<M>,
}

impl<M: Mode> QueryId for PlainInsert<'_, M> {
    type QueryId = PlainInsert<'static, M>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<M: Mode> QueryFragment<Pg> for PlainInsert<'_, M> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(INSERT_HEAD);
        out.push_sql("(");
        super::push_before_headers(self.row, &mut out, "::jsonb")?;
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
fn insert_one(
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
trait Mode: Send + Sync + 'static {
    /// Whether the statement has a wake-up expression (`Never` has none).
    const NOTIFIES: bool;
    /// The wake-up expression: an empty text whose evaluation sends the NOTIFY (or not).
    fn push_wake<'b>(out: &mut AstPass<'_, 'b, Pg>, wake: &'b Wake<'b>) -> QueryResult<()>;
}
struct NoNotify;
struct Always;
struct WhenIdle;
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
/// then the emit notifies. A lock-manager call, no table: the `EXISTS` on
/// `outbox_relay_idle` it replaced set up a scan per statement (relation lock,
/// `heap_beginscan`, an `lseek` for the size), about 3 % of the server at 8 emitting
/// connections. Held to the end of the emitting transaction, so that a relay about to
/// park waits for the transactions that emitted without a NOTIFY before it looks for
/// due rows (see `store::pg::listen`).
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
struct Wake<'a> {
    channel: &'a str,
    lock: (i32, i32),
}

impl<'a> Wake<'a> {
    fn new(channel: &'a str) -> Self {
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
struct Insert<'a, M> {
    rows: &'a [Row<'a>],
    wake: Wake<'a>,
    mode: PhantomData<M>,
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
        super::push_values(self.rows, &mut out, "::jsonb", "")?;
        out.push_sql(" ON CONFLICT DO NOTHING RETURNING id, msg_id) SELECT id, msg_id, ");
        M::push_wake(&mut out, &self.wake)?;
        out.push_sql(" AS notified FROM ins");
        Ok(())
    }
}

impl<Conn, M> RunQueryDsl<Conn> for Insert<'_, M> {}

type Inserted = (i64, String, Option<String>);

fn load_chunk(
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

fn insert(conn: &mut PgConnection, options: &EmitOptions, envelopes: &[Envelope]) -> Result<()> {
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
fn one_inserted(new: bool, row: &Row<'_>) -> Result<()> {
    if new { Ok(()) } else { duplicate(row.msg_id) }
}

/// The duplicate msg_id error.
fn duplicate(msg_id: &str) -> Result<()> {
    Err(outbox_core::Error::Duplicate(MsgId::new(msg_id)?).into())
}

/// Adds the ids of a chunk's inserted rows (`got`) to `inserted`; the msg_id of a row
/// of `chunk` that `ON CONFLICT` skipped, if any.
fn note_chunk<'a>(inserted: &mut Vec<i64>, chunk: &[Row<'a>], got: &[Inserted]) -> Option<&'a str> {
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
fn take_back(inserted: &[i64]) -> Option<SqlQuery> {
    (!inserted.is_empty()).then(|| {
        diesel::sql_query(format!(
            "DELETE FROM outbox WHERE id IN ({})",
            in_list(inserted)
        ))
    })
}

/// Emit on diesel-async's PostgreSQL connections: the same statements as above
/// ([`PlainInsert`], [`Insert`] in their NOTIFY modes, the take-back), awaited.
#[cfg(feature = "async-postgres")]
mod nonblocking {
    use std::marker::PhantomData;

    use diesel::IntoSql as _;
    use diesel::connection::{TransactionDepthChange, TransactionManagerStatus};
    use diesel::pg::Pg;
    use diesel::result::QueryResult;
    use diesel::result::{DatabaseErrorKind, Error as DieselError};
    use diesel::sql_types::Integer;
    use diesel_async::pooled_connection::deadpool::{Object, Pool, PoolError};
    use diesel_async::{
        AsyncConnection, AsyncConnectionCore, AsyncPgConnection, RunQueryDsl as _,
        SimpleAsyncConnection as _, TransactionManager as _,
    };
    use outbox_core::Envelope;

    use super::{Always, Insert, Inserted, Mode, NoNotify, PlainInsert, Row, Wake, WhenIdle};
    use super::{chunks, duplicate, note_chunk, one_inserted, take_back};
    use crate::{EmitOptions, Notify, Result};

    impl crate::async_emit::AsyncInsert for Pg {
        async fn insert<C>(
            conn: &mut C,
            options: &EmitOptions,
            envelopes: &[Envelope],
        ) -> Result<()>
        where
            C: AsyncConnectionCore<Backend = Pg>,
        {
            let rows = envelopes.iter().map(Row::new).collect::<Result<Vec<_>>>()?;
            if let [row] = rows.as_slice() {
                let new = insert_one(conn, options.notify, row, &options.channel).await?;
                return one_inserted(new, row);
            }
            let mut inserted = Vec::new();
            for chunk in chunks(&rows) {
                let got = load_chunk(conn, options.notify, chunk, &options.channel).await?;
                if let Some(dup) = note_chunk(&mut inserted, chunk, &got) {
                    if let Some(take_back) = take_back(&inserted) {
                        take_back.execute(conn).await?;
                    }
                    return duplicate(dup);
                }
            }
            Ok(())
        }
    }

    /// The blocking inbox's statements on `AsyncPgConnection`: the same prepared dedup
    /// insert and committable check.
    impl crate::async_inbox::AsyncInboxConnection for diesel_async::AsyncPgConnection {
        type Pool = Pool<Self>;
        type Pooled = Object<Self>;

        async fn checkout(pool: &Pool<Self>) -> std::result::Result<Object<Self>, PoolError> {
            pool.get().await
        }

        fn max_size(pool: &Pool<Self>) -> usize {
            pool.status().max_size
        }

        fn discard(pooled: Object<Self>) {
            drop(Object::take(pooled));
        }

        async fn insert_consumed(&mut self, group: &str, msg_id: &str) -> Result<bool> {
            Ok(super::ConsumedInsert { group, msg_id }
                .execute(self)
                .await?
                == 1)
        }

        async fn commit_checked(&mut self) -> Result<Result<()>> {
            // The blocking inbox's single round trip: in a simple-query string the
            // statements after a failed one do not run, so an aborted transaction fails
            // the `SELECT 1` and stays open, while a healthy one commits.
            let Err(e) = self.batch_execute("SELECT 1; COMMIT").await else {
                left_transaction(self)?;
                return Ok(Ok(()));
            };
            // diesel-async does not follow the server's transaction status, so ask it: any
            // statement fails in an aborted transaction (the `COMMIT` did not run); one
            // that succeeds means the `COMMIT` itself failed and ended the transaction.
            match diesel::select(1i32.into_sql::<Integer>())
                .execute(self)
                .await
            {
                Err(DieselError::DatabaseError(kind, _))
                    if kind != DatabaseErrorKind::ClosedConnection =>
                {
                    Ok(Err(e.into()))
                }
                Ok(_) => {
                    left_transaction(self)?;
                    Err(e.into())
                }
                Err(_) => Err(e.into()),
            }
        }

        async fn transaction_open(&mut self) -> Result<bool> {
            // PostgreSQL keeps an aborted transaction open: `check_committable` sees it.
            Ok(true)
        }
    }

    /// Tells diesel-async's transaction manager that the transaction it began is over
    /// (committed or ended by the server), as its own `commit_transaction` does.
    fn left_transaction(c: &mut AsyncPgConnection) -> Result<()> {
        match Tm::transaction_manager_status_mut(c) {
            TransactionManagerStatus::Valid(status) => {
                status.change_transaction_depth(TransactionDepthChange::DecreaseDepth)?;
                Ok(())
            }
            TransactionManagerStatus::InError => Err(DieselError::BrokenTransactionManager.into()),
        }
    }

    type Tm = <AsyncPgConnection as AsyncConnection>::TransactionManager;

    /// [`super::insert_one`], awaited.
    async fn insert_one<C: AsyncConnectionCore<Backend = Pg>>(
        conn: &mut C,
        notify: Notify,
        row: &Row<'_>,
        channel: &str,
    ) -> QueryResult<bool> {
        async fn q<M: Mode, C: AsyncConnectionCore<Backend = Pg>>(
            conn: &mut C,
            row: &Row<'_>,
            channel: &str,
        ) -> QueryResult<bool> {
            let insert = PlainInsert::<M> {
                row,
                wake: Wake::new(channel),
                mode: PhantomData,
            };
            Ok(insert.execute(conn).await? == 1)
        }
        match notify {
            Notify::Never => q::<NoNotify, C>(conn, row, channel).await,
            Notify::Always => q::<Always, C>(conn, row, channel).await,
            Notify::WhenRelayIdle => q::<WhenIdle, C>(conn, row, channel).await,
        }
    }

    /// [`super::load_chunk`], awaited.
    async fn load_chunk<C: AsyncConnectionCore<Backend = Pg>>(
        conn: &mut C,
        notify: Notify,
        rows: &[Row<'_>],
        channel: &str,
    ) -> QueryResult<Vec<Inserted>> {
        async fn q<M: Mode, C: AsyncConnectionCore<Backend = Pg>>(
            conn: &mut C,
            rows: &[Row<'_>],
            channel: &str,
        ) -> QueryResult<Vec<Inserted>> {
            Insert::<M> {
                rows,
                wake: Wake::new(channel),
                mode: PhantomData,
            }
            .load(conn)
            .await
        }
        match notify {
            Notify::Never => q::<NoNotify, C>(conn, rows, channel).await,
            Notify::Always => q::<Always, C>(conn, rows, channel).await,
            Notify::WhenRelayIdle => q::<WhenIdle, C>(conn, rows, channel).await,
        }
    }
}

/// `INSERT INTO consumed_msg .. ON CONFLICT DO NOTHING`, prepared once per connection.
struct ConsumedInsert<'a> {
    group: &'a str,
    msg_id: &'a str,
}

impl QueryId for ConsumedInsert<'_> {
    type QueryId = ConsumedInsert<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl QueryFragment<Pg> for ConsumedInsert<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("INSERT INTO consumed_msg (consumer_group, msg_id) VALUES (");
        out.push_bind_param::<Text, str>(self.group)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, str>(self.msg_id)?;
        out.push_sql(") ON CONFLICT DO NOTHING");
        Ok(())
    }
}

impl<Conn> RunQueryDsl<Conn> for ConsumedInsert<'_> {}

/// The dedup rows of a whole batch in one statement, prepared once per connection (the
/// ids travel as one array, so the text is the same for every batch size):
/// `INSERT .. SELECT $1, unnest($2) ON CONFLICT DO NOTHING RETURNING msg_id`, the new
/// ones. The caller passes the ids sorted: two consumers inserting overlapping batches
/// then take the rows' locks in the same order and cannot deadlock on them.
struct ConsumedInsertBatch<'a> {
    group: &'a str,
    msg_ids: &'a [&'a str],
}

impl QueryId for ConsumedInsertBatch<'_> {
    type QueryId = ConsumedInsertBatch<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl Query for ConsumedInsertBatch<'_> {
    type SqlType = Text;
}

impl QueryFragment<Pg> for ConsumedInsertBatch<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("INSERT INTO consumed_msg (consumer_group, msg_id) SELECT ");
        out.push_bind_param::<Text, str>(self.group)?;
        out.push_sql(", m FROM unnest(");
        out.push_bind_param::<Array<Text>, [&str]>(self.msg_ids)?;
        out.push_sql(") AS m ON CONFLICT DO NOTHING RETURNING msg_id");
        Ok(())
    }
}

impl<Conn> RunQueryDsl<Conn> for ConsumedInsertBatch<'_> {}

/// `DELETE FROM consumed_msg ..` of one dedup row, prepared once per connection.
struct ConsumedDelete<'a> {
    group: &'a str,
    msg_id: &'a str,
}

impl QueryId for ConsumedDelete<'_> {
    type QueryId = ConsumedDelete<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl QueryFragment<Pg> for ConsumedDelete<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("DELETE FROM consumed_msg WHERE consumer_group = ");
        out.push_bind_param::<Text, str>(self.group)?;
        out.push_sql(" AND msg_id = ");
        out.push_bind_param::<Text, str>(self.msg_id)?;
        Ok(())
    }
}

impl<Conn> RunQueryDsl<Conn> for ConsumedDelete<'_> {}

impl Backend for PgConnection {
    const __MIGRATION: &'static str = crate::migrate::POSTGRES_UP;
    const DIALECT: Dialect = DIALECT;

    fn load_records(&mut self, sql: &str, bind: Option<&str>) -> QueryResult<Vec<RecordRow>> {
        super::load_rows(self, sql, bind)
    }

    fn run_sql(&mut self, sql: &str, bind: Option<&str>) -> QueryResult<usize> {
        super::execute_sql(self, sql, bind)
    }

    fn __migration_sql(&mut self) -> Result<&'static str> {
        Ok(match crate::partition::partition_policy(self)? {
            Some(_) => crate::partition::POSTGRES_PARTITIONED_UP,
            None => Self::__MIGRATION,
        })
    }

    fn backlog_row(&mut self) -> QueryResult<BacklogRow> {
        super::load_one(self, DIALECT.backlog)
    }

    fn version_row(&mut self) -> QueryResult<VersionRow> {
        super::load_one(self, super::VERSION_SQL)
    }

    fn topic_rows(&mut self) -> QueryResult<Vec<super::TopicRow>> {
        super::load_rows(self, super::TOPICS_SQL, None)
    }

    fn __insert(&mut self, options: &EmitOptions, envelopes: &[Envelope]) -> Result<()> {
        insert(self, options, envelopes)
    }

    fn __begin_claim(&mut self) -> Result<()> {
        self.__begin_bounded_claim(Duration::ZERO)
    }

    fn __begin_bounded_claim(&mut self, stall: Duration) -> Result<()> {
        let begun = AnsiTransactionManager::begin_transaction_sql(self, &begin_claim_sql(stall));
        if begun.is_err() {
            // BEGIN may have run before a later statement of the string failed: leave
            // no transaction open on a connection that goes back to the pool.
            let _ = self.batch_execute("ROLLBACK");
        }
        Ok(begun?)
    }

    fn __insert_consumed(&mut self, group: &str, msg_id: &str) -> Result<bool> {
        Ok(ConsumedInsert { group, msg_id }.execute(self)? == 1)
    }

    fn __insert_consumed_batch(
        &mut self,
        group: &str,
        msg_ids: &[&str],
    ) -> Result<Option<HashSet<String>>> {
        let mut sorted = msg_ids.to_vec();
        sorted.sort_unstable();
        let new: Vec<String> = ConsumedInsertBatch {
            group,
            msg_ids: &sorted,
        }
        .load(self)?;
        Ok(Some(new.into_iter().collect()))
    }

    fn __delete_consumed(&mut self, group: &str, msg_id: &str) -> Result<()> {
        ConsumedDelete { group, msg_id }.execute(self)?;
        Ok(())
    }

    fn __check_committable(&mut self) -> Result<()> {
        // Any statement fails in an aborted transaction; this one is prepared once.
        diesel::select(1i32.into_sql::<Integer>()).execute(self)?;
        Ok(())
    }

    fn __commit_checked(&mut self) -> Result<Result<()>> {
        // One round trip for the check and the COMMIT (the consumer's single mode ran
        // five statements per message where a plain loop runs four): in a simple-query
        // string the statements after a failed one do not run, so an aborted
        // transaction fails the `SELECT 1` and stays open, while a healthy one commits.
        // libpq's transaction status, which diesel follows, tells the two failures
        // apart.
        match self.batch_execute("SELECT 1; COMMIT") {
            Ok(()) => Ok(Ok(())),
            Err(e) => {
                let status = <AnsiTransactionManager as diesel::connection::TransactionManager<
                    Self,
                >>::transaction_manager_status_mut(self);
                match status.transaction_depth() {
                    Ok(Some(_)) => Ok(Err(e.into())),
                    _ => Err(e.into()),
                }
            }
        }
    }

    fn __claim_per_key_sql(limit: usize, held: &[i64]) -> String {
        per_key_claim_sql(limit, held)
    }

    fn __claim_per_key(&mut self, limit: usize, held: &[i64]) -> Result<Vec<StoredMessage>> {
        claim_per_key(self, limit, held)
    }

    fn __claim_sql(limit: usize) -> String {
        claim_sql(limit, false)
    }

    fn __claim(&mut self, limit: usize, held: &[i64]) -> Result<Vec<StoredMessage>> {
        claim(self, limit, held)
    }

    fn __mark_sent(&mut self, ids: &[i64]) -> Result<()> {
        MarkSent { ids }.execute(self)?;
        Ok(())
    }

    fn __mark_sent_and_commit(&mut self, ids: &[i64]) -> Result<()> {
        // One simple-query string, one round trip where the prepared `MarkSent` and the
        // COMMIT took two: a relay's batch is otherwise BEGIN, claim, publish, mark,
        // COMMIT, and each round trip counts where the database is across a network.
        // The array is one constant to parse and the plan a primary-key lookup (on
        // loopback, where a round trip is cheap, the bench's drain and latency figures
        // stayed within their noise: BENCHMARKS.md). After a failed UPDATE the COMMIT
        // does not run and the transaction stays open, to be rolled back; a failed
        // COMMIT has ended it (diesel follows libpq's transaction status either way).
        Ok(self.batch_execute(&mark_sent_and_commit_sql(ids))?)
    }
}

/// [`MarkSent`] for `ids` and a `COMMIT`, as one string; the ids, integers, as one
/// array literal.
fn mark_sent_and_commit_sql(ids: &[i64]) -> String {
    if ids.is_empty() {
        return "COMMIT".into();
    }
    let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
    format!("{MARK_SENT_HEAD}'{{{}}}'::int8[]); COMMIT", ids.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_sent_in_full_is_marked_and_committed_by_one_string() {
        assert_eq!(
            mark_sent_and_commit_sql(&[7, 12]),
            "UPDATE outbox SET status = 1, sent_at = now() WHERE status = 0 \
             AND id = ANY('{7,12}'::int8[]); COMMIT"
        );
        assert_eq!(mark_sent_and_commit_sql(&[]), "COMMIT");
    }

    #[test]
    fn the_claim_begins_read_committed_with_its_stall_bounds() {
        assert_eq!(
            begin_claim_sql(Duration::ZERO),
            format!("BEGIN ISOLATION LEVEL READ COMMITTED; {COMMIT_SETTINGS}; {PLAN_SETTINGS}")
        );
        let sql = begin_claim_sql(Duration::from_secs(30));
        assert!(
            sql.starts_with("BEGIN ISOLATION LEVEL READ COMMITTED; "),
            "{sql}"
        );
        assert!(
            sql.contains("SET LOCAL idle_in_transaction_session_timeout = 30000;"),
            "{sql}"
        );
        assert!(sql.ends_with("SET LOCAL lock_timeout = 30000"), "{sql}");
        // Never 0 (which disables the timeouts), never past PostgreSQL's limit.
        assert!(begin_claim_sql(Duration::from_micros(1)).contains("timeout = 1;"));
        assert!(begin_claim_sql(Duration::MAX).contains(&format!("= {};", i32::MAX)));
    }
}
