//! A message or a batch through the store, then its ack, nak or dead letter.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::AckKind;
use async_nats::jetstream::message::PublishMessage;
use outbox_core::__private::consumer::StoreRun;
use outbox_core::{ConsumerStore, Delivery, Envelope, Processed, error_chain};
use tokio::sync::watch;

use super::Consumer;
use super::health::Count;
use super::screen::{Job, Screened};
use crate::dead_letters::dead_letter_headers;

/// How the work on one message ended, for the reader's backoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Acknowledged, dead-lettered, or left for a redelivery after its handler failed.
    Done,
    /// NATS or the store failed as a whole: the reader backs off.
    Outage,
}

/// Conflicts (deadlocks, serialization failures) a message is run again after in hand,
/// a short pause apart; the next one naks it. Holding it longer would stall the reader
/// behind a conflict another consumer keeps renewing.
const CONFLICTS_IN_HAND: u32 = 2;
/// The pause before a conflicting message runs again, times the conflicts so far.
const CONFLICT_PAUSE: Duration = Duration::from_millis(20);

/// How a batch's store run ended.
enum BatchRun {
    /// Each message's outcome.
    Decided(Vec<outbox_core::Result<Processed>>),
    /// The batch as a whole failed (a conflict, a crash).
    Failed,
    /// The run was stopped while the store was down: every message naked.
    Stopped,
}

/// One try at a message: its outcome, or the store could not decide it yet.
enum Step {
    Done(Outcome),
    /// A store outage (`true`) or a conflict: the message is held and run again.
    Again {
        outage: bool,
    },
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// One message in its own transaction (single mode). A store outage or a conflict
    /// holds it in hand and runs it again (see [`hold`](Self::hold)); `stop` ends the
    /// wait.
    pub(crate) async fn process(&self, job: &Job, stop: &watch::Receiver<bool>) -> Outcome {
        let (mut outages, mut conflicts) = (0, 0);
        loop {
            let outage = match self.try_once(job).await {
                Step::Done(outcome) => return outcome,
                Step::Again { outage } => outage,
            };
            let delay = if outage {
                outages += 1;
                self.outage_delay(outages)
            } else {
                conflicts += 1;
                if conflicts > CONFLICTS_IN_HAND {
                    // Still conflicting: back to the server, as Redis leaves it pending,
                    // so that the reader moves on; the redelivery counts.
                    return self.nak(job, Some(self.inner.config.nak_delay)).await;
                }
                // Usually over once the other transaction ended.
                CONFLICT_PAUSE * conflicts
            };
            if !self.hold(job, delay, stop).await {
                return Outcome::Outage;
            }
        }
    }

    async fn try_once(&self, job: &Job) -> Step {
        let delivery = match self.screen(job) {
            Screened::Acknowledge(count) => {
                self.count(count, 1);
                return Step::Done(self.ack(job).await);
            }
            Screened::DeadLetter(reason) => {
                return Step::Done(self.dead_letter(job, &reason).await);
            }
            Screened::OverLimit(envelope) => return self.over_limit(job, &envelope).await,
            Screened::Deliver(delivery) => delivery,
        };
        let prepared = match self.inner.dispatcher.prepare(&delivery.envelope) {
            Ok(prepared) => prepared,
            Err(e) => {
                return Step::Done(self.dead_letter(job, &error_chain(&e).to_string()).await);
            }
        };
        let inner = Arc::clone(&self.inner);
        let run = self
            .inner
            .executor
            .run(async move { inner.inbox.run_one(&inner.group, prepared, &delivery).await })
            .await;
        self.settle(job, run).await
    }

    /// Keeps `job` in hand for `delay`, telling the server it is in progress (its
    /// `ack_wait` starts again) so that it is not delivered again meanwhile: a
    /// redelivery, to this process or another, would count against the limit, and the
    /// store being down is not the message's fault. False, after a nak, when the run is
    /// stopped: the message's next delivery then counts.
    async fn hold(&self, job: &Job, delay: Duration, stop: &watch::Receiver<bool>) -> bool {
        let mut stop = stop.clone();
        let beat = self.inner.config.ack_wait / 3;
        let until = Instant::now() + delay;
        loop {
            if *stop.borrow() {
                self.nak(job, None).await;
                return false;
            }
            // A deliberate wait: the consumer is live (not ready: the store failed).
            self.inner.health.round();
            self.in_progress(job).await;
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return true;
            }
            tokio::select! {
                () = tokio::time::sleep(left.min(beat)) => {}
                _ = stop.changed() => {}
            }
        }
    }

    /// The end of a message's store run.
    async fn settle(&self, job: &Job, run: StoreRun<Processed>) -> Step {
        Step::Done(match run {
            StoreRun::Done(processed) => self.applied(job, processed).await,
            StoreRun::Failed(e) if e.is_outage() => return self.store_outage(job, &e),
            // A conflict (deadlock, serialization failure): again soon.
            StoreRun::Failed(e) if e.is_transient() => return Step::Again { outage: false },
            StoreRun::Failed(e) if e.is_poison() => {
                self.dead_letter(job, &error_chain(&e).to_string()).await
            }
            StoreRun::Failed(e) => self.failed(job, &error_chain(&e).to_string()).await,
            StoreRun::Crashed(crash) => self.failed(job, &crash).await,
        })
    }

    async fn applied(&self, job: &Job, processed: Processed) -> Outcome {
        self.inner.health.store_answered();
        self.count(
            match processed {
                Processed::Applied => Count::Consumed,
                Processed::Duplicate => Count::Duplicate,
            },
            1,
        );
        self.ack(job).await
    }

    /// The store could not be reached: noted, and the message held and run again.
    fn store_outage(&self, job: &Job, e: &outbox_core::Error) -> Step {
        self.count(Count::Failure, 1);
        let reason = error_chain(e).to_string();
        self.inner.health.store_failed(&reason);
        tracing::warn!(entry_id = %job.entry_id(), %reason, "idempotency store unavailable; the message is held and tried again");
        Step::Again { outage: true }
    }

    /// The outage backoff after `n` failures in a row.
    pub(crate) fn outage_delay(&self, n: u32) -> Duration {
        let b = &self.inner.config.outage_backoff;
        let exp = n.saturating_sub(1).min(20);
        b.min.saturating_mul(1 << exp).min(b.max)
    }

    /// A handler failed: redelivered after a delay, or dead-lettered on its last
    /// delivery.
    async fn failed(&self, job: &Job, reason: &str) -> Outcome {
        self.count(Count::Failure, 1);
        self.inner.health.store_answered();
        let delivered = job.delivered;
        if delivered >= self.inner.config.max_deliveries {
            tracing::warn!(entry_id = %job.entry_id(), %reason, "handler failed on its last delivery");
            return self.dead_letter(job, reason).await;
        }
        tracing::warn!(entry_id = %job.entry_id(), %reason, delivered, "handler failed; the message will be retried");
        let delay = self.inner.config.nak_delay_after(delivered);
        self.nak(job, Some(delay)).await
    }

    /// Delivered past the limit without an outcome (its consumers crashed or stalled
    /// past `ack_wait` each time): dead-lettered without running its handler, unless
    /// the inbox shows it was applied and only its ack was lost.
    async fn over_limit(&self, job: &Job, envelope: &Envelope) -> Step {
        let inner = &self.inner;
        let reason = format!(
            "delivery limit exceeded: delivered {} times (limit {}) without being processed",
            job.delivered, inner.config.max_deliveries
        );
        // Where the store's work runs: a blocking inbox must not hold a runtime thread.
        let (store, msg_id, refusal) = (Arc::clone(inner), envelope.msg_id.clone(), reason.clone());
        let asked = inner
            .executor
            .run(async move {
                (store.inbox)
                    .applied_before(&store.group, &msg_id, refusal)
                    .await
            })
            .await;
        Step::Done(match asked {
            StoreRun::Done(Processed::Duplicate) => self.applied(job, Processed::Duplicate).await,
            StoreRun::Failed(e) if e.is_outage() => return self.store_outage(job, &e),
            StoreRun::Failed(e) if e.is_transient() => return Step::Again { outage: false },
            _ => self.dead_letter(job, &reason).await,
        })
    }

    /// Copies the message to the dead-letter stream with `reason`, then acknowledges
    /// it. Should the copy fail, the message stays pending and comes back.
    pub(crate) async fn dead_letter(&self, job: &Job, reason: &str) -> Outcome {
        let inner = &self.inner;
        let headers = dead_letter_headers(job, &inner.group, reason, job.delivered);
        let subject = inner
            .config
            .naming
            .dead_letter_subject(&inner.group, &job.topic.name);
        let publish = PublishMessage::build()
            .headers(headers)
            .payload(job.msg.payload.clone());
        let stored = match inner.js.send_publish(subject, publish).await {
            Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = stored {
            self.count(Count::NatsError, 1);
            tracing::warn!(entry_id = %job.entry_id(), error = %e, "cannot write the dead letter; the message stays pending");
            let delay = self.outage_delay(1);
            self.nak(job, Some(delay)).await;
            return Outcome::Outage;
        }
        tracing::warn!(entry_id = %job.entry_id(), %reason, "message dead-lettered");
        self.count(Count::DeadLettered, 1);
        self.ack(job).await
    }

    /// Acknowledges the message: it is done for this group.
    pub(crate) async fn ack(&self, job: &Job) -> Outcome {
        self.reply(job, AckKind::Ack).await
    }

    /// Asks for a redelivery after `delay`.
    pub(crate) async fn nak(&self, job: &Job, delay: Option<Duration>) -> Outcome {
        self.reply(job, AckKind::Nak(delay)).await;
        Outcome::Done
    }

    async fn reply(&self, job: &Job, kind: AckKind) -> Outcome {
        match job.msg.ack_with(kind).await {
            Ok(()) => Outcome::Done,
            Err(e) => {
                // Lost: the server delivers the message again after `ack_wait`, and the
                // inbox recognises it.
                self.count(Count::NatsError, 1);
                tracing::warn!(entry_id = %job.entry_id(), error = %e, "cannot acknowledge");
                Outcome::Outage
            }
        }
    }

    /// A batch of messages in one transaction (batch mode); those that need no store
    /// run are settled first, one by one. A store outage holds the batch in hand and
    /// runs it again; the messages the store could not decide in the batch go on alone.
    pub(crate) async fn process_batch(
        &self,
        jobs: Vec<Job>,
        stop: &watch::Receiver<bool>,
    ) -> Outcome {
        let mut outage = false;
        let mut again = Vec::new();
        let mut through: Vec<(Job, Delivery)> = Vec::with_capacity(jobs.len());
        for job in jobs {
            let step = match self.screen(&job) {
                Screened::Deliver(delivery) => {
                    through.push((job, delivery));
                    continue;
                }
                Screened::Acknowledge(count) => {
                    self.count(count, 1);
                    Step::Done(self.ack(&job).await)
                }
                Screened::DeadLetter(reason) => Step::Done(self.dead_letter(&job, &reason).await),
                Screened::OverLimit(envelope) => self.over_limit(&job, &envelope).await,
            };
            match step {
                Step::Done(outcome) => outage |= outcome == Outcome::Outage,
                Step::Again { .. } => again.push(job),
            }
        }
        let (jobs, deliveries): (Vec<Job>, Vec<Delivery>) = through.into_iter().unzip();
        match self.run_batch(&jobs, deliveries, stop).await {
            BatchRun::Decided(outcomes) => {
                for (job, outcome) in jobs.into_iter().zip(outcomes) {
                    let run = match outcome {
                        Ok(processed) => StoreRun::Done(processed),
                        Err(e) => StoreRun::Failed(e),
                    };
                    match self.settle(&job, run).await {
                        Step::Done(o) => outage |= o == Outcome::Outage,
                        Step::Again { .. } => again.push(job),
                    }
                }
            }
            // The batch as a whole failed (a conflict, a crash): each alone, so that
            // one message's fault costs only its own delivery.
            BatchRun::Failed => again.extend(jobs),
            BatchRun::Stopped => return Outcome::Outage,
        }
        Outcome::of(self.alone(again, stop).await == Outcome::Outage || outage)
    }

    /// `deliveries` (of `jobs`) through the store in one transaction, held in hand and
    /// run again while the store is down.
    async fn run_batch(
        &self,
        jobs: &[Job],
        mut deliveries: Vec<Delivery>,
        stop: &watch::Receiver<bool>,
    ) -> BatchRun {
        if jobs.is_empty() {
            return BatchRun::Decided(Vec::new());
        }
        let mut outages = 0;
        loop {
            let inner = Arc::clone(&self.inner);
            let (run, back) = self
                .inner
                .executor
                .run(async move {
                    let run = inner
                        .inbox
                        .run_batch(&inner.dispatcher, &inner.group, &deliveries)
                        .await;
                    (run, deliveries)
                })
                .await;
            deliveries = back;
            match run {
                StoreRun::Done(outcomes) if outcomes.len() == jobs.len() => {
                    return BatchRun::Decided(outcomes);
                }
                StoreRun::Failed(e) if e.is_outage() => {
                    outages += 1;
                    for job in jobs {
                        self.store_outage(job, &e);
                    }
                    let delay = self.outage_delay(outages);
                    let held = futures_util::future::join_all(
                        jobs.iter().map(|job| self.hold(job, delay, stop)),
                    )
                    .await;
                    if held.iter().any(|h| !h) {
                        // Stopped: those still held are handed back too.
                        for (job, _) in jobs.iter().zip(&held).filter(|(_, h)| **h) {
                            self.nak(job, None).await;
                        }
                        return BatchRun::Stopped;
                    }
                }
                _ => return BatchRun::Failed,
            }
        }
    }

    /// Each of `jobs` alone (see [`process`](Self::process)), one after another; those
    /// waiting their turn are kept in progress meanwhile, so that a held one does not
    /// let the server deliver the others again.
    async fn alone(&self, jobs: Vec<Job>, stop: &watch::Receiver<bool>) -> Outcome {
        let mut outage = false;
        for (i, job) in jobs.iter().enumerate() {
            let waiting = &jobs[i + 1..];
            tokio::select! {
                outcome = self.process(job, stop) => outage |= outcome == Outcome::Outage,
                () = self.keep_in_progress(waiting) => {}
            }
        }
        Outcome::of(outage)
    }

    /// Tells the server every `ack_wait / 3` that `jobs` are in progress; never ends.
    async fn keep_in_progress(&self, jobs: &[Job]) {
        loop {
            tokio::time::sleep(self.inner.config.ack_wait / 3).await;
            for job in jobs {
                self.in_progress(job).await;
            }
        }
    }

    /// Tells the server `job` is in progress: its `ack_wait` starts again. A lost word
    /// only lets the server deliver it again, which the inbox absorbs.
    async fn in_progress(&self, job: &Job) {
        if let Err(e) = job.msg.ack_with(AckKind::Progress).await {
            tracing::debug!(entry_id = %job.entry_id(), error = %e, "cannot tell the server the message is in progress");
        }
    }
}

impl Outcome {
    fn of(outage: bool) -> Self {
        if outage { Self::Outage } else { Self::Done }
    }
}
