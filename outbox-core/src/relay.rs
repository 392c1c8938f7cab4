use std::future::Future;
use std::time::{Duration, Instant};

use chrono::Utc;
use tracing::Instrument as _;

use crate::{
    BatchOutcome, ClaimedBatch, Error, OutageBackoff, Publisher, RelayStore, RetryDecision,
    RetryPolicy,
};

/// Relay settings. `Default` gives batches of 500, a 1 s poll and the default
/// [`RetryPolicy`] and [`OutageBackoff`].
#[derive(Debug, Clone, PartialEq)]
pub struct RelayConfig {
    /// Rows claimed and published per round trip (default 500).
    pub batch_size: usize,
    /// Longest wait for new work while idle (default 1 s). With a store that wakes the
    /// relay (PostgreSQL LISTEN) this is only the fallback.
    pub poll_interval: Duration,
    /// Retries of messages that fail on their own.
    pub retry: RetryPolicy,
    /// Pauses while the broker or database is down.
    pub outage_backoff: OutageBackoff,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            batch_size: 500,
            poll_interval: Duration::from_secs(1),
            retry: RetryPolicy::default(),
            outage_backoff: OutageBackoff::default(),
        }
    }
}

/// What one [`Relay::run_once`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Rows claimed.
    pub claimed: usize,
    /// Rows published and marked SENT.
    pub sent: usize,
    /// Rows that failed and were scheduled for a retry.
    pub retried: usize,
    /// Rows that failed for the last time and became DEAD.
    pub dead: usize,
}

/// Moves committed outbox rows to a broker: claim a batch, publish it, mark SENT or
/// record the failures, commit.
///
/// ```
/// # #[cfg(feature = "memory")] {
/// use outbox_core::{MemoryBroker, MemoryDb, OutboxEvent, Relay};
///
/// #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
/// struct OrderPaid { #[outbox(id)] order_id: String }
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let db = MemoryDb::new(());
/// db.transaction(|tx| tx.emit(OrderPaid { order_id: "order-42".into() }))?;
/// let broker = MemoryBroker::new();
/// let relay = Relay::new(db.clone(), broker.clone());
/// assert_eq!(relay.run_once().await?.sent, 1);
/// assert_eq!(broker.published("order.paid")[0].msg_id.as_str(), "order-42:OrderPaid");
/// # Ok::<_, outbox_core::Error>(()) }).unwrap();
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Relay<S, P> {
    store: S,
    publisher: P,
    config: RelayConfig,
}

impl<S: RelayStore, P: Publisher> Relay<S, P> {
    /// A relay with the default [`RelayConfig`].
    pub fn new(store: S, publisher: P) -> Self {
        Self {
            store,
            publisher,
            config: RelayConfig::default(),
        }
    }

    /// Replaces the configuration; a batch size of zero is an error.
    pub fn with_config(mut self, config: RelayConfig) -> Result<Self, Error> {
        if config.batch_size == 0 {
            return Err(Error::Config("batch_size must be at least 1".into()));
        }
        self.config = config;
        Ok(self)
    }

    /// The configuration in force.
    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Claims, publishes and completes one batch.
    ///
    /// A broker outage or database error is returned as is and leaves every claimed row
    /// as it was (NEW, retries unchanged).
    pub async fn run_once(&self) -> Result<BatchReport, Error> {
        let started = Instant::now();
        let span = tracing::debug_span!("outbox.relay.batch", claimed = tracing::field::Empty);
        let report = self.batch().instrument(span).await;
        if let Ok(r) = &report {
            if r.claimed > 0 {
                metrics::histogram!("outbox_relay_batch_seconds")
                    .record(started.elapsed().as_secs_f64());
            }
        }
        report
    }

    async fn batch(&self) -> Result<BatchReport, Error> {
        let batch = self.store.claim(self.config.batch_size).await?;
        let claimed = batch.messages().len();
        tracing::Span::current().record("claimed", claimed);
        if claimed == 0 {
            return Ok(BatchReport::default());
        }
        // On an outage `batch` is dropped here, which releases every row untouched.
        let results = self.publisher.publish(batch.messages()).await?;
        if results.len() != claimed {
            return Err(Error::broker_unavailable(format!(
                "publisher returned {} results for a batch of {claimed}",
                results.len()
            )));
        }
        let outcome = self.outcome(batch.messages(), results);
        let report = BatchReport {
            claimed,
            sent: outcome.sent.len(),
            retried: outcome.retry.len(),
            dead: outcome.dead.len(),
        };
        let now = Utc::now();
        for m in batch.messages() {
            let lag = (now - m.envelope.created_at).to_std().unwrap_or_default();
            metrics::histogram!("outbox_relay_commit_to_publish_seconds").record(lag.as_secs_f64());
        }
        batch.complete(outcome).await?;
        metrics::counter!("outbox_relay_published_total").increment(report.sent as u64);
        metrics::counter!("outbox_relay_failed_attempts_total")
            .increment((report.retried + report.dead) as u64);
        metrics::counter!("outbox_relay_dead_lettered_total").increment(report.dead as u64);
        Ok(report)
    }

    fn outcome(
        &self,
        messages: &[crate::StoredMessage],
        results: crate::PublishOutcomes,
    ) -> BatchOutcome {
        let mut outcome = BatchOutcome::default();
        for (m, result) in messages.iter().zip(results) {
            let Err(rejected) = result else {
                outcome.sent.push(m.id);
                continue;
            };
            let failures = m.retries.saturating_add(1);
            match self.config.retry.decide_now(failures) {
                RetryDecision::RetryAfter(delay) => {
                    let at = Utc::now()
                        + chrono::Duration::from_std(delay).unwrap_or(chrono::Duration::MAX);
                    outcome.retry.push((m.id, at, rejected.reason));
                }
                RetryDecision::Dead => {
                    tracing::warn!(msg_id = %m.envelope.msg_id, failures, reason = %rejected.reason, "message dead-lettered");
                    outcome.dead.push((m.id, rejected.reason));
                }
            }
        }
        outcome
    }

    /// Runs until `shutdown` completes. The batch in hand is always finished; the signal
    /// is observed between batches and while waiting. Outages are logged and backed off;
    /// this returns only on shutdown.
    pub async fn run_until(&self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut outages = 0u32;
        loop {
            let pause = match self.run_once().await {
                Ok(report) => {
                    outages = 0;
                    // A busy relay claims again at once; an idle one waits for work.
                    (report.claimed == 0).then_some(Idle::Poll)
                }
                Err(e) => {
                    outages = outages.saturating_add(1);
                    let pause = self.config.outage_backoff.pause(outages);
                    tracing::warn!(error = %e, ?pause, "relay paused after an outage");
                    metrics::counter!("outbox_relay_outages_total").increment(1);
                    Some(Idle::Outage(pause))
                }
            };
            let wait = async {
                match pause {
                    None => {}
                    Some(Idle::Poll) => self.store.wait_for_work(self.config.poll_interval).await,
                    Some(Idle::Outage(pause)) => tokio::time::sleep(pause).await,
                }
            };
            tokio::select! {
                biased;
                () = &mut shutdown => {
                    tracing::info!("relay stopped");
                    return;
                }
                () = wait => {}
            }
        }
    }
}

enum Idle {
    Poll,
    Outage(Duration),
}
