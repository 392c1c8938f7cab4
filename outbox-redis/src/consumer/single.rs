//! One transaction per message.

use std::time::Duration;

use super::ConsumerStore;
use super::store::StoreRun;
use outbox_core::{Delivery, Prepared, Processed};
use tracing::Instrument as _;

use super::screen::Screened;
use super::stats::Count;
use super::{Consumer, Done, Job, Outcome};

/// How one run of a message's transaction ended.
enum Attempt {
    Processed(Processed),
    Failed {
        reason: String,
        outage: bool,
        /// A deadlock or serialization failure: nothing committed, run it again soon.
        conflict: bool,
    },
}

/// Immediate runs again of a message whose transaction met a transient conflict
/// (deadlock, serialization failure, lock wait timeout), before the conflict counts as
/// a failed delivery. A conflict is nobody's fault and usually gone at once; running
/// it again from the loop would wait `min_idle` for nothing.
const CONFLICT_RETRIES: u32 = 3;

/// The pause before the `n`-th run again after a conflict: 10, 20, 40 ms plus up to as
/// much again at random, so that the two sides of a deadlock do not meet again.
fn conflict_pause(n: u32) -> Duration {
    let base = Duration::from_millis(10) * (1 << n.min(6));
    base + base.mul_f64(fastrand::f64())
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// Processes one entry to the end: dead-letter, ack, or leave pending.
    pub(super) async fn process(self, job: Job) -> Done {
        let outcome = self.process_one(&job).await;
        Done {
            entries: vec![(job.stream, job.entry.id)],
            outage: outcome.outage(),
        }
    }

    /// [`process_inner`](Self::process_inner) in the entry's `outbox.consume` span.
    pub(super) async fn process_one(&self, job: &Job) -> Outcome {
        let span = tracing::info_span!(
            "outbox.consume",
            stream = &*job.stream,
            entry_id = %job.entry.id,
            delivery_count = job.delivery_count,
            msg_id = tracing::field::Empty,
            event_type = tracing::field::Empty,
            traceparent = tracing::field::Empty,
        );
        #[cfg(feature = "opentelemetry")]
        if let Some(headers) = crate::entry::headers_of(&job.entry.map) {
            outbox_core::trace::set_parent(&span, &headers);
        }
        self.process_inner(job).instrument(span).await
    }

    /// Processes one entry: dead-letter, ack, or leave pending.
    pub(super) async fn process_inner(&self, job: &Job) -> Outcome {
        let inner = &self.inner;
        let delivery = match self.screen(job) {
            Screened::Deliver(delivery) => delivery,
            Screened::Acknowledge => return self.ack(job).await,
            Screened::DeadLetter(reason) => return self.dead_letter(job, &reason).await,
            Screened::OverLimit => return self.over_limit(job).await,
        };
        let envelope = &delivery.envelope;
        let span = tracing::Span::current();
        span.record("msg_id", envelope.msg_id.as_str());
        span.record("event_type", envelope.event_type.as_str());
        // Trace context captured at emit time, for subscribers that link the spans.
        // A W3C traceparent is 55 bytes; a foreign producer's huge header stays out of
        // every log line.
        if let Some(parent) = envelope.headers.get(outbox_core::TRACEPARENT)
            && parent.len() <= MAX_TRACEPARENT_LEN
        {
            span.record("traceparent", parent.as_str());
        }
        let mut prepared = match inner.dispatcher.prepare(envelope) {
            Ok(prepared) => prepared,
            Err(e) => {
                return self
                    .dead_letter(job, &outbox_core::error_chain(&e).to_string())
                    .await;
            }
        };
        let mut conflicts = 0;
        let attempt = loop {
            match self.attempt(prepared, &delivery).await {
                Attempt::Failed {
                    reason,
                    conflict: true,
                    ..
                } if conflicts < CONFLICT_RETRIES => {
                    conflicts += 1;
                    self.count(Count::Conflict, Some(&job.stream));
                    tracing::debug!(%reason, conflicts, "transient database conflict; running the message again");
                    tokio::time::sleep(conflict_pause(conflicts)).await;
                    // Decoded before, so it decodes again.
                    prepared = match inner.dispatcher.prepare(&delivery.envelope) {
                        Ok(prepared) => prepared,
                        Err(e) => {
                            return self
                                .dead_letter(job, &outbox_core::error_chain(&e).to_string())
                                .await;
                        }
                    };
                }
                attempt => break attempt,
            }
        };
        match attempt {
            Attempt::Processed(Processed::Applied) => {
                self.count(Count::Consumed, Some(&job.stream));
                self.ack(job).await
            }
            Attempt::Processed(Processed::Duplicate) => {
                tracing::debug!("duplicate message acknowledged without running the handler");
                self.count(Count::Duplicate, Some(&job.stream));
                self.ack(job).await
            }
            Attempt::Failed { reason, outage, .. } => self.failed(job, &reason, outage).await,
        }
    }

    /// Runs the dedup transaction where the [`executor`](super::executor) runs this
    /// work; a panic is a failure.
    async fn attempt(&self, prepared: Prepared<C>, delivery: &Delivery) -> Attempt {
        let inner = &self.inner;
        match inner.inbox.run_one(&inner.group, prepared, delivery).await {
            StoreRun::Done(processed) => Attempt::Processed(processed),
            StoreRun::Failed(e) => Attempt::Failed {
                outage: e.is_outage(),
                conflict: e.is_transient(),
                reason: outbox_core::error_chain(&e).to_string(),
            },
            StoreRun::Crashed(crash) => Attempt::Failed {
                conflict: false,
                reason: format!("handler {crash}"),
                outage: false,
            },
        }
    }
}

/// Longest `traceparent` header recorded on a span (W3C's is 55 bytes; room for a
/// version with more fields).
const MAX_TRACEPARENT_LEN: usize = 256;
