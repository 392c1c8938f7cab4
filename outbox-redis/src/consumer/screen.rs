//! The checks every entry meets before the store, in every mode (single, batch, ordered;
//! blocking or async inbox): whose it is, the delivery limit, its fields, a handler.

use outbox_core::Delivery;

use super::stats::Count;
use super::{Consumer, ConsumerStore, Job};
use crate::conn::topic_of;
use crate::entry::{envelope_from_fields, redriven_for_another};

/// What the checks before the store decided for an entry.
pub(super) enum Screened {
    /// Decoded, with a handler: run it through the store.
    Deliver(Delivery),
    /// Not this group's to run: acknowledge it (counted and logged by the check).
    Acknowledge,
    DeadLetter(String),
    /// Delivered past the limit without an outcome: see `Consumer::over_limit`.
    OverLimit,
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// The checks before the store: a redrive for another group, the delivery limit,
    /// the entry's fields, a handler for its type. Decoding the payload is left to the
    /// dispatcher.
    pub(super) fn screen(&self, job: &Job) -> Screened {
        let inner = &self.inner;
        // First: another group's redrive is none of this group's business, not even a
        // dead letter. The inbox cannot tell: its dedup row may have been purged since.
        if let Some(target) = redriven_for_another(&job.entry.map, &inner.group) {
            tracing::debug!(entry_id = %job.entry.id, redrive_group = %target, "a redrive for another group; acknowledged");
            self.count(Count::RedriveForOthers, Some(&job.stream));
            return Screened::Acknowledge;
        }
        if job.delivery_count > inner.config.max_deliveries {
            return Screened::OverLimit;
        }
        let topic = topic_of(&job.stream, &inner.config.stream_prefix, inner.cluster);
        let envelope = match envelope_from_fields(&job.entry.map, topic) {
            Ok(envelope) => envelope,
            Err(e) => return Screened::DeadLetter(outbox_core::error_chain(&e).to_string()),
        };
        if !inner.dispatcher.handles(&envelope.event_type) {
            if inner.config.ignore_unknown_types {
                tracing::debug!(event_type = %envelope.event_type, "no handler for this event type; acknowledged");
                self.count(Count::Ignored, Some(&job.stream));
                return Screened::Acknowledge;
            }
            let e = outbox_core::Error::UnknownEventType(envelope.event_type);
            return Screened::DeadLetter(e.to_string());
        }
        Screened::Deliver(Delivery {
            envelope,
            delivery_count: job.delivery_count,
            entry_id: Some(job.entry.id.clone()),
        })
    }
}
