//! MySQL and MariaDB: the dialect, the [`Database`] and the relay store (`store`).

use std::collections::HashMap;
use std::time::Duration;

use diesel::connection::{AnsiTransactionManager, SimpleConnection as _, TransactionManager};
use diesel::mysql::Mysql;
use diesel::query_builder::{AstPass, BoxedSqlQuery, QueryFragment, QueryId, SqlQuery};
use diesel::result::{DatabaseErrorKind, QueryResult};
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel::{MysqlConnection, QueryableByName, RunQueryDsl};
use outbox_core::{Envelope, MsgId};

use crate::backend::{ConsumedInsert, ConsumedSql, Database, Dialect, RecordRow, ResultRow};
use crate::backend::{FIND_ONE, MsgIdRow, Row, TAKE_BACK, chunks, in_list, with_msg_ids};
use crate::{EmitOptions, Result};

mod store;

pub use store::{MysqlRelayStore, mysql_cdc_lock};

pub(super) const DIALECT: Dialect = Dialect {
    // Timestamps as Unix microseconds, independent of the session time zone.
    columns: "id, msg_id, topic, event_type, msg_key, schema_version, payload, headers, \
              status, retries, \
              TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', next_retry_at) AS next_retry_us, \
              TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', created_at) AS created_us, \
              TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', sent_at) AS sent_us, last_error",
    now: "UTC_TIMESTAMP(6)",
    ph: "?",
    lock: " FOR UPDATE SKIP LOCKED",
    backlog: "SELECT \
        (SELECT COUNT(*) FROM outbox WHERE status = 0 AND next_retry_at <= UTC_TIMESTAMP(6)) AS due, \
        (SELECT TIMESTAMPDIFF(MICROSECOND, MIN(created_at), UTC_TIMESTAMP(6)) \
           FROM outbox WHERE status = 0 AND next_retry_at <= UTC_TIMESTAMP(6)) AS oldest_us, \
        (SELECT COUNT(*) FROM outbox WHERE status = 2) AS dead",
    later: |us| format!("(UTC_TIMESTAMP(6) + INTERVAL {us} MICROSECOND)"),
    ago: |us| format!("(UTC_TIMESTAMP(6) - INTERVAL {us} MICROSECOND)"),
    // MySQL has DELETE .. ORDER BY .. LIMIT (and no LIMIT in IN subqueries).
    delete_limited: |table, filter, order, n| {
        format!("DELETE FROM {table} WHERE {filter} ORDER BY {order} LIMIT {n}")
    },
    durable_dead: None,
    published_minutes: |m| {
        format!(
            "SELECT CAST(FLOOR(TIMESTAMPDIFF(MICROSECOND, sent_at, UTC_TIMESTAMP(6)) / 60000000) \
             AS SIGNED) AS minutes_ago, COUNT(*) AS n, \
             CAST(AVG(TIMESTAMPDIFF(MICROSECOND, created_at, sent_at)) / 1000000 AS DOUBLE) \
             AS latency FROM outbox WHERE status = 1 \
             AND sent_at > UTC_TIMESTAMP(6) - INTERVAL {m} MINUTE GROUP BY minutes_ago"
        )
    },
    redrive: |ids| crate::backend::redrive_in_place("UTC_TIMESTAMP(6)", ids),
    wake_locks: false,
};

/// SQL that is true when two `msg_key` expressions are the same key, byte for byte, as
/// Rust compares them. The shipped tables' `utf8mb4_bin` is a PAD SPACE collation on
/// MariaDB (and MySQL), where `'k' = 'k '`: with that alone, a key's rows could be
/// held back by, or grouped with, another key's, and a later `k ` row published ahead
/// of an older one. The plain `=` keeps the `(status, msg_key, id)` index usable (it
/// selects both keys, in id order); the binary comparison then keeps the exact key.
fn same_key(a: &str, b: &str) -> String {
    format!("{a} = {b} AND CAST({a} AS BINARY) = CAST({b} AS BINARY)")
}

/// What the claim's connection runs before `BEGIN`, in one round trip.
///
/// READ COMMITTED for the claim: InnoDB then takes no gap locks, so a claim that reaches
/// the end of the NEW rows does not block emitters' inserts while the batch is being
/// published. Applies to the next transaction only.
///
/// Unless `stall` is zero, bounds for a relay that stalls while it holds the batch (see
/// `MysqlRelayStore`), in whole seconds (rounded up): `idle_transaction_timeout` (inside
/// `/*M! */`, which only MariaDB runs: MySQL has no such variable) and
/// `innodb_lock_wait_timeout`. Session variables: they stay on the connection.
fn prepare_claim_sql(stall: Duration) -> String {
    const ISOLATION: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED";
    if stall.is_zero() {
        return ISOLATION.to_owned();
    }
    // innodb_lock_wait_timeout's range is 1 ..= 1073741824 s; one year is plenty.
    let secs = stall
        .as_secs()
        .saturating_add(u64::from(stall.subsec_nanos() > 0))
        .clamp(1, 365 * 24 * 3600);
    format!(
        "SET SESSION innodb_lock_wait_timeout = {secs} \
         /*M! , idle_transaction_timeout = {secs} */; {ISOLATION}"
    )
}

/// `INSERT INTO outbox .. VALUES (..)[, (..)]`, timestamps from the server's UTC clock.
/// Cached when it holds one row.
///
/// No `INSERT IGNORE` (it also turns truncation and other errors into warnings) and no
/// `ON DUPLICATE KEY UPDATE id = id` (diesel connects with CLIENT_FOUND_ROWS, so a
/// duplicate would report 1 row, not 0): a plain INSERT, whose duplicate-key error InnoDB
/// rolls back as a statement, leaving the caller's transaction intact.
struct Insert<'a> {
    rows: &'a [Row<'a>],
}

impl QueryId for Insert<'_> {
    type QueryId = Insert<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl QueryFragment<Mysql> for Insert<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Mysql>) -> QueryResult<()> {
        if self.rows.len() != 1 {
            out.unsafe_to_cache_prepared();
        }
        out.push_sql(
            "INSERT INTO outbox (msg_id, topic, event_type, msg_key, schema_version, payload, \
             headers, next_retry_at, created_at) VALUES ",
        );
        crate::backend::push_values(
            self.rows,
            &mut out,
            "",
            ", UTC_TIMESTAMP(6), UTC_TIMESTAMP(6)",
        )?;
        Ok(())
    }
}

impl<Conn> RunQueryDsl<Conn> for Insert<'_> {}

/// The msg_id MySQL names in "Duplicate entry 'x' for key ..", if it is one of `rows`.
fn named_duplicate<'a>(message: &str, rows: &[Row<'a>]) -> Option<&'a str> {
    let rest = message.strip_prefix("Duplicate entry '")?;
    let end = rest.rfind("' for key")?;
    let named = &rest[..end];
    rows.iter().map(|r| r.msg_id).find(|id| *id == named)
}

fn insert(conn: &mut MysqlConnection, envelopes: &[Envelope]) -> Result<()> {
    let rows = envelopes.iter().map(Row::new).collect::<Result<Vec<_>>>()?;
    let mut done: Vec<&str> = Vec::new();
    for chunk in chunks(&rows) {
        match (Insert { rows: chunk }).execute(conn) {
            Ok(_) => done.extend(chunk.iter().map(|r| r.msg_id)),
            Err(diesel::result::Error::DatabaseError(DatabaseErrorKind::UniqueViolation, info)) => {
                let dup = match known_duplicate(chunk, info.message()) {
                    Some(d) => d.to_owned(),
                    None => found_duplicate(chunk, find_one(chunk).load::<MsgIdRow>(conn)?),
                };
                // The failed statement was rolled back by InnoDB; take back the earlier
                // chunks of this call so that it is all or nothing.
                if !done.is_empty() {
                    with_msg_ids::<Mysql>(TAKE_BACK, &done).execute(conn)?;
                }
                return Err(outbox_core::Error::Duplicate(MsgId::new(dup)?).into());
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The msg_id a chunk's duplicate-key error (`message`) is about, when it says so
/// without a query: the chunk's one row, or the row MySQL names.
fn known_duplicate<'a>(chunk: &[Row<'a>], message: &str) -> Option<&'a str> {
    match chunk {
        [one] => Some(one.msg_id),
        _ => named_duplicate(message, chunk),
    }
}

/// The query for a chunk's duplicate that [`known_duplicate`] could not name.
fn find_one<'a>(chunk: &[Row<'a>]) -> BoxedSqlQuery<'a, Mysql, SqlQuery> {
    let ids: Vec<&str> = chunk.iter().map(|r| r.msg_id).collect();
    with_msg_ids::<Mysql>(FIND_ONE, &ids)
}

/// The duplicate [`find_one`] found (the chunk's first row if it found none).
fn found_duplicate(chunk: &[Row<'_>], mut found: Vec<MsgIdRow>) -> String {
    found
        .pop()
        .map_or_else(|| chunk[0].msg_id.to_owned(), |r| r.msg_id)
}

/// Emit on diesel-async's MySQL connections: the same statements as above ([`Insert`],
/// the duplicate lookup, the take-back), awaited.
#[cfg(feature = "async-mysql")]
mod nonblocking {
    use diesel::mysql::Mysql;
    use diesel::result::DatabaseErrorKind;
    use diesel_async::pooled_connection::deadpool::{Object, Pool, PoolError};
    use diesel_async::{AsyncConnection, TransactionManager as _};
    use diesel_async::{AsyncConnectionCore, RunQueryDsl as _, SimpleAsyncConnection as _};
    use outbox_core::{Envelope, MsgId};

    use super::{Insert, MsgIdRow, Row, TAKE_BACK, chunks, with_msg_ids};
    use super::{find_one, found_duplicate, known_duplicate};
    use crate::{EmitOptions, Result};

    /// The blocking inbox's statements on `AsyncMysqlConnection`: the same dedup insert
    /// and probe of the server's transaction.
    impl crate::async_inbox::AsyncInboxConnection for diesel_async::AsyncMysqlConnection {
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
            // MySQL rolls back only a failed statement: nothing to check.
            <Self as AsyncConnection>::TransactionManager::commit_transaction(self).await?;
            Ok(Ok(()))
        }

        async fn transaction_open(&mut self) -> Result<bool> {
            // The probe of the blocking inbox: releasing a savepoint fails (1305)
            // exactly when no transaction is open.
            if self
                .batch_execute("SAVEPOINT outbox_probe; RELEASE SAVEPOINT outbox_probe")
                .await
                .is_ok()
            {
                return Ok(true);
            }
            // The probe also fails on a lost connection: that is a store error.
            self.batch_execute("DO 0").await?;
            Ok(false)
        }
    }

    impl crate::async_emit::AsyncInsert for Mysql {
        async fn insert<C>(
            conn: &mut C,
            _options: &EmitOptions,
            envelopes: &[Envelope],
        ) -> Result<()>
        where
            C: AsyncConnectionCore<Backend = Mysql>,
        {
            let rows = envelopes.iter().map(Row::new).collect::<Result<Vec<_>>>()?;
            let mut done: Vec<&str> = Vec::new();
            for chunk in chunks(&rows) {
                match (Insert { rows: chunk }).execute(conn).await {
                    Ok(_) => done.extend(chunk.iter().map(|r| r.msg_id)),
                    Err(diesel::result::Error::DatabaseError(
                        DatabaseErrorKind::UniqueViolation,
                        info,
                    )) => {
                        let dup = match known_duplicate(chunk, info.message()) {
                            Some(d) => d.to_owned(),
                            None => {
                                let found = find_one(chunk).load::<MsgIdRow>(conn).await?;
                                found_duplicate(chunk, found)
                            }
                        };
                        if !done.is_empty() {
                            with_msg_ids::<Mysql>(TAKE_BACK, &done)
                                .execute(conn)
                                .await?;
                        }
                        return Err(outbox_core::Error::Duplicate(MsgId::new(dup)?).into());
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Ok(())
        }
    }
}

/// `INSERT IGNORE INTO consumed_msg ..`: 0 rows when already consumed, no error. The
/// inputs are validated first (msg_id and group lengths), so IGNORE has nothing else to
/// hide.
impl ConsumedSql for Mysql {
    const HEAD: &'static str =
        "INSERT IGNORE INTO consumed_msg (consumer_group, msg_id, consumed_at) VALUES (";
    const TAIL: &'static str = ", UTC_TIMESTAMP(6))";
}

impl Database for MysqlConnection {
    const MIGRATION: &'static str = crate::migrate::MYSQL_UP;
    const DIALECT: Dialect = DIALECT;

    fn redrive_sql(&mut self, ids: &str) -> Result<String> {
        match store::mysql_cdc_lock(self)? {
            Some(relay) => Err(crate::Error::RedriveInCdcMode { relay }),
            None => Ok((DIALECT.redrive)(ids)),
        }
    }

    fn load<T: ResultRow>(&mut self, sql: &str, bind: Option<&str>) -> QueryResult<Vec<T>> {
        crate::backend::load_rows(self, sql, bind)
    }

    fn execute(&mut self, sql: &str, bind: Option<&str>) -> QueryResult<usize> {
        crate::backend::execute_sql(self, sql, bind)
    }

    fn insert(&mut self, _options: &EmitOptions, envelopes: &[Envelope]) -> Result<()> {
        insert(self, envelopes)
    }

    fn begin_claim(&mut self, stall: Duration) -> Result<()> {
        self.batch_execute(&prepare_claim_sql(stall))?;
        Ok(AnsiTransactionManager::begin_transaction(self)?)
    }

    fn insert_consumed(&mut self, group: &str, msg_id: &str) -> Result<bool> {
        Ok(ConsumedInsert { group, msg_id }.execute(self)? == 1)
    }

    fn forget_if_lost(&mut self) {
        // diesel's `MysqlConnection` does not notice that its server has gone away: r2d2
        // took a dead connection back as healthy and, on a pool that skips the check on
        // check-out, handed it out for every claim, long after the server had come back
        // (a relay never resumed after its MariaDB's restart). One round trip, after a
        // failure only.
        if self.batch_execute("DO 0").is_err() {
            AnsiTransactionManager::transaction_manager_status_mut(self).set_in_error();
        }
    }

    fn transaction_open(&mut self) -> Result<bool> {
        // Outside a transaction a savepoint ends with its own statement, so releasing it
        // fails (1305) exactly when no transaction is open. (`@@in_transaction` would
        // say it directly, but only MariaDB has it.) One round trip.
        if self
            .batch_execute("SAVEPOINT outbox_probe; RELEASE SAVEPOINT outbox_probe")
            .is_ok()
        {
            return Ok(true);
        }
        // The probe also fails on a lost connection: that is a store error.
        self.batch_execute("DO 0")?;
        Ok(false)
    }

    /// MariaDB allows no row locks in a CTE: the per-key claim takes two statements in
    /// the claim's transaction. This one locks `L` (due NEW rows whose key's head is
    /// due); [`key_probe_sql`](Database::key_probe_sql) then finds, per key
    /// of `L`, the first NEW row outside it.
    ///
    /// The unordered claim, forced onto `outbox_claim` too: on statistics taken before a
    /// burst (or none yet: a fresh table), MariaDB walks the primary key through every
    /// SENT row or reads and sorts the whole backlog until InnoDB recalculates them
    /// (BENCHMARKS.md, "Claim plans"); the index walk reads about `limit` rows
    /// whatever the statistics say.
    fn claim_sql(limit: usize) -> String {
        format!(
            "SELECT {} FROM outbox FORCE INDEX (outbox_claim) \
             WHERE status = 0 AND next_retry_at <= {} ORDER BY id LIMIT {limit}{}",
            DIALECT.columns, DIALECT.now, DIALECT.lock
        )
    }

    /// The scan is forced onto `outbox_claim` (`status, id, ..`), in id order: with the
    /// head check in its condition, MariaDB otherwise picks a range scan on
    /// `(status, next_retry_at)` and a filesort on small tables, which reads, and so
    /// locks, every due NEW row before the LIMIT, leaving nothing to a second relay.
    ///
    /// (`held` is always empty: see `MysqlRelayStore`'s `claim_after`.)
    fn claim_per_key_sql(limit: usize, held: &[i64]) -> String {
        debug_assert!(held.is_empty(), "MySQL claims ahead without `held`");
        format!(
            "SELECT {} FROM outbox o FORCE INDEX (outbox_claim) \
             WHERE status = 0 AND next_retry_at <= {} AND {} \
             ORDER BY id LIMIT {limit}{}",
            DIALECT.columns,
            DIALECT.now,
            crate::backend::head_is_due(&DIALECT, "o", same_key),
            DIALECT.lock
        )
    }

    fn key_probe_sql(ids: &[i64]) -> String {
        let ids = in_list(ids);
        // Grouped by the key's bytes (see `same_key`); all of a group's keys are equal,
        // so MIN picks that key.
        crate::backend::first_outside_sql(
            &format!(
                "SELECT MIN(msg_key) AS msg_key, MAX(id) AS last FROM outbox \
                 WHERE id IN ({ids}) GROUP BY CAST(msg_key AS BINARY)"
            ),
            &ids,
            same_key,
        )
    }

    fn claim_per_key(
        &mut self,
        limit: usize,
        held: &[i64],
        _floor: crate::backend::Floor,
    ) -> Result<Vec<outbox_core::StoredMessage>> {
        let rows: Vec<RecordRow> = self.load(&Self::claim_per_key_sql(limit, held), None)?;
        let mut locked = crate::backend::claimed(self, rows)?;
        if locked.is_empty() {
            return Ok(locked);
        }
        let ids: Vec<i64> = locked.iter().map(|r| r.id).collect();
        let first_out: HashMap<String, i64> = diesel::sql_query(Self::key_probe_sql(&ids))
            .load::<FirstOutside>(self)?
            .into_iter()
            .filter_map(|r| Some((r.msg_key, r.first_out?)))
            .collect();
        if !first_out.is_empty() {
            locked.retain(|r| first_out.get(&r.envelope.key).is_none_or(|&gap| r.id < gap));
        }
        Ok(locked)
    }
}

/// A row of [`first_outside_sql`].
#[derive(QueryableByName)]
struct FirstOutside {
    #[diesel(sql_type = Text)]
    msg_key: String,
    #[diesel(sql_type = Nullable<BigInt>)]
    first_out: Option<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;

    #[test]
    fn the_claim_sets_its_stall_bounds_in_whole_seconds() {
        assert_eq!(
            prepare_claim_sql(Duration::ZERO),
            "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
        );
        let sql = prepare_claim_sql(Duration::from_millis(1500));
        assert_eq!(
            sql,
            "SET SESSION innodb_lock_wait_timeout = 2 /*M! , idle_transaction_timeout = 2 */; \
             SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
        );
        assert!(prepare_claim_sql(Duration::from_millis(1)).contains("= 1 "));
        assert!(prepare_claim_sql(Duration::MAX).contains("= 31536000 "));
    }

    #[test]
    fn names_the_duplicate_from_the_message() {
        let row = |msg_id| Row {
            msg_id,
            topic: "t",
            event_type: "E",
            key: "k",
            schema_version: 1,
            payload: "{}",
            headers: Cow::Borrowed("{}"),
        };
        let rows = [row("a:E"), row("it's:E")];
        let m = "Duplicate entry 'it's:E' for key 'outbox_msg_id_key'";
        assert_eq!(named_duplicate(m, &rows), Some("it's:E"));
        assert_eq!(
            named_duplicate("Duplicate entry 'zz' for key 'x'", &rows),
            None
        );
    }
}
