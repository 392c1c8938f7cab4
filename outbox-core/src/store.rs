use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::{Error, StoredMessage};

/// What happened to a claimed batch, applied by [`ClaimedBatch::complete`] in one
/// transaction with the claim.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RelayBatchOutcome {
    /// Row ids published: mark SENT.
    pub sent: Vec<i64>,
    /// Rows that failed and will be retried: `retries + 1`, and the row's
    /// `next_retry_at` and error.
    pub retry: Vec<RetryRow>,
    /// Rows that failed for the last time: `retries + 1`, DEAD, and the error.
    pub dead: Vec<DeadRow>,
}

/// A row of a [`RelayBatchOutcome`] that failed and will be retried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryRow {
    /// The row's id.
    pub id: i64,
    /// When the row is due again (its `next_retry_at`).
    pub next_retry_at: DateTime<Utc>,
    /// Why it failed, stored as its `last_error`.
    pub error: String,
}

/// A row of a [`RelayBatchOutcome`] that failed for the last time: it becomes DEAD.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadRow {
    /// The row's id.
    pub id: i64,
    /// Why it failed, stored as its `last_error`.
    pub error: String,
}

impl RelayBatchOutcome {
    /// Whether there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.sent.is_empty() && self.retry.is_empty() && self.dead.is_empty()
    }
}

/// The numbers an operator alerts on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backlog {
    /// NEW rows whose `next_retry_at` has come.
    pub due: u64,
    /// Age of the oldest due NEW row (by `created_at`), if any.
    pub oldest_due_age: Option<Duration>,
    /// DEAD rows waiting for an operator.
    pub dead: u64,
}

/// The relay's side of the outbox table.
pub trait RelayStore: Send + Sync {
    /// A claimed batch; dropping it without [`ClaimedBatch::complete`] releases the rows
    /// untouched.
    type Batch: ClaimedBatch;

    /// Claims up to `limit` due NEW rows in id order. Claimed rows are invisible to other
    /// claimers until the batch is completed or dropped.
    fn claim(&self, limit: usize) -> impl Future<Output = Result<Self::Batch, Error>> + Send;

    /// Waits until new rows may be due, or `timeout` passes. The default sleeps;
    /// PostgreSQL overrides it with LISTEN so a commit wakes the relay at once.
    fn wait_for_work(&self, timeout: Duration) -> impl Future<Output = ()> + Send {
        tokio::time::sleep(timeout)
    }

    /// Backlog statistics.
    fn backlog(&self) -> impl Future<Output = Result<Backlog, Error>> + Send;

    /// Whether this store may claim again while a batch it returned is still in hand:
    /// the second claim must skip the first batch's rows (as row locks make another
    /// relay's claim skip them) and keep per-key order around them. Then
    /// [`Relay::run_until`](crate::Relay::run_until) claims its next batch while it
    /// publishes the current one, and holds two batches (two pooled connections with
    /// row locks) at a time. The default, `false`, claims one batch at a time (a store
    /// whose claim takes no locks, like SQLite's, must keep it).
    fn claims_ahead(&self) -> bool {
        false
    }

    /// Claims the next batch while `held` (the ids of a batch this store returned, still
    /// in hand) is published: like [`claim`](Self::claim), except that the rows of
    /// `held` hold back none of the later rows of their keys, since the caller publishes
    /// and completes `held` first. The caller must drop (release) the batch returned
    /// here unless every row of `held` was then completed SENT or DEAD: a row left NEW
    /// (retried, held back) would otherwise be overtaken by a later row of its key.
    ///
    /// Without it, a relay that claims ahead in per-key order would find the later rows
    /// of every key in its current batch held back behind its own batch. The default
    /// claims as [`claim`](Self::claim) does (always safe, never faster).
    fn claim_after(
        &self,
        limit: usize,
        held: &[i64],
    ) -> impl Future<Output = Result<Self::Batch, Error>> + Send {
        let _ = held;
        self.claim(limit)
    }
}

/// Rows claimed by [`RelayStore::claim`].
pub trait ClaimedBatch: Send {
    /// The claimed messages, in id order.
    fn messages(&self) -> &[StoredMessage];

    /// Writes the outcome and releases the claim, atomically.
    fn complete(self, outcome: RelayBatchOutcome)
    -> impl Future<Output = Result<(), Error>> + Send;
}
