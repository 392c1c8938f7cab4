//! Partitioned topics and ordered consumers against the real Redis: an unordered
//! consumer reads every partition stream; ordered consumers share the partitions by
//! lease, keep every key's order through failures, takeovers and rebalancing, and keep a
//! key blocked after a dead letter when told to, until an operator unblocks it.

mod fixtures;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fixtures::{cleanup, conn, eventually, pending_count, redis_url, unique, unique_prefix};
use outbox_core::{
    Delivery, Envelope, Handler, HandlerError, MemoryDb, MemoryTx, OutboxEvent, Partitions,
    partition_of,
};
use outbox_redis::redis::{self, aio::MultiplexedConnection};
use outbox_redis::{AfterDeadLetter, Consumer, ConsumerConfig, OrderedConfig, entry_fields};

/// One step of a key's sequence.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "ordered.step", key = key, id = "{key}/{seq}")]
struct Step {
    key: String,
    seq: i64,
}

const TOPIC: &str = "ordered.step";

/// What the handlers committed: per key, the sequence numbers applied in order, and
/// every step applied out of its key's order.
#[derive(Debug, Default, Clone)]
struct Applied {
    by_key: BTreeMap<String, Vec<i64>>,
    violations: Vec<String>,
}

/// Applies a step in its transaction, checking it follows its key's last one (unless
/// `gaps` are expected); fails the first delivery of the steps `fail_first` picks, and
/// every delivery of those `fail_always` picks.
#[derive(Clone)]
struct Apply {
    seen: Arc<Mutex<HashSet<String>>>,
    fail_first: fn(&Step) -> bool,
    fail_always: fn(&Step) -> bool,
    gaps: bool,
    /// How long each application takes.
    pause: Duration,
}

impl Apply {
    fn new(fail_first: fn(&Step) -> bool) -> Self {
        Self {
            seen: Arc::default(),
            fail_first,
            fail_always: |_| false,
            gaps: false,
            pause: Duration::ZERO,
        }
    }
}

impl Handler<Step> for Apply {
    type Conn = MemoryTx<Applied>;

    fn handle(&self, e: Step, tx: &mut Self::Conn, _: &Delivery) -> Result<(), HandlerError> {
        let first = self
            .seen
            .lock()
            .unwrap()
            .insert(format!("{}/{}", e.key, e.seq));
        if (first && (self.fail_first)(&e)) || (self.fail_always)(&e) {
            return Err(HandlerError::msg(format!("{}/{} refused", e.key, e.seq)));
        }
        std::thread::sleep(self.pause);
        let data = tx.data();
        let applied = data.by_key.entry(e.key.clone()).or_default();
        let last = applied.last().copied().unwrap_or(0);
        if !self.gaps && e.seq != last + 1 {
            data.violations
                .push(format!("{}: {} after {last}", e.key, e.seq));
        }
        applied.push(e.seq);
        Ok(())
    }
}

fn partitions(n: u32) -> Partitions {
    Partitions::new(n).unwrap()
}

/// Publishes `steps` as a foreign producer would: each to its key's partition stream.
async fn produce(conn: &mut MultiplexedConnection, prefix: &str, p: u32, steps: &[Step]) {
    let mut pipe = redis::pipe();
    for step in steps {
        let envelope = Envelope::from_event(step, 1 << 20).unwrap();
        let stream = stream_of(prefix, p, partition_of(&step.key, partitions(p)));
        let cmd = pipe.cmd("XADD").arg(stream).arg("*");
        for (field, value) in entry_fields(&envelope) {
            cmd.arg(field).arg(&*value);
        }
        cmd.ignore();
    }
    let () = pipe.query_async(conn).await.unwrap();
}

/// The stream of `partition` of `p`: unpartitioned for one.
fn stream_of(prefix: &str, p: u32, partition: u32) -> String {
    if p == 1 {
        format!("{prefix}{TOPIC}")
    } else {
        format!("{prefix}{TOPIC}:{partition}")
    }
}

/// `keys` keys of `steps` steps each, interleaved as writers would produce them.
fn steps(keys: usize, steps: i64) -> Vec<Step> {
    (1..=steps)
        .flat_map(|seq| {
            (0..keys).map(move |k| Step {
                key: format!("k{k}"),
                seq,
            })
        })
        .collect()
}

fn config(prefix: &str, p: u32) -> ConsumerConfig {
    ConsumerConfig::default()
        .with_stream_prefix(prefix.to_owned())
        .with_partitions(TOPIC, partitions(p))
        .with_block(Duration::from_millis(200))
        .with_max_in_flight(4)
        .with_outage_backoff(
            outbox_core::OutageBackoff::default()
                .with_min(Duration::from_millis(10))
                .with_max(Duration::from_millis(100)),
        )
}

fn ordered(prefix: &str, p: u32) -> ConsumerConfig {
    config(prefix, p).with_ordered(OrderedConfig::default().with_lease_ttl(Duration::from_secs(2)))
}

fn consumer(
    config: ConsumerConfig,
    group: &str,
    db: &MemoryDb<Applied>,
    handler: Apply,
) -> Consumer<MemoryDb<Applied>> {
    Consumer::builder(redis_url(), group)
        .handle::<Step, _>(handler)
        .idempotency(db.clone())
        .with_config(config)
        .build()
        .unwrap()
}

/// A consumer run in a task; stopped gracefully, or dropped like a crashed process.
struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<outbox_redis::Result<()>>,
}

fn start(consumer: &Consumer<MemoryDb<Applied>>) -> Running {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = consumer.clone();
    let task = tokio::spawn(async move {
        consumer
            .run_until(async {
                stopped.await.ok();
            })
            .await
    });
    Running { stop, task }
}

impl Running {
    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

fn complete(db: &MemoryDb<Applied>, keys: usize, last: i64) -> bool {
    let applied = db.read(Clone::clone);
    applied.by_key.len() == keys && applied.by_key.values().all(|s| s.len() as i64 == last)
}

fn assert_in_order_once(db: &MemoryDb<Applied>, keys: usize, last: i64) {
    let applied = db.read(Clone::clone);
    assert!(applied.violations.is_empty(), "{:?}", applied.violations);
    assert_eq!(applied.by_key.len(), keys);
    for (key, seqs) in &applied.by_key {
        assert_eq!(*seqs, (1..=last).collect::<Vec<_>>(), "key {key}");
    }
}

async fn nothing_pending(conn: &mut MultiplexedConnection, prefix: &str, p: u32, group: &str) {
    for partition in 0..p {
        let stream = stream_of(prefix, p, partition);
        assert_eq!(pending_count(conn, &stream, group).await, 0, "{stream}");
    }
}

/// The holder of each partition's lease (`None`: free).
async fn holders(
    conn: &mut MultiplexedConnection,
    prefix: &str,
    p: u32,
    group: &str,
) -> Vec<Option<String>> {
    let mut holders = Vec::new();
    for partition in 0..p {
        let lease = format!("{}:lease:{group}", stream_of(prefix, p, partition));
        let value: Option<String> = redis::cmd("GET")
            .arg(lease)
            .query_async(conn)
            .await
            .unwrap();
        holders.push(value.map(|v| v.split_once(':').unwrap().1.to_owned()));
    }
    holders
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unordered_consumer_reads_every_partition_stream() {
    let prefix = unique_prefix("partitioned");
    let mut c = conn().await;
    let db = MemoryDb::new(Applied::default());
    let mut apply = Apply::new(|_| false);
    apply.gaps = true;
    let consumer = consumer(config(&prefix, 4), "g", &db, apply);
    assert_eq!(
        consumer.streams().collect::<Vec<_>>(),
        (0..4)
            .map(|p| format!("{prefix}{TOPIC}:{p}"))
            .collect::<Vec<_>>()
    );
    let running = start(&consumer);
    produce(&mut c, &prefix, 4, &steps(20, 5)).await;
    eventually("every step applied", || complete(&db, 20, 5)).await;
    running.stop().await;
    assert_eq!(consumer.stats().consumed, 100);
    nothing_pending(&mut c, &prefix, 4, "g").await;
    cleanup(&prefix).await;
}

#[tokio::test]
async fn partitions_of_a_topic_not_handled_are_a_config_error() {
    let err = Consumer::builder(redis_url(), "g")
        .handle::<Step, _>(Apply::new(|_| false))
        .idempotency(MemoryDb::new(Applied::default()))
        .with_config(ConsumerConfig::default().with_partitions("other.topic", partitions(4)))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("partitions"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_ordered_consumers_share_the_partitions_and_keep_every_key_in_order() {
    let prefix = unique_prefix("ordered");
    let group = unique("g");
    let mut c = conn().await;
    let db = MemoryDb::new(Applied::default());
    // A first delivery in seven fails: its key waits for it while the others go on.
    let apply = Apply::new(|s| s.seq % 7 == 3);
    let a = consumer(ordered(&prefix, 4), &group, &db, apply.clone());
    let b = consumer(ordered(&prefix, 4), &group, &db, apply);
    let (ra, rb) = (start(&a), start(&b));
    // Rebalanced: every partition held, two each.
    let mut shared = false;
    for _ in 0..300 {
        let h = holders(&mut c, &prefix, 4, &group).await;
        let by_a = h
            .iter()
            .filter(|x| x.as_deref() == Some(a.consumer_name()))
            .count();
        let by_b = h
            .iter()
            .filter(|x| x.as_deref() == Some(b.consumer_name()))
            .count();
        if by_a == 2 && by_b == 2 {
            shared = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(shared, "{:?}", holders(&mut c, &prefix, 4, &group).await);
    produce(&mut c, &prefix, 4, &steps(40, 10)).await;
    eventually("every step applied", || complete(&db, 40, 10)).await;
    ra.stop().await;
    rb.stop().await;
    assert_in_order_once(&db, 40, 10);
    assert!(a.stats().consumed > 0 && b.stats().consumed > 0);
    assert_eq!(a.stats().consumed + b.stats().consumed, 400);
    assert!(a.stats().failures + b.stats().failures > 0);
    nothing_pending(&mut c, &prefix, 4, &group).await;
    // Shut down cleanly: the leases were given back.
    assert!(
        holders(&mut c, &prefix, 4, &group)
            .await
            .iter()
            .all(Option::is_none)
    );
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_takeover_finishes_the_pending_entries_of_a_dead_holder_first_and_in_order() {
    let prefix = unique_prefix("ordered");
    let group = unique("g");
    let mut c = conn().await;
    let db = MemoryDb::new(Applied::default());
    // The first holder fails everything: its entries stay pending, in its name.
    let mut failing = Apply::new(|_| false);
    failing.fail_always = |_| true;
    // Retried in process again and again, never dead-lettered.
    let config = ordered(&prefix, 2).with_max_deliveries(1_000_000);
    let a = consumer(config.clone(), &group, &db, failing);
    let ra = start(&a);
    produce(&mut c, &prefix, 2, &steps(10, 3)).await;
    eventually("the first holder failing", || a.stats().failures >= 10).await;
    // It dies: no release, no ack; its leases expire.
    ra.task.abort();
    let _ = ra.task.await;
    produce(&mut c, &prefix, 2, &steps(10, 6)[30..]).await;
    let b = consumer(config, &group, &db, Apply::new(|_| false));
    let rb = start(&b);
    eventually("every step applied", || complete(&db, 10, 6)).await;
    rb.stop().await;
    assert_in_order_once(&db, 10, 6);
    assert!(b.stats().reclaimed > 0, "{:?}", b.stats());
    nothing_pending(&mut c, &prefix, 2, &group).await;
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_taken_away_stops_the_reads_of_its_partition_at_once() {
    let prefix = unique_prefix("ordered");
    let group = unique("g");
    let mut c = conn().await;
    let db = MemoryDb::new(Applied::default());
    let a = consumer(ordered(&prefix, 1), &group, &db, Apply::new(|_| false));
    let ra = start(&a);
    let stream = format!("{prefix}{TOPIC}");
    let lease = format!("{stream}:lease:{group}");
    eventually_holder(&mut c, &lease).await;
    // Another holder got it (as after an expiry): the old one must not read on.
    let () = redis::cmd("SET")
        .arg(&lease)
        .arg("999:intruder")
        .arg("PX")
        .arg(60_000)
        .query_async(&mut c)
        .await
        .unwrap();
    let envelope = Envelope::from_event(
        &Step {
            key: "x".into(),
            seq: 1,
        },
        1 << 20,
    )
    .unwrap();
    let mut xadd = redis::cmd("XADD");
    xadd.arg(&stream).arg("*");
    for (field, value) in entry_fields(&envelope) {
        xadd.arg(field).arg(&*value);
    }
    let _: String = xadd.query_async(&mut c).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        a.stats().consumed,
        0,
        "read while another holder had the lease"
    );
    let pending: redis::streams::StreamPendingReply = redis::cmd("XPENDING")
        .arg(&stream)
        .arg(&group)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(pending.count(), 0, "nothing delivered to the old holder");
    ra.stop().await;
    cleanup(&prefix).await;
}

async fn eventually_holder(c: &mut MultiplexedConnection, lease: &str) {
    for _ in 0..300 {
        let v: Option<String> = redis::cmd("GET").arg(lease).query_async(c).await.unwrap();
        if v.is_some() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("nobody took {lease}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_blocked_after_a_dead_letter_waits_for_the_operator() {
    let prefix = unique_prefix("ordered");
    let group = unique("g");
    let mut c = conn().await;
    let db = MemoryDb::new(Applied::default());
    let mut apply = Apply::new(|_| false);
    apply.fail_always = |s| s.key == "k0" && s.seq == 2;
    apply.gaps = true;
    let config = ordered(&prefix, 1).with_max_deliveries(2).with_ordered(
        OrderedConfig::default()
            .with_lease_ttl(Duration::from_secs(2))
            .with_after_dead_letter(AfterDeadLetter::Block),
    );
    let a = consumer(config, &group, &db, apply);
    let ra = start(&a);
    produce(&mut c, &prefix, 1, &steps(3, 4)).await;
    eventually("the other keys applied", || {
        let applied = db.read(Clone::clone);
        applied.by_key.get("k1").is_some_and(|s| s.len() == 4)
            && applied.by_key.get("k2").is_some_and(|s| s.len() == 4)
    })
    .await;
    eventually("k0's step 2 dead-lettered", || a.stats().dead_lettered == 1).await;
    let stream = format!("{prefix}{TOPIC}");
    let blocked = outbox_redis::blocked_keys(&mut c, &stream, &group)
        .await
        .unwrap();
    assert_eq!(blocked.len(), 1);
    assert_eq!(blocked[0].0, "k0");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(db.read(Clone::clone).by_key["k0"], [1], "k0 waits");
    assert!(
        outbox_redis::unblock_key(&mut c, &stream, &group, "k0")
            .await
            .unwrap()
    );
    eventually("k0 moving on", || {
        db.read(Clone::clone).by_key["k0"].len() == 3
    })
    .await;
    ra.stop().await;
    assert_eq!(db.read(Clone::clone).by_key["k0"], [1, 3, 4]);
    nothing_pending(&mut c, &prefix, 1, &group).await;
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ordered_batches_keep_every_key_in_order() {
    let prefix = unique_prefix("ordered");
    let group = unique("g");
    let mut c = conn().await;
    let db = MemoryDb::new(Applied::default());
    let config = ordered(&prefix, 4)
        .with_batch_size(16)
        .with_trim_interval(Duration::from_millis(200));
    let a = consumer(config, &group, &db, Apply::new(|s| s.seq % 5 == 2));
    let ra = start(&a);
    produce(&mut c, &prefix, 4, &steps(30, 8)).await;
    eventually("every step applied", || complete(&db, 30, 8)).await;
    // The periodic trim runs in ordered mode too: acknowledged entries go.
    let mut left = usize::MAX;
    for _ in 0..300 {
        left = 0;
        for p in 0..4 {
            let len: usize = redis::cmd("XLEN")
                .arg(stream_of(&prefix, 4, p))
                .query_async(&mut c)
                .await
                .unwrap();
            left += len;
        }
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(left, 0, "entries left in the partitions");
    ra.stop().await;
    assert_in_order_once(&db, 30, 8);
    nothing_pending(&mut c, &prefix, 4, &group).await;
    cleanup(&prefix).await;
}

/// An event type that declares its partitions.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "ordered.sharded", partitions = 4)]
struct Sharded {
    #[outbox(id)]
    id: String,
}

struct Ignore;

impl Handler<Sharded> for Ignore {
    type Conn = MemoryTx<Applied>;

    fn handle(&self, _: Sharded, _: &mut Self::Conn, _: &Delivery) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[tokio::test]
async fn the_partition_count_an_event_declares_is_read_unless_the_config_overrides_it() {
    let build = |config: ConsumerConfig| {
        Consumer::builder(redis_url(), "g")
            .handle::<Sharded, _>(Ignore)
            .handle::<Step, _>(Apply::new(|_| false))
            .idempotency(MemoryDb::new(Applied::default()))
            .with_config(config)
            .build()
            .unwrap()
    };
    let streams =
        |c: &Consumer<MemoryDb<Applied>>| c.streams().map(str::to_owned).collect::<Vec<_>>();
    let declared = build(ConsumerConfig::default().with_stream_prefix("p:"));
    assert_eq!(
        streams(&declared),
        [
            "p:ordered.sharded:0",
            "p:ordered.sharded:1",
            "p:ordered.sharded:2",
            "p:ordered.sharded:3",
            "p:ordered.step"
        ]
    );
    let overridden = build(
        ConsumerConfig::default()
            .with_stream_prefix("p:")
            .with_partitions("ordered.sharded", Partitions::ONE)
            .with_partitions(TOPIC, partitions(2)),
    );
    assert_eq!(
        streams(&overridden),
        ["p:ordered.sharded", "p:ordered.step:0", "p:ordered.step:1"]
    );
}

/// Another event type of `ordered.sharded`, declaring another count.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "ordered.sharded", partitions = 8)]
struct ShardedToo {
    #[outbox(id)]
    id: String,
}

impl Handler<ShardedToo> for Ignore {
    type Conn = MemoryTx<Applied>;

    fn handle(&self, _: ShardedToo, _: &mut Self::Conn, _: &Delivery) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[tokio::test]
async fn event_types_of_one_topic_declaring_different_counts_are_a_config_error() {
    let err = Consumer::builder(redis_url(), "g")
        .handle::<Sharded, _>(Ignore)
        .handle::<ShardedToo, _>(Ignore)
        .idempotency(MemoryDb::new(Applied::default()))
        .build()
        .unwrap_err();
    let outbox_redis::Error::Config(invalid) = &err else {
        panic!("not a config error: {err:?}");
    };
    assert_eq!(invalid.field(), "partitions");
    assert!(err.to_string().contains("4 and 8"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ordered_consumer_reads_what_the_partitioned_publisher_writes_in_order() {
    use outbox_core::Publisher as _;
    let prefix = unique_prefix("ordered");
    let group = unique("g");
    let mut c = conn().await;
    let publisher = outbox_redis::RedisPublisher::new(redis_url())
        .unwrap()
        .with_config(
            outbox_redis::PublisherConfig::default()
                .with_stream_prefix(prefix.clone())
                .with_partitions(TOPIC, partitions(4)),
        )
        .unwrap();
    let batch = fixtures::stored(
        steps(25, 8)
            .iter()
            .map(|s| Envelope::from_event(s, 1 << 20).unwrap()),
    );
    let outcomes = publisher.publish(&batch).await.unwrap();
    assert!(outcomes.iter().all(Result::is_ok));
    let db = MemoryDb::new(Applied::default());
    let a = consumer(
        ordered(&prefix, 4),
        &group,
        &db,
        Apply::new(|s| s.seq % 3 == 1),
    );
    let ra = start(&a);
    eventually("every step applied", || complete(&db, 25, 8)).await;
    ra.stop().await;
    assert_in_order_once(&db, 25, 8);
    nothing_pending(&mut c, &prefix, 4, &group).await;
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_that_cannot_renew_its_lease_stops_at_its_deadline_and_resumes_in_order() {
    let mut scratch = outbox_tests::ScratchRedis::start_persistent();
    let prefix = unique_prefix("ordered");
    let mut c = redis::Client::open(scratch.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    // One key: its 30 steps run one after another, 100 ms each, all read at once.
    produce(&mut c, &prefix, 1, &steps(1, 30)).await;
    let db = MemoryDb::new(Applied::default());
    let mut apply = Apply::new(|_| false);
    apply.pause = Duration::from_millis(100);
    let config = ordered(&prefix, 1)
        .with_ordered(OrderedConfig::default().with_lease_ttl(Duration::from_secs(1)));
    let a = Consumer::builder(scratch.url(), "g")
        .handle::<Step, _>(apply)
        .idempotency(db.clone())
        .with_config(config)
        .build()
        .unwrap();
    let running = start(&a);
    let applied = || db.read(|a| a.by_key.get("k0").map_or(0, Vec::len));
    eventually("a few steps applied", || applied() >= 3).await;
    // Redis goes away: no renewal. The lease's local deadline (0.8 s after the last
    // renewal was sent) passes while steps are still queued in memory.
    scratch.stop();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let at_deadline = applied();
    assert!(
        at_deadline < 30,
        "the test needs steps left when the lease runs out"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        applied(),
        at_deadline,
        "steps handled after the lease was lost"
    );
    // Redis is back: the lease is acquired again, the pending steps taken over first.
    scratch.restart();
    eventually("every step applied", || complete(&db, 1, 30)).await;
    running.stop().await;
    assert_in_order_once(&db, 1, 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_entry_left_pending_in_the_holders_name_is_taken_again_after_min_idle() {
    let prefix = unique_prefix("ordered");
    let group = unique("g");
    let mut c = conn().await;
    let db = MemoryDb::new(Applied::default());
    let config = ordered(&prefix, 1).with_min_idle(Duration::from_millis(300));
    let a = consumer(config, &group, &db, Apply::new(|_| false));
    let ra = start(&a);
    produce(&mut c, &prefix, 1, &steps(3, 2)).await;
    eventually("the first steps applied", || complete(&db, 3, 2)).await;
    // An entry delivered in the holder's name that it never queued, as one whose XACK
    // failed is (added and delivered in one script, so the holder's reads cannot take it).
    let stream = format!("{prefix}{TOPIC}");
    let envelope = Envelope::from_event(
        &Step {
            key: "late".into(),
            seq: 1,
        },
        1 << 20,
    )
    .unwrap();
    let mut script = redis::cmd("EVAL");
    script
        .arg(
            "redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3)) \
             return redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', KEYS[1], '>')",
        )
        .arg(1)
        .arg(&stream)
        .arg(&group)
        .arg(a.consumer_name());
    for (field, value) in entry_fields(&envelope) {
        script.arg(field).arg(&*value);
    }
    let _: redis::Value = script.query_async(&mut c).await.unwrap();
    eventually("the orphan applied", || {
        db.read(|a| a.by_key.get("late").is_some_and(|s| s == &[1]))
    })
    .await;
    ra.stop().await;
    nothing_pending(&mut c, &prefix, 1, &group).await;
    cleanup(&prefix).await;
}

/// How a Redis loses every lease, group and stream under running ordered consumers.
enum DataLoss {
    /// Killed, kept down this long, and started again empty (no persistence).
    Restart(Duration),
    /// `FLUSHALL`: the connections stay up.
    Flushall,
}

/// Ordered consumers on a private Redis that loses its data: after it, they recreate
/// their groups and apply what is produced next, in order. `consumers` above the
/// partition count leaves some holding nothing, which must not matter.
async fn ordered_consumers_survive(loss: DataLoss, consumers: usize) {
    let mut scratch = outbox_tests::ScratchRedis::start();
    let prefix = unique_prefix("ordered");
    let connect = |url: String| async move {
        redis::Client::open(url)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    };
    let db = MemoryDb::new(Applied::default());
    // TTL 1 s; the outage backoff's longest pause is 100 ms.
    let config = ordered(&prefix, 2)
        .with_ordered(OrderedConfig::default().with_lease_ttl(Duration::from_secs(1)));
    let running: Vec<Running> = (0..consumers)
        .map(|_| {
            let consumer = Consumer::builder(scratch.url(), "g")
                .handle::<Step, _>(Apply::new(|_| false))
                .idempotency(db.clone())
                .with_config(config.clone())
                .build()
                .unwrap();
            start(&consumer)
        })
        .collect();
    produce(&mut connect(scratch.url()).await, &prefix, 2, &steps(10, 3)).await;
    eventually("the steps before the data loss applied", || {
        complete(&db, 10, 3)
    })
    .await;
    match loss {
        DataLoss::Restart(down) => {
            scratch.stop();
            tokio::time::sleep(down).await;
            scratch.restart();
        }
        DataLoss::Flushall => {
            let () = redis::cmd("FLUSHALL")
                .query_async(&mut connect(scratch.url()).await)
                .await
                .unwrap();
        }
    }
    // Written as a foreign producer would, whatever the consumers did meanwhile: to
    // streams that may not exist yet, or exist without a group.
    produce(
        &mut connect(scratch.url()).await,
        &prefix,
        2,
        &steps(10, 6)[30..],
    )
    .await;
    eventually("the steps after the data loss applied", || {
        complete(&db, 10, 6)
    })
    .await;
    for run in running {
        run.stop().await;
    }
    assert_in_order_once(&db, 10, 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ordered_consumers_recover_when_redis_restarts_without_its_data() {
    // Down longer than the lease TTL (1 s) and every backoff (100 ms): every lease is
    // lost locally before Redis comes back.
    ordered_consumers_survive(DataLoss::Restart(Duration::from_secs(3)), 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ordered_consumers_recover_after_a_flushall() {
    ordered_consumers_survive(DataLoss::Flushall, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_blocked_key_does_not_stall_the_other_partitions() {
    let prefix = unique_prefix("ordered");
    let group = unique("g");
    let mut c = conn().await;
    let db = MemoryDb::new(Applied::default());
    let mut apply = Apply::new(|_| false);
    apply.fail_always = |s| s.key == "k0" && s.seq == 1;
    let config = ordered(&prefix, 2).with_max_deliveries(1).with_ordered(
        OrderedConfig::default()
            .with_lease_ttl(Duration::from_secs(2))
            .with_after_dead_letter(AfterDeadLetter::Block),
    );
    let a = consumer(config, &group, &db, apply);
    let ra = start(&a);
    let blocked = partition_of("k0", partitions(2));
    let blocked_stream = stream_of(&prefix, 2, blocked);
    produce(&mut c, &prefix, 2, &steps(1, 1)).await;
    eventually("k0 blocked after its dead letter", || {
        a.stats().dead_lettered == 1
    })
    .await;
    // More of k0 than the read-ahead (64 here) holds: all wait for an operator.
    produce(&mut c, &prefix, 2, &steps(1, 200)[1..]).await;
    let mut delivered = 0;
    for _ in 0..300 {
        delivered = pending_count(&mut c, &blocked_stream, &group).await;
        if delivered >= 64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(delivered >= 64, "only {delivered} of k0's entries read");
    // The keys of the other partition go on.
    let others: Vec<Step> = steps(20, 3)
        .into_iter()
        .filter(|s| partition_of(&s.key, partitions(2)) != blocked)
        .collect();
    let keys: HashSet<String> = others.iter().map(|s| s.key.clone()).collect();
    produce(&mut c, &prefix, 2, &others).await;
    eventually("the other partition's steps applied", || {
        db.read(|a| {
            keys.iter()
                .all(|k| a.by_key.get(k).is_some_and(|s| s.len() == 3))
        })
    })
    .await;
    ra.stop().await;
    let applied = db.read(Clone::clone);
    assert!(applied.violations.is_empty(), "{:?}", applied.violations);
    assert!(!applied.by_key.contains_key("k0"), "k0 stays blocked");
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_holding_no_partition_is_ready_again_after_an_outage() {
    let mut scratch = outbox_tests::ScratchRedis::start_persistent();
    let prefix = unique_prefix("ordered");
    let db = MemoryDb::new(Applied::default());
    let config = ordered(&prefix, 1)
        .with_ordered(OrderedConfig::default().with_lease_ttl(Duration::from_secs(1)));
    // Two consumers, one partition: one of them holds nothing and reads nothing.
    let consumers: Vec<Consumer<MemoryDb<Applied>>> = (0..2)
        .map(|_| {
            Consumer::builder(scratch.url(), "g")
                .handle::<Step, _>(Apply::new(|_| false))
                .idempotency(db.clone())
                .with_config(config.clone())
                .build()
                .unwrap()
        })
        .collect();
    let running: Vec<Running> = consumers.iter().map(start).collect();
    let ready = |want: bool| {
        let consumers = &consumers;
        move || consumers.iter().all(|c| c.health().is_ready() == want)
    };
    eventually("both ready", ready(true)).await;
    scratch.stop();
    eventually("both unready during the outage", ready(false)).await;
    scratch.restart();
    eventually("both ready once Redis answers again", ready(true)).await;
    for run in running {
        run.stop().await;
    }
}
