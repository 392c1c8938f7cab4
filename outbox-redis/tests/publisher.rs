//! The publisher and stream trimming against the real Redis.

mod common;

use common::*;
use outbox_core::{Envelope, Publisher};
use outbox_redis::redis::{self, Value};
use outbox_redis::{PublisherConfig, RedisPublisher, trim_acknowledged};

#[tokio::test]
async fn a_batch_lands_in_one_stream_per_topic_with_every_field_in_order() {
    let prefix = unique_prefix();
    let refund = Envelope::from_event(
        &OrderRefunded {
            order_id: "order-2".into(),
        },
        1 << 20,
    )
    .unwrap()
    .with_header("traceparent", "00-abc-def-01");
    let batch = stored([paid(1), refund.clone(), paid(2), paid(3)]);
    let outcomes = publisher(&prefix).publish(&batch).await.unwrap();
    assert_eq!(outcomes, vec![Ok(()); 4]);

    let mut conn = conn().await;
    let paid_stream = xrange(&mut conn, &format!("{prefix}order.paid")).await;
    let ids: Vec<String> = paid_stream.ids.iter().map(|e| field(e, "msg_id")).collect();
    assert_eq!(
        ids,
        [
            "order-1:OrderPaid",
            "order-2:OrderPaid",
            "order-3:OrderPaid"
        ]
    );
    let first = &paid_stream.ids[0];
    let expected = paid(1);
    assert_eq!(field(first, "topic"), "order.paid");
    assert_eq!(field(first, "type"), "OrderPaid");
    assert_eq!(field(first, "version"), "1");
    assert_eq!(field(first, "key"), "order-1");
    assert_eq!(field(first, "payload"), expected.payload);
    assert_eq!(field(first, "headers"), "{}");
    assert!(!field(first, "created_at").is_empty());

    let refunds = xrange(&mut conn, &format!("{prefix}order.refunded")).await;
    assert_eq!(refunds.ids.len(), 1);
    let entry = &refunds.ids[0];
    assert_eq!(field(entry, "type"), "OrderRefunded");
    assert_eq!(
        field(entry, "headers"),
        r#"{"traceparent":"00-abc-def-01"}"#
    );
    // What the consumer decodes is what was published.
    let decoded = outbox_redis::envelope_from_fields(&entry.map, "unused").unwrap();
    assert_eq!(decoded, refund);
    cleanup(&prefix).await;
}

#[tokio::test]
async fn an_unreachable_redis_is_a_broker_outage() {
    let publisher = RedisPublisher::new("redis://127.0.0.1:1").unwrap();
    let err = publisher.publish(&stored([paid(1)])).await.unwrap_err();
    assert!(
        matches!(err, outbox_core::Error::BrokerUnavailable(_)),
        "{err:?}"
    );
    assert!(err.is_outage());
}

/// Wrong credentials or missing permissions fail every write until an operator fixes
/// them: an outage, never a per-message failure that would spend retries.
#[tokio::test]
async fn credential_and_permission_errors_are_outages() {
    let user = format!("outbox-test-{:08x}", fastrand::u32(..));
    let mut conn = conn().await;
    let _: () = redis::cmd("ACL")
        .arg(
            &[
                "SETUSER", &user, "on", ">secret", "~*", "-@all", "+ping", "+hello", "+client",
            ][..],
        )
        .query_async(&mut conn)
        .await
        .unwrap();
    let prefix = unique_prefix();
    let host = redis_url().trim_start_matches("redis://").to_owned();
    for (url, why) in [
        (
            format!("redis://{user}:secret@{host}"),
            "no permission for XADD",
        ),
        (format!("redis://{user}:wrong@{host}"), "wrong password"),
    ] {
        let config = outbox_redis::PublisherConfig {
            stream_prefix: prefix.clone(),
            ..outbox_redis::PublisherConfig::default()
        };
        let publisher = RedisPublisher::with_config(url.as_str(), config).unwrap();
        let err = publisher.publish(&stored([paid(1)])).await.unwrap_err();
        assert!(err.is_outage(), "{why}: {err:?}");
    }
    let _: () = redis::cmd("ACL")
        .arg(&["DELUSER", &user][..])
        .query_async(&mut conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn an_entry_redis_refuses_fails_alone() {
    let prefix = unique_prefix();
    let mut conn = conn().await;
    // The refunds stream's key holds a string: XADD there is WRONGTYPE.
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}order.refunded"))
        .arg("not a stream")
        .query_async(&mut conn)
        .await
        .unwrap();
    let refund = Envelope::from_event(
        &OrderRefunded {
            order_id: "order-9".into(),
        },
        1 << 20,
    )
    .unwrap();
    let outcomes = publisher(&prefix)
        .publish(&stored([paid(1), refund, paid(2)]))
        .await
        .unwrap();
    assert!(outcomes[0].is_ok() && outcomes[2].is_ok(), "{outcomes:?}");
    let rejected = outcomes[1].as_ref().unwrap_err();
    assert!(rejected.reason.contains("WRONGTYPE"), "{rejected:?}");
    assert_eq!(
        xrange(&mut conn, &format!("{prefix}order.paid"))
            .await
            .ids
            .len(),
        2
    );
    cleanup(&prefix).await;
}

#[tokio::test]
async fn max_len_bounds_the_stream_approximately() {
    let prefix = unique_prefix();
    let publisher = RedisPublisher::with_config(
        redis_url(),
        PublisherConfig {
            stream_prefix: prefix.clone(),
            max_len: Some(10),
            ..PublisherConfig::default()
        },
    )
    .unwrap();
    let batch = stored((0..1000).map(paid));
    let outcomes = publisher.publish(&batch).await.unwrap();
    assert!(outcomes.iter().all(Result::is_ok));
    let len: usize = redis::cmd("XLEN")
        .arg(format!("{prefix}order.paid"))
        .query_async(&mut conn().await)
        .await
        .unwrap();
    assert!((10..1000).contains(&len), "length {len}");
    assert!(
        RedisPublisher::with_config(
            redis_url(),
            PublisherConfig {
                max_len: Some(0),
                ..PublisherConfig::default()
            }
        )
        .is_err()
    );
    cleanup(&prefix).await;
}

async fn read_group(
    conn: &mut outbox_redis::redis::aio::MultiplexedConnection,
    stream: &str,
    group: &str,
    count: usize,
) -> Vec<String> {
    let reply: outbox_redis::redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(group)
        .arg("c1")
        .arg("COUNT")
        .arg(count)
        .arg("STREAMS")
        .arg(stream)
        .arg(">")
        .query_async(conn)
        .await
        .unwrap();
    reply.keys[0].ids.iter().map(|e| e.id.clone()).collect()
}

#[tokio::test]
async fn trimming_never_removes_pending_or_unread_entries() {
    let prefix = unique_prefix();
    let stream = format!("{prefix}order.paid");
    let mut conn = conn().await;
    publish(&prefix, (1..=5).map(paid)).await;
    for group in ["done", "slow", "idle"] {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream)
            .arg(group)
            .arg("0")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    // `done` read and acked everything; `slow` read everything but acked only two.
    let ids = read_group(&mut conn, &stream, "done", 10).await;
    let _: Value = redis::cmd("XACK")
        .arg(&stream)
        .arg("done")
        .arg(&ids)
        .query_async(&mut conn)
        .await
        .unwrap();
    let ids = read_group(&mut conn, &stream, "slow", 10).await;
    assert_eq!(ids.len(), 5);
    let _: Value = redis::cmd("XACK")
        .arg(&stream)
        .arg("slow")
        .arg(&ids[..2])
        .query_async(&mut conn)
        .await
        .unwrap();

    // `idle` has read nothing yet: nothing may go.
    let report = trim_acknowledged(&mut conn, &stream).await.unwrap();
    assert_eq!(report.removed, 0);
    assert_eq!(xrange(&mut conn, &stream).await.ids.len(), 5);

    // `idle` reads three and acks them; `slow`'s third entry is now the oldest needed.
    let read = read_group(&mut conn, &stream, "idle", 3).await;
    let _: Value = redis::cmd("XACK")
        .arg(&stream)
        .arg("idle")
        .arg(&read)
        .query_async(&mut conn)
        .await
        .unwrap();
    let report = trim_acknowledged(&mut conn, &stream).await.unwrap();
    assert_eq!(report.removed, 2);
    assert_eq!(report.min_id.as_deref(), Some(ids[2].as_str()));
    let left: Vec<String> = xrange(&mut conn, &stream)
        .await
        .ids
        .into_iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(left, ids[2..]);
    assert_eq!(pending_count(&mut conn, &stream, "slow").await, 3);

    // Everyone acks everything: the stream empties.
    let _: Value = redis::cmd("XACK")
        .arg(&stream)
        .arg("slow")
        .arg(&ids[2..])
        .query_async(&mut conn)
        .await
        .unwrap();
    let rest = read_group(&mut conn, &stream, "idle", 10).await;
    let _: Value = redis::cmd("XACK")
        .arg(&stream)
        .arg("idle")
        .arg(&rest)
        .query_async(&mut conn)
        .await
        .unwrap();
    let report = trim_acknowledged(&mut conn, &stream).await.unwrap();
    assert_eq!(report.removed, 3);

    // No stream, or no group: nothing to do.
    let missing = trim_acknowledged(&mut conn, &format!("{prefix}missing"))
        .await
        .unwrap();
    assert_eq!((missing.removed, missing.min_id), (0, None));
    cleanup(&prefix).await;
}
