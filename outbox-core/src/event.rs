use serde::{Serialize, de::DeserializeOwned};

use crate::{InvalidMsgId, MsgId};

/// A typed domain event that can be written to the outbox and handled by consumers.
///
/// Derive it with `#[derive(OutboxEvent)]` (see the derive's documentation for the
/// attributes); implementing it by hand is possible but rarely needed.
///
/// A struct is one event type. An enum is a family: each variant is its own event type,
/// and the payload is the whole enum as serde writes it, so a handler of the enum receives
/// every variant.
pub trait OutboxEvent: Serialize + DeserializeOwned + Send + 'static {
    /// Every event type name this Rust type can carry: one for a struct, one per variant
    /// for an enum. Consumers route by these names.
    const EVENT_TYPES: &'static [&'static str];
    /// The distinct topics this type publishes to (one stream per topic).
    const TOPICS: &'static [&'static str];
    /// The payload's schema version, carried with each message (default 1).
    const SCHEMA_VERSION: u32;
    /// How many partition streams each of [`TOPICS`](Self::TOPICS) is spread over, by
    /// ordering key (`#[outbox(partitions = N)]`; default 1: one stream a topic, named
    /// as without partitions). From 1 to [`MAX_PARTITIONS`](crate::MAX_PARTITIONS): the
    /// derive refuses anything else, and [`Partitions::of_event`](crate::Partitions::of_event)
    /// turns a hand-written value out of range into a compile error.
    ///
    /// The count only says what the type's producers and consumers should agree on; the
    /// relay's publisher decides where messages go, so give it the same count (e.g.
    /// `outbox_redis::PublisherConfig::with_partitions_of::<E>()`). See `docs/partitions.md`.
    const PARTITIONS: u32 = 1;

    /// The topic of this value.
    fn topic(&self) -> &'static str;

    /// The event type name of this value.
    fn event_type(&self) -> &'static str;

    /// The business key, built from the id field(s): `order-42` for `OrderPaid`.
    fn business_key(&self) -> String;

    /// The msg_id: `{business_key}:{event_type}`, validated.
    fn msg_id(&self) -> Result<MsgId, InvalidMsgId> {
        MsgId::from_parts(&self.business_key(), self.event_type())
    }

    /// Messages that share an ordering key reach the stream in the order they were
    /// written. Defaults to the business key.
    fn ordering_key(&self) -> String {
        self.business_key()
    }
}
