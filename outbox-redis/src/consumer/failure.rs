//! Failed deliveries: retried, or dead-lettered past the limit; outages uncounted.

use super::ConsumerStore;
use super::store::StoreRun;
use outbox_core::Processed;
use redis::RedisResult;

use super::stats::Count;
use super::{Consumer, Job, Outcome};
use crate::conn::topic_of;
use crate::entry::envelope_from_fields;

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// An entry delivered past the limit without an outcome: its consumers crashed or
    /// stalled past `min_idle` each time, and running it again could crash this one too.
    /// It is dead-lettered without running its handler, unless the inbox shows it was
    /// applied and only its `XACK` got lost: then it is acknowledged as a duplicate (asked
    /// by a `process` whose closure refuses, so nothing is written either way).
    pub(super) async fn over_limit(&self, job: &Job) -> Outcome {
        let inner = &self.inner;
        let reason = format!(
            "delivery limit exceeded: delivered {} times (limit {}) without being processed",
            job.delivery_count, inner.config.max_deliveries
        );
        let topic = topic_of(&job.stream, &inner.config.stream_prefix, inner.cluster);
        let Ok(envelope) = envelope_from_fields(&job.entry.map, topic) else {
            return self.dead_letter(job, &reason).await;
        };
        let applied = inner
            .inbox
            .applied_before(&inner.group, &envelope.msg_id, reason.clone())
            .await;
        match applied {
            StoreRun::Done(Processed::Duplicate) => {
                tracing::debug!("applied before; only its acknowledgement was lost");
                self.count(Count::Duplicate, Some(&job.stream));
                self.ack(job).await
            }
            StoreRun::Failed(e) if e.is_outage() => {
                self.failed(job, &outbox_core::error_chain(&e).to_string(), true)
                    .await
            }
            // Asking met a conflict: nothing is known yet; ask again at the next claim.
            StoreRun::Failed(e) if e.is_transient() => {
                self.count(Count::Conflict, Some(&job.stream));
                Outcome::Pending { outage: false }
            }
            _ => self.dead_letter(job, &reason).await,
        }
    }

    /// A failed attempt: after a store outage the delivery is not counted; a handler
    /// failure on the last delivery is dead-lettered, earlier ones stay pending.
    pub(super) async fn failed(&self, job: &Job, reason: &str, outage: bool) -> Outcome {
        self.count(Count::Failure, Some(&job.stream));
        if outage {
            tracing::warn!(entry_id = %job.entry.id, %reason, "idempotency store unavailable; the message will be retried");
            self.uncount_delivery(job).await;
            Outcome::Pending { outage: true }
        } else if job.delivery_count >= self.inner.config.max_deliveries {
            tracing::warn!(entry_id = %job.entry.id, %reason, "handler failed on its last delivery");
            self.dead_letter(job, reason).await
        } else {
            tracing::warn!(entry_id = %job.entry.id, %reason, "handler failed; the message will be retried");
            Outcome::Pending { outage: false }
        }
    }

    /// After a store outage: sets the entry's delivery count back, so that outages never
    /// bring a message closer to the dead-letter stream. Best effort.
    async fn uncount_delivery(&self, job: &Job) {
        self.set_delivery_count(job, job.delivery_count.saturating_sub(1))
            .await;
    }

    /// Sets the entry's delivery count in the group to `count` (`XCLAIM .. RETRYCOUNT`,
    /// to this consumer, which holds it already). Best effort.
    pub(super) async fn set_delivery_count(&self, job: &Job, count: u64) {
        let inner = &self.inner;
        let reset: RedisResult<redis::Value> = async {
            let mut conn = inner.commands.get().await?;
            redis::cmd("XCLAIM")
                .arg(&*job.stream)
                .arg(&inner.group)
                .arg(&inner.consumer_name)
                .arg(0)
                .arg(&job.entry.id)
                .arg("RETRYCOUNT")
                .arg(count)
                .arg("JUSTID")
                .query_async(&mut conn)
                .await
        }
        .await;
        self.redis_done(reset, "cannot set the delivery count")
            .await;
    }
}
