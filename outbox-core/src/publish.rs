use std::future::Future;

use crate::{Error, StoredMessage};

/// Why a message was not published, which decides what the relay does with it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectKind {
    /// The message failed on its own (the broker refused this message): it spends a
    /// retry, and becomes DEAD after the retry limit.
    #[default]
    Message,
    /// The broker could not take the message right now (out of memory, loading, read
    /// only, a timeout, a durability wait not met) after it had taken other messages of
    /// the call: an outage. The message stays NEW with its retries untouched, and the
    /// relay backs off as after any outage.
    Unavailable,
    /// The broker refuses every message of this message's topic until an operator fixes
    /// the topic (in Redis: a key of another type at the stream's name): a fault of the
    /// topic, not of the message. The message stays NEW with its retries untouched; the
    /// relay logs an error, counts `outbox_relay_topic_errors_total` and backs off.
    Topic,
    /// The publisher did not send the message because an earlier message of its key in
    /// the same call was not taken: sent, it would overtake that message (contract item
    /// 7). Not a fault of this message nor of the broker: it stays NEW with its retries
    /// untouched, and the relay neither backs off nor spends a retry; it goes out after
    /// the earlier message of its key.
    Held,
}

/// One message the broker did not publish, and why ([`RejectKind`]). Only
/// [`RejectKind::Message`] spends a retry; the rest of the batch is unaffected either way.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rejected {
    /// Why, as stored in the row's `last_error` when it spends a retry.
    pub reason: String,
    /// Whose fault it is: the message's, the broker's or the topic's.
    pub kind: RejectKind,
}

impl Rejected {
    /// A message the broker refused on its own: it spends a retry.
    pub fn new(reason: impl Into<String>) -> Self {
        Self::of_kind(RejectKind::Message, reason)
    }

    /// A message the broker could not take right now, while it took others of the same
    /// call (see [`RejectKind::Unavailable`]): no retry is spent.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self::of_kind(RejectKind::Unavailable, reason)
    }

    /// A message whose topic refuses every message until an operator fixes it (see
    /// [`RejectKind::Topic`]): no retry is spent.
    pub fn topic(reason: impl Into<String>) -> Self {
        Self::of_kind(RejectKind::Topic, reason)
    }

    /// A message not sent because an earlier message of its key in the same call was
    /// not taken (see [`RejectKind::Held`]): no retry is spent, no backoff.
    pub fn held(reason: impl Into<String>) -> Self {
        Self::of_kind(RejectKind::Held, reason)
    }

    /// A rejection of `kind`.
    pub fn of_kind(kind: RejectKind, reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            kind,
        }
    }

    /// Whether the message itself failed, so that it spends a retry.
    pub fn spends_retry(&self) -> bool {
        self.kind == RejectKind::Message
    }
}

/// Per-message results of [`Publisher::publish`], aligned with the batch.
pub type PublishOutcomes = Vec<Result<(), Rejected>>;

/// A broker the relay publishes to, a batch at a time.
///
/// Return `Err(Error::BrokerUnavailable(..))` when the broker as a whole failed before it
/// took any message (connection refused, timeout): the relay then backs off and spends no
/// message's retries. Return `Ok` with one entry per message otherwise: `Ok(())` for a
/// message the broker took (the relay marks it SENT), and a [`Rejected`] for one it did
/// not, whose [`kind`](Rejected::kind) says whether the message spends a retry
/// ([`RejectKind::Message`]) or the broker or topic is at fault and the relay backs off
/// ([`RejectKind::Unavailable`], [`RejectKind::Topic`]).
///
/// A broker that fails part-way through a batch must report what it took as `Ok(())`
/// and the rest as [`Rejected::unavailable`]: failing the whole call would make the relay
/// publish the accepted messages again, after later ones of their key.
pub trait Publisher: Send + Sync {
    /// Publishes `batch` (in id order; keep that order per topic).
    fn publish(
        &self,
        batch: &[StoredMessage],
    ) -> impl Future<Output = Result<PublishOutcomes, Error>> + Send;
}

impl<P: Publisher> Publisher for std::sync::Arc<P> {
    fn publish(
        &self,
        batch: &[StoredMessage],
    ) -> impl Future<Output = Result<PublishOutcomes, Error>> + Send {
        (**self).publish(batch)
    }
}
