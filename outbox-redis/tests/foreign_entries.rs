//! Stream entries written by a foreign producer (another service, an operator with
//! `redis-cli`, an older or newer version of this one), fed to a real `Consumer` on the
//! real Redis. Each bad entry is dead-lettered at once with a reason that names what is
//! wrong, its handler never runs and nothing of it is recorded, the good entries around
//! it are applied, and the stream itself is left as it was.

mod fixtures;

use std::collections::HashMap;

use fixtures::*;
use outbox_core::{HandlerError, Inbox as _, MemoryDb, MsgId, Processed};
use outbox_redis::ConsumerConfig;
use outbox_redis::redis::{self, Value};

/// A dead-letter reason stays one readable log line, whatever the entry held.
const MAX_REASON_LEN: usize = 400;

const MB100: usize = 100 << 20;

/// The fields of an entry a well-behaved producer would write for `OrderPaid`, with
/// `edit` applied (`None` removes the field).
fn entry(edit: &[(&str, Option<Vec<u8>>)]) -> Vec<(String, Vec<u8>)> {
    let mut fields: Vec<(String, Vec<u8>)> = [
        ("msg_id", "order-9:OrderPaid"),
        ("topic", "order.paid"),
        ("type", "OrderPaid"),
        ("version", "1"),
        ("key", "order-9"),
        ("payload", r#"{"order_id":"order-9","amount_cents":900}"#),
        ("headers", "{}"),
        ("created_at", "2025-01-02T03:04:05.123456Z"),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
    .collect();
    for (name, value) in edit {
        fields.retain(|(k, _)| k != name);
        if let Some(v) = value {
            fields.push(((*name).to_owned(), v.clone()));
        }
    }
    fields
}

fn set(name: &'static str, value: impl Into<Vec<u8>>) -> (&'static str, Option<Vec<u8>>) {
    (name, Some(value.into()))
}

fn remove(name: &'static str) -> (&'static str, Option<Vec<u8>>) {
    (name, None)
}

async fn xadd(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    fields: &[(String, Vec<u8>)],
) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*");
    for (k, v) in fields {
        cmd.arg(k).arg(v.as_slice());
    }
    cmd.query_async(conn).await.expect("XADD")
}

/// Every entry of `stream`: id and fields, as Redis holds them.
async fn snapshot(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
) -> Vec<(String, HashMap<String, Value>)> {
    xrange(conn, stream)
        .await
        .ids
        .into_iter()
        .map(|e| (e.id, e.map))
        .collect()
}

/// What the consumer did with the bad entries.
struct Outcome {
    /// Each bad entry's dead letter, in the order the entries were given.
    dead: Vec<HashMap<String, Value>>,
}

/// Publishes a good message, the `bad` entries, and another good message; runs a
/// consumer with `config` until the good ones are applied and the bad ones
/// dead-lettered. Asserts everything the caller relies on besides the reasons: the
/// handler ran only for the good messages and each applied once, no bad msg_id has a
/// dedup record, nothing is left pending, the stream is unchanged, and each dead letter
/// carries its entry verbatim with the entry's id and a short reason.
async fn feed(
    bad: &[Vec<(String, Vec<u8>)>],
    config: impl FnOnce(&str) -> ConsumerConfig,
) -> Outcome {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    let group = unique("foreign");
    let mut conn = conn().await;
    publish(&prefix, [paid(1)]).await;
    let mut bad_ids = Vec::new();
    for fields in bad {
        bad_ids.push(xadd(&mut conn, &stream, fields).await);
    }
    publish(&prefix, [paid(2)]).await;
    let before = snapshot(&mut conn, &stream).await;
    assert_eq!(before.len(), bad.len() + 2);

    let db = MemoryDb::new(Applied::new());
    let handler = Recorder::ok();
    let c = consumer(config(&prefix), &group, &db, handler.clone());
    let running = Running::start(&c);
    eventually(
        "the good entries applied and the bad ones dead-lettered",
        || {
            let s = c.stats();
            s.consumed == 2 && s.dead_lettered == bad.len() as u64
        },
    )
    .await;
    running.stop().await;

    let stats = c.stats();
    assert_eq!((stats.consumed, stats.failures), (2, 0), "{stats:?}");
    assert_eq!(handler.calls(), 2, "the handler ran for a bad entry");
    let applied = db.read(Clone::clone);
    assert_eq!(
        applied,
        Applied::from([("order-1".to_owned(), 1), ("order-2".to_owned(), 1)])
    );
    // No dedup record for a bad entry's msg_id (the probe's handler refuses, so it
    // writes nothing either way).
    for fields in bad {
        let Some(id) = fields
            .iter()
            .find(|(k, _)| k == "msg_id")
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
            .and_then(|v| MsgId::new(v).ok())
        else {
            continue;
        };
        let probe = db.process(&group, &id, |_| Err(HandlerError::msg("probe")));
        assert!(
            !matches!(probe, Ok(Processed::Duplicate)),
            "a dedup record exists for the dead-lettered {id}"
        );
    }
    assert_eq!(pending_count(&mut conn, &stream, &group).await, 0);
    assert_eq!(
        snapshot(&mut conn, &stream).await,
        before,
        "the consumer changed the stream"
    );

    let dead = snapshot(&mut conn, &c.dead_letter_stream(&stream)).await;
    assert_eq!(dead.len(), bad.len());
    let mut by_entry = HashMap::new();
    for (_, letter) in dead {
        let entry_id: String = redis::from_redis_value_ref(&letter["entry_id"]).unwrap();
        by_entry.insert(entry_id, letter);
    }
    let mut ordered = Vec::new();
    for (fields, id) in bad.iter().zip(&bad_ids) {
        let letter = by_entry
            .remove(id)
            .unwrap_or_else(|| panic!("no dead letter for entry {id}"));
        let text = |name: &str| -> String { redis::from_redis_value_ref(&letter[name]).unwrap() };
        assert_eq!(text("delivery_count"), "1", "dead-lettered at once");
        assert_eq!(text("group"), group);
        assert_eq!(text("stream"), stream);
        let reason = text("reason");
        assert!(
            reason.len() <= MAX_REASON_LEN,
            "a {} byte reason: {}…",
            reason.len(),
            reason.chars().take(200).collect::<String>()
        );
        for (k, v) in fields {
            let copied: Vec<u8> = redis::from_redis_value_ref(&letter[k.as_str()]).unwrap();
            assert!(copied == *v, "field `{k}` was not copied verbatim");
        }
        ordered.push(letter);
    }
    cleanup(&prefix).await;
    Outcome { dead: ordered }
}

/// Feeds one bad entry in single mode and returns its dead letter's reason.
async fn reason_for(edit: &[(&str, Option<Vec<u8>>)]) -> String {
    let outcome = feed(&[entry(edit)], fast_config).await;
    redis::from_redis_value_ref(&outcome.dead[0]["reason"]).unwrap()
}

fn assert_reason(reason: &str, needle: &str) {
    assert!(
        reason.contains(needle),
        "reason {reason:?} lacks {needle:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unedited_entry_is_applied() {
    // The baseline the bad entries are variations of: a good entry, applied.
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    let mut conn = conn().await;
    xadd(&mut conn, &stream, &entry(&[])).await;
    let db = MemoryDb::new(Applied::new());
    let c = consumer(
        fast_config(&prefix),
        "foreign-baseline",
        &db,
        Recorder::ok(),
    );
    let running = Running::start(&c);
    eventually("applied", || c.stats().consumed == 1).await;
    running.stop().await;
    assert_eq!(db.read(|a| a.get("order-9").copied()), Some(1));
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_required_fields_are_named() {
    for field in ["msg_id", "type", "version", "payload"] {
        let reason = reason_for(&[remove(field)]).await;
        assert_reason(
            &reason,
            &format!("malformed stream entry: missing field `{field}`"),
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_that_is_not_json_is_dead_lettered() {
    let reason = reason_for(&[set("payload", "<order id=9/>")]).await;
    assert_reason(
        &reason,
        "cannot decode a `OrderPaid` payload: expected value",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_of_another_shape_is_dead_lettered() {
    let reason = reason_for(&[set("payload", r#"{"order_id":9}"#)]).await;
    assert_reason(&reason, "cannot decode a `OrderPaid` payload: invalid type");
    let reason = reason_for(&[set("payload", r#"{"order_id":"order-9"}"#)]).await;
    assert_reason(&reason, "missing field `amount_cents`");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_field_that_is_not_utf8_is_dead_lettered() {
    let reason = reason_for(&[set("payload", b"{\"order_id\":\"\xff\xfe\"}".to_vec())]).await;
    assert_reason(&reason, "field `payload` is not UTF-8 text");
    let reason = reason_for(&[set("type", b"Order\xc3Paid".to_vec())]).await;
    assert_reason(&reason, "field `type` is not UTF-8 text");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_event_type_is_dead_lettered() {
    let reason = reason_for(&[
        set("type", "OrderShipped"),
        set("msg_id", "order-9:OrderShipped"),
    ])
    .await;
    assert_reason(&reason, "no handler for event type `OrderShipped`");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_version_is_dead_lettered_not_decoded() {
    // Version 2 of OrderPaid added a field; decoding it as version 1 would drop it
    // without a word. The payload is otherwise one version 1 decodes.
    let reason = reason_for(&[
        set("version", "2"),
        set(
            "payload",
            r#"{"order_id":"order-9","amount_cents":900,"currency":"EUR"}"#,
        ),
    ])
    .await;
    assert_reason(
        &reason,
        "`OrderPaid` payload has schema version 2; this consumer handles versions up to 1",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_that_is_not_a_u32_is_dead_lettered() {
    for version in ["two", "-1", "4294967296", "1.0", ""] {
        let reason = reason_for(&[set("version", version)]).await;
        assert_reason(&reason, "field `version` is not a schema version");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_msg_id_is_dead_lettered() {
    for (id, needle) in [
        ("", "msg_id is empty"),
        (
            "order 9:OrderPaid",
            "contains whitespace or a control character at byte 5",
        ),
        ("order-9\u{7}:OrderPaid", "at byte 7"),
        ("order-9\n:OrderPaid", "at byte 7"),
    ] {
        let reason = reason_for(&[set("msg_id", id)]).await;
        assert_reason(&reason, "field `msg_id`");
        assert_reason(&reason, needle);
    }
    let long = format!("{}:OrderPaid", "9".repeat(60));
    let reason = reason_for(&[set("msg_id", long)]).await;
    assert_reason(&reason, "is 70 bytes long; the limit is 64");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_that_are_not_a_json_object_of_strings_are_dead_lettered() {
    for headers in ["traceparent=00-abc", r#"["a"]"#, r#"{"n":1}"#] {
        let reason = reason_for(&[set("headers", headers)]).await;
        assert_reason(&reason, "field `headers`");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_created_at_that_is_not_rfc3339_is_dead_lettered() {
    for at in ["yesterday", "1735787045", "2025-13-02T03:04:05Z"] {
        let reason = reason_for(&[set("created_at", at)]).await;
        assert_reason(&reason, "field `created_at`");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlong_type_or_topic_is_dead_lettered() {
    let reason = reason_for(&[set("type", "T".repeat(129))]).await;
    assert_reason(&reason, "field `type` is 129 bytes long; the limit is 128");
    let reason = reason_for(&[set("topic", "t".repeat(200))]).await;
    assert_reason(&reason, "field `topic` is 200 bytes long; the limit is 128");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mb_payload_is_dead_lettered_with_a_short_reason() {
    // Not JSON: a producer that wrote a file where the event belonged.
    let reason = reason_for(&[set("payload", vec![b'#'; MB100])]).await;
    assert_reason(&reason, "cannot decode a `OrderPaid` payload");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mb_msg_id_is_dead_lettered_with_a_short_reason() {
    let reason = reason_for(&[set("msg_id", vec![b'9'; MB100])]).await;
    assert_reason(&reason, &format!("is {MB100} bytes long; the limit is 64"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mb_type_or_version_is_dead_lettered_with_a_short_reason() {
    let reason = reason_for(&[set("type", vec![b'T'; MB100])]).await;
    assert_reason(&reason, &format!("field `type` is {MB100} bytes long"));
    let reason = reason_for(&[set("version", vec![b'7'; MB100])]).await;
    assert_reason(&reason, "field `version` is not a schema version");
    assert_reason(&reason, &format!("({MB100} bytes)"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_batch_mode_bad_entries_are_dead_lettered_and_the_batch_commits() {
    let bad = [
        entry(&[remove("payload")]),
        entry(&[set("payload", "not json")]),
        entry(&[set("version", "3")]),
        entry(&[
            set("type", "OrderShipped"),
            set("msg_id", "order-9:OrderShipped"),
        ]),
    ];
    let outcome = feed(&bad, |prefix| fast_config(prefix).with_batch_size(16)).await;
    let reasons: Vec<String> = outcome
        .dead
        .iter()
        .map(|d| redis::from_redis_value_ref(&d["reason"]).unwrap())
        .collect();
    assert_reason(&reasons[0], "missing field `payload`");
    assert_reason(&reasons[1], "cannot decode a `OrderPaid` payload");
    assert_reason(&reasons[2], "schema version 3");
    assert_reason(&reasons[3], "no handler for event type `OrderShipped`");
}
