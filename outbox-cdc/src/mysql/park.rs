//! The failure path on MySQL / MariaDB: the same [`Writes`] as on PostgreSQL (refused
//! rows, parked messages, re-published ones) in MySQL's SQL, and the queries of the
//! retry round and the backfill.

use std::collections::HashSet;

use mysql_async::prelude::Queryable as _;
use mysql_async::{Pool, TxOpts};

use super::rows::{Rows, SELECT_COLUMNS, split_rows};
use crate::park::Writes;
use crate::{CdcError, Result};

/// `YYYY-MM-DD HH:MM:SS.ffffff` in UTC, as outbox-diesel writes `DATETIME(6)`.
fn datetime(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S%.6f").to_string()
}

impl crate::store::FailureWrites for Pool {
    async fn write(&self, writes: Writes) -> Result<()> {
        apply(self, writes).await
    }
}

/// Writes `writes` in one transaction (see [`Writes::apply`] for PostgreSQL's).
pub(crate) async fn apply(pool: &Pool, writes: Writes) -> Result<()> {
    let mut conn = pool.get_conn().await.map_err(CdcError::db)?;
    let mut tx = conn
        .start_transaction(TxOpts::default())
        .await
        .map_err(CdcError::db)?;
    for (id, at, error) in &writes.retry {
        tx.exec_drop(
            "UPDATE outbox SET retries = retries + 1, next_retry_at = ?, last_error = ? \
             WHERE id = ? AND status = 0",
            (datetime(*at), error.as_str(), id),
        )
        .await
        .map_err(CdcError::db)?;
    }
    for (id, error) in &writes.dead {
        tx.exec_drop(
            "UPDATE outbox SET retries = retries + 1, status = 2, last_error = ? \
             WHERE id = ? AND status = 0",
            (error.as_str(), id),
        )
        .await
        .map_err(CdcError::db)?;
        tx.exec_drop("DELETE FROM outbox_cdc_parked WHERE id = ?", (id,))
            .await
            .map_err(CdcError::db)?;
    }
    for (id, key) in &writes.park {
        // A row parked before a crash (the same commits read again) keeps its place.
        tx.exec_drop(
            "INSERT IGNORE INTO outbox_cdc_parked (id, msg_key) VALUES (?, ?)",
            (id, key.as_str()),
        )
        .await
        .map_err(CdcError::db)?;
    }
    for id in &writes.sent {
        tx.exec_drop(
            "UPDATE outbox SET status = 1, sent_at = UTC_TIMESTAMP(6) WHERE id = ? AND status = 0",
            (id,),
        )
        .await
        .map_err(CdcError::db)?;
        tx.exec_drop("DELETE FROM outbox_cdc_parked WHERE id = ?", (id,))
            .await
            .map_err(CdcError::db)?;
    }
    tx.commit().await.map_err(CdcError::db)
}

/// The keys with parked messages.
pub(crate) async fn blocked_keys(pool: &Pool) -> Result<HashSet<String>> {
    let mut conn = pool.get_conn().await.map_err(CdcError::db)?;
    let keys: Vec<String> = conn
        .query("SELECT DISTINCT msg_key FROM outbox_cdc_parked")
        .await
        .map_err(CdcError::db)?;
    Ok(keys.into_iter().collect())
}

/// The parked messages due now: the first of each key whose retry time has come, in
/// parked order, at most `limit` (see [`crate::park::due_heads`]).
pub(crate) async fn due_heads(pool: &Pool, limit: usize) -> Result<Rows> {
    let mut conn = pool.get_conn().await.map_err(CdcError::db)?;
    conn.query_drop(
        "DELETE p FROM outbox_cdc_parked p LEFT JOIN outbox o ON o.id = p.id AND o.status = 0 \
         WHERE o.id IS NULL",
    )
    .await
    .map_err(CdcError::db)?;
    let rows: Vec<mysql_async::Row> = conn
        .exec(
            format!(
                "SELECT {SELECT_COLUMNS} FROM outbox_cdc_parked p JOIN outbox o ON o.id = p.id \
                 WHERE p.seq = (SELECT MIN(q.seq) FROM outbox_cdc_parked q WHERE q.msg_key = p.msg_key) \
                 AND o.status = 0 AND o.next_retry_at <= UTC_TIMESTAMP(6) ORDER BY p.seq LIMIT ?"
            ),
            (u64::try_from(limit).unwrap_or(u64::MAX),),
        )
        .await
        .map_err(CdcError::db)?;
    split_rows(rows)
}

/// The rows of `ids` still NEW and not parked, in the order of `ids`: a spilled commit's
/// messages as committed (a row it deleted is not found, one it updated is read
/// updated).
pub(crate) async fn committed_rows(pool: &Pool, ids: &[i64]) -> Result<Rows> {
    if ids.is_empty() {
        return Ok(Rows::default());
    }
    let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    let mut conn = pool.get_conn().await.map_err(CdcError::db)?;
    let rows: Vec<mysql_async::Row> = conn
        .query(format!(
            "SELECT {SELECT_COLUMNS} FROM outbox o WHERE o.id IN ({list}) AND o.status = 0 \
             AND NOT EXISTS (SELECT 1 FROM outbox_cdc_parked p WHERE p.id = o.id)"
        ))
        .await
        .map_err(CdcError::db)?;
    let (mut messages, unreadable) = split_rows(rows)?;
    crate::reader::in_order_of(ids, &mut messages, |m| m.id);
    Ok((messages, unreadable))
}

/// The next backfill batch (NEW rows in the range not parked, in id order) and the last
/// id read; `None` when the range is done (its start then moved to its end).
pub(crate) async fn backfill_batch(pool: &Pool, limit: usize) -> Result<Option<(Rows, i64)>> {
    let mut conn = pool.get_conn().await.map_err(CdcError::db)?;
    let range: Option<(i64, i64)> = conn
        .query_first("SELECT backfill_from, backfill_upto FROM outbox_cdc")
        .await
        .map_err(CdcError::db)?;
    let (from, upto) = range.ok_or(CdcError::NotSetUp)?;
    if from >= upto {
        return Ok(None);
    }
    let rows: Vec<mysql_async::Row> = conn
        .exec(
            format!(
                "SELECT {SELECT_COLUMNS} FROM outbox o WHERE o.status = 0 AND o.id > ? AND o.id <= ? \
                 AND NOT EXISTS (SELECT 1 FROM outbox_cdc_parked p WHERE p.id = o.id) \
                 ORDER BY o.id LIMIT ?"
            ),
            (from, upto, u64::try_from(limit).unwrap_or(u64::MAX)),
        )
        .await
        .map_err(CdcError::db)?;
    if rows.is_empty() {
        conn.query_drop("UPDATE outbox_cdc SET backfill_from = backfill_upto")
            .await
            .map_err(CdcError::db)?;
        return Ok(None);
    }
    let last = rows
        .last()
        .and_then(|r| r.get::<Option<String>, _>(0).flatten())
        .and_then(|id| id.parse().ok())
        .unwrap_or(from);
    Ok(Some((split_rows(rows)?, last)))
}

/// Moves the backfill's start past `last`.
pub(crate) async fn backfilled(pool: &Pool, last: i64) -> Result<()> {
    let mut conn = pool.get_conn().await.map_err(CdcError::db)?;
    conn.exec_drop(
        "UPDATE outbox_cdc SET backfill_from = GREATEST(backfill_from, ?)",
        (last,),
    )
    .await
    .map_err(CdcError::db)
}
