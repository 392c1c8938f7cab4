use std::borrow::Cow;
use std::collections::HashMap;

use chrono::{DateTime, SecondsFormat, Utc};
use outbox_core::{Envelope, Headers, MsgId};
use redis::Value;

use crate::{Error, Result};

/// Names of the fields of a stream entry, as [`entry_fields`] writes them.
///
/// | field | value |
/// |---|---|
/// | `msg_id` | the msg_id, the consumer's idempotency key |
/// | `topic` | the topic (the stream is the prefix + the topic) |
/// | `type` | the event type, which picks the handler |
/// | `version` | the payload's schema version, decimal |
/// | `key` | the ordering key |
/// | `payload` | the event as JSON |
/// | `headers` | a JSON object of string headers |
/// | `created_at` | RFC 3339 time of the emit, UTC |
pub const ENTRY_FIELDS: [&str; 8] = [
    "msg_id",
    "topic",
    "type",
    "version",
    "key",
    "payload",
    "headers",
    "created_at",
];

/// The field a redrive ([`redrive_dead_letter`](crate::redrive_dead_letter)) adds to the
/// entry it puts back on the stream: the consumer group that gave up on it. Every other
/// group acknowledges such an entry without running a handler or asking its inbox, so a
/// message it applied long ago (its dedup row purged since) is not applied again.
pub const REDRIVE_GROUP_FIELD: &str = "redrive_group";

/// The group a redriven entry is for, when that is not `group`: the entry is then
/// another group's alone (see [`REDRIVE_GROUP_FIELD`]).
pub(crate) fn redriven_for_another(fields: &HashMap<String, Value>, group: &str) -> Option<String> {
    let target = value_bytes(fields.get(REDRIVE_GROUP_FIELD)?);
    (target != group.as_bytes()).then(|| String::from_utf8_lossy(&target).into_owned())
}

/// The field/value pairs of the stream entry that carries `envelope`, in
/// [`ENTRY_FIELDS`] order. The payload and the other text fields are borrowed: the relay
/// writes them to Redis without copying them first.
pub fn entry_fields(envelope: &Envelope) -> [(&'static str, Cow<'_, str>); 8] {
    let headers = if envelope.headers.is_empty() {
        Cow::Borrowed("{}")
    } else {
        Cow::Owned(serde_json::to_string(&envelope.headers).unwrap_or_else(|_| "{}".to_owned()))
    };
    [
        ("msg_id", Cow::Borrowed(envelope.msg_id.as_str())),
        ("topic", Cow::Borrowed(envelope.topic.as_str())),
        ("type", Cow::Borrowed(envelope.event_type.as_str())),
        ("version", Cow::Owned(envelope.schema_version.to_string())),
        ("key", Cow::Borrowed(envelope.key.as_str())),
        ("payload", Cow::Borrowed(envelope.payload.as_str())),
        ("headers", headers),
        ("created_at", Cow::Owned(rfc3339(&envelope.created_at))),
    ]
}

/// `at` as `to_rfc3339_opts(SecondsFormat::AutoSi, true)` writes it (`2025-01-02T03:04:05.123456Z`:
/// no fraction, or 3, 6 or 9 digits, whichever holds the nanoseconds), without going
/// through `fmt` (a third of the cost of building an entry). Years outside 0..=9999 and
/// leap seconds take chrono's own path.
fn rfc3339(at: &DateTime<Utc>) -> String {
    use chrono::{Datelike as _, Timelike as _};
    let (year, nanos) = (at.year(), at.nanosecond());
    if !(0..=9999).contains(&year) || nanos >= 1_000_000_000 {
        return at.to_rfc3339_opts(SecondsFormat::AutoSi, true);
    }
    let mut out = Vec::with_capacity(30);
    let mut digits = |n: u32, width: u32| {
        for i in (0..width).rev() {
            out.push(b'0' + (n / 10u32.pow(i) % 10) as u8);
        }
    };
    digits(year as u32, 4);
    digits(at.month(), 2);
    digits(at.day(), 2);
    digits(at.hour(), 2);
    digits(at.minute(), 2);
    digits(at.second(), 2);
    let (fraction, width) = if nanos == 0 {
        (0, 0)
    } else if nanos % 1_000_000 == 0 {
        (nanos / 1_000_000, 3)
    } else if nanos % 1_000 == 0 {
        (nanos / 1_000, 6)
    } else {
        (nanos, 9)
    };
    digits(fraction, width);
    // YYYYMMDDhhmmss[f..] -> YYYY-MM-DDThh:mm:ss[.f..]Z
    let mut text = String::with_capacity(30);
    for (i, &b) in out.iter().enumerate() {
        match i {
            4 | 6 => text.push('-'),
            8 => text.push('T'),
            10 | 12 => text.push(':'),
            14 => text.push('.'),
            _ => {}
        }
        text.push(char::from(b));
    }
    text.push('Z');
    text
}

/// Longest `type` and `topic` accepted, in bytes: the outbox's `VARCHAR(128)` columns.
/// Both reach logs (the event type is a field of the consume span) and error messages,
/// so a foreign producer's megabytes are refused rather than repeated.
pub(crate) const MAX_NAME_LEN: usize = 128;

/// Messages quote at most this many bytes of a field's value.
const QUOTED_LEN: usize = 64;

fn text(fields: &HashMap<String, Value>, name: &str) -> Result<Option<String>> {
    let malformed = |why: String| Error::MalformedEntry(format!("field `{name}` {why}"));
    match fields.get(name) {
        None => Ok(None),
        // Not through `from_redis_value_ref`: its errors quote the whole value.
        Some(Value::BulkString(bytes)) => std::str::from_utf8(bytes)
            .map(|s| Some(s.to_owned()))
            .map_err(|e| malformed(format!("is not UTF-8 text: {e}"))),
        Some(v) => redis::from_redis_value_ref::<String>(v)
            .map(Some)
            .map_err(|_| malformed("is not text".to_owned())),
    }
}

/// The beginning of `value`, for messages.
fn quoted(value: &str) -> Cow<'_, str> {
    if value.len() <= QUOTED_LEN {
        return Cow::Borrowed(value);
    }
    let end = (0..=QUOTED_LEN)
        .rev()
        .find(|&i| value.is_char_boundary(i))
        .unwrap_or(0);
    Cow::Owned(format!("{}… ({} bytes)", &value[..end], value.len()))
}

fn name(fields: &HashMap<String, Value>, field: &str) -> Result<Option<String>> {
    match text(fields, field)? {
        Some(v) if v.len() > MAX_NAME_LEN => Err(Error::MalformedEntry(format!(
            "field `{field}` is {} bytes long; the limit is {MAX_NAME_LEN}",
            v.len()
        ))),
        v => Ok(v),
    }
}

fn required(fields: &HashMap<String, Value>, name: &str) -> Result<String> {
    text(fields, name)?.ok_or_else(|| Error::MalformedEntry(format!("missing field `{name}`")))
}

/// Rebuilds the envelope from a stream entry's fields.
///
/// `msg_id`, `type`, `version` and `payload` are required. The others have defaults, so
/// entries written by other producers work too: `topic` defaults to `default_topic`,
/// `key` to the msg_id's business key, `headers` to none and `created_at` to now.
///
/// Anything else is an [`Error::MalformedEntry`] naming the field, never a panic: a
/// missing field, a value that is not UTF-8, a msg_id [`MsgId::new`] refuses, a `type`
/// or `topic` over 128 bytes (the outbox's columns), a `version` that is not a `u32`,
/// `headers` that are not a JSON object of strings, a `created_at` that is not RFC 3339.
/// Messages quote at most 64 bytes of a value. The payload is not parsed here.
pub fn envelope_from_fields(
    fields: &HashMap<String, Value>,
    default_topic: &str,
) -> Result<Envelope> {
    let msg_id = required(fields, "msg_id")?;
    let msg_id =
        MsgId::new(msg_id).map_err(|e| Error::MalformedEntry(format!("field `msg_id`: {e}")))?;
    let event_type = name(fields, "type")?
        .ok_or_else(|| Error::MalformedEntry("missing field `type`".to_owned()))?;
    let version = required(fields, "version")?;
    let schema_version = version.parse().map_err(|_| {
        Error::MalformedEntry(format!(
            "field `version` is not a schema version (0 to {}): {:?}",
            u32::MAX,
            quoted(&version)
        ))
    })?;
    let payload = required(fields, "payload")?;
    let topic = name(fields, "topic")?.unwrap_or_else(|| default_topic.to_owned());
    let key = match text(fields, "key")? {
        Some(key) => key,
        None => msg_id
            .as_str()
            .rsplit_once(':')
            .map_or(msg_id.as_str(), |(k, _)| k)
            .to_owned(),
    };
    let headers: Headers = match text(fields, "headers")? {
        Some(h) => serde_json::from_str(&h)
            .map_err(|e| Error::MalformedEntry(format!("field `headers`: {e}")))?,
        None => Headers::new(),
    };
    let created_at = match text(fields, "created_at")? {
        Some(t) => DateTime::parse_from_rfc3339(&t)
            .map_err(|e| Error::MalformedEntry(format!("field `created_at`: {e}")))?
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
        headers,
        created_at,
    })
}

/// The headers of a stream entry's fields, if it has a well-formed `headers` field. The
/// consumer reads them before the entry is decoded, for the trace its span joins.
#[cfg(feature = "opentelemetry")]
pub(crate) fn headers_of(fields: &HashMap<String, Value>) -> Option<Headers> {
    let headers = text(fields, "headers").ok()??;
    serde_json::from_str(&headers).ok()
}

/// A field value as bytes, for copying an entry verbatim.
pub(crate) fn value_bytes(v: &Value) -> Vec<u8> {
    redis::from_redis_value_ref::<Vec<u8>>(v).unwrap_or_else(|_| format!("{v:?}").into_bytes())
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

    fn as_map<V: AsRef<str>>(fields: &[(&str, V)]) -> HashMap<String, Value> {
        fields
            .iter()
            .map(|(k, v)| {
                (
                    (*k).to_owned(),
                    Value::BulkString(v.as_ref().as_bytes().to_vec()),
                )
            })
            .collect()
    }

    #[test]
    fn created_at_is_written_as_chrono_writes_it() {
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let nanos = [
            0,
            1,
            999,
            1_000,
            123_000,
            1_000_000,
            120_000_000,
            123_456_789,
            999_999_999,
        ];
        for i in 0..20_000u64 {
            // Seconds from year 0 to 9999, and past both ends.
            let secs = (next() % 380_000_000_000) as i64 - 62_200_000_000;
            let nano = if i % 2 == 0 {
                nanos[(next() % nanos.len() as u64) as usize]
            } else {
                (next() % 1_000_000_000) as u32
            };
            let at = DateTime::from_timestamp(secs, nano).unwrap();
            assert_eq!(
                rfc3339(&at),
                at.to_rfc3339_opts(SecondsFormat::AutoSi, true),
                "{secs} {nano}"
            );
        }
        let leap = chrono::NaiveDate::from_ymd_opt(2016, 12, 31)
            .unwrap()
            .and_hms_nano_opt(23, 59, 59, 1_500_000_000)
            .unwrap()
            .and_utc();
        assert_eq!(rfc3339(&leap), "2016-12-31T23:59:60.500Z");
    }

    #[test]
    fn round_trips() {
        let e = envelope();
        let fields = entry_fields(&e);
        assert_eq!(fields.clone().map(|(k, _)| k), ENTRY_FIELDS);
        assert_eq!(envelope_from_fields(&as_map(&fields), "other").unwrap(), e);
    }

    #[test]
    fn a_redrive_is_for_the_group_it_names_alone() {
        let plain = as_map(&entry_fields(&envelope()));
        assert_eq!(redriven_for_another(&plain, "billing"), None);
        let mut redriven = plain;
        redriven.insert(
            REDRIVE_GROUP_FIELD.into(),
            Value::BulkString(b"ledger".to_vec()),
        );
        assert_eq!(redriven_for_another(&redriven, "ledger"), None);
        assert_eq!(
            redriven_for_another(&redriven, "billing").as_deref(),
            Some("ledger")
        );
    }

    #[test]
    fn optional_fields_default() {
        let fields = as_map(&[
            ("msg_id", "order-7:OrderPaid"),
            ("type", "OrderPaid"),
            ("version", "1"),
            ("payload", "{}"),
        ]);
        let e = envelope_from_fields(&fields, "order.paid").unwrap();
        assert_eq!(e.topic, "order.paid");
        assert_eq!(e.key, "order-7");
        assert!(e.headers.is_empty());
    }

    #[test]
    fn missing_or_bad_fields_are_malformed() {
        let mut fields = as_map(&entry_fields(&envelope()));
        fields.remove("payload");
        let err = envelope_from_fields(&fields, "t").unwrap_err();
        assert!(err.is_malformed_entry(), "{err}");
        assert!(err.to_string().contains("payload"));

        let mut fields = as_map(&entry_fields(&envelope()));
        fields.insert("version".into(), Value::BulkString(b"two".to_vec()));
        assert!(
            envelope_from_fields(&fields, "t")
                .unwrap_err()
                .is_malformed_entry()
        );

        let mut fields = as_map(&entry_fields(&envelope()));
        fields.insert("msg_id".into(), Value::BulkString(b"has space".to_vec()));
        assert!(
            envelope_from_fields(&fields, "t")
                .unwrap_err()
                .is_malformed_entry()
        );
    }
}
