//! The failure path: messages the broker refused, parked in `outbox_cdc_parked` with the
//! later messages of their keys, and retried from there in order.
//!
//! The success path writes nothing per message; only a refusal writes: the refused
//! row's `retries`, `next_retry_at` and `last_error` (or DEAD past the limit), as the
//! polling relay does, and a parked entry for it and for each later message of its key
//! until the key's parked messages are all published or dead.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Text, Timestamptz};
use diesel::{Connection as _, PgConnection, QueryableByName, RunQueryDsl as _};
use outbox_core::{RetryDecision, RetryPolicy, StoredMessage};
use outbox_diesel::PgMessageRow;

use crate::{CdcError, PgPool, Result};

/// Runs `f` on a pooled connection on a blocking thread (diesel is synchronous).
pub(crate) async fn db<T: Send + 'static>(
    pool: &PgPool,
    f: impl FnOnce(&mut PgConnection) -> Result<T> + Send + 'static,
) -> Result<T> {
    let pool = pool.clone();
    tokio::task::spawn_blocking(move || f(&mut *pool.get()?))
        .await
        .map_err(|e| CdcError::db(format!("database task failed: {e}")))?
}

/// What to write after a publish call: refused rows and the messages to park.
#[derive(Debug, Default)]
pub(crate) struct Writes {
    /// Refused rows to retry: id, when, why.
    pub(crate) retry: Vec<(i64, DateTime<Utc>, String)>,
    /// Refused rows past the limit: id, why.
    pub(crate) dead: Vec<(i64, String)>,
    /// Rows to park, in the order they must be published: id, key.
    pub(crate) park: Vec<(i64, String)>,
    /// Parked rows published (by a retry round): unpark, mark SENT.
    pub(crate) sent: Vec<i64>,
}

impl Writes {
    pub(crate) fn is_empty(&self) -> bool {
        self.retry.is_empty()
            && self.dead.is_empty()
            && self.park.is_empty()
            && self.sent.is_empty()
    }

    /// Records that `m` was refused for `reason`: a retry spent, or dead past `policy`'s
    /// limit. Whether its key is now blocked (it waits for a retry).
    pub(crate) fn refused(
        &mut self,
        m: &StoredMessage,
        reason: String,
        policy: &RetryPolicy,
    ) -> bool {
        let failures = m.retries.saturating_add(1);
        match policy.decide_now(failures) {
            RetryDecision::RetryAfter(delay) => {
                let at = Utc::now() + chrono::Duration::from_std(delay).unwrap_or_default();
                self.retry.push((m.id, at, reason));
                true
            }
            RetryDecision::Dead => {
                tracing::warn!(msg_id = %m.envelope.msg_id, failures, %reason, "message dead-lettered");
                self.dead.push((m.id, reason));
                false
            }
        }
    }

    /// Writes everything in one transaction.
    pub(crate) fn apply(self, conn: &mut PgConnection) -> Result<()> {
        conn.transaction(|c| {
            for (id, at, error) in &self.retry {
                diesel::sql_query(
                    "UPDATE outbox SET retries = retries + 1, next_retry_at = $2, last_error = $3 \
                     WHERE id = $1 AND status = 0",
                )
                .bind::<BigInt, _>(id)
                .bind::<Timestamptz, _>(at)
                .bind::<Text, _>(error)
                .execute(c)?;
            }
            for (id, error) in &self.dead {
                diesel::sql_query(
                    "UPDATE outbox SET retries = retries + 1, status = 2, last_error = $2 \
                     WHERE id = $1 AND status = 0",
                )
                .bind::<BigInt, _>(id)
                .bind::<Text, _>(error)
                .execute(c)?;
                diesel::sql_query("DELETE FROM outbox_cdc_parked WHERE id = $1")
                    .bind::<BigInt, _>(id)
                    .execute(c)?;
            }
            for (id, key) in &self.park {
                // A row parked before a crash (the same commits read again) keeps its place.
                diesel::sql_query(
                    "INSERT INTO outbox_cdc_parked (id, msg_key) VALUES ($1, $2) \
                     ON CONFLICT (id) DO NOTHING",
                )
                .bind::<BigInt, _>(id)
                .bind::<Text, _>(key)
                .execute(c)?;
            }
            if !self.sent.is_empty() {
                diesel::sql_query(
                    "UPDATE outbox SET status = 1, sent_at = now() WHERE id = ANY($1) AND status = 0",
                )
                .bind::<diesel::sql_types::Array<BigInt>, _>(&self.sent)
                .execute(c)?;
                diesel::sql_query("DELETE FROM outbox_cdc_parked WHERE id = ANY($1)")
                    .bind::<diesel::sql_types::Array<BigInt>, _>(&self.sent)
                    .execute(c)?;
            }
            Ok::<_, CdcError>(())
        })
    }
}

/// The keys with parked messages: their later messages are parked behind them.
pub(crate) fn blocked_keys(conn: &mut PgConnection) -> Result<HashSet<String>> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Text)]
        msg_key: String,
    }
    let rows: Vec<Row> =
        diesel::sql_query("SELECT DISTINCT msg_key FROM outbox_cdc_parked").load(conn)?;
    Ok(rows.into_iter().map(|r| r.msg_key).collect())
}

/// The parked messages due now: the first parked message of each key, if its retry
/// time has come, in parked order, at most `limit`. Parked entries whose row is no longer
/// NEW (re-driven, purged or marked by an operator) are dropped first.
pub(crate) fn due_heads(conn: &mut PgConnection, limit: usize) -> Result<Vec<PgMessageRow>> {
    diesel::sql_query(
        "DELETE FROM outbox_cdc_parked p WHERE NOT EXISTS \
         (SELECT 1 FROM outbox o WHERE o.id = p.id AND o.status = 0)",
    )
    .execute(conn)?;
    Ok(diesel::sql_query(format!(
        "SELECT {columns} FROM outbox_cdc_parked p JOIN outbox o ON o.id = p.id \
         WHERE p.seq = (SELECT min(q.seq) FROM outbox_cdc_parked q WHERE q.msg_key = p.msg_key) \
         AND o.status = 0 AND o.next_retry_at <= now() ORDER BY p.seq LIMIT $1",
        columns = PgMessageRow::COLUMNS
    ))
    .bind::<BigInt, _>(i64::try_from(limit).unwrap_or(i64::MAX))
    .load(conn)?)
}
