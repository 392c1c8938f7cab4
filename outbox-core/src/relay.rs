use std::collections::HashSet;
use std::future::Future;
use std::time::{Duration, Instant};

use chrono::Utc;
use tracing::Instrument as _;

use crate::{
    ClaimedBatch, DeadRow, Error, InvalidConfig, OutageBackoff, Publisher, RejectKind, Rejected,
    RelayBatchOutcome, RelayStore, RetryDecision, RetryPolicy, RetryRow,
};

/// Relay settings. `Default` gives batches of 500, a 1 s poll and the default
/// [`RetryPolicy`] and [`OutageBackoff`]; each `with_*` setter changes one field and
/// keeps the others, and [`Relay::with_config`] validates the whole.
///
/// ```
/// use std::time::Duration;
/// use outbox_core::{RelayConfig, RetryPolicy};
///
/// let config = RelayConfig::default()
///     .with_batch_size(100)
///     .with_retry(RetryPolicy::default().with_max_attempts(5));
/// assert_eq!(config.batch_size, 100);
/// assert_eq!(config.poll_interval, Duration::from_secs(1)); // untouched
/// assert!(config.validate().is_ok());
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
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
    /// How often [`Relay::run_until`] reads the backlog into the `outbox_backlog_*`
    /// gauges (default 10 s).
    pub backlog_interval: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            batch_size: 500,
            poll_interval: Duration::from_secs(1),
            retry: RetryPolicy::default(),
            outage_backoff: OutageBackoff::default(),
            backlog_interval: Duration::from_secs(10),
        }
    }
}

impl RelayConfig {
    /// Sets [`batch_size`](Self::batch_size).
    #[must_use]
    pub fn with_batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// Sets [`poll_interval`](Self::poll_interval).
    #[must_use]
    pub fn with_poll_interval(mut self, poll_interval: Duration) -> Self {
        self.poll_interval = poll_interval;
        self
    }

    /// Sets [`retry`](Self::retry).
    #[must_use]
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Sets [`outage_backoff`](Self::outage_backoff).
    #[must_use]
    pub fn with_outage_backoff(mut self, outage_backoff: OutageBackoff) -> Self {
        self.outage_backoff = outage_backoff;
        self
    }

    /// Sets [`backlog_interval`](Self::backlog_interval).
    #[must_use]
    pub fn with_backlog_interval(mut self, backlog_interval: Duration) -> Self {
        self.backlog_interval = backlog_interval;
        self
    }

    /// Checks every field, nested policies included (their fields are reported as
    /// `retry.jitter`, `outage_backoff.min`): `batch_size` at least 1, and
    /// [`RetryPolicy::validate`], [`OutageBackoff::validate`].
    /// [`Relay::with_config`] calls it.
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        if self.batch_size == 0 {
            return Err(InvalidConfig::new("batch_size", "must be at least 1"));
        }
        self.retry.validate().map_err(|e| e.in_field("retry"))?;
        self.outage_backoff
            .validate()
            .map_err(|e| e.in_field("outage_backoff"))
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

#[doc = include_str!("../docs/relay.md")]
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

    /// Replaces the configuration, after [`RelayConfig::validate`]: a value out of range
    /// is [`Error::Config`].
    pub fn with_config(mut self, config: RelayConfig) -> Result<Self, Error> {
        config.validate()?;
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
    /// as it was (NEW, retries unchanged), except that what the broker took before it
    /// failed (an outage part-way through the batch, see [`Relay`]) is first recorded as
    /// SENT, and the outage returned afterwards. Rows held back behind a rejected retry
    /// of their key are released untouched: `claimed - sent - retried - dead` of the
    /// report.
    pub async fn run_once(&self) -> Result<BatchReport, Error> {
        observed(async {
            let batch = self.store.claim(self.config.batch_size).await?;
            self.finish(batch).await
        })
        .await
    }

    /// One batch of [`run_until`](Self::run_until): the batch claimed ahead by the last
    /// one, or a new claim. While a full batch is published and completed, the next one
    /// is claimed beside it if the store allows it ([`RelayStore::claims_ahead`]): a
    /// relay that is behind keeps the database and the broker busy at once instead of
    /// one after the other. The batch claimed ahead is published after this one is
    /// completed, so a relay still publishes in id order; with per-key claims it may hold
    /// later rows of this batch's keys, and is released if a row of this batch stays NEW.
    async fn run_ahead(
        &self,
        ahead: &mut Option<S::Batch>,
        lookahead: &mut Lookahead,
    ) -> Result<BatchReport, Error> {
        let limit = self.config.batch_size;
        observed(async {
            let batch = match ahead.take() {
                Some(batch) => batch,
                None => self.store.claim(limit).await?,
            };
            let full = batch.messages().len() >= limit;
            if !(full && self.store.claims_ahead() && lookahead.allows()) {
                return self.finish(batch).await;
            }
            let held: Vec<i64> = batch.messages().iter().map(|m| m.id).collect();
            let (report, next) =
                tokio::join!(self.finish(batch), self.store.claim_after(limit, &held));
            // After a failure the relay backs off: it does not hold a batch meanwhile.
            let report = report?;
            let next = next?;
            lookahead.saw(next.messages().len(), limit);
            // The batch ahead was claimed as if this one were published in full: if a
            // row of it stays NEW (to be retried, or held back behind a retry), a later
            // row of its key may be in the batch ahead, which is released instead.
            if report.sent + report.dead == report.claimed && !next.messages().is_empty() {
                *ahead = Some(next);
            }
            Ok(report)
        })
        .await
    }

    /// Publishes a claimed batch and completes it.
    async fn finish(&self, batch: S::Batch) -> Result<BatchReport, Error> {
        let claimed = batch.messages().len();
        tracing::Span::current().record("claimed", claimed);
        if claimed == 0 {
            return Ok(BatchReport::default());
        }
        // Open until the batch is recorded (dropped on return).
        let _traces = crate::trace::publish_spans(batch.messages());
        // On an outage in the first wave `batch` is dropped here, which releases every
        // row untouched.
        let Waves { fates, interrupted } = self.publish_in_waves(batch.messages()).await?;
        let outcome = self.outcome(batch.messages(), fates);
        let report = BatchReport {
            claimed,
            sent: outcome.sent.len(),
            retried: outcome.retry.len(),
            dead: outcome.dead.len(),
        };
        let now = Utc::now();
        let lag = metrics::histogram!("outbox_relay_commit_to_publish_seconds");
        for m in batch.messages() {
            lag.record(
                (now - m.envelope.created_at)
                    .to_std()
                    .unwrap_or_default()
                    .as_secs_f64(),
            );
        }
        batch.complete(outcome).await?;
        metrics::counter!("outbox_relay_published_total").increment(report.sent as u64);
        metrics::counter!("outbox_relay_failed_attempts_total")
            .increment((report.retried + report.dead) as u64);
        metrics::counter!("outbox_relay_dead_lettered_total").increment(report.dead as u64);
        match interrupted {
            // What was published is recorded; the rest stays NEW. Back off as usual.
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// Publishes the batch, usually in one call. A message that is being retried
    /// (`retries > 0`) has failed on its own before and may well fail again, so the
    /// later messages of its key wait for its result in a further call ("wave") and are
    /// not published at all, left NEW and untouched, if it is rejected again. That keeps
    /// a key in order across retries at the price of one more round trip, paid only by
    /// batches that hold a retry followed by a message of the same key.
    ///
    /// Returns what became of each message and the error that interrupted the batch
    /// after something was published, if any ([`Waves`]): what was published is
    /// recorded first. A message the broker did not take for a fault of its own or of
    /// the topic ([`RejectKind::Unavailable`], [`RejectKind::Topic`]) ends the waves with
    /// such an error. A whole call that fails in the first wave is returned as is.
    async fn publish_in_waves(&self, messages: &[crate::StoredMessage]) -> Result<Waves, Error> {
        let mut fates = vec![Fate::Unpublished; messages.len()];
        let mut pending: Vec<usize> = (0..messages.len()).collect();
        let mut rejected_keys: HashSet<&str> = HashSet::new();
        let mut first = true;
        while !pending.is_empty() {
            let (wave, later) = next_wave(messages, pending, &rejected_keys);
            if wave.is_empty() {
                break;
            }
            let outcomes = match self.publish_wave(messages, &wave).await {
                Ok(r) => r,
                Err(e) if first => return Err(e),
                Err(e) => return Ok(Waves::interrupted(fates, e)),
            };
            let mut failed_here: HashSet<&str> = HashSet::new();
            let mut halted = Halted::default();
            for (&i, result) in wave.iter().zip(outcomes) {
                let key = messages[i].envelope.key.as_str();
                match &result {
                    Err(rejected) => {
                        failed_here.insert(key);
                        rejected_keys.insert(key);
                        halted.note(&messages[i].envelope.topic, rejected);
                    }
                    Ok(()) if failed_here.contains(key) => {
                        // Published in the same call as an earlier message of its key
                        // that the broker did not take: this key is now out of order.
                        tracing::warn!(msg_id = %messages[i].envelope.msg_id, key, "published after an unpublished message of its key");
                        metrics::counter!("outbox_relay_key_order_broken_total").increment(1);
                    }
                    Ok(()) => {}
                }
                fates[i] = Fate::from(result);
            }
            if let Some(e) = halted.into_error(wave.len()) {
                // The broker or a topic is at fault: what it took is recorded, the rest
                // (including later waves) stays NEW, and the relay backs off.
                return Ok(Waves::interrupted(fates, e));
            }
            pending = later;
            first = false;
        }
        Ok(Waves {
            fates,
            interrupted: None,
        })
    }

    /// One call of the publisher with the messages of `wave`; a result per message.
    async fn publish_wave(
        &self,
        messages: &[crate::StoredMessage],
        wave: &[usize],
    ) -> Result<crate::PublishOutcomes, Error> {
        let published = if wave.len() == messages.len() {
            self.publisher.publish(messages).await?
        } else {
            let subset: Vec<crate::StoredMessage> =
                wave.iter().map(|&i| messages[i].clone()).collect();
            self.publisher.publish(&subset).await?
        };
        if published.len() != wave.len() {
            return Err(Error::broker_unavailable(format!(
                "publisher returned {} results for {} messages",
                published.len(),
                wave.len()
            )));
        }
        Ok(published)
    }

    fn outcome(&self, messages: &[crate::StoredMessage], fates: Vec<Fate>) -> RelayBatchOutcome {
        let mut outcome = RelayBatchOutcome::default();
        for (m, fate) in messages.iter().zip(fates) {
            let rejected = match fate {
                Fate::Unpublished => continue, // released untouched
                Fate::Taken => {
                    outcome.sent.push(m.id);
                    continue;
                }
                Fate::Rejected(rejected) => rejected,
            };
            if !rejected.spends_retry() {
                continue; // the broker's or the topic's fault: released untouched
            }
            let failures = m.retries.saturating_add(1);
            match self.config.retry.decide_now(failures) {
                RetryDecision::RetryAfter(delay) => {
                    // Capped so that every backend's timestamp column can hold it.
                    let delay = delay.min(LONGEST_DELAY);
                    let at = Utc::now() + chrono::Duration::from_std(delay).unwrap_or_default();
                    outcome.retry.push(RetryRow {
                        id: m.id,
                        next_retry_at: at,
                        error: rejected.reason,
                    });
                }
                RetryDecision::Dead => {
                    tracing::warn!(msg_id = %m.envelope.msg_id, failures, reason = %rejected.reason, "message dead-lettered");
                    outcome.dead.push(DeadRow {
                        id: m.id,
                        error: rejected.reason,
                    });
                }
            }
        }
        outcome
    }

    /// Runs until `shutdown` completes. The batch in hand is always finished; the signal
    /// is observed between batches and while waiting.
    ///
    /// Outages of the broker or database ([`Error::is_outage`]) are logged and backed off
    /// without end; any other error (a misconfiguration, a store held by another relay)
    /// stops the relay and is returned.
    pub async fn run_until(&self, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut outages = 0u32;
        let mut backlog_due = Instant::now(); // read it on the first turn
        // A batch claimed ahead is released (rolled back) when the relay stops.
        let mut ahead = None;
        let mut lookahead = Lookahead::default();
        loop {
            if Instant::now() >= backlog_due {
                backlog_due = Instant::now() + self.config.backlog_interval.min(LONGEST_DELAY);
                // The backlog is read on a pooled connection: with a pool of one, a relay
                // holding a batch claimed ahead would wait for itself (and the batch's
                // transaction would sit idle meanwhile). Release it; it is claimed again.
                ahead = None;
                self.record_backlog().await;
            }
            let idle = match self.run_ahead(&mut ahead, &mut lookahead).await {
                Ok(report) => {
                    outages = 0;
                    // A busy relay claims again at once; an idle one waits for work.
                    (report.claimed == 0).then_some(Idle::Poll)
                }
                Err(e) if e.is_outage() => {
                    outages = outages.saturating_add(1);
                    let pause = self.config.outage_backoff.pause(outages);
                    tracing::warn!(error = %crate::error_chain(&e), ?pause, "relay paused after an outage");
                    metrics::counter!("outbox_relay_outages_total").increment(1);
                    Some(Idle::Outage(pause))
                }
                Err(e) => {
                    tracing::error!(error = %crate::error_chain(&e), "relay stopped by an error");
                    return Err(e);
                }
            };
            let wait = async {
                match idle {
                    None => {}
                    Some(Idle::Poll) => {
                        let timeout = self.config.poll_interval.min(LONGEST_DELAY);
                        self.store.wait_for_work(timeout).await;
                    }
                    Some(Idle::Outage(pause)) => tokio::time::sleep(pause).await,
                }
            };
            tokio::select! {
                biased;
                () = &mut shutdown => {
                    tracing::info!("relay stopped");
                    return Ok(());
                }
                () = wait => {}
            }
        }
    }

    async fn record_backlog(&self) {
        match self.store.backlog().await {
            Ok(b) => {
                metrics::gauge!("outbox_backlog_due").set(b.due as f64);
                let age = b.oldest_due_age.unwrap_or_default().as_secs_f64();
                metrics::gauge!("outbox_backlog_oldest_due_seconds").set(age);
                metrics::gauge!("outbox_backlog_dead").set(b.dead as f64);
            }
            Err(e) => {
                tracing::warn!(error = %crate::error_chain(&e), "cannot read the outbox backlog")
            }
        }
    }
}

/// Ten years: the longest delay taken from a configuration (retry delays, poll and
/// backlog intervals), so that deadlines and stored timestamps never overflow.
const LONGEST_DELAY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

enum Idle {
    Poll,
    Outage(Duration),
}

/// Runs one batch (`run`) in the `outbox.relay.batch` span, whose `claimed` field
/// [`Relay::finish`] records, and records `outbox_relay_batch_seconds` for a batch that
/// claimed rows and did not fail: what [`Relay::run_once`] and [`Relay::run_ahead`]
/// share.
async fn observed(
    run: impl Future<Output = Result<BatchReport, Error>>,
) -> Result<BatchReport, Error> {
    let started = Instant::now();
    let span = tracing::debug_span!("outbox.relay.batch", claimed = tracing::field::Empty);
    let report = run.instrument(span).await;
    if let Ok(r) = &report
        && r.claimed > 0
    {
        metrics::histogram!("outbox_relay_batch_seconds").record(started.elapsed().as_secs_f64());
    }
    report
}

/// Of the `pending` messages (indexes into `messages`), those of the next wave and those
/// that wait for a later one: a message waits behind a retried message of its key
/// (`retries > 0`) in this wave, and one whose key was rejected in an earlier wave is
/// left out (it stays NEW).
fn next_wave<'m>(
    messages: &'m [crate::StoredMessage],
    pending: Vec<usize>,
    rejected_keys: &HashSet<&'m str>,
) -> (Vec<usize>, Vec<usize>) {
    let mut wave = Vec::with_capacity(pending.len());
    let mut later = Vec::new();
    let mut waiting_keys: HashSet<&str> = HashSet::new();
    for i in pending {
        let key = messages[i].envelope.key.as_str();
        if rejected_keys.contains(key) {
            continue; // stays NEW: an earlier message of its key failed
        }
        if waiting_keys.contains(key) {
            later.push(i);
            continue;
        }
        if messages[i].retries > 0 {
            waiting_keys.insert(key);
        }
        wave.push(i);
    }
    (wave, later)
}

/// What [`Relay::publish_in_waves`] did with a batch.
struct Waves {
    /// What became of each message, in the batch's order.
    fates: Vec<Fate>,
    /// The error that ended the waves after the broker had taken part of the batch:
    /// the relay records what it took, then backs off with this error.
    interrupted: Option<Error>,
}

impl Waves {
    /// Waves ended by `error`, with what they did until then.
    fn interrupted(fates: Vec<Fate>, error: Error) -> Self {
        Self {
            fates,
            interrupted: Some(error),
        }
    }
}

/// What became of one message of a batch published in waves.
#[derive(Debug, Clone)]
enum Fate {
    /// Not published: an earlier message of its key was rejected, or the waves ended
    /// before its own. Its row is released untouched.
    Unpublished,
    /// The broker took it: its row is marked SENT.
    Taken,
    /// The broker did not take it: a retry is spent if the fault is the message's own
    /// ([`Rejected::spends_retry`]), else its row is released untouched.
    Rejected(Rejected),
}

impl From<Result<(), Rejected>> for Fate {
    fn from(published: Result<(), Rejected>) -> Self {
        match published {
            Ok(()) => Self::Taken,
            Err(rejected) => Self::Rejected(rejected),
        }
    }
}

/// When [`Relay::run_ahead`] claims ahead. A claim ahead that comes back nearly empty
/// although the last batch was full found the rows held back behind the batch in hand
/// (per-key claims over few hot keys): it cost a claim for nothing, so the relay claims
/// one batch at a time for the next few batches before it tries again.
#[derive(Default)]
struct Lookahead {
    /// Batches left to run without claiming ahead.
    pause: u32,
}

impl Lookahead {
    /// Batches without a claim ahead after one that came back nearly empty.
    const PAUSE: u32 = 8;

    fn allows(&mut self) -> bool {
        if self.pause == 0 {
            return true;
        }
        self.pause -= 1;
        false
    }

    fn saw(&mut self, claimed: usize, limit: usize) {
        if claimed < limit.div_ceil(4) {
            self.pause = Self::PAUSE;
        }
    }
}

/// The messages of one call that the broker did not take for a fault of its own
/// ([`RejectKind::Unavailable`]) or of their topic ([`RejectKind::Topic`]).
#[derive(Default)]
struct Halted {
    unavailable: usize,
    first_unavailable: Option<String>,
    /// Per topic: how many messages, and the first reason.
    topics: Vec<(String, usize, String)>,
}

impl Halted {
    fn note(&mut self, topic: &str, rejected: &Rejected) {
        match rejected.kind {
            // Held back behind an earlier message of its key: that one's fate decides.
            RejectKind::Message | RejectKind::Held => {}
            RejectKind::Unavailable => {
                self.unavailable += 1;
                self.first_unavailable
                    .get_or_insert_with(|| rejected.reason.clone());
            }
            RejectKind::Topic => match self.topics.iter_mut().find(|(t, ..)| t == topic) {
                Some((_, n, _)) => *n += 1,
                None => self
                    .topics
                    .push((topic.to_owned(), 1, rejected.reason.clone())),
            },
        }
    }

    /// The error that ends the batch, if any message was held back; logs and counts each
    /// topic the broker refuses.
    fn into_error(self, called: usize) -> Option<Error> {
        let mut parts = Vec::new();
        if let Some(reason) = self.first_unavailable {
            parts.push(format!(
                "{} of {called} messages not taken by the broker: {reason}",
                self.unavailable
            ));
        }
        for (topic, n, reason) in self.topics {
            tracing::error!(topic, messages = n, %reason, "the broker refuses every message of this topic: they wait, spending no retries, until an operator fixes the topic");
            metrics::counter!("outbox_relay_topic_errors_total", "topic" => topic.clone())
                .increment(1);
            parts.push(format!(
                "topic `{topic}` refuses every message ({n} held back): {reason}"
            ));
        }
        (!parts.is_empty()).then(|| Error::broker_unavailable(parts.join("; ")))
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use super::*;
    use crate::{MemoryBroker, MemoryDb, OutboxEvent, Status};

    #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
    struct Ping {
        #[outbox(id)]
        n: u32,
    }

    fn db_with(n: u32) -> MemoryDb<()> {
        let db = MemoryDb::new(());
        for i in 0..n {
            db.transaction(|tx| tx.emit(Ping { n: i })).unwrap();
        }
        db
    }

    fn config(max_attempts: u32, batch_size: usize) -> RelayConfig {
        let retry = RetryPolicy {
            max_attempts,
            base_delay: Duration::ZERO,
            jitter: 0.0,
            ..RetryPolicy::default()
        };
        RelayConfig {
            batch_size,
            retry,
            ..RelayConfig::default()
        }
    }

    #[tokio::test]
    async fn publishes_in_id_order_one_batch_at_a_time() {
        let db = db_with(5);
        let broker = MemoryBroker::new();
        let relay = Relay::new(db.clone(), broker.clone())
            .with_config(config(3, 2))
            .unwrap();
        let sent: Vec<usize> = [
            relay.run_once().await,
            relay.run_once().await,
            relay.run_once().await,
            relay.run_once().await,
        ]
        .into_iter()
        .map(|r| r.unwrap().sent)
        .collect();
        assert_eq!(sent, [2, 2, 1, 0]);
        let ids: Vec<String> = broker
            .published("ping")
            .iter()
            .map(|e| e.msg_id.to_string())
            .collect();
        assert_eq!(ids, ["0:Ping", "1:Ping", "2:Ping", "3:Ping", "4:Ping"]);
        assert!(db.rows().iter().all(|r| r.status == Status::Sent));
    }

    #[tokio::test]
    async fn outage_spends_no_retries_and_kills_nothing() {
        let db = db_with(3);
        let broker = MemoryBroker::new();
        broker.set_down(true);
        let relay = Relay::new(db.clone(), broker.clone())
            .with_config(config(1, 10))
            .unwrap();
        for _ in 0..5 {
            let err = relay.run_once().await.unwrap_err();
            assert!(err.is_outage(), "{err}");
        }
        assert!(
            db.rows()
                .iter()
                .all(|r| r.status == Status::New && r.retries == 0)
        );
        broker.set_down(false);
        assert_eq!(
            relay.run_once().await.unwrap().sent,
            3,
            "released rows are claimable again"
        );
    }

    #[tokio::test]
    async fn rejected_messages_retry_then_die_with_their_error() {
        let db = db_with(2);
        let broker = MemoryBroker::new();
        broker.reject_next(4); // both messages fail twice
        let relay = Relay::new(db.clone(), broker.clone())
            .with_config(config(2, 10))
            .unwrap();
        let first = relay.run_once().await.unwrap();
        assert_eq!((first.retried, first.dead, first.sent), (2, 0, 0));
        let second = relay.run_once().await.unwrap();
        assert_eq!((second.retried, second.dead, second.sent), (0, 2, 0));
        let rows = db.rows();
        assert!(
            rows.iter()
                .all(|r| r.status == Status::Dead && r.retries == 2)
        );
        assert_eq!(rows[0].last_error.as_deref(), Some("injected failure"));
        assert_eq!(
            relay.run_once().await.unwrap().claimed,
            0,
            "DEAD rows are never claimed"
        );
        assert_eq!(relay.store().backlog().await.unwrap().dead, 2);
    }

    #[tokio::test]
    async fn retry_waits_for_its_backoff() {
        let db = db_with(1);
        let broker = MemoryBroker::new();
        broker.reject_next(1);
        let hour = Duration::from_secs(3600);
        let retry = RetryPolicy {
            base_delay: hour,
            max_delay: hour,
            ..RetryPolicy::default()
        };
        let relay = Relay::new(db.clone(), broker)
            .with_config(RelayConfig {
                retry,
                ..RelayConfig::default()
            })
            .unwrap();
        assert_eq!(relay.run_once().await.unwrap().retried, 1);
        assert_eq!(
            relay.run_once().await.unwrap().claimed,
            0,
            "not due for an hour"
        );
        assert!(db.rows()[0].next_retry_at > chrono::Utc::now() + chrono::Duration::minutes(30));
    }

    #[test]
    fn zero_batch_size_is_a_config_error() {
        let relay = Relay::new(MemoryDb::new(()), MemoryBroker::new());
        let err = relay
            .with_config(RelayConfig {
                batch_size: 0,
                ..RelayConfig::default()
            })
            .unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err}");
    }

    #[test]
    fn a_nested_policy_out_of_range_is_refused_and_named() {
        let cases = [
            (
                RelayConfig::default().with_retry(RetryPolicy::default().with_jitter(1.5)),
                "retry.jitter",
            ),
            (
                RelayConfig::default().with_retry(RetryPolicy::default().with_max_attempts(0)),
                "retry.max_attempts",
            ),
            (
                RelayConfig::default()
                    .with_outage_backoff(OutageBackoff::default().with_min(Duration::from_secs(9))),
                "outage_backoff.min",
            ),
        ];
        for (config, field) in cases {
            let relay = Relay::new(MemoryDb::new(()), MemoryBroker::new());
            match relay.with_config(config) {
                Err(Error::Config(e)) => assert_eq!(e.field(), field, "{e}"),
                other => panic!("{field}: expected a config error, got {:?}", other.err()),
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn run_until_drains_wakes_on_commit_and_stops() {
        let db = db_with(1200);
        let broker = MemoryBroker::new();
        // A poll interval far longer than the test: only the wake-up can deliver the late
        // message in time.
        let cfg = RelayConfig {
            poll_interval: Duration::from_secs(3600),
            ..RelayConfig::default()
        };
        let relay = Relay::new(db.clone(), broker.clone())
            .with_config(cfg)
            .unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task =
            tokio::spawn(
                async move { relay.run_until(async { stopped.await.unwrap_or(()) }).await },
            );
        wait_until(|| broker.published("ping").len() == 1200).await;
        db.transaction(|tx| tx.emit(Ping { n: 5000 })).unwrap();
        wait_until(|| broker.published("ping").len() == 1201).await;
        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("relay stops on signal")
            .unwrap()
            .unwrap();
        assert!(db.rows().iter().all(|r| r.status == Status::Sent));
    }

    #[tokio::test]
    async fn random_outages_delay_but_lose_and_reorder_nothing() {
        let db = db_with(300);
        let flaky =
            crate::FlakyPublisher::new(MemoryBroker::new(), crate::FailAs::Outage).fail_ratio(0.3);
        let relay = Relay::new(db.clone(), flaky)
            .with_config(config(1, 7))
            .unwrap();
        let mut rounds = 0;
        while db.rows().iter().any(|r| r.status == Status::New) {
            rounds += 1;
            assert!(rounds < 10_000, "the relay makes progress");
            let _ = relay.run_once().await;
        }
        let published: Vec<String> = relay
            .publisher
            .inner()
            .published("ping")
            .iter()
            .map(|e| e.msg_id.to_string())
            .collect();
        let expected: Vec<String> = (0..300).map(|n| format!("{n}:Ping")).collect();
        assert_eq!(published, expected, "every message once, in order");
        assert!(relay.publisher.failures() > 0, "failures were injected");
        assert!(
            db.rows()
                .iter()
                .all(|r| r.status == Status::Sent && r.retries == 0),
            "outages spend no retries"
        );
    }

    #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
    #[outbox(key = account)]
    struct Moved {
        #[outbox(id)]
        n: u32,
        account: String,
    }

    fn moved(n: u32, account: &str) -> Moved {
        Moved {
            n,
            account: account.into(),
        }
    }

    /// Rejects chosen msg_ids a number of times, and fails chosen calls as outages.
    #[derive(Default)]
    struct Picky {
        broker: MemoryBroker,
        reject: std::sync::Mutex<std::collections::HashMap<String, (RejectKind, u32)>>,
        outage_on_call: Option<usize>,
        calls: std::sync::atomic::AtomicUsize,
    }

    impl Picky {
        fn rejecting(msg_id: &str, times: u32) -> Self {
            let p = Self::default();
            p.refuse(msg_id, RejectKind::Message, times);
            p
        }

        fn refuse(&self, msg_id: &str, kind: RejectKind, times: u32) {
            self.reject
                .lock()
                .unwrap()
                .insert(msg_id.into(), (kind, times));
        }

        fn order(&self) -> Vec<String> {
            self.broker
                .published("moved")
                .iter()
                .map(|e| e.msg_id.to_string())
                .collect()
        }
    }

    impl Publisher for Picky {
        async fn publish(
            &self,
            batch: &[crate::StoredMessage],
        ) -> Result<crate::PublishOutcomes, Error> {
            let call = self
                .calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if self.outage_on_call == Some(call) {
                return Err(Error::broker_unavailable("injected outage"));
            }
            let mut out = Vec::new();
            for m in batch {
                let rejected = match self
                    .reject
                    .lock()
                    .unwrap()
                    .get_mut(m.envelope.msg_id.as_str())
                {
                    Some((kind, n)) if *n > 0 => {
                        *n -= 1;
                        Some(*kind)
                    }
                    _ => None,
                };
                if let Some(kind) = rejected {
                    out.push(Err(Rejected::of_kind(kind, "picky")));
                } else {
                    out.extend(self.broker.publish(std::slice::from_ref(m)).await?);
                }
            }
            Ok(out)
        }
    }

    #[tokio::test]
    async fn a_retried_message_holds_back_the_rest_of_its_key_in_the_batch() {
        let db = MemoryDb::new(());
        db.transaction(|tx| tx.emit(moved(0, "a"))).unwrap();
        let relay = Relay::new(db.clone(), Picky::rejecting("0:Moved", 2))
            .with_config(config(5, 10))
            .unwrap();
        assert_eq!(relay.run_once().await.unwrap().retried, 1);
        db.transaction(|tx| {
            tx.emit(moved(1, "a"))?;
            tx.emit(moved(2, "b"))
        })
        .unwrap();
        // a0 is a retry: it goes first, and a1 waits for it; b2 is another key.
        let r = relay.run_once().await.unwrap();
        assert_eq!((r.claimed, r.sent, r.retried, r.dead), (3, 1, 1, 0));
        assert_eq!(relay.publisher.order(), ["2:Moved"]);
        let a1 = db.row("1:Moved").unwrap();
        assert_eq!(
            (a1.status, a1.retries),
            (Status::New, 0),
            "held back untouched"
        );
        let r = relay.run_once().await.unwrap();
        assert_eq!((r.claimed, r.sent), (2, 2));
        assert_eq!(
            relay.publisher.order(),
            ["2:Moved", "0:Moved", "1:Moved"],
            "key a in id order"
        );
    }

    #[tokio::test]
    async fn an_outage_in_a_later_wave_records_the_earlier_one() {
        let db = MemoryDb::new(());
        db.transaction(|tx| tx.emit(moved(0, "a"))).unwrap();
        let picky = Picky {
            outage_on_call: Some(2),
            ..Picky::rejecting("0:Moved", 1)
        };
        let relay = Relay::new(db.clone(), picky)
            .with_config(config(5, 10))
            .unwrap();
        assert_eq!(relay.run_once().await.unwrap().retried, 1);
        db.transaction(|tx| tx.emit(moved(1, "a"))).unwrap();
        let err = relay.run_once().await.unwrap_err();
        assert!(err.is_outage(), "{err}");
        assert_eq!(db.row("0:Moved").unwrap().status, Status::Sent);
        assert_eq!(db.row("1:Moved").unwrap().status, Status::New);
        assert_eq!(relay.run_once().await.unwrap().sent, 1);
        assert_eq!(relay.publisher.order(), ["0:Moved", "1:Moved"]);
    }

    /// A broker that takes the start of a call and then cannot take more (out of memory,
    /// a timeout between round trips): what it took is SENT and never published again,
    /// the rest waits without spending a retry, and the relay reports an outage.
    #[tokio::test]
    async fn an_outage_part_way_through_a_call_records_what_the_broker_took() {
        let db = MemoryDb::new(());
        db.transaction(|tx| (0..4).try_for_each(|n| tx.emit(moved(n, "a")).map(drop)))
            .unwrap();
        let picky = Picky::default();
        picky.refuse("2:Moved", RejectKind::Unavailable, 1);
        picky.refuse("3:Moved", RejectKind::Unavailable, 1);
        let relay = Relay::new(db.clone(), picky)
            .with_config(config(1, 10))
            .unwrap();
        let err = relay.run_once().await.unwrap_err();
        assert!(err.is_outage(), "{err}");
        let shown = crate::error_chain(&err).to_string();
        assert!(shown.contains("2 of 4"), "{shown}");
        let rows: Vec<(Status, u32)> = db.rows().iter().map(|r| (r.status, r.retries)).collect();
        assert_eq!(
            rows,
            [
                (Status::Sent, 0),
                (Status::Sent, 0),
                (Status::New, 0),
                (Status::New, 0)
            ]
        );
        assert_eq!(relay.run_once().await.unwrap().sent, 2);
        assert_eq!(
            relay.publisher.order(),
            ["0:Moved", "1:Moved", "2:Moved", "3:Moved"],
            "each once, in order"
        );
    }

    /// A message the broker did not take for the broker's fault ends the batch: a
    /// later wave (here the rest of a key behind a retried message) is not published.
    #[tokio::test]
    async fn an_unavailable_message_stops_the_later_waves() {
        let db = MemoryDb::new(());
        db.transaction(|tx| tx.emit(moved(0, "a"))).unwrap();
        let picky = Picky::rejecting("0:Moved", 1);
        let relay = Relay::new(db.clone(), picky)
            .with_config(config(5, 10))
            .unwrap();
        assert_eq!(relay.run_once().await.unwrap().retried, 1);
        db.transaction(|tx| {
            tx.emit(moved(1, "a"))?;
            tx.emit(moved(2, "b"))
        })
        .unwrap();
        relay
            .publisher
            .refuse("0:Moved", RejectKind::Unavailable, 1);
        assert!(relay.run_once().await.unwrap_err().is_outage());
        assert_eq!(relay.publisher.order(), ["2:Moved"]);
        let a: Vec<(Status, u32)> = ["0:Moved", "1:Moved"]
            .iter()
            .map(|id| db.row(id).map(|r| (r.status, r.retries)).unwrap())
            .collect();
        assert_eq!(a, [(Status::New, 1), (Status::New, 0)], "no retry spent");
        assert_eq!(relay.run_once().await.unwrap().sent, 2);
        assert_eq!(relay.publisher.order(), ["2:Moved", "0:Moved", "1:Moved"]);
    }

    /// A topic the broker refuses as a whole spends no retry, however often it is
    /// tried, while the other topics of the batch are published.
    #[tokio::test]
    async fn a_refused_topic_spends_no_retries_and_holds_back_only_itself() {
        let db = MemoryDb::new(());
        db.transaction(|tx| {
            tx.emit(moved(0, "a"))?;
            tx.emit(Ping { n: 7 })
        })
        .unwrap();
        let picky = Picky::default();
        picky.refuse("0:Moved", RejectKind::Topic, 3);
        let relay = Relay::new(db.clone(), picky)
            .with_config(config(1, 10))
            .unwrap();
        for _ in 0..3 {
            let err = relay.run_once().await.unwrap_err();
            assert!(err.is_outage(), "{err}");
            let shown = crate::error_chain(&err).to_string();
            assert!(shown.contains("topic `moved`"), "{shown}");
        }
        let row = db.row("0:Moved").unwrap();
        assert_eq!((row.status, row.retries), (Status::New, 0));
        assert_eq!(db.row("7:Ping").unwrap().status, Status::Sent);
        assert_eq!(relay.run_once().await.unwrap().sent, 1);
        assert_eq!(relay.publisher.order(), ["0:Moved"]);
    }

    /// A message the publisher held back behind an earlier one of its key stays NEW with
    /// its retries untouched, without the relay backing off, and goes out after it.
    #[tokio::test]
    async fn a_held_message_spends_no_retry_and_no_backoff() {
        let db = MemoryDb::new(());
        db.transaction(|tx| {
            tx.emit(moved(0, "a"))?;
            tx.emit(moved(1, "a"))?;
            tx.emit(moved(2, "b"))
        })
        .unwrap();
        let picky = Picky::rejecting("0:Moved", 1);
        picky.refuse("1:Moved", RejectKind::Held, 1);
        let relay = Relay::new(db.clone(), picky)
            .with_config(config(5, 10))
            .unwrap();
        let report = relay.run_once().await.unwrap();
        assert_eq!((report.sent, report.retried), (1, 1), "{report:?}");
        let row = db.row("1:Moved").unwrap();
        assert_eq!((row.status, row.retries), (Status::New, 0));
        assert_eq!(relay.publisher.order(), ["2:Moved"]);
    }

    /// A [`MemoryDb`] that lets the relay claim ahead, counting the batches it holds.
    struct AheadDb {
        db: MemoryDb<()>,
        held: std::sync::Arc<std::sync::atomic::AtomicUsize>,
        most_held: std::sync::Arc<std::sync::atomic::AtomicUsize>,
        claims: std::sync::Arc<std::sync::Mutex<Vec<Claim>>>,
    }

    /// One claim's row ids, and for a claim ahead the ids it was told were in hand.
    type Claim = (Vec<i64>, Option<Vec<i64>>);

    impl AheadDb {
        fn on(db: &MemoryDb<()>) -> Self {
            Self {
                db: db.clone(),
                held: Default::default(),
                most_held: Default::default(),
                claims: Default::default(),
            }
        }

        async fn claim_noting(&self, limit: usize, held: Option<&[i64]>) -> Result<Held, Error> {
            let batch = self.db.claim(limit).await?;
            let ids = batch.messages().iter().map(|m| m.id).collect();
            let held_ids = held.map(<[i64]>::to_vec);
            self.claims.lock().unwrap().push((ids, held_ids));
            let now = self.held.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            self.most_held
                .fetch_max(now, std::sync::atomic::Ordering::SeqCst);
            Ok(Held {
                batch: Some(batch),
                held: self.held.clone(),
            })
        }
    }

    struct Held {
        batch: Option<crate::MemoryBatch<()>>,
        held: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Drop for Held {
        fn drop(&mut self) {
            self.held.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    impl ClaimedBatch for Held {
        fn messages(&self) -> &[crate::StoredMessage] {
            self.batch.as_ref().map_or(&[], |b| b.messages())
        }

        async fn complete(mut self, outcome: RelayBatchOutcome) -> Result<(), Error> {
            match self.batch.take() {
                Some(batch) => batch.complete(outcome).await,
                None => Ok(()),
            }
        }
    }

    impl RelayStore for AheadDb {
        type Batch = Held;

        async fn claim(&self, limit: usize) -> Result<Held, Error> {
            self.claim_noting(limit, None).await
        }

        async fn claim_after(&self, limit: usize, held: &[i64]) -> Result<Held, Error> {
            self.claim_noting(limit, Some(held)).await
        }

        async fn backlog(&self) -> Result<crate::Backlog, Error> {
            self.db.backlog().await
        }

        fn claims_ahead(&self) -> bool {
            true
        }
    }

    /// Takes a moment per call, as a real broker does.
    struct SlowBroker(MemoryBroker);

    impl Publisher for SlowBroker {
        async fn publish(
            &self,
            batch: &[crate::StoredMessage],
        ) -> Result<crate::PublishOutcomes, Error> {
            tokio::time::sleep(Duration::from_millis(2)).await;
            self.0.publish(batch).await
        }
    }

    #[tokio::test]
    async fn run_until_claims_the_next_batch_while_publishing_and_keeps_id_order() {
        let db = db_with(1000);
        let store = AheadDb::on(&db);
        let most_held = store.most_held.clone();
        let broker = MemoryBroker::new();
        let relay = Relay::new(store, SlowBroker(broker.clone()))
            .with_config(config(3, 100))
            .unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task =
            tokio::spawn(
                async move { relay.run_until(async { stopped.await.unwrap_or(()) }).await },
            );
        wait_until(|| broker.published("ping").len() >= 1000).await;
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
        let published: Vec<String> = broker
            .published("ping")
            .iter()
            .map(|e| e.msg_id.to_string())
            .collect();
        let expected: Vec<String> = (0..1000).map(|n| format!("{n}:Ping")).collect();
        assert_eq!(published, expected, "every message once, in id order");
        assert!(db.rows().iter().all(|r| r.status == Status::Sent));
        assert_eq!(
            most_held.load(std::sync::atomic::Ordering::SeqCst),
            2,
            "the next batch was claimed while one was in hand"
        );
    }

    #[tokio::test]
    async fn a_batch_claimed_ahead_is_released_when_a_row_in_hand_stays_new() {
        let db = MemoryDb::new(());
        db.transaction(|tx| {
            (0..30).try_for_each(|n| tx.emit(moved(n, &format!("k{}", n % 3))).map(drop))
        })
        .unwrap();
        let store = AheadDb::on(&db);
        let claims = store.claims.clone();
        // The last row of the first batch fails once; the batch claimed ahead holds later
        // rows of its key.
        let picky = Picky::rejecting("9:Moved", 1);
        let relay = Relay::new(store, picky).with_config(config(3, 10)).unwrap();
        let relay = std::sync::Arc::new(relay);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = relay.clone();
        let task = tokio::spawn(async move {
            running
                .run_until(async { stopped.await.unwrap_or(()) })
                .await
        });
        wait_until(|| db.rows().iter().all(|r| r.status == Status::Sent)).await;
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();

        let claims = claims.lock().unwrap().clone();
        let (first, none) = &claims[0];
        assert_eq!(none, &None, "the first claim has nothing in hand");
        let (ahead, held) = &claims[1];
        assert_eq!(
            held.as_ref(),
            Some(first),
            "the claim ahead is told what is in hand"
        );
        assert!(
            claims[2..].iter().any(|(ids, _)| ids.contains(&ahead[0])),
            "the batch claimed ahead of a batch with a retry was released and claimed again: {claims:?}"
        );
        let order = relay.publisher.order();
        assert_eq!(order.len(), 30, "every message once: {order:?}");
    }

    async fn wait_until(done: impl Fn() -> bool) {
        tokio::time::timeout(Duration::from_secs(30), async {
            while !done() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("condition not reached within 30 s");
    }
}
