//! The outbox message as a NATS message: the event's JSON as the payload, the other
//! fields of the envelope as headers.

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use chrono::{DateTime, SecondsFormat, Utc};
use outbox_core::{Envelope, Headers, MsgId};

use crate::{Error, Result};

/// The headers of a message, as [`message_headers`] writes them; the payload is the
/// event's JSON.
///
/// | header | value |
/// |---|---|
/// | `Nats-Msg-Id` | the msg_id: JetStream's dedup key within the stream's duplicate window |
/// | `Outbox-Msg-Id` | the msg_id, the consumer's idempotency key |
/// | `Outbox-Topic` | the topic |
/// | `Outbox-Type` | the event type, which picks the handler |
/// | `Outbox-Version` | the payload's schema version, decimal |
/// | `Outbox-Key` | the ordering key |
/// | `Outbox-Headers` | a JSON object of string headers (`traceparent`, ...) |
/// | `Outbox-Created-At` | RFC 3339 time of the emit, UTC |
pub const MESSAGE_HEADERS: [&str; 8] = [
    "Nats-Msg-Id",
    MSG_ID,
    TOPIC,
    TYPE,
    VERSION,
    KEY,
    HEADERS,
    CREATED_AT,
];

pub(crate) const MSG_ID: &str = "Outbox-Msg-Id";
pub(crate) const TOPIC: &str = "Outbox-Topic";
pub(crate) const TYPE: &str = "Outbox-Type";
pub(crate) const VERSION: &str = "Outbox-Version";
pub(crate) const KEY: &str = "Outbox-Key";
pub(crate) const HEADERS: &str = "Outbox-Headers";
pub(crate) const CREATED_AT: &str = "Outbox-Created-At";

/// The header a redrive ([`redrive_dead_letter`](crate::redrive_dead_letter)) adds: the
/// consumer group that gave up on the message. Every other group acknowledges such a
/// message without running a handler, so a message it applied long ago is not applied
/// again.
pub const REDRIVE_GROUP_HEADER: &str = "Outbox-Redrive-Group";

/// Longest `Outbox-Type` and `Outbox-Topic` accepted, in bytes (the outbox's
/// `VARCHAR(128)` columns).
const MAX_NAME_LEN: usize = 128;

/// The headers of the message that carries `envelope`, or why it cannot be carried
/// (a value with a line break, which NATS headers cannot hold).
pub fn message_headers(envelope: &Envelope) -> Result<HeaderMap, String> {
    let headers = if envelope.headers.is_empty() {
        "{}".to_owned()
    } else {
        serde_json::to_string(&envelope.headers).map_err(|e| format!("headers: {e}"))?
    };
    let created_at = envelope
        .created_at
        .to_rfc3339_opts(SecondsFormat::AutoSi, true);
    let version = envelope.schema_version.to_string();
    let pairs: [(&str, &str); 8] = [
        (NATS_MESSAGE_ID.as_ref(), envelope.msg_id.as_str()),
        (MSG_ID, envelope.msg_id.as_str()),
        (TOPIC, &envelope.topic),
        (TYPE, &envelope.event_type),
        (VERSION, &version),
        (KEY, &envelope.key),
        (HEADERS, &headers),
        (CREATED_AT, &created_at),
    ];
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        if value.contains(['\r', '\n']) {
            return Err(format!(
                "header `{name}` would hold a line break, which NATS headers cannot carry"
            ));
        }
        map.insert(name, value);
    }
    Ok(map)
}

fn text<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).map(|v| v.as_str())
}

fn required<'a>(headers: &'a HeaderMap, name: &str) -> Result<&'a str> {
    text(headers, name).ok_or_else(|| Error::MalformedMessage(format!("missing header `{name}`")))
}

fn name(headers: &HeaderMap, header: &str) -> Result<Option<String>> {
    match text(headers, header) {
        Some(v) if v.len() > MAX_NAME_LEN => Err(Error::MalformedMessage(format!(
            "header `{header}` is {} bytes long; the limit is {MAX_NAME_LEN}",
            v.len()
        ))),
        v => Ok(v.map(str::to_owned)),
    }
}

/// Rebuilds the envelope from a message's headers and payload.
///
/// `Outbox-Msg-Id` (or else `Nats-Msg-Id`), `Outbox-Type` and `Outbox-Version` are
/// required, and the payload must be UTF-8 text. The others have defaults: the topic
/// `default_topic`, the key the msg_id's business key, no headers, `created_at` now.
/// Anything else is an [`Error::MalformedMessage`] naming the header, never a panic.
pub fn envelope_from_message(
    headers: Option<&HeaderMap>,
    payload: &[u8],
    default_topic: &str,
) -> Result<Envelope> {
    let empty = HeaderMap::new();
    let headers = headers.unwrap_or(&empty);
    let msg_id = match text(headers, MSG_ID) {
        Some(id) => id,
        None => required(headers, NATS_MESSAGE_ID.as_ref())?,
    };
    let msg_id = MsgId::new(msg_id)
        .map_err(|e| Error::MalformedMessage(format!("header `{MSG_ID}`: {e}")))?;
    let event_type = name(headers, TYPE)?
        .ok_or_else(|| Error::MalformedMessage(format!("missing header `{TYPE}`")))?;
    let version = required(headers, VERSION)?;
    let schema_version = version.parse().map_err(|_| {
        Error::MalformedMessage(format!(
            "header `{VERSION}` is not a schema version (0 to {})",
            u32::MAX
        ))
    })?;
    let payload = std::str::from_utf8(payload)
        .map_err(|e| Error::MalformedMessage(format!("the payload is not UTF-8 text: {e}")))?
        .to_owned();
    let topic = name(headers, TOPIC)?.unwrap_or_else(|| default_topic.to_owned());
    let key = match text(headers, KEY) {
        Some(key) => key.to_owned(),
        None => msg_id
            .as_str()
            .rsplit_once(':')
            .map_or(msg_id.as_str(), |(k, _)| k)
            .to_owned(),
    };
    let headers_map: Headers = match text(headers, HEADERS) {
        Some(h) => serde_json::from_str(h)
            .map_err(|e| Error::MalformedMessage(format!("header `{HEADERS}`: {e}")))?,
        None => Headers::new(),
    };
    let created_at = match text(headers, CREATED_AT) {
        Some(t) => DateTime::parse_from_rfc3339(t)
            .map_err(|e| Error::MalformedMessage(format!("header `{CREATED_AT}`: {e}")))?
            .with_timezone(&Utc),
        None => Utc::now(),
    };
    Ok(Envelope {
        msg_id,
        topic,
        event_type,
        key,
        schema_version,
        payload,
        headers: headers_map,
        created_at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope() -> Envelope {
        Envelope {
            msg_id: MsgId::new("order-42:OrderPaid").unwrap(),
            topic: "order.paid".into(),
            event_type: "OrderPaid".into(),
            key: "order-42".into(),
            schema_version: 3,
            payload: r#"{"order_id":"order-42"}"#.into(),
            headers: Headers::from([("traceparent".to_owned(), "00-abc".to_owned())]),
            created_at: DateTime::parse_from_rfc3339("2025-01-02T03:04:05.123456Z")
                .unwrap()
                .with_timezone(&Utc),
        }
    }

    #[test]
    fn round_trips() {
        let e = envelope();
        let headers = message_headers(&e).unwrap();
        assert_eq!(
            headers.get("Nats-Msg-Id").unwrap().as_str(),
            "order-42:OrderPaid"
        );
        let back = envelope_from_message(Some(&headers), e.payload.as_bytes(), "x").unwrap();
        assert_eq!(back, e);
    }

    #[test]
    fn line_breaks_are_refused_not_rewritten() {
        let mut e = envelope();
        e.key = "a\nb".into();
        assert!(message_headers(&e).unwrap_err().contains("Outbox-Key"));
    }

    #[test]
    fn missing_or_bad_headers_are_malformed() {
        let e = envelope();
        let mut h = message_headers(&e).unwrap();
        h.insert(VERSION, "two");
        let err = envelope_from_message(Some(&h), b"{}", "t").unwrap_err();
        assert!(err.is_malformed_message() && err.to_string().contains(VERSION));
        let err = envelope_from_message(None, b"{}", "t").unwrap_err();
        assert!(err.to_string().contains("Nats-Msg-Id"), "{err}");
        let h = message_headers(&e).unwrap();
        let err = envelope_from_message(Some(&h), &[0xff, 0xfe], "t").unwrap_err();
        assert!(err.to_string().contains("UTF-8"), "{err}");
    }
}
