//! The consumer runner's batch mode (`ConsumerConfig::batch_size`) against the real
//! Redis, with the in-memory inbox (a savepoint per message) as the idempotency store.

mod fixtures;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use fixtures::*;
use outbox_core::{HandlerError, Inbox, InboxBatchOutcomes, MemoryDb, MemoryTx, MsgId, Processed};
use outbox_redis::redis;
use outbox_redis::{Consumer, ConsumerConfig};

fn batch_config(prefix: &str, size: usize) -> ConsumerConfig {
    fast_config(prefix)
        .with_batch_size(size)
        .with_max_in_flight(2)
}

/// The in-memory inbox, recording each batch's size; its next `outages` batches fail
/// as a whole, as a database outage would.
#[derive(Clone)]
struct Recording {
    db: MemoryDb<Applied>,
    batches: Arc<Mutex<Vec<usize>>>,
    outages: Arc<AtomicUsize>,
}

impl Recording {
    fn new(db: &MemoryDb<Applied>, outages: usize) -> Self {
        Self {
            db: db.clone(),
            batches: Arc::default(),
            outages: Arc::new(AtomicUsize::new(outages)),
        }
    }

    fn batches(&self) -> Vec<usize> {
        self.batches.lock().unwrap().clone()
    }
}

impl Inbox for Recording {
    type Conn = MemoryTx<Applied>;

    fn process<F>(&self, group: &str, msg_id: &MsgId, handle: F) -> outbox_core::Result<Processed>
    where
        F: FnOnce(&mut MemoryTx<Applied>) -> Result<(), HandlerError>,
    {
        self.batches.lock().unwrap().push(1);
        self.db.process(group, msg_id, handle)
    }

    fn process_batch<F>(
        &self,
        group: &str,
        msg_ids: &[MsgId],
        handle: F,
    ) -> outbox_core::Result<InboxBatchOutcomes>
    where
        F: FnMut(usize, &mut MemoryTx<Applied>) -> Result<(), HandlerError>,
    {
        self.batches.lock().unwrap().push(msg_ids.len());
        let down = self
            .outages
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if down {
            return Err(outbox_core::Error::store("connection refused"));
        }
        self.db.process_batch(group, msg_ids, handle)
    }
}

fn recording_consumer(
    config: ConsumerConfig,
    group: &str,
    inbox: &Recording,
    handler: Recorder,
) -> Consumer<Recording> {
    Consumer::builder(redis_url(), group)
        .handle::<OrderPaid, _>(handler)
        .idempotency(inbox.clone())
        .with_config(config)
        .build()
        .unwrap()
}

fn all_applied_once(db: &MemoryDb<Applied>, n: usize) -> bool {
    db.read(|a| a.len() == n && a.values().all(|&c| c == 1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_mode_applies_each_message_once_in_batches() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    publish(&prefix, (1..=250).map(paid)).await;
    let db = MemoryDb::new(Applied::new());
    let inbox = Recording::new(&db, 0);
    let handler = Recorder::ok();
    let c = recording_consumer(
        batch_config(&prefix, 50),
        &unique("batch"),
        &inbox,
        handler.clone(),
    );
    let running = Running::start(&c);
    eventually("all applied", || c.stats().consumed == 250).await;
    running.stop().await;
    assert!(all_applied_once(&db, 250));
    assert_eq!(handler.calls(), 250);
    let batches = inbox.batches();
    assert_eq!(batches.iter().sum::<usize>(), 250, "{batches:?}");
    assert!(batches.iter().all(|&n| n <= 50), "{batches:?}");
    // Published before the start: the first read fills whole batches.
    assert_eq!(batches[0], 50, "{batches:?}");
    let mut conn = conn().await;
    assert_eq!(pending_count(&mut conn, &stream, c.group()).await, 0);
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_message_is_retried_then_dead_lettered_while_the_others_are_acked() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    publish(&prefix, (1..=5).map(paid)).await;
    let db = MemoryDb::new(Applied::new());
    let handler = Recorder::with(|_, e| {
        if e.order_id == "order-3" {
            Err(HandlerError::msg("insufficient funds for order-3"))
        } else {
            Ok(())
        }
    });
    let config = batch_config(&prefix, 10).with_max_deliveries(3);
    let c = consumer(config, &unique("dlq"), &db, handler.clone());
    let running = Running::start(&c);
    eventually("dead-lettered", || c.stats().dead_lettered == 1).await;
    running.stop().await;
    let deliveries = handler.deliveries.lock().unwrap().clone();
    assert_eq!(deliveries["order-3"], [1, 2, 3]);
    for n in [1, 2, 4, 5] {
        assert_eq!(
            deliveries[&format!("order-{n}")],
            [1],
            "applied in the first batch"
        );
    }
    let stats = c.stats();
    assert_eq!((stats.consumed, stats.failures), (4, 3), "{stats:?}");
    assert!(db.read(|a| !a.contains_key("order-3") && a.len() == 4 && a.values().all(|&n| n == 1)));
    let mut conn = conn().await;
    let dead = xrange(&mut conn, &c.dead_letter_stream(&stream)).await;
    assert_eq!(dead.ids.len(), 1);
    assert!(field(&dead.ids[0], "reason").contains("insufficient funds for order-3"));
    assert_eq!(field(&dead.ids[0], "delivery_count"), "3");
    assert_eq!(field(&dead.ids[0], "msg_id"), "order-3:OrderPaid");
    assert_eq!(pending_count(&mut conn, &stream, c.group()).await, 0);
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_fails_only_its_message_and_is_retried() {
    let prefix = unique_prefix("test");
    publish(&prefix, (1..=4).map(paid)).await;
    let db = MemoryDb::new(Applied::new());
    let first = Arc::new(AtomicUsize::new(0));
    let handler = Recorder::with(move |_, e| {
        if e.order_id == "order-2" && first.fetch_add(1, Ordering::SeqCst) == 0 {
            panic!("handler bug on the first call");
        }
        Ok(())
    });
    let c = consumer(
        batch_config(&prefix, 10),
        &unique("panic"),
        &db,
        handler.clone(),
    );
    let running = Running::start(&c);
    eventually("all applied", || c.stats().consumed == 4).await;
    running.stop().await;
    assert_eq!(c.stats().failures, 1);
    let deliveries = handler.deliveries.lock().unwrap().clone();
    assert_eq!(deliveries["order-2"], [1, 2]);
    assert_eq!(deliveries["order-1"], [1]);
    assert!(all_applied_once(&db, 4));
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_in_a_batch_are_acked_without_running_the_handler() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    let db = MemoryDb::new(Applied::new());
    let group = unique("dups");
    // order-7 was applied before; it is re-published twice, order-8 twice in between.
    db.process(&group, &paid(7).msg_id, |tx| {
        tx.data().insert("order-7".into(), 1);
        Ok(())
    })
    .unwrap();
    publish(&prefix, [paid(7), paid(8), paid(8), paid(7)]).await;
    let handler = Recorder::ok();
    let c = consumer(batch_config(&prefix, 10), &group, &db, handler.clone());
    let running = Running::start(&c);
    eventually("all four processed", || {
        let s = c.stats();
        s.consumed + s.duplicates == 4
    })
    .await;
    running.stop().await;
    let stats = c.stats();
    assert_eq!((stats.consumed, stats.duplicates), (1, 3), "{stats:?}");
    assert_eq!(handler.calls(), 1);
    assert!(all_applied_once(&db, 2));
    let mut conn = conn().await;
    assert_eq!(pending_count(&mut conn, &stream, &group).await, 0);
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_fails_the_batch_without_spending_deliveries() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    publish(&prefix, (1..=3).map(paid)).await;
    let db = MemoryDb::new(Applied::new());
    let inbox = Recording::new(&db, 4);
    let handler = Recorder::ok();
    let config = batch_config(&prefix, 10).with_max_deliveries(2);
    let c = recording_consumer(config, &unique("outage"), &inbox, handler.clone());
    let running = Running::start(&c);
    eventually("applied after the outage", || c.stats().consumed == 3).await;
    running.stop().await;
    let stats = c.stats();
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert!(stats.failures >= 3, "{stats:?}");
    // Each message's first handler call was on a first delivery: the outage spent none.
    let deliveries = handler.deliveries.lock().unwrap().clone();
    for n in 1..=3 {
        assert_eq!(deliveries[&format!("order-{n}")], [1]);
    }
    assert!(all_applied_once(&db, 3));
    let mut conn = conn().await;
    assert_eq!(pending_count(&mut conn, &stream, c.group()).await, 0);
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_in_a_batch_is_dead_lettered_at_once_and_the_rest_applied() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    let mut conn = conn().await;
    publish(&prefix, [paid(1)]).await;
    let entries: [&[(&str, &str)]; 2] = [
        &[
            ("msg_id", "order-2:OrderPaid"),
            ("type", "OrderPaid"),
            ("version", "1"),
            ("payload", "this is not json"),
        ],
        &[
            ("msg_id", "order-3:OrderShipped"),
            ("type", "OrderShipped"),
            ("version", "1"),
            ("payload", "{}"),
        ],
    ];
    for fields in entries {
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg(fields)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    publish(&prefix, [paid(4)]).await;
    let db = MemoryDb::new(Applied::new());
    let handler = Recorder::ok();
    let c = consumer(
        batch_config(&prefix, 10),
        &unique("poison"),
        &db,
        handler.clone(),
    );
    let running = Running::start(&c);
    eventually("all four processed", || {
        let s = c.stats();
        s.dead_lettered == 2 && s.consumed == 2
    })
    .await;
    running.stop().await;
    assert_eq!(handler.calls(), 2);
    assert_eq!(c.stats().failures, 0);
    let dead = xrange(&mut conn, &c.dead_letter_stream(&stream)).await;
    let reasons: Vec<String> = dead.ids.iter().map(|e| field(e, "reason")).collect();
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("cannot decode a `OrderPaid` payload")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("no handler for event type `OrderShipped`")),
        "{reasons:?}"
    );
    assert!(all_applied_once(&db, 2));
    assert_eq!(pending_count(&mut conn, &stream, c.group()).await, 0);
    cleanup(&prefix).await;
}

#[tokio::test]
async fn a_zero_batch_size_is_a_config_error() {
    let db = MemoryDb::new(Applied::new());
    let built = Consumer::builder(redis_url(), "g")
        .handle::<OrderPaid, _>(Recorder::ok())
        .idempotency(db)
        .with_config(ConsumerConfig::default().with_batch_size(0))
        .build();
    assert!(built.unwrap_err().is_config());
}
