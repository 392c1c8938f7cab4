//! SQLite: the dialect, the [`Database`] and the single relay's store (`store`).

use diesel::connection::AnsiTransactionManager;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::result::{DatabaseErrorKind, QueryResult};
use diesel::sqlite::Sqlite;
use diesel::{RunQueryDsl, SqliteConnection};
use outbox_core::{Envelope, MsgId};

use crate::backend::{ConsumedInsert, ConsumedSql, Database, ResultRow};
use crate::backend::{
    Dialect, FIND_ONE, MsgIdRow, Row, TAKE_BACK, chunks, first_outside_sql, head_is_due,
    with_msg_ids,
};
use crate::{EmitOptions, Result};

mod store;

pub use store::{SqliteBatch, SqliteCustomizer, SqliteRelayStore, sqlite_pool};

/// The database clock as the tables store it: UTC text with milliseconds, whose text
/// order is time order.
macro_rules! now {
    () => {
        "strftime('%Y-%m-%d %H:%M:%f', 'now')"
    };
}
pub(crate) use now;

/// Unix microseconds of a stored timestamp (NULL stays NULL).
macro_rules! us {
    ($col:literal) => {
        concat!(
            "(CAST(strftime('%s', ",
            $col,
            ") AS INTEGER) * 1000000 + CAST(substr(",
            $col,
            ", 21, 3) AS INTEGER) * 1000)"
        )
    };
}

pub(super) const DIALECT: Dialect = Dialect {
    columns: concat!(
        "id, msg_id, topic, event_type, msg_key, schema_version, payload, headers, status, retries, ",
        us!("next_retry_at"),
        " AS next_retry_us, ",
        us!("created_at"),
        " AS created_us, ",
        us!("sent_at"),
        " AS sent_us, last_error"
    ),
    now: now!(),
    ph: "?",
    // No row locks: one relay per database, enforced by the store's lock file.
    lock: "",
    backlog: concat!(
        "SELECT (SELECT count(*) FROM outbox WHERE status = 0 AND next_retry_at <= ",
        now!(),
        ") AS due, (SELECT CAST((julianday('now') - julianday(min(created_at))) * 86400000000.0 AS INTEGER) \
         FROM outbox WHERE status = 0 AND next_retry_at <= ",
        now!(),
        ") AS oldest_us, (SELECT count(*) FROM outbox WHERE status = 2) AS dead"
    ),
    later: |us| {
        format!(
            "strftime('%Y-%m-%d %H:%M:%f', 'now', '+{}.{:06} seconds')",
            us / 1_000_000,
            us % 1_000_000
        )
    },
    ago: |us| {
        format!(
            "strftime('%Y-%m-%d %H:%M:%f', 'now', '-{}.{:06} seconds')",
            us / 1_000_000,
            us % 1_000_000
        )
    },
    delete_limited: |table, filter, order, n| {
        format!(
            "DELETE FROM {table} WHERE rowid IN \
             (SELECT rowid FROM {table} WHERE {filter} ORDER BY {order} LIMIT {n})"
        )
    },
    durable_dead: None,
    published_minutes: |m| {
        format!(
            "SELECT CAST((julianday('now') - julianday(sent_at)) * 1440 AS INTEGER) AS minutes_ago, \
             COUNT(*) AS n, AVG((julianday(sent_at) - julianday(created_at)) * 86400.0) AS latency \
             FROM outbox WHERE status = 1 \
             AND sent_at > strftime('%Y-%m-%d %H:%M:%f', 'now', '-{m} minutes') \
             GROUP BY minutes_ago"
        )
    },
    redrive: |ids| crate::backend::redrive_in_place(now!(), ids),
    wake_locks: false,
};

/// One row: `INSERT .. ON CONFLICT (msg_id) DO NOTHING` (0 rows on a duplicate), cached.
/// Several rows: a plain multi-row INSERT, which SQLite aborts as a statement on a
/// duplicate, so the call is all or nothing and the transaction stays usable.
struct Insert<'a> {
    rows: &'a [Row<'a>],
}

impl QueryId for Insert<'_> {
    type QueryId = Insert<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl QueryFragment<Sqlite> for Insert<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Sqlite>) -> QueryResult<()> {
        if self.rows.len() != 1 {
            out.unsafe_to_cache_prepared();
        }
        out.push_sql(
            "INSERT INTO outbox (msg_id, topic, event_type, msg_key, schema_version, payload, \
             headers, next_retry_at, created_at) VALUES ",
        );
        crate::backend::push_values(self.rows, &mut out, "", concat!(", ", now!(), ", ", now!()))?;
        if self.rows.len() == 1 {
            out.push_sql(" ON CONFLICT (msg_id) DO NOTHING");
        }
        Ok(())
    }
}

impl<Conn> RunQueryDsl<Conn> for Insert<'_> {}

fn insert(conn: &mut SqliteConnection, envelopes: &[Envelope]) -> Result<()> {
    let rows = envelopes.iter().map(Row::new).collect::<Result<Vec<_>>>()?;
    if let [row] = rows.as_slice() {
        return match (Insert { rows: &rows }).execute(conn)? {
            0 => Err(outbox_core::Error::Duplicate(MsgId::new(row.msg_id)?).into()),
            _ => Ok(()),
        };
    }
    let mut done: Vec<&str> = Vec::new();
    for chunk in chunks(&rows) {
        match (Insert { rows: chunk }).execute(conn) {
            Ok(_) => done.extend(chunk.iter().map(|r| r.msg_id)),
            Err(diesel::result::Error::DatabaseError(DatabaseErrorKind::UniqueViolation, _)) => {
                // One writer at a time in SQLite: what is there now is what conflicted.
                let ids: Vec<&str> = chunk.iter().map(|r| r.msg_id).collect();
                let dup = with_msg_ids::<Sqlite>(FIND_ONE, &ids)
                    .load::<MsgIdRow>(conn)?
                    .pop()
                    .map_or_else(|| chunk[0].msg_id.to_owned(), |r| r.msg_id);
                if !done.is_empty() {
                    with_msg_ids::<Sqlite>(TAKE_BACK, &done).execute(conn)?;
                }
                return Err(outbox_core::Error::Duplicate(MsgId::new(dup)?).into());
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// `INSERT INTO consumed_msg .. ON CONFLICT DO NOTHING`, cached.
impl ConsumedSql for Sqlite {
    const HEAD: &'static str =
        "INSERT INTO consumed_msg (consumer_group, msg_id, consumed_at) VALUES (";
    const TAIL: &'static str = concat!(", ", now!(), ") ON CONFLICT DO NOTHING");
}

impl Database for SqliteConnection {
    const MIGRATION: &'static str = crate::migrate::SQLITE_UP;
    const DIALECT: Dialect = DIALECT;

    fn load<T: ResultRow>(&mut self, sql: &str, bind: Option<&str>) -> QueryResult<Vec<T>> {
        crate::backend::load_rows(self, sql, bind)
    }

    fn execute(&mut self, sql: &str, bind: Option<&str>) -> QueryResult<usize> {
        crate::backend::execute_sql(self, sql, bind)
    }

    fn insert(&mut self, _options: &EmitOptions, envelopes: &[Envelope]) -> Result<()> {
        insert(self, envelopes)
    }

    /// No bounds to set: one relay per database, whose claim holds no row locks.
    fn begin_claim(&mut self, _stall: std::time::Duration) -> Result<()> {
        Ok(AnsiTransactionManager::begin_transaction_sql(
            self,
            "BEGIN IMMEDIATE",
        )?)
    }

    fn insert_consumed(&mut self, group: &str, msg_id: &str) -> Result<bool> {
        Ok(ConsumedInsert { group, msg_id }.execute(self)? == 1)
    }

    /// One relay per database: a row outside `L` below a row of `L` is one waiting for
    /// its retry time, so this keeps a key in order across retries.
    /// (`held` is always empty: the SQLite store claims no batch ahead.)
    fn claim_per_key_sql(limit: usize, held: &[i64]) -> String {
        debug_assert!(held.is_empty(), "SQLite claims no batch ahead");
        per_key_claim_sql(&DIALECT, limit, "IN (SELECT id FROM l)")
    }
}

/// SQL that is true when two `msg_key` expressions are the same key: byte for byte, as
/// Rust compares them. A plain `=` on PostgreSQL (deterministic collations break ties
/// by bytes) and SQLite (BINARY).
fn same_key(a: &str, b: &str) -> String {
    format!("{a} = {b}")
}

/// The per-key claim in one statement on SQLite (PostgreSQL has its own, with walks
/// instead of probes: `pg::per_key_claim_sql`):
/// lock the due NEW rows in id order whose key's head is due (`L`), then return the rows
/// of `L` that no NEW row outside `L` precedes within their key, in id order.
///
/// `g` is materialized so that each key is probed once: inlined, PostgreSQL evaluates
/// the probe once per row of `L` (a hot key of 500 rows: 250,000 index entries;
/// BENCHMARKS.md, "Claim plans").
///
/// `in_l` tests `id` for membership in `L`: on PostgreSQL `= ANY(ARRAY(..))`, which
/// reads the rows by primary key (a plain `IN (SELECT ..)` is planned as a hash semi
/// join over a scan of the whole table).
fn per_key_claim_sql(d: &Dialect, limit: usize, in_l: &str) -> String {
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
