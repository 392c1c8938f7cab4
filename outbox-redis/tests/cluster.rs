//! Redis Cluster, against a real three-node cluster that each test starts on free
//! loopback ports and stops when it ends. `redis-server` and `redis-cli` must be on the
//! `PATH`: without them these tests fail.
#![cfg(feature = "cluster")]

mod fixtures;

use std::collections::HashSet;
use std::time::Duration;

use fixtures::*;
use outbox_core::{Delivery, Envelope, Handler, HandlerError, MemoryDb, MemoryTx, Publisher};
use outbox_redis::redis::cluster::ClusterClient;
use outbox_redis::redis::cluster_async::ClusterConnection;
use outbox_redis::redis::cluster_routing::Slot;
use outbox_redis::redis::{self, Value};
use outbox_redis::{Consumer, ConsumerConfig, PublisherConfig, RedisPublisher};
use outbox_tests::ScratchCluster;

/// A cluster connection for checks.
async fn conn(cluster: &ScratchCluster) -> ClusterConnection {
    ClusterClient::builder(cluster.urls())
        .response_timeout(Duration::from_secs(10))
        .build()
        .unwrap()
        .get_async_connection()
        .await
        .unwrap()
}

async fn keyslot(conn: &mut ClusterConnection, key: &str) -> i64 {
    redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query_async(conn)
        .await
        .unwrap()
}

fn with_topic(mut envelope: Envelope, topic: &str) -> Envelope {
    envelope.topic = topic.to_owned();
    envelope
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_over_several_topics_lands_per_topic_in_order_across_the_nodes() {
    let cluster = ScratchCluster::start();
    let publisher = RedisPublisher::cluster(cluster.urls()).unwrap();
    assert!(publisher.is_cluster());
    let topics = [
        "order.paid",
        "order.refunded",
        "invoice.sent",
        "user.signed_up",
    ];
    // Topics interleaved: message n goes to topic n % 4.
    let batch = stored((0..40).map(|n| with_topic(paid(n), topics[n % topics.len()])));
    let outcomes = publisher.publish(&batch).await.unwrap();
    assert_eq!(outcomes, vec![Ok(()); 40]);

    let mut conn = conn(&cluster).await;
    let mut slots = HashSet::new();
    for (t, topic) in topics.iter().enumerate() {
        let stream = publisher.stream_for(topic);
        assert_eq!(stream, format!("outbox:{{{topic}}}"));
        slots.insert(keyslot(&mut conn, &stream).await);
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(&stream)
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await
            .unwrap();
        let ids: Vec<String> = reply.ids.iter().map(|e| field(e, "msg_id")).collect();
        let expected: Vec<String> = (0..40)
            .filter(|n| n % topics.len() == t)
            .map(|n| format!("order-{n}:OrderPaid"))
            .collect();
        assert_eq!(ids, expected, "stream {stream}");
        let entry = &reply.ids[0];
        assert_eq!(field(entry, "topic"), *topic);
        let decoded = outbox_redis::envelope_from_fields(&entry.map, "unused").unwrap();
        assert_eq!(decoded, batch[t].envelope);
    }
    assert_eq!(slots.len(), topics.len(), "one slot per topic");
    let spread = cluster.keys_per_node();
    assert!(
        spread.iter().filter(|&&n| n > 0).count() >= 2,
        "the streams should span several nodes: {spread:?}"
    );
}

/// A partitioned topic on a cluster: each partition its own hash tag
/// (`outbox:{order.paid:<p>}`), so the partitions spread over the nodes, and each keeps
/// its keys' order; the count is recorded in `outbox:partitions`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_streams_are_hash_tagged_per_partition_and_keep_key_order() {
    let cluster = ScratchCluster::start();
    let eight = outbox_core::Partitions::new(8).unwrap();
    let publisher = RedisPublisher::cluster(cluster.urls())
        .unwrap()
        .with_config(PublisherConfig::default().with_partitions("order.paid", eight))
        .unwrap();
    // 16 keys (order-0..15), each twice: paid(n) carries key order-(n % 16).
    let batch = stored((0..32).map(|n| {
        let mut e = paid(n % 16);
        e.msg_id =
            outbox_core::MsgId::from_parts(&format!("order-{}-{}", n % 16, n / 16), "OrderPaid")
                .unwrap();
        e
    }));
    let outcomes = publisher.publish(&batch).await.unwrap();
    assert_eq!(outcomes, vec![Ok(()); 32]);

    let mut conn = conn(&cluster).await;
    let mut slots = HashSet::new();
    let mut seen = 0;
    for p in 0..8 {
        let stream = format!("outbox:{{order.paid:{p}}}");
        slots.insert(keyslot(&mut conn, &stream).await);
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(&stream)
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await
            .unwrap();
        let ids: Vec<String> = reply.ids.iter().map(|e| field(e, "msg_id")).collect();
        let expected: Vec<String> = (0..32)
            .filter(|n| eight.of(&format!("order-{}", n % 16)) == p)
            .map(|n| format!("order-{}-{}:OrderPaid", n % 16, n / 16))
            .collect();
        assert_eq!(ids, expected, "stream {stream}");
        seen += ids.len();
    }
    assert_eq!(seen, 32);
    assert_eq!(slots.len(), 8, "one slot per partition");
    let recorded: Option<u32> = redis::cmd("HGET")
        .arg("outbox:partitions")
        .arg("order.paid")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(recorded, Some(8));
}

/// Pipelines capped by bytes and a durability wait on a cluster: the `WAIT` travels in
/// each slot's pipeline to the node that took its entries. The cluster has no replicas:
/// `WAIT 0` is met, `WAIT 1` is an outage that marks nothing published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_pipelines_and_replica_waits_work_per_node() {
    let cluster = ScratchCluster::start();
    let topics = ["order.paid", "order.refunded", "invoice.sent"];
    let batch = stored((0..30).map(|n| with_topic(paid(n), topics[n % topics.len()])));
    let config = |replicas| {
        PublisherConfig::default()
            .with_max_pipeline_bytes(1)
            .with_durability(outbox_redis::Durability::Replicas {
                replicas,
                timeout: std::time::Duration::from_millis(50),
            })
    };
    let publisher = RedisPublisher::cluster(cluster.urls())
        .unwrap()
        .with_config(config(0))
        .unwrap();
    assert_eq!(publisher.publish(&batch).await.unwrap(), vec![Ok(()); 30]);
    let mut conn = conn(&cluster).await;
    for (t, topic) in topics.iter().enumerate() {
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(publisher.stream_for(topic))
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await
            .unwrap();
        let ids: Vec<String> = reply.ids.iter().map(|e| field(e, "msg_id")).collect();
        let expected: Vec<String> = (0..30)
            .filter(|n| n % topics.len() == t)
            .map(|n| format!("order-{n}:OrderPaid"))
            .collect();
        assert_eq!(ids, expected, "topic {topic}");
    }
    let waiting = RedisPublisher::cluster(cluster.urls())
        .unwrap()
        .with_config(config(1))
        .unwrap();
    let err = waiting.publish(&batch).await.unwrap_err();
    assert!(err.is_outage(), "{err}");
}

#[tokio::test]
async fn a_cluster_prefix_with_a_brace_is_refused_and_builders_name_streams_alike() {
    // No server is contacted: these are configuration checks.
    let nodes = ["redis://127.0.0.1:1"];
    let config = PublisherConfig::default().with_stream_prefix("app{x}:");
    let err = RedisPublisher::cluster(nodes)
        .and_then(|p| p.with_config(config))
        .unwrap_err();
    assert!(err.is_config(), "{err:?}");
    let err = Consumer::builder_cluster(nodes, "g")
        .handle::<OrderPaid, _>(Recorder::ok())
        .idempotency(MemoryDb::new(Applied::new()))
        .with_config(ConsumerConfig::default().with_stream_prefix("app{x}:"))
        .build()
        .unwrap_err();
    assert!(err.is_config(), "{err:?}");
    assert!(
        matches!(&err, outbox_redis::Error::Config(e) if e.field() == "stream_prefix"),
        "{err:?}"
    );
    let err = RedisPublisher::cluster(Vec::<String>::new()).unwrap_err();
    assert!(err.is_config(), "{err:?}");

    let publisher = RedisPublisher::cluster(nodes).unwrap();
    let consumer = Consumer::builder_cluster(nodes, "g")
        .handle::<OrderPaid, _>(Recorder::ok())
        .idempotency(MemoryDb::new(Applied::new()))
        .build()
        .unwrap();
    assert!(consumer.is_cluster());
    let stream = publisher.stream_for("order.paid");
    assert_eq!(consumer.streams().collect::<Vec<_>>(), [stream.as_str()]);
    assert_eq!(
        Slot::for_key(&stream),
        Slot::for_key(consumer.dead_letter_stream(&stream))
    );
}

/// Counts refunds in the same data as [`Recorder`] counts payments (`refund:<order>`).
#[derive(Clone)]
struct Refunds;

impl Handler<OrderRefunded> for Refunds {
    type Conn = MemoryTx<Applied>;

    fn handle(
        &self,
        e: OrderRefunded,
        tx: &mut MemoryTx<Applied>,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        *tx.data()
            .entry(format!("refund:{}", e.order_id))
            .or_default() += 1;
        Ok(())
    }
}

fn refund(n: usize) -> Envelope {
    let e = OrderRefunded {
        order_id: format!("order-{n}"),
    };
    Envelope::from_event(&e, 1 << 20).unwrap()
}

fn cluster_consumer(
    cluster: &ScratchCluster,
    config: ConsumerConfig,
    group: &str,
    db: &MemoryDb<Applied>,
    handler: Recorder,
) -> Consumer<MemoryDb<Applied>> {
    Consumer::builder_cluster(cluster.urls(), group)
        .handle::<OrderPaid, _>(handler)
        .handle::<OrderRefunded, _>(Refunds)
        .idempotency(db.clone())
        .with_config(config)
        .build()
        .unwrap()
}

async fn pending(conn: &mut ClusterConnection, stream: &str, group: &str) -> usize {
    let reply: redis::streams::StreamPendingReply = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .query_async(conn)
        .await
        .unwrap();
    reply.count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_applies_every_message_once_across_slots_in_single_and_batch_mode() {
    let cluster = ScratchCluster::start();
    let publisher = RedisPublisher::cluster(cluster.urls()).unwrap();
    let batch = stored((1..=30).map(paid).chain((1..=10).map(refund)));
    // Published twice: the second copies are duplicates to the consumers.
    for _ in 0..2 {
        let outcomes = publisher.publish(&batch).await.unwrap();
        assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    }
    let db = MemoryDb::new(Applied::new());
    let config = fast_config("outbox:")
        .with_stream_prefix("outbox:")
        .with_read_count(8);
    let single = cluster_consumer(&cluster, config.clone(), "points", &db, Recorder::ok());
    let batched = cluster_consumer(
        &cluster,
        config.with_batch_size(5),
        "points",
        &db,
        Recorder::ok(),
    );
    let streams: Vec<String> = single.streams().map(str::to_owned).collect();
    assert_eq!(streams.len(), 2);
    assert_ne!(Slot::for_key(&streams[0]), Slot::for_key(&streams[1]));

    let (a, b) = (Running::start(&single), Running::start(&batched));
    eventually("every message applied or recognised", || {
        let (s, t) = (single.stats(), batched.stats());
        s.consumed + t.consumed == 40 && s.duplicates + t.duplicates == 40
    })
    .await;
    // Published after the consumers block on their reads.
    let late = stored([paid(31), refund(11)]);
    assert!(
        publisher
            .publish(&late)
            .await
            .unwrap()
            .iter()
            .all(Result::is_ok)
    );
    eventually("late messages applied", || {
        single.stats().consumed + batched.stats().consumed == 42
    })
    .await;
    a.stop().await;
    b.stop().await;

    db.read(|applied| {
        assert_eq!(applied.len(), 42, "{applied:?}");
        assert!(applied.values().all(|&n| n == 1), "{applied:?}");
    });
    for s in [single.stats(), batched.stats()] {
        assert_eq!(
            (s.failures, s.dead_lettered, s.redis_errors),
            (0, 0, 0),
            "{s:?}"
        );
    }
    let mut conn = conn(&cluster).await;
    for stream in &streams {
        assert_eq!(pending(&mut conn, stream, "points").await, 0, "{stream}");
    }
    // Trimming works per stream on the cluster too: everything was acknowledged.
    let reports = single.trim_acknowledged().await.unwrap();
    assert_eq!(reports.len(), 2);
    let removed: usize = reports.iter().map(|r| r.removed).sum();
    assert_eq!(removed, 82);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_and_exhausted_entries_go_to_the_dead_stream_in_the_same_slot() {
    let cluster = ScratchCluster::start();
    let mut conn = conn(&cluster).await;
    let db = MemoryDb::new(Applied::new());
    let handler = Recorder::with(|_, e| {
        if e.order_id == "order-2" {
            Err(HandlerError::msg("payment provider says no"))
        } else {
            Ok(())
        }
    });
    let config = fast_config("outbox:").with_max_deliveries(2);
    let c = cluster_consumer(&cluster, config, "poison", &db, handler);
    let stream = "outbox:{order.paid}".to_owned();
    let dead = c.dead_letter_stream(&stream);
    assert_eq!(dead, "outbox:{order.paid}:dead");
    assert_eq!(
        keyslot(&mut conn, &stream).await,
        keyslot(&mut conn, &dead).await
    );

    let _: String = redis::cmd("XADD")
        .arg(&stream)
        .arg("*")
        .arg(&[("msg_id", "order-1:OrderPaid"), ("type", "OrderPaid")])
        .arg(&[("version", "1"), ("payload", "this is not json")])
        .query_async(&mut conn)
        .await
        .unwrap();
    let publisher = RedisPublisher::cluster(cluster.urls()).unwrap();
    let outcomes = publisher
        .publish(&stored([paid(2), paid(3), refund(4)]))
        .await
        .unwrap();
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");

    let running = Running::start(&c);
    eventually("poison and exhausted entries dead-lettered", || {
        let s = c.stats();
        s.dead_lettered == 2 && s.consumed == 2
    })
    .await;
    running.stop().await;

    let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(&dead)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(reply.ids.len(), 2, "{reply:?}");
    let by_msg = |msg_id: &str| {
        reply
            .ids
            .iter()
            .find(|e| field(e, "msg_id") == msg_id)
            .unwrap_or_else(|| panic!("no dead letter for {msg_id}: {reply:?}"))
    };
    let poison = by_msg("order-1:OrderPaid");
    assert!(field(poison, "reason").contains("cannot decode"));
    assert_eq!(field(poison, "payload"), "this is not json");
    assert_eq!(field(poison, "delivery_count"), "1");
    assert_eq!(field(poison, "stream"), stream);
    let exhausted = by_msg("order-2:OrderPaid");
    assert!(field(exhausted, "reason").contains("payment provider says no"));
    assert_eq!(field(exhausted, "delivery_count"), "2");
    for s in c.streams() {
        assert_eq!(pending(&mut conn, s, "poison").await, 0, "{s}");
    }
    db.read(|applied| {
        assert_eq!(applied.get("order-3"), Some(&1));
        assert_eq!(applied.get("refund:order-4"), Some(&1));
        assert!(!applied.contains_key("order-2"));
    });
    // Nothing else was written: the streams and the one dead-letter stream.
    let _: Value = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    assert_eq!(cluster.keys_per_node().iter().sum::<usize>(), 3);
}

/// One step of a key's sequence, over 4 partitions.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, outbox_core::OutboxEvent)]
#[outbox(topic = "cluster.step", key = key, id = "{key}/{seq}", partitions = 4)]
struct Step {
    key: String,
    seq: u32,
}

/// Records each key's last step, and every step out of order under `violations`.
struct InOrder;

impl Handler<Step> for InOrder {
    type Conn = MemoryTx<Applied>;

    fn handle(
        &self,
        e: Step,
        tx: &mut MemoryTx<Applied>,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        let data = tx.data();
        let last = data.get(&e.key).copied().unwrap_or(0);
        if e.seq != last + 1 {
            *data.entry("violations".to_owned()).or_default() += 1;
        }
        data.insert(e.key, e.seq);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_consumers_share_partitions_in_their_own_slots_and_keep_key_order() {
    let cluster = ScratchCluster::start();
    let publisher = RedisPublisher::cluster(cluster.urls())
        .unwrap()
        .with_config(PublisherConfig::default().with_partitions_of::<Step>())
        .unwrap();
    let steps: Vec<Envelope> = (1..=5)
        .flat_map(|seq| {
            (0..20).map(move |k| Step {
                key: format!("k{k}"),
                seq,
            })
        })
        .map(|s| Envelope::from_event(&s, 1 << 20).unwrap())
        .collect();
    let outcomes = publisher.publish(&stored(steps)).await.unwrap();
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    let db = MemoryDb::new(Applied::new());
    let config = fast_config("outbox:").with_ordered(
        outbox_redis::OrderedConfig::default().with_lease_ttl(Duration::from_secs(2)),
    );
    let consumers: Vec<_> = (0..2)
        .map(|_| {
            Consumer::builder_cluster(cluster.urls(), "ordered")
                .handle::<Step, _>(InOrder)
                .idempotency(db.clone())
                .with_config(config.clone())
                .build()
                .unwrap()
        })
        .collect();
    let streams: Vec<String> = consumers[0].streams().map(str::to_owned).collect();
    assert_eq!(streams.len(), 4);
    let running: Vec<_> = consumers.iter().map(Running::start).collect();
    eventually("every step applied", || {
        db.read(|a| (0..20).all(|k| a.get(&format!("k{k}")) == Some(&5)))
    })
    .await;
    for r in running {
        r.stop().await;
    }
    db.read(|a| assert_eq!(a.get("violations"), None, "{a:?}"));
    let consumed: u64 = consumers.iter().map(|c| c.stats().consumed).sum();
    assert_eq!(consumed, 100);
    let mut conn = conn(&cluster).await;
    for stream in &streams {
        assert_eq!(pending(&mut conn, stream, "ordered").await, 0, "{stream}");
    }
}
