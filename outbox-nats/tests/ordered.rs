//! Ordered mode against real nats-servers (the shared one on 127.0.0.1:4222, a private
//! ScratchNats for the restart): several readers of one group, each with its own
//! connection, and the steps of each key reach the handler in the order they were
//! published, through failing handlers, a dead letter and its redrive, a reader frozen
//! with a message in hand, a reader shut down mid-run, and a server restart.
//!
//! Each test records what its handlers applied, in the order they applied it, in one
//! log shared by its readers; the idempotency store is the in-memory one (async inbox,
//! so that a reader's task can be dropped with its transaction).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use outbox_core::{
    AsyncTxHandler, Delivery, Envelope, HandlerError, MemoryDb, MemoryTx, OutboxEvent, Publisher,
    StoredMessage,
};
use outbox_nats::{AsyncStore, Consumer, ConsumerConfig, Naming, NatsPublisher, PublisherConfig};
use outbox_tests::{DropStreams, ScratchNats, eventually, nats_url, unique};

const PARTITIONS: u32 = 4;
const KEYS: usize = 8;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "ordered.step", key = key, id = "{key}/{seq}", partitions = 4)]
struct Step {
    key: String,
    seq: u32,
}

/// What the handlers applied, in the order they applied it.
type Log = Arc<Mutex<Vec<(String, u32)>>>;

/// A step's key and sequence number.
type StepId = (String, u32);

/// Appends each step to the log. Fails the first delivery of every step whose `seq` is
/// 2 modulo 4 (a key's later steps then wait behind a failed one), always fails `poison`
/// until `cured`, and never ends the first delivery of `freeze` (a reader frozen with
/// it in hand; `frozen` tells it happened).
#[derive(Clone, Default)]
struct Apply {
    log: Log,
    poison: Option<StepId>,
    cured: Arc<AtomicBool>,
    freeze: Option<StepId>,
    frozen: Arc<AtomicBool>,
    /// Each application takes this long (keeps a run going while a reader stops).
    pace: Duration,
    calls: Arc<AtomicU32>,
}

impl Apply {
    fn is(step: &Option<StepId>, e: &Step) -> bool {
        step.as_ref()
            .is_some_and(|(k, s)| *k == e.key && *s == e.seq)
    }
}

impl AsyncTxHandler<Step> for Apply {
    type Conn = MemoryTx<()>;
    async fn handle(&self, e: Step, _: &mut Self::Conn, d: &Delivery) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if Self::is(&self.freeze, &e) && d.delivery_count == 1 {
            self.frozen.store(true, Ordering::SeqCst);
            std::future::pending::<()>().await;
        }
        if Self::is(&self.poison, &e) && !self.cured.load(Ordering::SeqCst) {
            return Err(HandlerError::msg(format!(
                "cannot apply {}/{}",
                e.key, e.seq
            )));
        }
        if e.seq % 4 == 2 && d.delivery_count == 1 {
            return Err(HandlerError::msg("flaky"));
        }
        tokio::time::sleep(self.pace).await;
        self.log.lock().unwrap().push((e.key, e.seq));
        Ok(())
    }
}

struct Fixture {
    _streams: Option<DropStreams>,
    url: String,
    naming: Naming,
    publisher: NatsPublisher,
    group: String,
}

impl Fixture {
    /// On the shared server; its streams are deleted at the end.
    async fn new() -> Self {
        Self::on(nats_url(), true).await
    }

    /// On the server at `url`; a private one's streams go with it (`shared` false).
    async fn on(url: String, shared: bool) -> Self {
        let id = unique("o");
        let naming = Naming::new(id.clone(), format!("S{id}_")).unwrap();
        let streams = shared.then(|| DropStreams::new(url.clone(), naming.stream_prefix.clone()));
        let config = PublisherConfig::default()
            .with_naming(naming.clone())
            .with_partitions_of::<Step>();
        let publisher = NatsPublisher::new(connect(&url).await, config).unwrap();
        Self {
            _streams: streams,
            url,
            naming,
            publisher,
            group: unique("g"),
        }
    }

    /// Publishes steps `seqs` of every key, key after key for each step, retried while
    /// the server is away.
    async fn publish(&self, seqs: std::ops::RangeInclusive<u32>) {
        let batch: Vec<StoredMessage> = (seqs.flat_map(|seq| (0..KEYS).map(move |k| step(k, seq))))
            .enumerate()
            .map(|(i, e)| StoredMessage {
                id: i as i64,
                retries: 0,
                envelope: Envelope::from_event(&e, 1 << 20).unwrap(),
            })
            .collect();
        for chunk in batch.chunks(20) {
            let mut tries = 0;
            while !self
                .publisher
                .publish(chunk)
                .await
                .is_ok_and(|o| o.iter().all(Result::is_ok))
            {
                tries += 1;
                assert!(tries < 300, "the server did not take the steps");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    fn config(&self) -> ConsumerConfig {
        ConsumerConfig::default()
            .with_naming(self.naming.clone())
            .with_ordered(true)
            .with_fetch_wait(Duration::from_millis(200))
            .with_nak_delays(Duration::from_millis(50), Duration::from_millis(200))
            // Short, so that a message the server handed to a pull that ended as it was
            // sent (seen about once in four runs of this file with 200 ms pulls) comes
            // back within `eventually`'s patience: its partition waits `ack_wait`, and
            // the order still holds (docs/nats.md, "Ordered mode").
            .with_ack_wait(Duration::from_secs(5))
            .with_max_deliveries(1_000)
    }

    /// A reader of the group on a connection of its own, its inbox in `db` (the
    /// group's readers share one, as they share a database).
    async fn reader(&self, handler: Apply, config: ConsumerConfig, db: &MemoryDb<()>) -> Reader {
        Consumer::builder(connect(&self.url).await, self.group.as_str())
            .handle_tx::<Step, _>(handler)
            .idempotency_async(db.clone())
            .with_config(config)
            .build()
            .unwrap()
    }
}

type Reader = Consumer<AsyncStore<MemoryDb<()>>>;

async fn connect(url: &str) -> async_nats::Client {
    async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(url)
        .await
        .unwrap()
}

fn key(k: usize) -> String {
    format!("key-{k}")
}

fn step(k: usize, seq: u32) -> Step {
    Step { key: key(k), seq }
}

/// Runs `reader` in a task; the returned sender stops it.
fn spawn(reader: &Reader) -> Running {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let reader = reader.clone();
    let task = tokio::spawn(async move {
        reader
            .run_until(async {
                let _ = rx.await;
            })
            .await
    });
    Running { stop: tx, task }
}

struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<outbox_nats::Result<()>>,
}

impl Running {
    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("the reader stops on its signal")
            .unwrap()
            .unwrap();
    }
}

/// The log by key: each key's steps in the order they were applied.
fn by_key(log: &Log) -> BTreeMap<String, Vec<u32>> {
    let mut keys: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for (k, seq) in log.lock().unwrap().iter() {
        keys.entry(k.clone()).or_default().push(*seq);
    }
    keys
}

/// Every key's steps `1..=last` applied once each, in order.
fn assert_in_order(log: &Log, last: u32) {
    let expected: Vec<u32> = (1..=last).collect();
    let keys = by_key(log);
    for k in 0..KEYS {
        assert_eq!(
            keys.get(&key(k)),
            Some(&expected),
            "the steps of {} as applied",
            key(k)
        );
    }
}

fn applied(log: &Log) -> usize {
    log.lock().unwrap().len()
}

/// The partition of a key (the publisher's subject for it).
fn partition(k: usize) -> u32 {
    outbox_core::Partitions::new(PARTITIONS)
        .unwrap()
        .of(&key(k))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_steps_reach_the_handler_in_order_across_readers_and_a_failing_step_holds_its_partition_alone()
 {
    let f = Fixture::new().await;
    f.publish(1..=12).await;
    let poison = (key(5), 6);
    let handler = Apply {
        poison: Some(poison.clone()),
        ..Apply::default()
    };
    let (db, mut readers) = (MemoryDb::new(()), Vec::new());
    for _ in 0..3 {
        readers.push(f.reader(handler.clone(), f.config(), &db).await);
    }
    let running: Vec<Running> = readers.iter().map(spawn).collect();

    // Every partition but the poison's is done; the poison's key waits behind it.
    let held = partition(5);
    let others = (0..KEYS).filter(|&k| partition(k) != held).count();
    assert!(
        others > 0 && others < KEYS,
        "the keys spread over partitions"
    );
    eventually("every step of the other partitions applied", || {
        let keys = by_key(&handler.log);
        (0..KEYS)
            .filter(|&k| partition(k) != held)
            .all(|k| keys.get(&key(k)).is_some_and(|s| s.len() == 12))
    })
    .await;
    let keys = by_key(&handler.log);
    assert_eq!(
        keys[&poison.0],
        [1, 2, 3, 4, 5],
        "the key waits behind its failing step"
    );

    handler.cured.store(true, Ordering::SeqCst);
    eventually("every step applied", || applied(&handler.log) == KEYS * 12).await;
    assert_in_order(&handler.log, 12);
    let consumed: u64 = readers.iter().map(|r| r.stats().consumed).sum();
    assert_eq!(consumed, (KEYS * 12) as u64);
    for r in running {
        r.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_lettered_step_lets_its_partition_move_on_and_is_redriven_after_it() {
    let f = Fixture::new().await;
    f.publish(1..=6).await;
    let poison = (key(3), 4);
    let handler = Apply {
        poison: Some(poison.clone()),
        ..Apply::default()
    };
    let (config, db) = (f.config().with_max_deliveries(3), MemoryDb::new(()));
    let a = f.reader(handler.clone(), config.clone(), &db).await;
    let b = f.reader(handler.clone(), config, &db).await;
    let running = [spawn(&a), spawn(&b)];
    eventually("every other step applied", || {
        applied(&handler.log) == KEYS * 6 - 1
    })
    .await;
    let keys = by_key(&handler.log);
    assert_eq!(
        keys[&poison.0],
        [1, 2, 3, 5, 6],
        "moved on past the dead letter"
    );

    let js = jetstream::new(connect(&f.url).await);
    let dead = outbox_nats::dead_letters(&js, &f.naming, Some(&f.group), 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(
        dead[0].reason.contains("cannot apply key-3/4"),
        "{}",
        dead[0].reason
    );
    handler.cured.store(true, Ordering::SeqCst);
    assert!(
        outbox_nats::redrive_dead_letter(&js, &f.naming, dead[0].sequence)
            .await
            .unwrap()
    );
    eventually("the redriven step applied", || {
        applied(&handler.log) == KEYS * 6
    })
    .await;
    assert_eq!(by_key(&handler.log)[&poison.0], [1, 2, 3, 5, 6, 4]);
    for r in running {
        r.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_message_of_a_frozen_reader_goes_to_another_after_ack_wait_before_any_later_one() {
    let f = Fixture::new().await;
    f.publish(1..=8).await;
    let config = f.config().with_ack_wait(Duration::from_secs(2));
    let frozen = Apply {
        freeze: Some((key(1), 3)),
        ..Apply::default()
    };
    // Each its own inbox: the frozen reader holds its store's transaction (the
    // in-memory store runs one at a time), as a frozen process holds its own.
    let a = f
        .reader(frozen.clone(), config.clone(), &MemoryDb::new(()))
        .await;
    let running_a = spawn(&a);
    eventually("the first reader froze with key-1/3 in hand", || {
        frozen.frozen.load(Ordering::SeqCst)
    })
    .await;

    // The second reader shares the log; its handler never freezes.
    let healthy = Apply {
        log: Arc::clone(&frozen.log),
        ..Apply::default()
    };
    let b = f.reader(healthy.clone(), config, &MemoryDb::new(())).await;
    let running_b = spawn(&b);
    eventually("every step applied", || applied(&healthy.log) == KEYS * 8).await;
    assert_in_order(&healthy.log, 8);
    assert!(b.stats().consumed > 0);
    running_a.task.abort();
    running_b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_shut_down_mid_run_hands_its_partitions_over_in_order() {
    let f = Fixture::new().await;
    f.publish(1..=30).await;
    let handler = Apply {
        pace: Duration::from_millis(5),
        ..Apply::default()
    };
    // The stopped reader finishes what it holds and pulls no more: the other one reads
    // every later step of its partitions, in order (at once, but for a message handed
    // to a pull as it ended, which comes back after ack_wait).
    let db = MemoryDb::new(());
    let a = f.reader(handler.clone(), f.config(), &db).await;
    let b = f.reader(handler.clone(), f.config(), &db).await;
    let (running_a, running_b) = (spawn(&a), spawn(&b));
    eventually("a quarter applied", || {
        applied(&handler.log) >= KEYS * 30 / 4
    })
    .await;
    running_a.stop().await;
    let by_a = a.stats().consumed;
    eventually("every step applied", || applied(&handler.log) == KEYS * 30).await;
    assert_in_order(&handler.log, 30);
    assert_eq!(a.stats().consumed, by_a, "nothing handled once stopped");
    running_b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_order_holds_through_a_restart_of_the_server() {
    let mut nats = ScratchNats::start();
    let f = Fixture::on(nats.url(), false).await;
    let handler = Apply::default();
    let (config, db) = (
        f.config().with_ack_wait(Duration::from_secs(2)),
        MemoryDb::new(()),
    );
    let a = f.reader(handler.clone(), config.clone(), &db).await;
    let b = f.reader(handler.clone(), config, &db).await;
    let running = [spawn(&a), spawn(&b)];
    f.publish(1..=10).await;
    eventually("some applied", || applied(&handler.log) >= KEYS * 3).await;
    nats.restart();
    f.publish(11..=20).await;
    eventually("every step applied", || applied(&handler.log) == KEYS * 20).await;
    assert_in_order(&handler.log, 20);
    for r in running {
        r.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_durable_edited_to_hand_out_more_than_one_is_refused() {
    let f = Fixture::new().await;
    f.publish(1..=1).await;
    let js = jetstream::new(connect(&f.url).await);
    let stream = js
        .get_stream(f.naming.stream(Step::TOPICS[0]))
        .await
        .unwrap();
    stream
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some(format!("{}~p0", f.group)),
            filter_subject: f.naming.partition_subject(Step::TOPICS[0], 0),
            max_ack_pending: 5,
            ..Default::default()
        })
        .await
        .unwrap();
    let reader = f
        .reader(Apply::default(), f.config(), &MemoryDb::new(()))
        .await;
    let err = tokio::time::timeout(
        Duration::from_secs(20),
        reader.run_until(std::future::pending::<()>()),
    )
    .await
    .expect("refused, not retried")
    .unwrap_err();
    assert!(err.to_string().contains("max_ack_pending = 5"), "{err}");
}
