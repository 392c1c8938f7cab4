//! A message or a batch through the store, then its ack, nak or dead letter.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::message::PublishMessage;
use outbox_core::__private::consumer::StoreRun;
use outbox_core::{ConsumerStore, Delivery, Envelope, Processed, error_chain};

use super::Consumer;
use super::health::Count;
use super::screen::{Job, Screened};
use crate::dead_letters::dead_letter_headers;

/// The most messages whose outage deliveries a consumer remembers.
const MAX_OUTAGE_ENTRIES: usize = 100_000;

/// How the work on one message ended, for the reader's backoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Acknowledged, dead-lettered, or left for a redelivery after its handler failed.
    Done,
    /// NATS or the store failed as a whole: the reader backs off.
    Outage,
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// One message in its own transaction (single mode).
    pub(crate) async fn process(&self, job: Job) -> Outcome {
        let delivery = match self.screen(&job) {
            Screened::Acknowledge(count) => {
                self.count(count, 1);
                return self.ack(&job).await;
            }
            Screened::DeadLetter(reason) => return self.dead_letter(&job, &reason).await,
            Screened::OverLimit(envelope) => return self.over_limit(&job, &envelope).await,
            Screened::Deliver(delivery) => delivery,
        };
        let prepared = match self.inner.dispatcher.prepare(&delivery.envelope) {
            Ok(prepared) => prepared,
            Err(e) => return self.dead_letter(&job, &error_chain(&e).to_string()).await,
        };
        let inner = Arc::clone(&self.inner);
        let run = self
            .inner
            .executor
            .run(async move { inner.inbox.run_one(&inner.group, prepared, &delivery).await })
            .await;
        self.settle(&job, run).await
    }

    /// The end of a message's store run.
    async fn settle(&self, job: &Job, run: StoreRun<Processed>) -> Outcome {
        match run {
            StoreRun::Done(processed) => self.applied(job, processed).await,
            StoreRun::Failed(e) if e.is_outage() => self.store_outage(job, &e).await,
            // A conflict (deadlock, serialization failure): again soon, uncounted.
            StoreRun::Failed(e) if e.is_transient() => {
                self.uncount(job);
                self.nak(job, Some(self.inner.config.nak_delay)).await
            }
            StoreRun::Failed(e) if e.is_poison() => {
                self.dead_letter(job, &error_chain(&e).to_string()).await
            }
            StoreRun::Failed(e) => self.failed(job, &error_chain(&e).to_string()).await,
            StoreRun::Crashed(crash) => self.failed(job, &crash).await,
        }
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

    /// The store could not be reached: the delivery is not counted, and the message
    /// comes back after the outage backoff.
    async fn store_outage(&self, job: &Job, e: &outbox_core::Error) -> Outcome {
        self.count(Count::Failure, 1);
        let reason = error_chain(e).to_string();
        let outages = self.inner.health.store_failed(&reason);
        tracing::warn!(entry_id = %job.entry_id(), %reason, "idempotency store unavailable; the message will be retried");
        self.uncount(job);
        let delay = self.outage_delay(outages);
        self.nak(job, Some(delay)).await;
        Outcome::Outage
    }

    /// Notes a delivery of `job` that does not count against the limit.
    fn uncount(&self, job: &Job) {
        let mut outages = self.inner.outages.lock().unwrap_or_else(|p| p.into_inner());
        // Bounded: entries of messages another process finished never leave otherwise.
        // Forgetting them only lets those messages count outages as deliveries.
        if outages.len() >= MAX_OUTAGE_ENTRIES {
            outages.clear();
        }
        *outages.entry(job.key()).or_default() += 1;
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
        let delivered = self.counted_deliveries(job);
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
    async fn over_limit(&self, job: &Job, envelope: &Envelope) -> Outcome {
        let inner = &self.inner;
        let reason = format!(
            "delivery limit exceeded: delivered {} times (limit {}) without being processed",
            self.counted_deliveries(job),
            inner.config.max_deliveries
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
        match asked {
            StoreRun::Done(Processed::Duplicate) => self.applied(job, Processed::Duplicate).await,
            StoreRun::Failed(e) if e.is_outage() => self.store_outage(job, &e).await,
            StoreRun::Failed(e) if e.is_transient() => {
                self.nak(job, Some(inner.config.nak_delay)).await
            }
            _ => self.dead_letter(job, &reason).await,
        }
    }

    /// Copies the message to the dead-letter stream with `reason`, then acknowledges
    /// it. Should the copy fail, the message stays pending and comes back.
    pub(crate) async fn dead_letter(&self, job: &Job, reason: &str) -> Outcome {
        let inner = &self.inner;
        let headers = dead_letter_headers(job, &inner.group, reason, self.counted_deliveries(job));
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
        self.inner
            .outages
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&job.key());
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
    /// run are settled first, one by one.
    pub(crate) async fn process_batch(&self, jobs: Vec<Job>) -> Outcome {
        let mut outage = false;
        let mut through: Vec<(Job, Delivery)> = Vec::with_capacity(jobs.len());
        for job in jobs {
            let outcome = match self.screen(&job) {
                Screened::Deliver(delivery) => {
                    through.push((job, delivery));
                    continue;
                }
                Screened::Acknowledge(count) => {
                    self.count(count, 1);
                    self.ack(&job).await
                }
                Screened::DeadLetter(reason) => self.dead_letter(&job, &reason).await,
                Screened::OverLimit(envelope) => self.over_limit(&job, &envelope).await,
            };
            outage |= outcome == Outcome::Outage;
        }
        if through.is_empty() {
            return if outage {
                Outcome::Outage
            } else {
                Outcome::Done
            };
        }
        let (jobs, deliveries): (Vec<Job>, Vec<Delivery>) = through.into_iter().unzip();
        let inner = Arc::clone(&self.inner);
        let run = self
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
        let outcomes = match run {
            (StoreRun::Done(outcomes), _) if outcomes.len() == jobs.len() => outcomes,
            (StoreRun::Failed(e), _) if e.is_outage() => {
                for job in &jobs {
                    self.store_outage(job, &e).await;
                }
                return Outcome::Outage;
            }
            // The batch as a whole failed (a conflict, a crash): each alone, so that
            // one message's fault costs only its own delivery.
            _ => return self.one_by_one(jobs, outage).await,
        };
        for (job, outcome) in jobs.iter().zip(outcomes) {
            let run = match outcome {
                Ok(processed) => StoreRun::Done(processed),
                Err(e) => StoreRun::Failed(e),
            };
            outage |= self.settle(job, run).await == Outcome::Outage;
        }
        if outage {
            Outcome::Outage
        } else {
            Outcome::Done
        }
    }

    async fn one_by_one(&self, jobs: Vec<Job>, mut outage: bool) -> Outcome {
        for job in jobs {
            outage |= self.process(job).await == Outcome::Outage;
        }
        if outage {
            Outcome::Outage
        } else {
            Outcome::Done
        }
    }
}
