use diesel::connection::AnsiTransactionManager;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::result::{DatabaseErrorKind, QueryResult};
use diesel::sql_types::{Nullable, Text};
use diesel::sqlite::Sqlite;
use diesel::{OptionalExtension as _, QueryableByName, RunQueryDsl, SqliteConnection};
use outbox_core::{Envelope, MsgId};

use super::{Dialect, FIND_ONE, MsgIdRow, Row, TAKE_BACK, chunks, with_msg_ids};
use crate::{EmitOptions, Error, OutboxConnection, Result};

/// The database clock as the tables store it: UTC text with milliseconds, whose text
/// order is time order.
macro_rules! now {
    () => {
        "strftime('%Y-%m-%d %H:%M:%f', 'now')"
    };
}

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
        super::push_values(self.rows, &mut out, "", concat!(", ", now!(), ", ", now!()))?;
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
            0 => Err(Error::Duplicate(MsgId::new(row.msg_id)?)),
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
                return Err(Error::Duplicate(MsgId::new(dup)?));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// `INSERT INTO consumed_msg .. ON CONFLICT DO NOTHING`, cached.
struct ConsumedInsert<'a> {
    group: &'a str,
    msg_id: &'a str,
}

impl QueryId for ConsumedInsert<'_> {
    type QueryId = ConsumedInsert<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl QueryFragment<Sqlite> for ConsumedInsert<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Sqlite>) -> QueryResult<()> {
        out.push_sql("INSERT INTO consumed_msg (consumer_group, msg_id, consumed_at) VALUES (");
        out.push_bind_param::<Text, str>(self.group)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, str>(self.msg_id)?;
        out.push_sql(concat!(", ", now!(), ") ON CONFLICT DO NOTHING"));
        Ok(())
    }
}

impl<Conn> RunQueryDsl<Conn> for ConsumedInsert<'_> {}

impl OutboxConnection for SqliteConnection {
    const __MIGRATION: &'static str = crate::migrate::SQLITE_UP;

    fn __insert(&mut self, _options: &EmitOptions, envelopes: &[Envelope]) -> Result<()> {
        insert(self, envelopes)
    }

    fn __begin_claim(&mut self) -> Result<()> {
        Ok(AnsiTransactionManager::begin_transaction_sql(
            self,
            "BEGIN IMMEDIATE",
        )?)
    }

    fn __insert_consumed(&mut self, group: &str, msg_id: &str) -> Result<bool> {
        Ok(ConsumedInsert { group, msg_id }.execute(self)? == 1)
    }

    /// One relay per database: a row outside `L` below a row of `L` is one waiting for
    /// its retry time, so this keeps a key in order across retries.
    fn __claim_per_key_sql(limit: usize) -> String {
        super::per_key_claim_sql(&DIALECT, limit, "IN (SELECT id FROM l)")
    }

    fn __claim_per_key(&mut self, limit: usize) -> Result<Vec<crate::OutboxRecord>> {
        let rows = diesel::sql_query(Self::__claim_per_key_sql(limit)).load(self)?;
        super::claimed(self, rows)
    }

    super::common_methods!(DIALECT);
}

#[derive(QueryableByName)]
struct DatabaseFile {
    #[diesel(sql_type = Nullable<Text>)]
    file: Option<String>,
}

/// The file of the connection's main database as SQLite resolved it (absolute), or
/// `None` for a database without one (`:memory:`, a shared-cache memory URI, a temporary
/// database).
pub(crate) fn database_file(conn: &mut SqliteConnection) -> Result<Option<String>> {
    let row = diesel::sql_query("SELECT file FROM pragma_database_list WHERE name = 'main'")
        .get_result::<DatabaseFile>(conn)
        .optional()?;
    Ok(row.and_then(|r| r.file).filter(|f| !f.is_empty()))
}

#[derive(QueryableByName)]
struct LeaseOwner {
    #[diesel(sql_type = Text)]
    owner: String,
}

/// Takes the relay lease row of a database without a file, inside the caller's
/// immediate transaction. Such a database lives and dies with this process, so the row
/// needs no heartbeat and no expiry: it is written once here and deleted by [`release`].
/// A row of another owner is [`Error::RelayAlreadyRunning`].
pub(crate) fn take_lease(conn: &mut SqliteConnection, owner: &str) -> Result<()> {
    let taken = diesel::sql_query(concat!(
        "INSERT INTO outbox_relay_lease (singleton, owner, heartbeat_at) VALUES (1, ?, ",
        now!(),
        ") ON CONFLICT (singleton) DO NOTHING"
    ))
    .bind::<Text, _>(owner)
    .execute(conn)?;
    if taken == 1 {
        return Ok(());
    }
    let holder = diesel::sql_query("SELECT owner FROM outbox_relay_lease WHERE singleton = 1")
        .get_result::<LeaseOwner>(conn)?
        .owner;
    Err(Error::RelayAlreadyRunning {
        owner: holder,
        lock: "the outbox_relay_lease row of this in-memory database".into(),
    })
}

/// Gives the lease up if `owner` holds it.
pub(crate) fn release(conn: &mut SqliteConnection, owner: &str) -> Result<()> {
    diesel::sql_query("DELETE FROM outbox_relay_lease WHERE owner = ?")
        .bind::<Text, _>(owner)
        .execute(conn)?;
    Ok(())
}
