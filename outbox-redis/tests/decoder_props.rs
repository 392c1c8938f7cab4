//! Property tests of the stream-entry decoder (`envelope_from_fields`): whatever a
//! producer wrote, decoding never panics and fails only with `MalformedEntry` and a short
//! message; what it accepts round-trips through `entry_fields`; and every envelope the
//! relay writes decodes back to itself.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use outbox_core::{Envelope, Headers, MsgId};
use outbox_redis::redis::Value;
use outbox_redis::{ENTRY_FIELDS, entry_fields, envelope_from_fields};
use proptest::collection::{btree_map, hash_map, vec};
use proptest::prelude::*;

/// A decode error stays one readable log line.
const MAX_MESSAGE_LEN: usize = 400;

fn as_map(fields: &[(&str, std::borrow::Cow<'_, str>)]) -> HashMap<String, Value> {
    fields
        .iter()
        .map(|(k, v)| ((*k).to_owned(), Value::BulkString(v.as_bytes().to_vec())))
        .collect()
}

/// Values as Redis may hand them over: mostly bulk strings (all a stream holds),
/// valid-looking or arbitrary bytes, and the other reply kinds for good measure.
fn value() -> impl Strategy<Value = Value> {
    let text = prop_oneof![
        Just("1".to_owned()),
        Just("{}".to_owned()),
        Just("order-1:OrderPaid".to_owned()),
        Just("2025-01-02T03:04:05Z".to_owned()),
        Just(r#"{"traceparent":"00-1"}"#.to_owned()),
        "[0-9]{0,12}",
        "[a-z:. -]{0,80}",
        any::<String>(),
    ];
    let leaf = prop_oneof![
        6 => text.prop_map(|s| Value::BulkString(s.into_bytes())),
        2 => vec(any::<u8>(), 0..80).prop_map(Value::BulkString),
        1 => any::<i64>().prop_map(Value::Int),
        1 => Just(Value::Nil),
        1 => any::<String>().prop_map(Value::SimpleString),
        1 => any::<f64>().prop_map(Value::Double),
        1 => any::<bool>().prop_map(Value::Boolean),
    ];
    leaf.prop_recursive(2, 8, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::Array),
            vec((inner.clone(), inner), 0..3).prop_map(Value::Map),
        ]
    })
}

/// Field names: the decoder's own, often, and anything else.
fn field_name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => proptest::sample::select(ENTRY_FIELDS.to_vec()).prop_map(str::to_owned),
        1 => any::<String>(),
    ]
}

/// A well-formed entry with some fields replaced, removed or added.
fn mutated_entry() -> impl Strategy<Value = HashMap<String, Value>> {
    (
        envelope(),
        hash_map(field_name(), value(), 0..4),
        vec(proptest::sample::select(ENTRY_FIELDS.to_vec()), 0..3),
    )
        .prop_map(|(e, replace, removed)| {
            let mut map = as_map(&entry_fields(&e));
            map.extend(replace);
            for name in removed {
                map.remove(name);
            }
            map
        })
}

fn msg_id() -> impl Strategy<Value = MsgId> {
    "[a-z0-9/_-]{1,20}:[A-Za-z]{1,20}".prop_map(|s| MsgId::new(s).unwrap())
}

/// Any envelope the emit side can produce: valid msg_id, type and topic within their
/// columns, any key, version, payload text and headers, a time of the years 1970–9999
/// to the nanosecond.
fn envelope() -> impl Strategy<Value = Envelope> {
    (
        msg_id(),
        "[a-z.]{1,128}",
        "[A-Za-z0-9]{1,128}",
        any::<String>(),
        any::<u32>(),
        any::<String>(),
        btree_map(any::<String>(), any::<String>(), 0..4),
        0_i64..253_402_300_799,
        0_u32..1_000_000_000,
    )
        .prop_map(
            |(msg_id, topic, event_type, key, schema_version, payload, headers, secs, nanos)| {
                Envelope {
                    msg_id,
                    topic,
                    event_type,
                    key,
                    schema_version,
                    payload,
                    headers: Headers::from_iter(headers),
                    created_at: DateTime::<Utc>::from_timestamp(secs, nanos).unwrap(),
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn every_written_envelope_decodes_to_itself(e in envelope()) {
        let decoded = envelope_from_fields(&as_map(&entry_fields(&e)), "unused").unwrap();
        prop_assert_eq!(decoded, e);
    }

    #[test]
    fn arbitrary_fields_never_panic_and_accepted_ones_round_trip(
        fields in prop_oneof![mutated_entry(), hash_map(field_name(), value(), 0..10)],
        default_topic in "[a-z.]{1,20}",
    ) {
        match envelope_from_fields(&fields, &default_topic) {
            Ok(e) => {
                let again = envelope_from_fields(&as_map(&entry_fields(&e)), "unused").unwrap();
                prop_assert_eq!(again, e);
            }
            Err(err) => {
                prop_assert!(err.is_malformed_entry(), "{:?}", err);
                prop_assert!(err.to_string().len() <= MAX_MESSAGE_LEN, "{}", err);
            }
        }
    }
}

/// The defaults fill what a minimal foreign entry leaves out, and the result
/// round-trips like any other.
#[test]
fn a_minimal_entry_gets_the_defaults() {
    let fields: HashMap<String, Value> = [
        ("msg_id", "t-1/order-7:OrderPaid"),
        ("type", "OrderPaid"),
        ("version", "4"),
        ("payload", "{}"),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), Value::BulkString(v.as_bytes().to_vec())))
    .collect();
    let e = envelope_from_fields(&fields, "order.paid").unwrap();
    assert_eq!(
        (e.topic.as_str(), e.key.as_str(), e.schema_version),
        ("order.paid", "t-1/order-7", 4)
    );
    assert!(e.headers.is_empty());
    assert_eq!(
        envelope_from_fields(&as_map(&entry_fields(&e)), "x").unwrap(),
        e
    );
}
