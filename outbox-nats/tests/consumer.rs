//! The consumer against the shared nats-server (127.0.0.1:4222, JetStream), with the
//! in-memory idempotency store: each message applied once, failed handlers retried
//! after a delay, poison dead-lettered with its reason and redriven, batch mode and the
//! async inbox, shutdown and health.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_nats::jetstream;
use outbox_core::{
    Delivery, Envelope, Handler, HandlerError, MemoryDb, MemoryTx, OutboxEvent, Publisher,
    StoredMessage,
};
use outbox_nats::{AsyncStore, Consumer, ConsumerConfig, Naming, NatsPublisher, PublisherConfig};
use outbox_tests::{DropStreams, eventually, nats_url, unique};

#[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "points.earned")]
struct PointsEarned {
    #[outbox(id)]
    id: String,
    who: String,
    points: i64,
}

type Ledger = BTreeMap<String, i64>;

/// Adds points; fails the first `fail_first` calls for each message whose id starts
/// with `bad`, and always for ids starting with `poison`; takes `slow` for each.
#[derive(Clone, Default)]
struct AddPoints {
    calls: Arc<AtomicU32>,
    fail_first: u32,
    slow: Duration,
}

impl Handler<PointsEarned> for AddPoints {
    type Conn = MemoryTx<Ledger>;
    fn handle(
        &self,
        e: PointsEarned,
        tx: &mut Self::Conn,
        d: &Delivery,
    ) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(self.slow);
        if e.id.starts_with("poison") {
            return Err(HandlerError::msg(format!(
                "cannot award {} points",
                e.points
            )));
        }
        if e.id.starts_with("bad") && d.delivery_count <= u64::from(self.fail_first) {
            return Err(HandlerError::msg("flaky"));
        }
        *tx.data().entry(e.who).or_default() += e.points;
        Ok(())
    }
}

struct Fixture {
    _streams: DropStreams,
    naming: Naming,
    client: async_nats::Client,
    publisher: NatsPublisher,
}

impl Fixture {
    async fn new() -> Self {
        let id = unique("c");
        let naming = Naming::new(id.clone(), format!("S{id}_")).unwrap();
        let client = async_nats::connect(nats_url())
            .await
            .expect("nats-server on 4222");
        let publisher = NatsPublisher::new(
            client.clone(),
            PublisherConfig::default().with_naming(naming.clone()),
        )
        .unwrap();
        Self {
            _streams: DropStreams::new(nats_url(), naming.stream_prefix.clone()),
            naming,
            client,
            publisher,
        }
    }

    async fn publish(&self, events: &[PointsEarned]) {
        let batch: Vec<StoredMessage> = events
            .iter()
            .enumerate()
            .map(|(i, e)| StoredMessage {
                id: i as i64,
                retries: 0,
                envelope: Envelope::from_event(e, 1 << 20).unwrap(),
            })
            .collect();
        let outcomes = self.publisher.publish(&batch).await.unwrap();
        assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    }

    fn config(&self) -> ConsumerConfig {
        ConsumerConfig::default()
            .with_naming(self.naming.clone())
            .with_fetch_wait(Duration::from_millis(200))
            .with_nak_delays(Duration::from_millis(100), Duration::from_millis(400))
            .with_max_deliveries(3)
    }

    fn consumer(
        &self,
        group: &str,
        handler: AddPoints,
        db: &MemoryDb<Ledger>,
    ) -> Consumer<MemoryDb<Ledger>> {
        Consumer::builder(self.client.clone(), group)
            .handle::<PointsEarned, _>(handler)
            .idempotency(db.clone())
            .with_config(self.config())
            .build()
            .unwrap()
    }
}

fn earned(id: &str, who: &str, points: i64) -> PointsEarned {
    PointsEarned {
        id: id.into(),
        who: who.into(),
        points,
    }
}

/// Runs `consumer` in a task; the returned sender stops it.
fn spawn<I, C>(
    consumer: &Consumer<I, C>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<outbox_nats::Result<()>>,
)
where
    I: outbox_core::ConsumerStore<Conn = C>,
    C: 'static,
    Consumer<I, C>: Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let consumer = consumer.clone();
    let task = tokio::spawn(async move {
        consumer
            .run_until(async {
                let _ = rx.await;
            })
            .await
    });
    (tx, task)
}

async fn stop(
    stopper: (
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<outbox_nats::Result<()>>,
    ),
) {
    let _ = stopper.0.send(());
    tokio::time::timeout(Duration::from_secs(10), stopper.1)
        .await
        .expect("the consumer stops on its signal")
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_message_is_applied_once_even_when_published_twice() {
    let f = Fixture::new().await;
    let events: Vec<PointsEarned> = (0..50)
        .map(|i| earned(&format!("e{i}"), "bob", 1))
        .collect();
    f.publish(&events).await;
    // A copy past the duplicate window (another publisher, another prefix of ids no):
    // the same msg_ids published again under other Nats-Msg-Ids, as a redrive would.
    let js = jetstream::new(f.client.clone());
    for e in &events[..10] {
        let envelope = Envelope::from_event(e, 1 << 20).unwrap();
        let mut headers = outbox_nats::message_headers(&envelope).unwrap();
        headers.insert("Nats-Msg-Id", format!("{}-copy", envelope.msg_id));
        js.publish_with_headers(
            f.naming.subject("points.earned"),
            headers,
            envelope.payload.into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    let db = MemoryDb::new(Ledger::new());
    let consumer = f.consumer(&unique("g"), AddPoints::default(), &db);
    let running = spawn(&consumer);
    eventually("all 60 deliveries handled", || {
        let s = consumer.stats();
        s.consumed + s.duplicates == 60
    })
    .await;
    assert_eq!(db.read(|l| l["bob"]), 50, "each applied once");
    assert_eq!(consumer.stats().duplicates, 10);
    assert!(consumer.health().is_ready(), "{:?}", consumer.health());
    stop(running).await;
    assert!(!consumer.health().running);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_handler_is_retried_after_a_delay_and_applied_once() {
    let f = Fixture::new().await;
    f.publish(&[earned("bad-1", "ann", 5), earned("ok-1", "ann", 1)])
        .await;
    let db = MemoryDb::new(Ledger::new());
    let handler = AddPoints {
        fail_first: 2,
        ..AddPoints::default()
    };
    let consumer = f.consumer(&unique("g"), handler.clone(), &db);
    let running = spawn(&consumer);
    eventually("both applied", || consumer.stats().consumed == 2).await;
    assert_eq!(db.read(|l| l["ann"]), 6);
    assert_eq!(consumer.stats().failures, 2);
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        4,
        "two failures, two applications"
    );
    assert_eq!(consumer.stats().dead_lettered, 0);
    stop(running).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_is_dead_lettered_with_its_reason_and_redriven_for_its_group_alone() {
    let f = Fixture::new().await;
    f.publish(&[earned("poison-1", "cy", 7), earned("ok-1", "cy", 1)])
        .await;
    let (group, other) = (unique("g"), unique("o"));
    let db = MemoryDb::new(Ledger::new());
    let other_db = MemoryDb::new(Ledger::new());
    let consumer = f.consumer(&group, AddPoints::default(), &db);
    let bystander = Consumer::builder(f.client.clone(), other.as_str())
        .handle::<PointsEarned, _>(AddPoints::default())
        .idempotency(other_db.clone())
        .with_config(f.config())
        .build()
        .unwrap();
    let running = spawn(&consumer);
    let running_other = spawn(&bystander);
    eventually("the poison dead-lettered by both groups", || {
        consumer.stats().dead_lettered == 1 && bystander.stats().dead_lettered == 1
    })
    .await;
    assert_eq!(consumer.stats().failures, 3, "max_deliveries attempts");

    let js = jetstream::new(f.client.clone());
    let dead = outbox_nats::dead_letters(&js, &f.naming, Some(&group), 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    let d = &dead[0];
    assert!(d.reason.contains("cannot award 7 points"), "{}", d.reason);
    assert_eq!(d.deliveries, 3);
    assert_eq!(d.group, group);
    assert_eq!(
        d.envelope.as_ref().unwrap().msg_id.as_str(),
        "poison-1:PointsEarned"
    );

    // The operator fixes the data and redrives: applied by its group, not by the other.
    let fixed = Envelope::from_event(&earned("poison-1", "cy", 7), 1 << 20).unwrap();
    assert_eq!(fixed.msg_id, d.envelope.as_ref().unwrap().msg_id);
    stop(running).await;
    let healed = AddPoints::default();
    let consumer = Consumer::builder(f.client.clone(), group.as_str())
        .handle::<PointsEarned, _>(Healed(healed.clone()))
        .idempotency(db.clone())
        .with_config(f.config())
        .build()
        .unwrap();
    let running = spawn(&consumer);
    assert!(
        outbox_nats::redrive_dead_letter(&js, &f.naming, d.sequence)
            .await
            .unwrap()
    );
    eventually("the redriven message applied", || {
        db.read(|l| l.get("cy").copied()) == Some(8)
    })
    .await;
    eventually("the other group acknowledged it unapplied", || {
        bystander.stats().redrives_for_others == 1
    })
    .await;
    assert_eq!(other_db.read(|l| l.get("cy").copied()), Some(1));
    let left = outbox_nats::dead_letters(&js, &f.naming, Some(&group), 10)
        .await
        .unwrap();
    assert!(left.is_empty(), "{left:?}");
    stop(running).await;
    stop(running_other).await;
}

/// The handler after the operator's fix: awards the poison's points too.
#[derive(Clone)]
struct Healed(AddPoints);

impl Handler<PointsEarned> for Healed {
    type Conn = MemoryTx<Ledger>;
    fn handle(
        &self,
        e: PointsEarned,
        tx: &mut Self::Conn,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        self.0.calls.fetch_add(1, Ordering::SeqCst);
        *tx.data().entry(e.who).or_default() += e.points;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_message_is_dead_lettered_at_once() {
    let f = Fixture::new().await;
    f.publish(&[earned("ok-1", "dan", 1)]).await;
    let js = jetstream::new(f.client.clone());
    js.publish(
        f.naming.subject("points.earned"),
        "not an outbox message".into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let group = unique("g");
    let db = MemoryDb::new(Ledger::new());
    let consumer = f.consumer(&group, AddPoints::default(), &db);
    let running = spawn(&consumer);
    eventually("dead-lettered", || consumer.stats().dead_lettered == 1).await;
    eventually("the good one applied", || consumer.stats().consumed == 1).await;
    assert_eq!(consumer.stats().failures, 0, "no handler ran for it");
    let dead = outbox_nats::dead_letters(&js, &f.naming, Some(&group), 10)
        .await
        .unwrap();
    assert!(dead[0].reason.contains("Nats-Msg-Id"), "{}", dead[0].reason);
    assert!(dead[0].envelope.is_err());
    stop(running).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_mode_on_the_async_inbox_applies_each_once() {
    let f = Fixture::new().await;
    let events: Vec<PointsEarned> = (0..40)
        .map(|i| {
            earned(
                &format!("{}{i}", if i == 7 { "bad-" } else { "e" }),
                "eve",
                1,
            )
        })
        .collect();
    f.publish(&events).await;
    let db = MemoryDb::new(Ledger::new());
    let handler = AddPoints {
        fail_first: 1,
        ..AddPoints::default()
    };
    let consumer: Consumer<AsyncStore<MemoryDb<Ledger>>> =
        Consumer::builder(f.client.clone(), unique("g"))
            .handle::<PointsEarned, _>(handler)
            .idempotency_async(db.clone())
            .with_config(f.config().with_batch_size(10))
            .build()
            .unwrap();
    let running = spawn(&consumer);
    eventually("all applied", || consumer.stats().consumed == 40).await;
    assert_eq!(db.read(|l| l["eve"]), 40);
    assert_eq!(consumer.stats().failures, 1, "the flaky one, once, alone");
    stop(running).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_group_name_or_no_handler_is_refused_at_build() {
    let client = async_nats::connect(nats_url()).await.unwrap();
    let err = Consumer::builder(client.clone(), "has.dot")
        .handle::<PointsEarned, _>(AddPoints::default())
        .idempotency(MemoryDb::new(Ledger::new()))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("group"), "{err}");
    let err = Consumer::builder::<MemoryTx<Ledger>>(client, "g")
        .idempotency(MemoryDb::new(Ledger::new()))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("handler"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_deleted_under_a_running_consumer_is_set_up_again() {
    let f = Fixture::new().await;
    f.publish(&[earned("a1", "fay", 1), earned("a2", "fay", 1)])
        .await;
    let db = MemoryDb::new(Ledger::new());
    let consumer = f.consumer(&unique("g"), AddPoints::default(), &db);
    let running = spawn(&consumer);
    eventually("the first two applied", || consumer.stats().consumed == 2).await;

    let js = jetstream::new(f.client.clone());
    js.delete_stream(f.naming.stream("points.earned"))
        .await
        .unwrap();
    // The publisher's first call meets no stream (no responders: an outage), its next
    // creates it again.
    let batch: Vec<StoredMessage> = [earned("b1", "fay", 1), earned("b2", "fay", 1)]
        .iter()
        .enumerate()
        .map(|(i, e)| StoredMessage {
            id: i as i64,
            retries: 0,
            envelope: Envelope::from_event(e, 1 << 20).unwrap(),
        })
        .collect();
    let first = f.publisher.publish(&batch).await;
    assert!(first.as_ref().is_err_and(|e| e.is_outage()), "{first:?}");
    let again = f.publisher.publish(&batch).await.unwrap();
    assert!(again.iter().all(Result::is_ok), "{again:?}");

    eventually("the two after the delete applied", || {
        consumer.stats().consumed == 4
    })
    .await;
    assert_eq!(db.read(|l| l["fay"]), 4);
    stop(running).await;
}

/// Takes its time: a message in hand when shutdown comes.
#[derive(Clone, Default)]
struct Slow(Arc<AtomicU32>);

impl Handler<PointsEarned> for Slow {
    type Conn = MemoryTx<Ledger>;
    fn handle(
        &self,
        e: PointsEarned,
        tx: &mut Self::Conn,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(800));
        *tx.data().entry(e.who).or_default() += e.points;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_the_message_in_hand_and_acknowledges_it() {
    let f = Fixture::new().await;
    f.publish(&[earned("s1", "gus", 3)]).await;
    let (group, db, slow) = (unique("g"), MemoryDb::new(Ledger::new()), Slow::default());
    let build = |handler: Slow| {
        Consumer::builder(f.client.clone(), group.as_str())
            .handle::<PointsEarned, _>(handler)
            .idempotency(db.clone())
            .with_config(f.config().with_ack_wait(Duration::from_secs(1)))
            .build()
            .unwrap()
    };
    let consumer = build(slow.clone());
    let running = spawn(&consumer);
    eventually("the handler started", || slow.0.load(Ordering::SeqCst) == 1).await;
    stop(running).await;
    assert_eq!(
        db.read(|l| l.get("gus").copied()),
        Some(3),
        "finished before returning"
    );
    assert_eq!(consumer.stats().consumed, 1);

    // Acknowledged: past ack_wait, a new process of the group gets nothing again.
    let again = Slow::default();
    let consumer = build(again.clone());
    let running = spawn(&consumer);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(again.0.load(Ordering::SeqCst), 0, "not delivered again");
    stop(running).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_delivered_past_the_limit_without_an_outcome_is_dead_lettered_unrun() {
    use async_nats::jetstream::consumer::{AckPolicy, pull};
    use futures_util::StreamExt as _;

    let f = Fixture::new().await;
    f.publish(&[earned("crashy", "hal", 1)]).await;
    let group = unique("g");
    // Two processes of the group took the message and died before any outcome: the
    // durable consumer delivered it twice, unacknowledged.
    let js = jetstream::new(f.client.clone());
    let stream = js
        .get_stream(f.naming.stream("points.earned"))
        .await
        .unwrap();
    let durable = stream
        .get_or_create_consumer(
            &group,
            pull::Config {
                durable_name: Some(group.clone()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: Duration::from_secs(1),
                max_deliver: -1,
                max_ack_pending: 10_000,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    for _ in 0..2 {
        let mut batch = durable
            .batch()
            .max_messages(1)
            .expires(Duration::from_secs(3))
            .messages()
            .await
            .unwrap();
        let taken = batch.next().await.expect("delivered").unwrap();
        drop(taken); // no ack: the process died
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    let db = MemoryDb::new(Ledger::new());
    let handler = AddPoints::default();
    let consumer = Consumer::builder(f.client.clone(), group.as_str())
        .handle::<PointsEarned, _>(handler.clone())
        .idempotency(db.clone())
        .with_config(
            f.config()
                .with_max_deliveries(2)
                .with_ack_wait(Duration::from_secs(1)),
        )
        .build()
        .unwrap();
    let running = spawn(&consumer);
    eventually("dead-lettered", || consumer.stats().dead_lettered == 1).await;
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        0,
        "its handler never ran"
    );
    let dead = outbox_nats::dead_letters(&js, &f.naming, Some(&group), 10)
        .await
        .unwrap();
    assert!(
        dead[0].reason.contains("delivery limit exceeded"),
        "{}",
        dead[0].reason
    );
    stop(running).await;
}

/// A group whose durable consumer exists with another `ack_wait` (another process of
/// the group, or an operator's edit) is refused with a typed error naming it, before
/// any message is handled: the server would otherwise redeliver on the other timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_consumer_with_another_ack_wait_is_refused() {
    let f = Fixture::new().await;
    let group = unique("g");
    let db = MemoryDb::new(Ledger::new());
    let first = f.consumer(&group, AddPoints::default(), &db);
    let running = spawn(&first);
    eventually("the durable consumer set up", || first.health().is_ready()).await;
    stop(running).await;

    let other = Consumer::builder(f.client.clone(), group.as_str())
        .handle::<PointsEarned, _>(AddPoints::default())
        .idempotency(db.clone())
        .with_config(f.config().with_ack_wait(Duration::from_secs(5)))
        .build()
        .unwrap();
    let err = tokio::time::timeout(
        Duration::from_secs(20),
        other.run_until(std::future::pending()),
    )
    .await
    .expect("refused at once, not retried as an outage")
    .unwrap_err();
    assert!(err.is_consumer_mismatch(), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("ack_wait") && text.contains(&group) && text.contains("5s"),
        "{text}"
    );
    assert!(!other.health().running);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_slower_to_handle_than_its_wait_is_finished_not_dropped() {
    let f = Fixture::new().await;
    let events: Vec<PointsEarned> = (0..60)
        .map(|i| earned(&format!("s{i}"), "sam", 1))
        .collect();
    f.publish(&events).await;
    let db = MemoryDb::new(Ledger::new());
    let handler = AddPoints {
        slow: Duration::from_millis(60),
        ..AddPoints::default()
    };
    // One pull of 60, one at a time: 3.6 s of handling against a 0.2 s wait.
    let consumer = Consumer::builder(f.client.clone(), unique("g").as_str())
        .handle::<PointsEarned, _>(handler.clone())
        .idempotency(db.clone())
        .with_config(f.config().with_max_in_flight(1).with_max_deliveries(1))
        .build()
        .unwrap();
    let running = spawn(&consumer);
    outbox_tests::eventually_within("all 60 applied", Duration::from_secs(20), || {
        consumer.stats().consumed == 60
    })
    .await;
    assert_eq!(db.read(|l| l["sam"]), 60);
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        60,
        "each handled once"
    );
    assert_eq!(
        consumer.stats().dead_lettered,
        0,
        "nothing dead-lettered unrun"
    );
    stop(running).await;
}

/// The in-memory inbox, down (an outage) until `up_at`; shared by the processes of a
/// group.
#[derive(Clone)]
struct DownUntil {
    db: MemoryDb<Ledger>,
    up_at: std::time::Instant,
}

impl outbox_core::Inbox for DownUntil {
    type Conn = MemoryTx<Ledger>;

    fn process<F>(
        &self,
        group: &str,
        msg_id: &outbox_core::MsgId,
        handle: F,
    ) -> outbox_core::Result<outbox_core::Processed>
    where
        F: FnOnce(&mut MemoryTx<Ledger>) -> Result<(), HandlerError>,
    {
        if std::time::Instant::now() < self.up_at {
            return Err(outbox_core::Error::store("connection refused"));
        }
        outbox_core::Inbox::process(&self.db, group, msg_id, handle)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_spends_no_delivery_with_two_processes_of_the_group() {
    store_outage_with_two_processes(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_spends_no_delivery_with_two_processes_in_batch_mode() {
    store_outage_with_two_processes(Some(4)).await;
}

async fn store_outage_with_two_processes(batch: Option<usize>) {
    let f = Fixture::new().await;
    let events: Vec<PointsEarned> = (0..10)
        .map(|i| earned(&format!("o{i}"), "oli", 1))
        .collect();
    f.publish(&events).await;
    let db = MemoryDb::new(Ledger::new());
    // Down for 4 s: many outage backoffs, and longer than the limit of 2 deliveries
    // would allow if each try were a delivery.
    let inbox = DownUntil {
        db: db.clone(),
        up_at: std::time::Instant::now() + Duration::from_secs(4),
    };
    let group = unique("g");
    let handler = AddPoints::default();
    let mut config = f.config().with_max_deliveries(2).with_outage_backoff(
        outbox_core::OutageBackoff::default()
            .with_min(Duration::from_millis(100))
            .with_max(Duration::from_millis(400)),
    );
    if let Some(n) = batch {
        config = config.with_batch_size(n);
    }
    let process = || {
        Consumer::builder(f.client.clone(), group.as_str())
            .handle::<PointsEarned, _>(handler.clone())
            .idempotency(inbox.clone())
            .with_config(config.clone())
            .build()
            .unwrap()
    };
    let (a, b) = (process(), process());
    let (run_a, run_b) = (spawn(&a), spawn(&b));
    outbox_tests::eventually_within("all 10 applied", Duration::from_secs(30), || {
        a.stats().consumed + b.stats().consumed == 10
    })
    .await;
    assert_eq!(db.read(|l| l["oli"]), 10);
    assert_eq!(
        a.stats().dead_lettered + b.stats().dead_lettered,
        0,
        "nothing dead-lettered unrun"
    );
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        10,
        "each handled once"
    );
    stop(run_a).await;
    stop(run_b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_near_the_streams_size_limit_is_still_dead_lettered() {
    let f = Fixture::new().await;
    // Topic streams take at most 1,000 bytes; the dead letter adds its headers and
    // reason to a message that fit.
    let streams = outbox_nats::StreamSettings::default().with_max_message_size(1000);
    let publisher = NatsPublisher::new(
        f.client.clone(),
        PublisherConfig::default()
            .with_naming(f.naming.clone())
            .with_streams(streams.clone()),
    )
    .unwrap();
    let big = earned("poison-big", &"w".repeat(600), 1);
    let batch = [StoredMessage {
        id: 1,
        retries: 0,
        envelope: Envelope::from_event(&big, 1 << 20).unwrap(),
    }];
    let outcomes = publisher.publish(&batch).await.unwrap();
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    let db = MemoryDb::new(Ledger::new());
    let consumer = Consumer::builder(f.client.clone(), unique("g").as_str())
        .handle::<PointsEarned, _>(AddPoints::default())
        .idempotency(db.clone())
        .with_config(f.config().with_max_deliveries(2).with_streams(streams))
        .build()
        .unwrap();
    let running = spawn(&consumer);
    outbox_tests::eventually_within("dead-lettered", Duration::from_secs(20), || {
        consumer.stats().dead_lettered == 1
    })
    .await;
    stop(running).await;
}
