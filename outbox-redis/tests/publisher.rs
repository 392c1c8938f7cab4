//! The publisher and stream trimming against the real Redis.

mod fixtures;

use fixtures::*;
use std::time::Duration;

use outbox_core::{Envelope, Publisher, RejectKind};
use outbox_redis::redis::{self, Value};
use outbox_redis::{Durability, PublisherConfig, RedisPublisher, trim_acknowledged};

#[tokio::test]
async fn a_batch_lands_in_one_stream_per_topic_with_every_field_in_order() {
    let prefix = unique_prefix("test");
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
    let user = unique("outbox-test");
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
    let prefix = unique_prefix("test");
    let host = redis_url().trim_start_matches("redis://").to_owned();
    for (url, why) in [
        (
            format!("redis://{user}:secret@{host}"),
            "no permission for XADD",
        ),
        (format!("redis://{user}:wrong@{host}"), "wrong password"),
    ] {
        let config = outbox_redis::PublisherConfig::default().with_stream_prefix(prefix.clone());
        let publisher = RedisPublisher::new(url.as_str())
            .unwrap()
            .with_config(config)
            .unwrap();
        let err = publisher.publish(&stored([paid(1)])).await.unwrap_err();
        assert!(err.is_outage(), "{why}: {err:?}");
    }
    let _: () = redis::cmd("ACL")
        .arg(&["DELUSER", &user][..])
        .query_async(&mut conn)
        .await
        .unwrap();
}

/// A key of another type at a stream's name refuses every entry of that stream: the
/// topic's fault, reported as such (no retry spent), while the other streams of the
/// batch are written.
#[tokio::test]
async fn a_stream_key_of_another_type_refuses_its_topic_only() {
    let prefix = unique_prefix("test");
    let mut conn = conn().await;
    // The refunds stream's key holds a string: XADD there is WRONGTYPE.
    set_string(
        &mut conn,
        &format!("{prefix}order.refunded"),
        "not a stream",
    )
    .await;
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
    assert_eq!(rejected.kind, RejectKind::Topic);
    assert!(!rejected.spends_retry());
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
    let prefix = unique_prefix("test");
    let publisher = RedisPublisher::new(redis_url())
        .unwrap()
        .with_config(
            PublisherConfig::default()
                .with_stream_prefix(prefix.clone())
                .with_max_len(Some(10)),
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
        RedisPublisher::new(redis_url())
            .and_then(|p| p.with_config(PublisherConfig::default().with_max_len(Some(0))))
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
    let prefix = unique_prefix("test");
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

/// Sets `key` to a string: a key of the wrong type for a stream or a hash.
async fn set_string(conn: &mut redis::aio::MultiplexedConnection, key: &str, value: &str) {
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg(value)
        .query_async(conn)
        .await
        .unwrap();
}

fn config_with(prefix: &str, change: impl FnOnce(&mut PublisherConfig)) -> PublisherConfig {
    let mut config = PublisherConfig::default().with_stream_prefix(prefix.to_owned());
    change(&mut config);
    config
}

async fn msg_ids(stream: &str) -> Vec<String> {
    xrange(&mut conn().await, stream)
        .await
        .ids
        .iter()
        .map(|e| field(e, "msg_id"))
        .collect()
}

/// A batch over the pipeline cap goes in several pipelines, in order; a message larger
/// than the cap goes alone rather than not at all.
#[tokio::test]
async fn a_batch_over_the_pipeline_cap_is_split_in_order() {
    let prefix = unique_prefix("test");
    for cap in [1, 600] {
        let config = config_with(&prefix, |c| c.max_pipeline_bytes = cap);
        let publisher = RedisPublisher::new(redis_url())
            .unwrap()
            .with_config(config)
            .unwrap();
        let outcomes = publisher.publish(&stored((0..20).map(paid))).await.unwrap();
        assert_eq!(outcomes, vec![Ok(()); 20], "cap {cap}");
    }
    let want: Vec<String> = (0..20)
        .chain(0..20)
        .map(|n| format!("order-{n}:OrderPaid"))
        .collect();
    assert_eq!(msg_ids(&format!("{prefix}order.paid")).await, want);
    let err = RedisPublisher::new(redis_url())
        .and_then(|p| p.with_config(config_with(&prefix, |c| c.max_pipeline_bytes = 0)))
        .unwrap_err();
    assert!(err.is_config(), "{err}");
    cleanup(&prefix).await;
}

/// `WAIT 0`: every entry counts as published at once.
#[tokio::test]
async fn waiting_for_zero_replicas_publishes() {
    let prefix = unique_prefix("test");
    let config = config_with(&prefix, |c| {
        c.durability = Durability::Replicas {
            replicas: 0,
            timeout: Duration::from_millis(100),
        }
    });
    let publisher = RedisPublisher::new(redis_url())
        .unwrap()
        .with_config(config)
        .unwrap();
    publisher.check().await.unwrap();
    let outcomes = publisher.publish(&stored((0..3).map(paid))).await.unwrap();
    assert_eq!(outcomes, vec![Ok(()); 3]);
    assert_eq!(msg_ids(&format!("{prefix}order.paid")).await.len(), 3);
    cleanup(&prefix).await;
}

/// `WAIT 1` on a server without replicas times out: the entries are not counted as
/// published, as an outage (no retry spent), never as the messages' own failure. Nor are
/// they written: before its first write the publisher counts the replicas in sync.
#[tokio::test]
async fn waiting_for_a_missing_replica_is_an_outage() {
    let mut c = conn().await;
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(
        info.contains("connected_slaves:0"),
        "the test needs a Redis without replicas: {info}"
    );
    let prefix = unique_prefix("test");
    let config = config_with(&prefix, |c| {
        c.durability = Durability::Replicas {
            replicas: 1,
            timeout: Duration::from_millis(50),
        }
    });
    let publisher = RedisPublisher::new(redis_url())
        .unwrap()
        .with_config(config)
        .unwrap();
    let err = publisher
        .publish(&stored((0..3).map(paid)))
        .await
        .unwrap_err();
    assert!(err.is_outage(), "{err}");
    assert!(
        outbox_core::error_chain(&err)
            .to_string()
            .contains("0 of 1 replicas"),
        "{err}"
    );
    assert!(
        msg_ids(&format!("{prefix}order.paid")).await.is_empty(),
        "nothing written"
    );
    cleanup(&prefix).await;
}

/// `WAITAOF` is Redis 7.2; on an older server the publisher refuses to write with a
/// configuration error, before it writes anything.
#[tokio::test]
async fn waitaof_on_a_server_without_it_is_a_config_error() {
    let mut c = conn().await;
    let version: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut c)
        .await
        .unwrap();
    let version = version
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap()
        .trim()
        .to_owned();
    let prefix = unique_prefix("test");
    let config = config_with(&prefix, |c| {
        c.durability = Durability::Aof {
            local: false,
            replicas: 0,
            timeout: Duration::from_millis(100),
        }
    });
    let publisher = RedisPublisher::new(redis_url())
        .unwrap()
        .with_config(config)
        .unwrap();
    let older = version
        .split('.')
        .map(|p| p.parse::<u32>().unwrap())
        .collect::<Vec<_>>()
        < vec![7, 2];
    assert!(
        older,
        "this test needs Redis before 7.2; the server is {version}"
    );
    let err = publisher
        .publish(&stored((0..3).map(paid)))
        .await
        .unwrap_err();
    assert!(matches!(err, outbox_core::Error::Config(_)), "{err:?}");
    assert!(!err.is_outage());
    let text = err.to_string();
    assert!(text.contains("WAITAOF") && text.contains("7.2"), "{text}");
    assert!(
        msg_ids(&format!("{prefix}order.paid")).await.is_empty(),
        "nothing written"
    );
    let err = publisher.check().await.unwrap_err();
    assert!(err.is_config(), "{err}");
    cleanup(&prefix).await;
}

/// A durability timeout of zero (which would block the server's reply without end) or
/// not below the response timeout is refused.
#[test]
fn durability_timeouts_are_checked() {
    for timeout in [
        Duration::ZERO,
        Duration::from_secs(5),
        Duration::from_secs(60),
    ] {
        let config = PublisherConfig::default().with_durability(Durability::Replicas {
            replicas: 1,
            timeout,
        });
        let err = RedisPublisher::new(redis_url())
            .and_then(|p| p.with_config(config))
            .unwrap_err();
        assert!(err.is_config(), "{timeout:?}: {err}");
    }
}

/// `order.paid` spread over 4 partitions by `#[outbox(partitions = 4)]`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, outbox_core::OutboxEvent)]
#[outbox(topic = "order.paid", partitions = 4)]
struct PartitionedPaid {
    #[outbox(id)]
    order_id: String,
    seq: usize,
}

/// Event `seq` of order `key` (`order-<key>`), on the partitioned topic.
fn nth(key: usize, seq: usize) -> Envelope {
    let e = PartitionedPaid {
        order_id: format!("order-{key}"),
        seq,
    };
    Envelope::from_event(&e, 1 << 20).unwrap()
}

/// A partitioned topic: each message goes to the partition stream of its ordering key,
/// where a key's messages keep their order; an unpartitioned topic of the same batch
/// keeps its one stream; the count is recorded for consumers.
#[tokio::test]
async fn a_partitioned_topic_spreads_keys_over_partition_streams_in_order() {
    let prefix = unique_prefix("test");
    let config = PublisherConfig::default()
        .with_stream_prefix(prefix.clone())
        .with_partitions_of::<PartitionedPaid>();
    let publisher = RedisPublisher::new(redis_url())
        .unwrap()
        .with_config(config)
        .unwrap();
    let four = outbox_core::Partitions::new(4).unwrap();
    assert_eq!(publisher.partitions_of("order.paid"), four);
    // 20 keys, 3 events each, interleaved key by key, with a refund among them.
    let mut envelopes: Vec<Envelope> = (0..3)
        .flat_map(|seq| (0..20).map(move |key| nth(key, seq)))
        .collect();
    envelopes.insert(
        7,
        Envelope::from_event(
            &OrderRefunded {
                order_id: "order-1".into(),
            },
            1 << 20,
        )
        .unwrap(),
    );
    let outcomes = publisher.publish(&stored(envelopes)).await.unwrap();
    assert_eq!(outcomes, vec![Ok(()); 61]);

    let mut conn = conn().await;
    let mut seen = 0;
    for p in 0..4 {
        let stream = format!("{prefix}order.paid:{p}");
        let entries = xrange(&mut conn, &stream).await.ids;
        assert!(!entries.is_empty(), "partition {p} got no key");
        let mut last_seq: std::collections::HashMap<String, usize> = Default::default();
        for entry in &entries {
            let key = field(entry, "key");
            assert_eq!(
                outbox_core::partition_of(&key, four),
                p,
                "{key} in {stream}"
            );
            assert_eq!(publisher.stream_for_key("order.paid", &key), stream);
            let payload: serde_json::Value =
                serde_json::from_str(&field(entry, "payload")).unwrap();
            let seq = payload["seq"].as_u64().unwrap() as usize;
            let expected = last_seq.get(&key).map_or(0, |s| s + 1);
            assert_eq!(seq, expected, "{key}'s events out of order in {stream}");
            last_seq.insert(key, seq);
        }
        assert!(last_seq.values().all(|&s| s == 2), "{last_seq:?}");
        seen += entries.len();
    }
    assert_eq!(seen, 60);
    let exists: bool = redis::cmd("EXISTS")
        .arg(format!("{prefix}order.paid"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!exists, "a partitioned topic has no unpartitioned stream");
    assert_eq!(
        msg_ids(&format!("{prefix}order.refunded")).await,
        ["order-1:OrderRefunded"]
    );
    let recorded: std::collections::HashMap<String, u32> = redis::cmd("HGETALL")
        .arg(format!("{prefix}partitions"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(recorded, [("order.paid".to_owned(), 4)].into());
    cleanup(&prefix).await;
}

/// The hash of partition counts holding another type: the relay stops with a
/// configuration error before any entry is written (no retry spent, nothing lost).
#[tokio::test]
async fn a_partitions_key_of_another_type_is_a_config_error_before_any_write() {
    let prefix = unique_prefix("test");
    let mut conn = conn().await;
    set_string(&mut conn, &format!("{prefix}partitions"), "not a hash").await;
    let config = PublisherConfig::default()
        .with_stream_prefix(prefix.clone())
        .with_partitions("order.paid", outbox_core::Partitions::new(2).unwrap());
    let publisher = RedisPublisher::new(redis_url())
        .unwrap()
        .with_config(config)
        .unwrap();
    let err = publisher.publish(&stored([nth(1, 0)])).await.unwrap_err();
    assert!(matches!(err, outbox_core::Error::Config(_)), "{err:?}");
    assert!(publisher.check().await.unwrap_err().is_config());
    let streams: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}order.paid*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(streams.is_empty(), "{streams:?}");
    cleanup(&prefix).await;
}

/// A Redis that comes back from an outage without its data (no persistence): the
/// publisher records the partition counts again, for the consumers that compare theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partition_counts_are_recorded_again_after_redis_lost_its_data() {
    let mut scratch = outbox_tests::ScratchRedis::start();
    let prefix = unique_prefix("test");
    let config = PublisherConfig::default()
        .with_stream_prefix(prefix.clone())
        .with_partitions_of::<PartitionedPaid>();
    let publisher = RedisPublisher::new(scratch.url())
        .unwrap()
        .with_config(config)
        .unwrap();
    let (url, key) = (scratch.url(), format!("{prefix}partitions"));
    let recorded = || {
        let (url, key) = (url.clone(), key.clone());
        async move {
            let mut conn = redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            let count: Option<u32> = redis::cmd("HGET")
                .arg(key)
                .arg("order.paid")
                .query_async(&mut conn)
                .await
                .unwrap();
            count
        }
    };
    assert!(publisher.publish(&stored([nth(1, 0)])).await.is_ok());
    assert_eq!(recorded().await, Some(4));
    tokio::task::block_in_place(|| scratch.stop());
    assert!(publisher.publish(&stored([nth(1, 1)])).await.is_err());
    tokio::task::block_in_place(|| scratch.restart());
    let mut taken = false;
    for _ in 0..100 {
        if let Ok(outcomes) = publisher.publish(&stored([nth(1, 1)])).await
            && outcomes.iter().all(Result::is_ok)
        {
            taken = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(taken, "the restarted Redis took no entry");
    assert_eq!(recorded().await, Some(4));
}

/// Every entry is, byte for byte and field by field in order, what `entry_fields` gives
/// for its message, in the stream `stream_for_key` names, whatever the batch mixes:
/// topics interleaved, a partitioned topic, MAXLEN, timestamps with 0, 3, 6 and 9
/// fractional digits and headers. (The publisher builds each distinct stream name once
/// per batch and each command in buffers of its exact size.)
#[tokio::test]
async fn every_entry_is_entry_fields_in_its_stream_whatever_the_batch_mixes() {
    let prefix = unique_prefix("test");
    let config = PublisherConfig::default()
        .with_stream_prefix(prefix.clone())
        .with_partitions_of::<PartitionedPaid>()
        .with_max_len(Some(1_000));
    let publisher = RedisPublisher::new(redis_url())
        .unwrap()
        .with_config(config)
        .unwrap();
    let fractions = [0, 120_000_000, 123_456_000, 123_456_789];
    let envelopes: Vec<Envelope> = (0..40)
        .map(|n| {
            let mut e = match n % 3 {
                0 => paid(n),
                1 => nth(n % 7, n),
                _ => Envelope::from_event(
                    &OrderRefunded {
                        order_id: format!("order-{n}"),
                    },
                    1 << 20,
                )
                .unwrap()
                .with_header("traceparent", format!("00-{n}")),
            };
            e.created_at = chrono::DateTime::from_timestamp(
                1_700_000_000 + n as i64,
                fractions[n % fractions.len()],
            )
            .unwrap();
            e
        })
        .collect();
    let outcomes = publisher.publish(&stored(envelopes.clone())).await.unwrap();
    assert_eq!(outcomes, vec![Ok(()); envelopes.len()]);

    let mut conn = conn().await;
    let mut by_stream: std::collections::BTreeMap<String, Vec<&Envelope>> = Default::default();
    for e in &envelopes {
        by_stream
            .entry(publisher.stream_for_key(&e.topic, &e.key))
            .or_default()
            .push(e);
    }
    assert!(by_stream.len() >= 4, "{:?}", by_stream.keys());
    for (stream, expected) in by_stream {
        let raw: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE")
            .arg(&stream)
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(raw.len(), expected.len(), "{stream}");
        for ((_, got), e) in raw.iter().zip(expected) {
            let want: Vec<Vec<u8>> = outbox_redis::entry_fields(e)
                .iter()
                .flat_map(|(f, v)| [f.as_bytes().to_vec(), v.as_bytes().to_vec()])
                .collect();
            assert_eq!(got, &want, "{} in {stream}", e.msg_id);
        }
    }
    cleanup(&prefix).await;
}

/// A large batch with rejected messages spread through it: every message's outcome is
/// its own entry's reply; the entries land in batch order; and the durability wait
/// after the last covers them all (`WAIT 0`: all taken; `WAIT 1` without replicas: none
/// counted).
#[tokio::test]
async fn a_large_batch_keeps_order_and_each_message_its_own_outcome() {
    let prefix = unique_prefix("test");
    let mut conn = conn().await;
    // The refunds stream's key holds a string: each refund's XADD is WRONGTYPE.
    set_string(
        &mut conn,
        &format!("{prefix}order.refunded"),
        "not a stream",
    )
    .await;
    let refund = |n: usize| {
        Envelope::from_event(
            &OrderRefunded {
                order_id: format!("order-{n}"),
            },
            1 << 20,
        )
        .unwrap()
    };
    // 700 messages, a refund every 97th.
    let envelopes: Vec<Envelope> = (0..700)
        .map(|n| if n % 97 == 0 { refund(n) } else { paid(n) })
        .collect();
    let zero = config_with(&prefix, |c| {
        c.durability = Durability::Replicas {
            replicas: 0,
            timeout: Duration::from_millis(100),
        }
    });
    let publisher = RedisPublisher::new(redis_url())
        .unwrap()
        .with_config(zero)
        .unwrap();
    let outcomes = publisher.publish(&stored(envelopes.clone())).await.unwrap();
    assert_eq!(outcomes.len(), 700);
    for (n, outcome) in outcomes.iter().enumerate() {
        if n % 97 == 0 {
            let rejected = outcome.as_ref().unwrap_err();
            assert_eq!(rejected.kind, RejectKind::Topic, "{n}: {rejected:?}");
        } else {
            assert_eq!(outcome, &Ok(()), "{n}");
        }
    }
    let want: Vec<String> = (0..700)
        .filter(|n| n % 97 != 0)
        .map(|n| format!("order-{n}:OrderPaid"))
        .collect();
    assert_eq!(msg_ids(&format!("{prefix}order.paid")).await, want);

    let one = config_with(&prefix, |c| {
        c.durability = Durability::Replicas {
            replicas: 1,
            timeout: Duration::from_millis(100),
        }
    });
    let publisher = RedisPublisher::new(redis_url())
        .unwrap()
        .with_config(one)
        .unwrap();
    let paid_only: Vec<Envelope> = (1000..1300).map(paid).collect();
    match publisher.publish(&stored(paid_only)).await {
        Err(e) => assert!(e.is_outage(), "{e}"),
        Ok(outcomes) => assert!(
            outcomes
                .iter()
                .all(|o| matches!(o, Err(r) if r.kind == RejectKind::Unavailable)),
            "{outcomes:?}"
        ),
    }
    cleanup(&prefix).await;
}
