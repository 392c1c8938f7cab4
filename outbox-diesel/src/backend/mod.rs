//! Backend-specific SQL behind [`OutboxConnection`](crate::OutboxConnection): the
//! crate-private [`Backend`] trait, whose default methods hold the statements that differ
//! between backends only by their [`Dialect`], and one module per backend for the rest
//! (emit, the claim's transaction, the inbox insert). Rows are written in `row`, read in
//! `record`; shared SQL text is in `sql`.

use diesel::query_builder::{BoxedSqlQuery, SqlQuery};
use diesel::query_dsl::LoadQuery;
use diesel::query_dsl::methods::ExecuteDsl;
use diesel::result::QueryResult;
use diesel::serialize::ToSql;
use diesel::sql_types::HasSqlType;
use diesel::sql_types::Text;
use diesel::{Connection, RunQueryDsl as _};
use outbox_core::{Backlog, Envelope, RelayBatchOutcome, Status, StoredMessage};

use crate::{EmitOptions, Error, OutboxRow, Result};

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod pg;
mod pooled;
mod record;
mod row;
mod sql;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;

#[cfg(feature = "postgres")]
pub(crate) use record::ClaimRow;
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) use record::MsgIdRow;
pub(crate) use record::{
    BacklogRow, MinuteRow, ParkedRow, RecordRow, TopicRow, VersionRow, claimed,
};
#[cfg(feature = "postgres")]
pub(crate) use row::push_before_headers;
pub(crate) use row::{Row, check_group, chunks, push_values};

/// The highest recorded migration: the same text on every backend.
const VERSION_SQL: &str = "SELECT MAX(version) AS version FROM outbox_migrations";
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
    /// (`minutes_ago`, 0 the current one), with their mean commit→publish latency:
    /// [`MinuteRow`]s.
    pub(crate) published_minutes: fn(u32) -> String,
    /// DEAD → NEW, due now, retries reset, of the DEAD rows among these ids (an
    /// [`in_list`]).
    pub(crate) redrive: fn(&str) -> String,
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

/// [`Dialect::redrive`] keeping the rows' ids (MySQL, SQLite: no claim floor).
pub(crate) fn redrive_in_place(now: &str, ids: &str) -> String {
    format!(
        "UPDATE outbox SET status = 0, retries = 0, next_retry_at = {now}, \
         last_error = NULL WHERE status = 2 AND id IN ({ids})"
    )
}

/// What `OutboxConnection` does, per backend. Crate-private and a supertrait of the
/// public, otherwise empty `OutboxConnection`: outside this crate its methods cannot be
/// called (E0624) and the trait cannot be implemented, so the SQL stays out of the API.
///
/// A backend implements the required methods; the defaults are the statements whose SQL
/// differs only by [`Self::DIALECT`](Backend::DIALECT). They reach the database through
/// four primitives (`load_records`, `run_sql`, `backlog_row`, `version_row`) that each backend
/// implements by calling the generic [`load_rows`] / [`execute_sql`] with its own connection
/// type: diesel proves a query runs on a connection only for a concrete row type and
/// backend (`RecordRow: QueryableByName<Pg>`), which a default method, generic over the
/// backend, cannot state.
pub(crate) trait Backend: Connection + Sized {
    /// The embedded migration (the shipped `up.sql`).
    const __MIGRATION: &'static str;

    /// The backend's SQL for the shared statements.
    const DIALECT: Dialect;

    /// Loads `sql` (with `bind` as its one text parameter, if any) as records.
    fn load_records(&mut self, sql: &str, bind: Option<&str>) -> QueryResult<Vec<RecordRow>>;

    /// Runs `sql` (with `bind` as its one text parameter, if any); the rows it touched.
    fn run_sql(&mut self, sql: &str, bind: Option<&str>) -> QueryResult<usize>;

    /// Runs [`Dialect::backlog`].
    fn backlog_row(&mut self) -> QueryResult<BacklogRow>;

    /// Runs [`VERSION_SQL`].
    fn version_row(&mut self) -> QueryResult<VersionRow>;

    /// Runs [`TOPICS_SQL`].
    fn topic_rows(&mut self) -> QueryResult<Vec<TopicRow>>;

    /// Runs [`Dialect::published_minutes`].
    fn minute_rows(&mut self, minutes: u32) -> QueryResult<Vec<MinuteRow>>;

    /// The sessions holding a relay's [wake-up lock](crate::wake_lock_key) exclusively
    /// (relays parked on LISTEN), in pid order; `None` where relays park without one
    /// (every backend but PostgreSQL).
    fn parked_relay_rows(&mut self) -> QueryResult<Option<Vec<ParkedRow>>> {
        Ok(None)
    }

    /// Inserts envelopes (validated by the caller: sizes, in-batch duplicates).
    fn __insert(&mut self, options: &EmitOptions, envelopes: &[Envelope]) -> Result<()>;

    /// Opens the claim transaction (locking where the backend has row locks).
    fn __begin_claim(&mut self) -> Result<()>;

    /// Opens the claim transaction with server-side bounds on how long a stalled holder
    /// keeps its row locks (`Duration::ZERO`: the server's own settings).
    fn __begin_bounded_claim(&mut self, _stall: std::time::Duration) -> Result<()> {
        self.__begin_claim()
    }

    /// The per-key claim's statement (for EXPLAIN tests too): on PostgreSQL and SQLite
    /// the whole claim; on MySQL its first, locking statement (the second is
    /// [`__key_probe_sql`](Self::__key_probe_sql)).
    ///
    /// `held`: the ids of a batch the relay has in hand and publishes first (a claim
    /// ahead, [`RelayStore::claim_after`](outbox_core::RelayStore::claim_after)): they
    /// hold back no row of their keys. Empty for a plain claim.
    fn __claim_per_key_sql(limit: usize, held: &[i64]) -> String;

    /// MySQL's second per-key statement, for the locked ids `ids` (empty elsewhere).
    fn __key_probe_sql(_ids: &[i64]) -> String {
        String::new()
    }

    /// Like [`__claim`](Self::__claim), keeping only the rows that no unclaimed NEW row
    /// of their key precedes (ARCHITECTURE.md, "Order per key"), the rows of `held`
    /// excepted. `floor`: where the walk starts ([`Floor`]).
    fn __claim_per_key(
        &mut self,
        limit: usize,
        held: &[i64],
        _floor: Floor,
    ) -> Result<Vec<StoredMessage>> {
        let rows = self.load_records(&Self::__claim_per_key_sql(limit, held), None)?;
        claimed(self, rows)
    }

    /// Inserts a dedup row; `false` if it was there.
    fn __insert_consumed(&mut self, group: &str, msg_id: &str) -> Result<bool>;

    /// Inserts the dedup rows of a whole batch in one statement, ahead of its handlers:
    /// the msg_ids that were new (`msg_ids` holds no repeats). `None`: the backend has no
    /// such statement, and nothing ran; the batch takes the per-message path.
    ///
    /// A backend that answers `Some` runs the batch's fast path in
    /// `DieselInbox::process_batch`, which needs two more things of it: multi-statement
    /// strings in `batch_execute` that stop at the first failed statement
    /// (`RELEASE SAVEPOINT ..; SAVEPOINT ..`), and [`__delete_consumed`](Self::__delete_consumed).
    fn __insert_consumed_batch(
        &mut self,
        _group: &str,
        _msg_ids: &[&str],
    ) -> Result<Option<std::collections::HashSet<String>>> {
        Ok(None)
    }

    /// Deletes a dedup row inserted by [`__insert_consumed_batch`](Self::__insert_consumed_batch)
    /// in the open transaction (its message failed). Only called on a backend whose
    /// `__insert_consumed_batch` answers `Some`.
    fn __delete_consumed(&mut self, _group: &str, _msg_id: &str) -> Result<()> {
        Err(diesel::result::Error::QueryBuilderError(
            "this backend inserts no dedup rows ahead of a batch".into(),
        )
        .into())
    }

    /// Fails if the open transaction can no longer commit. PostgreSQL aborts a
    /// transaction at its first failed statement and then turns `COMMIT` into a silent
    /// `ROLLBACK`; MySQL and SQLite roll back only the failed statement, so they have
    /// nothing to check.
    fn __check_committable(&mut self) -> Result<()> {
        Ok(())
    }

    /// Commits the open transaction of a consumer's message if it can commit
    /// ([`__check_committable`](Self::__check_committable)). `Ok(Err(e))`: it cannot (`e`
    /// says why) and is still open, to be rolled back; `Err`: the commit itself failed.
    /// PostgreSQL checks and commits in one round trip.
    fn __commit_checked(&mut self) -> Result<Result<()>> {
        if let Err(e) = self.__check_committable() {
            return Ok(Err(e));
        }
        <Self::TransactionManager as diesel::connection::TransactionManager<Self>>::commit_transaction(self)?;
        Ok(Ok(()))
    }

    /// Whether the transaction this connection began is still open on the server.
    /// MySQL and MariaDB end a transaction themselves on a deadlock (1213), savepoints
    /// included, and run the statements that follow in autocommit mode while diesel
    /// still counts the transaction open; PostgreSQL keeps an aborted transaction open
    /// until it is rolled back ([`__check_committable`](Self::__check_committable)).
    fn __transaction_open(&mut self) -> Result<bool> {
        Ok(true)
    }

    /// After a statement failed outside a transaction: marks the connection broken if
    /// it no longer reaches its server, so that the pool drops it instead of handing it
    /// out again. (Inside a transaction a failed rollback marks it.) Nothing to do on
    /// PostgreSQL, whose connection marks itself (diesel reads libpq's status after each
    /// statement), nor on SQLite.
    fn __forget_if_lost(&mut self) {}

    /// The unordered claim statement (for EXPLAIN tests too).
    fn __claim_sql(limit: usize) -> String {
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
    /// backend may leave them out of its walk before it tries their locks.
    ///
    /// `floor`: an id below which no row is NEW or can become visible as NEW (0: none
    /// known). A backend may start its walk there (PostgreSQL, `ClaimFloor`).
    fn __claim(&mut self, limit: usize, _held: &[i64], _floor: i64) -> Result<Vec<StoredMessage>> {
        let rows = self.load_records(&Self::__claim_sql(limit), None)?;
        claimed(self, rows)
    }

    /// Marks these claimed rows SENT (in the caller's transaction): one statement for
    /// the whole batch; `status = 0` keeps status moving forward.
    fn __mark_sent(&mut self, ids: &[i64]) -> Result<()> {
        let sql = format!(
            "UPDATE outbox SET status = 1, sent_at = {} WHERE status = 0 AND id IN ({})",
            Self::DIALECT.now,
            in_list(ids)
        );
        self.run_sql(&sql, None)?;
        Ok(())
    }

    /// Writes a batch outcome (in the caller's transaction).
    fn __complete(&mut self, outcome: &RelayBatchOutcome) -> Result<()> {
        let d = &Self::DIALECT;
        if !outcome.sent.is_empty() {
            self.__mark_sent(&outcome.sent)?;
        }
        for retry in &outcome.retry {
            let sql = format!(
                "UPDATE outbox SET retries = retries + 1, next_retry_at = {}, last_error = {} \
                 WHERE status = 0 AND id = {}",
                (d.later)(retry_delay_us(retry.next_retry_at)),
                d.ph,
                retry.id,
            );
            self.run_sql(&sql, Some(truncate(&retry.error)))?;
        }
        if let (false, Some(durable)) = (outcome.dead.is_empty(), d.durable_dead) {
            self.run_sql(durable, None)?;
        }
        for dead in &outcome.dead {
            let id = dead.id;
            let sql = format!(
                "UPDATE outbox SET retries = retries + 1, status = 2, last_error = {} \
                 WHERE status = 0 AND id = {id}",
                d.ph
            );
            self.run_sql(&sql, Some(truncate(&dead.error)))?;
        }
        Ok(())
    }

    /// Marks these claimed rows SENT ([`__mark_sent`](Self::__mark_sent), nothing if
    /// empty) and commits the claim's transaction: a batch whose every message was
    /// published. On an error the transaction may still be open, to be rolled back.
    /// PostgreSQL does both in one round trip.
    fn __mark_sent_and_commit(&mut self, ids: &[i64]) -> Result<()> {
        if !ids.is_empty() {
            self.__mark_sent(ids)?;
        }
        <Self::TransactionManager as diesel::connection::TransactionManager<Self>>::commit_transaction(self)?;
        Ok(())
    }

    /// Backlog statistics.
    fn __backlog(&mut self) -> Result<Backlog> {
        Ok(self.backlog_row()?.into_backlog())
    }

    /// Rows with `id > after_id`, optionally of one status, in id order; a row that does
    /// not decode comes as [`OutboxRow::Unreadable`].
    fn __list(
        &mut self,
        status: Option<Status>,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<OutboxRow>> {
        let filter = status.map_or(String::new(), |s| format!("status = {} AND ", s.as_i16()));
        let sql = format!(
            "SELECT {} FROM outbox WHERE {filter}id > {after_id} ORDER BY id LIMIT {limit}",
            Self::DIALECT.columns
        );
        Ok(self
            .load_records(&sql, None)?
            .into_iter()
            .map(RecordRow::into_row)
            .collect())
    }

    /// The row with this msg_id (compared as stored, so an unreadable one is found too).
    fn __find(&mut self, msg_id: &str) -> Result<Option<OutboxRow>> {
        let d = &Self::DIALECT;
        let sql = format!("SELECT {} FROM outbox WHERE msg_id = {}", d.columns, d.ph);
        // msg_id is unique: at most one row.
        Ok(self
            .load_records(&sql, Some(msg_id))?
            .pop()
            .map(RecordRow::into_row))
    }

    /// DEAD → NEW: these ids, refused as a whole ([`Error::UnreadableRow`]) if one of them
    /// does not decode; or every DEAD row that decodes, a page at a time.
    fn __redrive(&mut self, ids: Option<&[i64]>) -> Result<usize> {
        const PAGE: usize = 1000;
        let redrive = |c: &mut Self, ids: &[i64]| -> Result<usize> {
            if ids.is_empty() {
                return Ok(0);
            }
            Ok(c.run_sql(&(Self::DIALECT.redrive)(&in_list(ids)), None)?)
        };
        if let Some(ids) = ids {
            if ids.is_empty() {
                return Ok(0);
            }
            let sql = format!(
                "SELECT {} FROM outbox WHERE status = 2 AND id IN ({})",
                Self::DIALECT.columns,
                in_list(ids)
            );
            for row in self.load_records(&sql, None)? {
                if let OutboxRow::Unreadable(raw) = row.into_row() {
                    return Err(Error::UnreadableRow {
                        id: raw.id,
                        reason: raw.reason,
                    });
                }
            }
            return redrive(self, ids);
        }
        let (mut after, mut total) = (0, 0);
        loop {
            let page = self.__list(Some(Status::Dead), after, PAGE)?;
            let Some(last) = page.last() else {
                return Ok(total);
            };
            after = last.id();
            let readable: Vec<i64> = page
                .iter()
                .filter_map(|r| match r {
                    OutboxRow::Readable(r) => Some(r.id),
                    OutboxRow::Unreadable(_) => None,
                })
                .collect();
            total += redrive(self, &readable)?;
        }
    }

    /// Deletes these DEAD rows.
    fn __purge_dead(&mut self, ids: &[i64]) -> Result<usize> {
        if ids.is_empty() {
            return Ok(0);
        }
        let sql = format!(
            "DELETE FROM outbox WHERE status = 2 AND id IN ({})",
            in_list(ids)
        );
        Ok(self.run_sql(&sql, None)?)
    }

    /// Deletes up to `batch` SENT rows sent more than `older_than_us` ago.
    fn __purge_sent(&mut self, older_than_us: i64, batch: usize) -> Result<usize> {
        let d = &Self::DIALECT;
        let filter = format!("status = 1 AND sent_at < {}", (d.ago)(older_than_us));
        // Oldest first, through the `outbox_sent` index.
        Ok(self.run_sql(
            &(d.delete_limited)("outbox", &filter, "sent_at", batch),
            None,
        )?)
    }

    /// Deletes up to `batch` dedup rows older than `older_than_us`.
    fn __purge_consumed(&mut self, older_than_us: i64, batch: usize) -> Result<usize> {
        let d = &Self::DIALECT;
        let filter = format!("consumed_at < {}", (d.ago)(older_than_us));
        let sql = (d.delete_limited)("consumed_msg", &filter, "consumed_at", batch);
        Ok(self.run_sql(&sql, None)?)
    }

    /// The migration [`migrate`](crate::migrate) runs: [`Self::__MIGRATION`], but on
    /// PostgreSQL the partitioned one for partitioned tables.
    fn __migration_sql(&mut self) -> Result<&'static str> {
        Ok(Self::__MIGRATION)
    }

    /// The highest migration version recorded in `outbox_migrations`; `None` when the
    /// table is missing (never migrated, or migrated before the table existed) or empty.
    fn __migration_version(&mut self) -> Result<Option<i32>> {
        // In a transaction (a savepoint inside the caller's): on PostgreSQL a failed
        // statement would otherwise abort a transaction the caller has open.
        match self.transaction(Self::version_row) {
            Ok(row) => Ok(row.version),
            Err(e) if is_missing_table(&e, "outbox_migrations") => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

/// Loads the rows of `sql`, with `bind` as its one text parameter if any: the body of
/// each backend's `load_records`, `backlog_row` and `version_row` (see [`Backend`]).
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

/// NEW and DEAD rows per topic and status (SENT rows are left out: counting them would
/// read the whole table, where the partial indexes hold only NEW and DEAD rows).
pub(crate) const TOPICS_SQL: &str = "SELECT topic, status, COUNT(*) AS n FROM outbox \
     WHERE status IN (0, 2) GROUP BY topic, status ORDER BY topic";

/// Loads the one row of `sql` (see [`load_rows`]).
pub(crate) fn load_one<C, T>(conn: &mut C, sql: &str) -> QueryResult<T>
where
    C: Connection,
    for<'q> SqlQuery: LoadQuery<'q, C, T>,
{
    diesel::sql_query(sql).get_result(conn)
}

/// Runs `sql`, with `bind` as its one text parameter if any: the body of each
/// backend's `run_sql` (see [`Backend`]).
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
