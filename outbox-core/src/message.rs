use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, Utc};

use crate::{Error, MsgId, OutboxEvent};

/// Message headers: string pairs such as `traceparent`, carried to the consumer.
pub type Headers = BTreeMap<String, String>;

/// The header that carries W3C trace context (`traceparent`) from the emitting
/// transaction to the consumer, which records it on its `outbox.consume` span.
pub const TRACEPARENT: &str = "traceparent";

/// Default limit on a serialized payload: 1 MiB.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1 << 20;

/// A message as it is stored in the outbox and carried on the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// The id, unique across the outbox: publish-side dedup and consume-side idempotency key.
    pub msg_id: MsgId,
    /// The topic, which names the stream.
    pub topic: String,
    /// The event type name, which picks the handler.
    pub event_type: String,
    /// Messages with one ordering key are published in id order.
    pub key: String,
    /// The payload's schema version.
    pub schema_version: u32,
    /// The event as JSON text. The relay passes it through without parsing it.
    pub payload: String,
    /// Free-form headers (trace context and the like).
    pub headers: Headers,
    /// When the message was emitted.
    pub created_at: DateTime<Utc>,
}

impl Envelope {
    /// Serializes `event` into an envelope stamped now, refusing payloads over
    /// `max_payload_bytes`.
    pub fn from_event<E: OutboxEvent>(event: &E, max_payload_bytes: usize) -> Result<Self, Error> {
        let msg_id = event.msg_id()?;
        let payload = serde_json::to_string(event).map_err(|source| Error::Serialize {
            msg_id: msg_id.clone(),
            source,
        })?;
        if payload.len() > max_payload_bytes {
            return Err(Error::PayloadTooLarge {
                msg_id,
                size: payload.len(),
                limit: max_payload_bytes,
            });
        }
        Ok(Self {
            msg_id,
            topic: event.topic().to_owned(),
            event_type: event.event_type().to_owned(),
            key: event.ordering_key(),
            schema_version: E::SCHEMA_VERSION,
            payload,
            headers: Headers::new(),
            created_at: Utc::now(),
        })
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Decodes the payload as `E`.
    pub fn decode<E: OutboxEvent>(&self) -> Result<E, Error> {
        serde_json::from_str(&self.payload).map_err(|source| Error::Decode {
            event_type: self.event_type.clone(),
            source,
        })
    }
}

/// A stored outbox row handed to the relay: its row id, the retries it has spent, and
/// the envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    /// The row id: the outbox's publish order.
    pub id: i64,
    /// Failed publish attempts so far.
    pub retries: u32,
    /// The message.
    pub envelope: Envelope,
}

/// The lifecycle of an outbox row. The stored values are part of the table contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i16)]
pub enum Status {
    /// Waiting to be published (stored as 0).
    New = 0,
    /// Published (stored as 1).
    Sent = 1,
    /// Gave up after the retry limit (stored as 2); stays until re-driven or purged.
    Dead = 2,
}

impl Status {
    /// The value stored in the `status` column.
    pub const fn as_i16(self) -> i16 {
        self as i16
    }
}

impl TryFrom<i16> for Status {
    type Error = Error;
    fn try_from(v: i16) -> Result<Self, Error> {
        match v {
            0 => Ok(Self::New),
            1 => Ok(Self::Sent),
            2 => Ok(Self::Dead),
            other => Err(Error::UnknownStatus(other)),
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::New => "NEW",
            Self::Sent => "SENT",
            Self::Dead => "DEAD",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_values_are_the_table_contract() {
        assert_eq!(Status::New.as_i16(), 0);
        assert_eq!(Status::Sent.as_i16(), 1);
        assert_eq!(Status::Dead.as_i16(), 2);
        for s in [Status::New, Status::Sent, Status::Dead] {
            assert_eq!(Status::try_from(s.as_i16()).unwrap(), s);
        }
        assert!(matches!(Status::try_from(7), Err(Error::UnknownStatus(7))));
        assert_eq!(Status::Dead.to_string(), "DEAD");
    }
}
