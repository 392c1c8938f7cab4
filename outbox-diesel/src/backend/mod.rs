//! The SQL behind [`OutboxConnection`](crate::OutboxConnection): the crate-private
//! [`Database`] trait, which each database's connection implements in a module of its
//! own (emit, the claim's transaction, the inbox insert, its [`Dialect`]), and
//! [`Backend`], which takes a connection (pooled or not) to its database. Rows are
//! written in `row`, read in `record`; shared SQL text is in `sql`.

use std::collections::HashSet;
use std::time::Duration;

use diesel::connection::TransactionManager as _;
use diesel::query_builder::{BoxedSqlQuery, SqlQuery};
use diesel::query_dsl::LoadQuery;
use diesel::query_dsl::methods::ExecuteDsl;
use diesel::r2d2::{ConnectionManager, PooledConnection, R2D2Connection};
use diesel::result::QueryResult;
use diesel::serialize::ToSql;
use diesel::sql_types::{HasSqlType, Text};
use diesel::{Connection, RunQueryDsl as _};
use outbox_core::{Envelope, RelayBatchOutcome, StoredMessage};

use crate::{EmitOptions, Result};

mod consumed;
mod record;
mod row;
mod sql;

pub(crate) use consumed::{ConsumedInsert, ConsumedSql};
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) use record::MsgIdRow;
#[cfg(feature = "postgres")]
pub use record::PgMessageRow;
pub(crate) use record::{RecordRow, claimed};
#[cfg(feature = "postgres")]
pub(crate) use row::push_before_headers;
pub(crate) use row::{Row, check_group, chunks, push_values};
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) use sql::{FIND_ONE, TAKE_BACK, first_outside_sql, head_is_due, with_msg_ids};
pub(crate) use sql::{in_list, is_missing_table, retry_delay_us, truncate};

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
    /// Run before rows are marked DEAD in a claim's transaction, where its commit must
    /// be durable.
    pub(crate) durable_dead: Option<&'static str>,
    /// SENT rows of the last `n` minutes by the minute they were sent in
    /// (`minutes_ago`, 0 the current one), with their mean commit→publish latency.
    pub(crate) published_minutes: fn(u32) -> String,
    /// DEAD → NEW, due now, retries reset, of the DEAD rows among these ids (an
    /// [`in_list`]).
    pub(crate) redrive: fn(&str) -> String,
    /// Whether a relay parked on LISTEN holds a [wake-up lock](crate::wake_lock_key)
    /// (PostgreSQL; elsewhere relays park without one).
    pub(crate) wake_locks: bool,
}

/// Where the PostgreSQL claim walks from (its `ClaimFloor`; zero elsewhere).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Floor {
    /// No row below this id is NEW, but those the floor has not come down to yet.
    pub(crate) at: i64,
    /// From here up to `at`, the per-key claim looks for such rows of its keys: the
    /// ids the floor passed in its last rise, where a row it passed may still appear.
    pub(crate) watch: i64,
}

#[cfg(any(feature = "mysql", feature = "sqlite"))]
/// [`Dialect::redrive`] keeping the rows' ids (MySQL, SQLite: no claim floor).
pub(crate) fn redrive_in_place(now: &str, ids: &str) -> String {
    format!(
        "UPDATE outbox SET status = 0, retries = 0, next_retry_at = {now}, \
         last_error = NULL WHERE status = 2 AND id IN ({ids})"
    )
}

/// One database's statements, implemented by its driver's connection (`PgConnection`,
/// `MysqlConnection`, `SqliteConnection`). The statements that differ only by their
/// [`Dialect`] are written once, as generic functions over this trait (the operations
/// queries in `ops`, [`complete`], the migration's version): they reach the database
/// through [`load`](Self::load) and [`execute`](Self::execute). What a database does
/// its own way (emit, the claim's transaction, the inbox's dedup rows) is a method here,
/// with the common way as its default.
pub(crate) trait Database: Connection + Sized + 'static {
    /// The embedded migration (the shipped `up.sql`).
    const MIGRATION: &'static str;

    /// The database's SQL for the shared statements.
    const DIALECT: Dialect;

    /// Loads the rows of `sql`, with `bind` as its one text parameter if any.
    fn load<T: ResultRow>(&mut self, sql: &str, bind: Option<&str>) -> QueryResult<Vec<T>>;

    /// Runs `sql`, with `bind` as its one text parameter if any; the rows it touched.
    fn execute(&mut self, sql: &str, bind: Option<&str>) -> QueryResult<usize>;

    /// The statement that re-drives the DEAD rows among `ids` (an [`in_list`]): the
    /// dialect's, unless the database's state asks for another (PostgreSQL in CDC mode).
    fn redrive_sql(&mut self, ids: &str) -> Result<String> {
        Ok((Self::DIALECT.redrive)(ids))
    }

    /// The one row of `sql`.
    fn load_one<T: ResultRow>(&mut self, sql: &str) -> QueryResult<T> {
        self.load(sql, None)?
            .pop()
            .ok_or(diesel::result::Error::NotFound)
    }

    /// Inserts envelopes (validated by the caller: sizes, in-batch duplicates).
    fn insert(&mut self, options: &EmitOptions, envelopes: &[Envelope]) -> Result<()>;

    /// Opens the claim transaction, locking where the database has row locks, with
    /// server-side bounds on how long a stalled holder keeps them (`Duration::ZERO`: the
    /// server's own settings).
    fn begin_claim(&mut self, stall: Duration) -> Result<()>;

    /// The unordered claim statement (for EXPLAIN tests too).
    fn claim_sql(limit: usize) -> String {
        let d = &Self::DIALECT;
        format!(
            "SELECT {} FROM outbox WHERE status = 0 AND next_retry_at <= {} ORDER BY id LIMIT {}{}",
            d.columns, d.now, limit, d.lock
        )
    }

    /// Reads up to `limit` due NEW rows in id order, locking them where possible.
    ///
    /// `held`: the ids of a batch the relay has in hand (a claim ahead), else empty.
    /// They are locked by that batch's transaction, so the claim skips them anyway; a
    /// database may leave them out of its walk before it tries their locks.
    ///
    /// `floor`: an id below which no row is NEW or can become visible as NEW (0: none
    /// known). A database may start its walk there (PostgreSQL, `ClaimFloor`).
    fn claim(&mut self, limit: usize, _held: &[i64], _floor: i64) -> Result<Vec<StoredMessage>> {
        let rows: Vec<RecordRow> = self.load(&Self::claim_sql(limit), None)?;
        claimed(self, rows)
    }

    /// The per-key claim's statement (for EXPLAIN tests too): on PostgreSQL and SQLite
    /// the whole claim; on MySQL its first, locking statement (the second is
    /// [`key_probe_sql`](Self::key_probe_sql)).
    ///
    /// `held`: the ids of a batch the relay has in hand and publishes first (a claim
    /// ahead, [`RelayStore::claim_after`](outbox_core::RelayStore::claim_after)): they
    /// hold back no row of their keys. Empty for a plain claim.
    fn claim_per_key_sql(limit: usize, held: &[i64]) -> String;

    /// MySQL's second per-key statement, for the locked ids `ids` (empty elsewhere).
    fn key_probe_sql(_ids: &[i64]) -> String {
        String::new()
    }

    /// Like [`claim`](Self::claim), keeping only the rows that no unclaimed NEW row of
    /// their key precedes (ARCHITECTURE.md, "Order per key"), the rows of `held`
    /// excepted. `floor`: where the walk starts ([`Floor`]).
    fn claim_per_key(
        &mut self,
        limit: usize,
        held: &[i64],
        _floor: Floor,
    ) -> Result<Vec<StoredMessage>> {
        let rows: Vec<RecordRow> = self.load(&Self::claim_per_key_sql(limit, held), None)?;
        claimed(self, rows)
    }

    /// Marks these claimed rows SENT (in the caller's transaction): one statement for
    /// the whole batch; `status = 0` keeps status moving forward.
    fn mark_sent(&mut self, ids: &[i64]) -> Result<()> {
        let sql = format!(
            "UPDATE outbox SET status = 1, sent_at = {} WHERE status = 0 AND id IN ({})",
            Self::DIALECT.now,
            in_list(ids)
        );
        self.execute(&sql, None)?;
        Ok(())
    }

    /// Marks these claimed rows SENT ([`mark_sent`](Self::mark_sent), nothing if
    /// empty) and commits the claim's transaction: a batch whose every message was
    /// published. On an error the transaction may still be open, to be rolled back.
    /// PostgreSQL does both in one round trip.
    fn mark_sent_and_commit(&mut self, ids: &[i64]) -> Result<()> {
        if !ids.is_empty() {
            self.mark_sent(ids)?;
        }
        Self::TransactionManager::commit_transaction(self)?;
        Ok(())
    }

    /// Inserts a dedup row; `false` if it was there.
    fn insert_consumed(&mut self, group: &str, msg_id: &str) -> Result<bool>;

    /// Inserts the dedup rows of a whole batch in one statement, ahead of its handlers:
    /// the msg_ids that were new (`msg_ids` holds no repeats). `None`: the database has
    /// no such statement, and nothing ran; the batch takes the per-message path.
    ///
    /// A database that answers `Some` runs the batch's fast path in
    /// `DieselInbox::process_batch`, which needs two more things of it: multi-statement
    /// strings in `batch_execute` that stop at the first failed statement
    /// (`RELEASE SAVEPOINT ..; SAVEPOINT ..`), and [`delete_consumed`](Self::delete_consumed).
    fn insert_consumed_batch(
        &mut self,
        _group: &str,
        _msg_ids: &[&str],
    ) -> Result<Option<HashSet<String>>> {
        Ok(None)
    }

    /// Deletes a dedup row inserted by [`insert_consumed_batch`](Self::insert_consumed_batch)
    /// in the open transaction (its message failed). Only called on a database whose
    /// `insert_consumed_batch` answers `Some`.
    fn delete_consumed(&mut self, _group: &str, _msg_id: &str) -> Result<()> {
        Err(diesel::result::Error::QueryBuilderError(
            "this backend inserts no dedup rows ahead of a batch".into(),
        )
        .into())
    }

    /// Commits the open transaction of a consumer's message if it can commit.
    /// `Ok(Err(e))`: it cannot (`e` says why) and is still open, to be rolled back;
    /// `Err`: the commit itself failed. PostgreSQL aborts a transaction at its first
    /// failed statement and then turns `COMMIT` into a silent `ROLLBACK`, so it checks
    /// (and commits in the same round trip); MySQL and SQLite roll back only the failed
    /// statement, so they have nothing to check.
    fn commit_checked(&mut self) -> Result<Result<()>> {
        Self::TransactionManager::commit_transaction(self)?;
        Ok(Ok(()))
    }

    /// Whether the transaction this connection began is still open on the server.
    /// MySQL and MariaDB end a transaction themselves on a deadlock (1213), savepoints
    /// included, and run the statements that follow in autocommit mode while diesel
    /// still counts the transaction open; PostgreSQL keeps an aborted transaction open
    /// until it is rolled back ([`commit_checked`](Self::commit_checked)).
    fn transaction_open(&mut self) -> Result<bool> {
        Ok(true)
    }

    /// After a statement failed outside a transaction: marks the connection broken if
    /// it no longer reaches its server, so that the pool drops it instead of handing it
    /// out again. (Inside a transaction a failed rollback marks it.) Nothing to do on
    /// PostgreSQL, whose connection marks itself (diesel reads libpq's status after each
    /// statement), nor on SQLite.
    fn forget_if_lost(&mut self) {}

    /// The migration [`migrate`](crate::migrate) runs: [`Self::MIGRATION`], but on
    /// PostgreSQL the partitioned one for partitioned tables.
    fn migration_sql(&mut self) -> Result<&'static str> {
        Ok(Self::MIGRATION)
    }
}

/// A connection [`OutboxConnection`](crate::OutboxConnection) runs on: a driver's
/// connection, which is its own [`Database`], or a pooled one, which hands over the
/// connection it wraps. Crate-private and a supertrait of the public, otherwise empty
/// `OutboxConnection`: outside this crate the SQL cannot be called (E0624) and the trait
/// cannot be implemented.
pub(crate) trait Backend {
    /// The driver's connection.
    type Db: Database;

    /// The driver's connection, to run a statement on.
    fn db(&mut self) -> &mut Self::Db;
}

impl<D: Database> Backend for D {
    type Db = D;

    fn db(&mut self) -> &mut D {
        self
    }
}

/// As diesel's r2d2 connection runs a statement: on the connection it wraps.
impl<C: Backend + R2D2Connection + 'static> Backend for PooledConnection<ConnectionManager<C>> {
    type Db = C::Db;

    fn db(&mut self) -> &mut C::Db {
        (**self).db()
    }
}

/// Writes a batch outcome (in the caller's transaction).
pub(crate) fn complete<D: Database>(conn: &mut D, outcome: &RelayBatchOutcome) -> Result<()> {
    let d = &D::DIALECT;
    if !outcome.sent.is_empty() {
        conn.mark_sent(&outcome.sent)?;
    }
    for retry in &outcome.retry {
        let sql = format!(
            "UPDATE outbox SET retries = retries + 1, next_retry_at = {}, last_error = {} \
             WHERE status = 0 AND id = {}",
            (d.later)(retry_delay_us(retry.next_retry_at)),
            d.ph,
            retry.id,
        );
        conn.execute(&sql, Some(truncate(&retry.error)))?;
    }
    if let (false, Some(durable)) = (outcome.dead.is_empty(), d.durable_dead) {
        conn.execute(durable, None)?;
    }
    for dead in &outcome.dead {
        let id = dead.id;
        let sql = format!(
            "UPDATE outbox SET retries = retries + 1, status = 2, last_error = {} \
             WHERE status = 0 AND id = {id}",
            d.ph
        );
        conn.execute(&sql, Some(truncate(&dead.error)))?;
    }
    Ok(())
}

/// A row type every enabled database loads (`QueryableByName` for each of them), so
/// that a statement written once, generic over [`Database`], can name it: diesel proves
/// a query runs on a connection only for a concrete backend.
pub(crate) trait ResultRow: PgRow + MysqlRow + SqliteRow + 'static {}

impl<T: PgRow + MysqlRow + SqliteRow + 'static> ResultRow for T {}

/// `$name`: `QueryableByName<$db>` with the feature `$feature`, anything without it.
/// A macro because a supertrait cannot depend on a feature.
macro_rules! row_of {
    ($name:ident, $feature:literal, $db:ty) => {
        #[cfg(feature = $feature)]
        pub(crate) trait $name: diesel::QueryableByName<$db> {}
        #[cfg(feature = $feature)]
        impl<T: diesel::QueryableByName<$db>> $name for T {}
        #[cfg(not(feature = $feature))]
        pub(crate) trait $name {}
        #[cfg(not(feature = $feature))]
        impl<T> $name for T {}
    };
}
row_of!(PgRow, "postgres", diesel::pg::Pg);
row_of!(MysqlRow, "mysql", diesel::mysql::Mysql);
row_of!(SqliteRow, "sqlite", diesel::sqlite::Sqlite);

/// Loads the rows of `sql`, with `bind` as its one text parameter if any: the body of
/// each database's [`Database::load`].
pub(crate) fn load_rows<'a, C, T>(
    conn: &mut C,
    sql: &str,
    bind: Option<&'a str>,
) -> QueryResult<Vec<T>>
where
    C: Connection<Backend: HasSqlType<Text>>,
    &'a str: ToSql<Text, C::Backend>,
    for<'q> SqlQuery: LoadQuery<'q, C, T>,
    BoxedSqlQuery<'a, C::Backend, SqlQuery>: LoadQuery<'a, C, T>,
{
    let query = diesel::sql_query(sql);
    match bind {
        // Boxed: diesel does not name the unboxed query with a bind.
        Some(value) => query.into_boxed().bind::<Text, _>(value).load(conn),
        None => query.load(conn),
    }
}

/// Runs `sql`, with `bind` as its one text parameter if any: the body of each
/// database's [`Database::execute`].
pub(crate) fn execute_sql<'a, C>(
    conn: &mut C,
    sql: &str,
    bind: Option<&'a str>,
) -> QueryResult<usize>
where
    C: Connection<Backend: HasSqlType<Text>>,
    &'a str: ToSql<Text, C::Backend>,
    SqlQuery: ExecuteDsl<C>,
    BoxedSqlQuery<'a, C::Backend, SqlQuery>: ExecuteDsl<C>,
{
    let query = diesel::sql_query(sql);
    match bind {
        Some(value) => query.into_boxed().bind::<Text, _>(value).execute(conn),
        None => query.execute(conn),
    }
}
