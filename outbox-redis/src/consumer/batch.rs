//! Batch mode: one transaction per batch of messages.

use super::ConsumerStore;
use super::store::StoreRun;
use outbox_core::{Delivery, InboxBatchOutcomes, Processed};
use tracing::Instrument as _;

use super::screen::Screened;
use super::stats::Count;
use super::{Consumer, Done, Job, Outcome};

/// A batch whose store transaction failed as a whole.
struct BatchFailed {
    reason: String,
    outage: bool,
    /// A deadlock or serialization failure rolled the whole batch back.
    conflict: bool,
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// Processes the batches of a lane to the end, one after another: for each the
    /// checks of [`screen`](Self::screen) per entry, then one store transaction for the
    /// rest, then one `XACK` per stream.
    pub(super) async fn process_lane(self, batches: Vec<Vec<Job>>) -> Done {
        let mut done = Done {
            entries: Vec::new(),
            outage: false,
        };
        for jobs in batches {
            let outcomes = self.process_batch_outcomes(&jobs).await;
            done.outage |= outcomes.iter().any(|o| o.outage());
            let entries = jobs.into_iter().map(|job| (job.stream, job.entry.id));
            done.entries.extend(entries);
        }
        done
    }

    /// [`process_batch_inner`](Self::process_batch_inner) in the batch's
    /// `outbox.consume_batch` span: how each of `jobs` ended, in order.
    pub(super) async fn process_batch_outcomes(&self, jobs: &[Job]) -> Vec<Outcome> {
        let span = tracing::info_span!("outbox.consume_batch", messages = jobs.len());
        // A batch serves many traces: it links to each instead of joining one.
        #[cfg(feature = "opentelemetry")]
        for job in jobs {
            use opentelemetry::trace::TraceContextExt as _;
            use tracing_opentelemetry::OpenTelemetrySpanExt as _;
            let cx = crate::entry::headers_of(&job.entry.map)
                .and_then(|headers| outbox_core::trace::context_of(&headers));
            if let Some(cx) = cx {
                span.add_link(cx.span().span_context().clone());
            }
        }
        self.process_batch_inner(jobs).instrument(span).await
    }

    /// How each of `jobs` ended, in order.
    async fn process_batch_inner(&self, jobs: &[Job]) -> Vec<Outcome> {
        let mut ended = vec![Outcome::Acked; jobs.len()];
        let mut acks: Vec<usize> = Vec::new();
        let mut runs: Vec<usize> = Vec::new();
        let mut deliveries: Vec<Delivery> = Vec::new();
        for (i, job) in jobs.iter().enumerate() {
            match self.screen(job) {
                Screened::Deliver(delivery) => {
                    runs.push(i);
                    deliveries.push(delivery);
                }
                Screened::Acknowledge => acks.push(i),
                Screened::DeadLetter(reason) => ended[i] = self.dead_letter(job, &reason).await,
                Screened::OverLimit => ended[i] = self.over_limit(job).await,
            }
        }
        if !deliveries.is_empty() {
            match self.attempt_batch(&deliveries).await {
                Ok(outcomes) => {
                    for (i, outcome) in runs.into_iter().zip(outcomes) {
                        match self.after_batch(&jobs[i], outcome).await {
                            Some(outcome) => ended[i] = outcome,
                            None => acks.push(i),
                        }
                    }
                }
                Err(BatchFailed {
                    conflict: true,
                    reason,
                    ..
                }) => {
                    // The database rolled the whole batch back (MySQL ends the
                    // transaction on a deadlock, savepoints included): nobody's fault.
                    // Each message runs again on its own, so a conflict costs its own
                    // message at most.
                    tracing::debug!(%reason, "transient database conflict rolled the batch back; running its messages one by one");
                    for &i in &runs {
                        self.count(Count::Conflict, Some(&jobs[i].stream));
                    }
                    for i in runs {
                        ended[i] = self.process_inner(&jobs[i]).await;
                    }
                }
                Err(BatchFailed {
                    reason,
                    outage: store_down,
                    ..
                }) => {
                    for i in runs {
                        ended[i] = self.failed(&jobs[i], &reason, store_down).await;
                    }
                }
            }
        }
        let acked: Vec<&Job> = acks.iter().map(|&i| &jobs[i]).collect();
        if self.ack_all(&acked).await {
            for i in acks {
                ended[i] = Outcome::Pending { outage: true };
            }
        }
        ended
    }

    /// How `job` ended after its batch's transaction committed, given its own outcome
    /// there; `None`: applied or a duplicate, to be acknowledged with the batch.
    async fn after_batch(
        &self,
        job: &Job,
        outcome: Result<Processed, outbox_core::Error>,
    ) -> Option<Outcome> {
        let e = match outcome {
            Ok(Processed::Applied) => {
                self.count(Count::Consumed, Some(&job.stream));
                return None;
            }
            Ok(Processed::Duplicate) => {
                self.count(Count::Duplicate, Some(&job.stream));
                return None;
            }
            Err(e) => e,
        };
        let reason = outbox_core::error_chain(&e).to_string();
        Some(if e.is_poison() {
            self.dead_letter(job, &reason).await
        } else if e.is_transient() {
            // Only its savepoint rolled back: it runs again on its own.
            tracing::debug!(error = %reason, "transient database conflict; running the message again on its own");
            self.count(Count::Conflict, Some(&job.stream));
            self.process_inner(job).await
        } else {
            self.failed(job, &reason, e.is_outage()).await
        })
    }

    /// Runs the batch's store transaction. `Err`: the whole batch failed and nothing
    /// committed.
    async fn attempt_batch(
        &self,
        deliveries: &[Delivery],
    ) -> Result<InboxBatchOutcomes, BatchFailed> {
        let inner = &self.inner;
        let run = inner
            .inbox
            .run_batch(&inner.dispatcher, &inner.group, deliveries);
        match run.await {
            StoreRun::Done(outcomes) => Ok(outcomes),
            StoreRun::Failed(e) => Err(BatchFailed {
                outage: e.is_outage(),
                conflict: e.is_transient(),
                reason: outbox_core::error_chain(&e).to_string(),
            }),
            // Handler panics are caught per message; this is the store's own panic.
            StoreRun::Crashed(crash) => Err(BatchFailed {
                conflict: false,
                reason: format!("batch {crash}"),
                outage: false,
            }),
        }
    }
}
