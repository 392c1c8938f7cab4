//! PostgreSQL, all of it: its dialect and its [`Database`] here; the statements of
//! each role in a module of its own (the claim, emit, the consumers' dedup rows, emit on
//! diesel-async); the relay store (`store`) with its claim floor, its LISTEN wake-up and
//! its partition upkeep; the partitioned layout (`partition`).

use std::collections::HashSet;
use std::time::Duration;

use diesel::connection::{AnsiTransactionManager, SimpleConnection as _, TransactionManager as _};
use diesel::result::QueryResult;
use diesel::{PgConnection, RunQueryDsl};
use outbox_core::{Envelope, StoredMessage};

use crate::backend::{Database, Dialect, Floor, ResultRow, execute_sql, load_rows};
use crate::{EmitOptions, Result};

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
    published_minutes: |m| {
        format!(
            "SELECT floor(extract(epoch FROM now() - sent_at) / 60)::bigint AS minutes_ago, \
             COUNT(*) AS n, avg(extract(epoch FROM sent_at - created_at))::float8 AS latency \
             FROM outbox WHERE status = 1 AND sent_at > now() - interval '{m} minutes' \
             GROUP BY 1"
        )
    },
    // New ids, in the order of the old ones, from the id sequence: above the relay's
    // claim floor (`ClaimFloor`), so claimed at the next poll whatever transaction is
    // open, and after every row emitted before, as a message emitted now would be.
    redrive: |ids| redrive_sql(ids, false),
    wake_locks: true,
};

mod claim;
mod emit;
mod floor;
mod inbox;
mod listen;
mod maintenance;
mod partition;
mod store;

pub use partition::{
    POSTGRES_PARTITIONED_MIGRATION, Partition, PartitionPolicy, PartitionReport,
    maintain_partitions, migrate_partitioned, partition_policy, partitions,
};
pub use store::{PgRelayStore, with_keepalives};

use crate::backend::ConsumedInsert;
use claim::{
    MarkSent, begin_claim_sql, claim, claim_per_key, claim_sql, mark_sent_and_commit_sql,
    per_key_claim_sql,
};
use emit::insert;
use inbox::{ConsumedDelete, ConsumedInsertBatch};
#[cfg(feature = "async-postgres")]
mod nonblocking;

/// [`Dialect::redrive`]'s statement; with `cdc`, the re-driven rows are parked too
/// (`outbox_cdc_parked`, typed-outbox-cdc's), for the CDC relay's retry round: it reads
/// the log's inserts only, and would never see this UPDATE. One statement either way.
fn redrive_sql(ids: &str, cdc: bool) -> String {
    let (park, returning) = if cdc {
        (
            ", u AS (",
            " RETURNING o.id, o.msg_key) INSERT INTO outbox_cdc_parked (id, msg_key) \
             SELECT id, msg_key FROM u ORDER BY id",
        )
    } else {
        (" ", "")
    };
    format!(
        "WITH d AS MATERIALIZED (SELECT id FROM outbox WHERE status = 2 \
         AND id IN ({ids}) ORDER BY id), \
         n AS MATERIALIZED (SELECT id AS old, \
         nextval(pg_get_serial_sequence('outbox', 'id')) AS id FROM d){park}\
         UPDATE outbox o SET status = 0, retries = 0, next_retry_at = now(), \
         last_error = NULL, id = n.id FROM n WHERE o.id = n.old AND o.status = 2{returning}"
    )
}

impl Database for PgConnection {
    const MIGRATION: &'static str = crate::migrate::POSTGRES_UP;
    const DIALECT: Dialect = DIALECT;

    fn redrive_sql(&mut self, ids: &str) -> Result<String> {
        Ok(redrive_sql(ids, store::cdc_slot(self)?.is_some()))
    }

    fn load<T: ResultRow>(&mut self, sql: &str, bind: Option<&str>) -> QueryResult<Vec<T>> {
        load_rows(self, sql, bind)
    }

    fn execute(&mut self, sql: &str, bind: Option<&str>) -> QueryResult<usize> {
        execute_sql(self, sql, bind)
    }

    fn migration_sql(&mut self) -> Result<&'static str> {
        Ok(match partition::partition_policy(self)? {
            Some(_) => partition::POSTGRES_PARTITIONED_UP,
            None => Self::MIGRATION,
        })
    }

    fn insert(&mut self, options: &EmitOptions, envelopes: &[Envelope]) -> Result<()> {
        insert(self, options, envelopes)
    }

    fn begin_claim(&mut self, stall: Duration) -> Result<()> {
        let begun = AnsiTransactionManager::begin_transaction_sql(self, &begin_claim_sql(stall));
        if begun.is_err() {
            // BEGIN may have run before a later statement of the string failed: leave
            // no transaction open on a connection that goes back to the pool.
            let _ = self.batch_execute("ROLLBACK");
        }
        Ok(begun?)
    }

    fn insert_consumed(&mut self, group: &str, msg_id: &str) -> Result<bool> {
        Ok(ConsumedInsert { group, msg_id }.execute(self)? == 1)
    }

    fn insert_consumed_batch(
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

    fn delete_consumed(&mut self, group: &str, msg_id: &str) -> Result<()> {
        ConsumedDelete { group, msg_id }.execute(self)?;
        Ok(())
    }

    fn commit_checked(&mut self) -> Result<Result<()>> {
        // One round trip for the check and the COMMIT (the consumer's single mode ran
        // five statements per message where a plain loop runs four): in a simple-query
        // string the statements after a failed one do not run, so an aborted
        // transaction fails the `SELECT 1` (any statement fails in an aborted
        // transaction) and stays open, while a healthy one commits. libpq's transaction
        // status, which diesel follows, tells the two failures apart.
        match self.batch_execute("SELECT 1; COMMIT") {
            Ok(()) => Ok(Ok(())),
            Err(e) => {
                let status = AnsiTransactionManager::transaction_manager_status_mut(self);
                match status.transaction_depth() {
                    Ok(Some(_)) => Ok(Err(e.into())),
                    _ => Err(e.into()),
                }
            }
        }
    }

    fn claim_per_key_sql(limit: usize, held: &[i64]) -> String {
        per_key_claim_sql(limit, held, Floor::default())
    }

    fn claim_per_key(
        &mut self,
        limit: usize,
        held: &[i64],
        floor: Floor,
    ) -> Result<Vec<StoredMessage>> {
        claim_per_key(self, limit, held, floor)
    }

    fn claim_sql(limit: usize) -> String {
        claim_sql(limit, false, 0)
    }

    fn claim(&mut self, limit: usize, held: &[i64], floor: i64) -> Result<Vec<StoredMessage>> {
        claim(self, limit, held, floor)
    }

    fn mark_sent(&mut self, ids: &[i64]) -> Result<()> {
        MarkSent { ids }.execute(self)?;
        Ok(())
    }

    fn mark_sent_and_commit(&mut self, ids: &[i64]) -> Result<()> {
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
