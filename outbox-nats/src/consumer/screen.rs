//! The checks every message meets before the store, in every mode.

use async_nats::jetstream;
use outbox_core::{ConsumerStore, Delivery, Envelope};

use super::health::Count;
use super::{Consumer, Topic};
use crate::entry::{REDRIVE_GROUP_HEADER, envelope_from_message};

/// One message to process, as pulled.
pub(crate) struct Job {
    pub(crate) msg: jetstream::Message,
    pub(crate) topic: Topic,
    /// Its sequence in the stream.
    pub(crate) seq: u64,
    /// Deliveries so far, this one included, as the server counts them (at least 1).
    pub(crate) delivered: u64,
}

impl Job {
    /// A pulled message, or `None` without the reply subject's metadata (not a
    /// JetStream delivery; nothing can be acknowledged).
    pub(crate) fn new(msg: jetstream::Message, topic: &Topic) -> Option<Self> {
        let info = msg.info().ok()?;
        let (seq, delivered) = (
            info.stream_sequence,
            u64::try_from(info.delivered).unwrap_or(1).max(1),
        );
        Some(Self {
            msg,
            topic: topic.clone(),
            seq,
            delivered,
        })
    }

    /// `<stream>:<sequence>`, the [`Delivery::entry_id`].
    pub(crate) fn entry_id(&self) -> String {
        format!("{}:{}", self.topic.stream, self.seq)
    }
}

/// What the checks decided.
pub(crate) enum Screened {
    /// Acknowledge without the store, counted as this.
    Acknowledge(Count),
    /// Dead-letter at once, for this reason.
    DeadLetter(String),
    /// Delivered past the limit without an outcome: dead-lettered unless applied before.
    OverLimit(Envelope),
    /// Through the store.
    Deliver(Delivery),
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// The checks before the store: a redrive for another group, the message's
    /// headers, the delivery limit, a handler for its type.
    pub(crate) fn screen(&self, job: &Job) -> Screened {
        let inner = &self.inner;
        let headers = job.msg.headers.as_ref();
        if let Some(target) = headers.and_then(|h| h.get(REDRIVE_GROUP_HEADER))
            && target.as_str() != inner.group
        {
            return Screened::Acknowledge(Count::RedriveForOthers);
        }
        let envelope = match envelope_from_message(headers, &job.msg.payload, &job.topic.name) {
            Ok(envelope) => envelope,
            Err(e) => return Screened::DeadLetter(e.to_string()),
        };
        let delivered = job.delivered;
        if delivered > inner.config.max_deliveries {
            return Screened::OverLimit(envelope);
        }
        if !inner.dispatcher.handles(&envelope.event_type) {
            if inner.config.ignore_unknown_types {
                return Screened::Acknowledge(Count::Ignored);
            }
            let e = outbox_core::Error::UnknownEventType(envelope.event_type);
            return Screened::DeadLetter(e.to_string());
        }
        Screened::Deliver(Delivery {
            envelope,
            delivery_count: delivered,
            entry_id: Some(job.entry_id()),
        })
    }
}
