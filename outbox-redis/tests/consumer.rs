//! The consumer runner against the real Redis, with the in-memory inbox as the
//! idempotency store.

mod fixtures;

use std::collections::HashSet;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use fixtures::*;
use std::sync::atomic::{AtomicUsize, Ordering};

use outbox_core::{HandlerError, Inbox, MemoryDb, MemoryTx, MsgId, Processed};
use outbox_redis::redis::{self, AsyncConnectionConfig};
use outbox_redis::{Consumer, ConsumerConfig, StartFrom};

fn all_applied_once(db: &MemoryDb<Applied>, n: usize) -> bool {
    db.read(|a| a.len() == n && a.values().all(|&c| c == 1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_groups_each_get_every_message_published_before_they_started() {
    let prefix = unique_prefix("test");
    publish(&prefix, (1..=10).map(paid)).await;
    let (db_a, db_b) = (MemoryDb::new(Applied::new()), MemoryDb::new(Applied::new()));
    let a = consumer(fast_config(&prefix), &unique("a"), &db_a, Recorder::ok());
    let b = consumer(fast_config(&prefix), &unique("b"), &db_b, Recorder::ok());
    let (ra, rb) = (Running::start(&a), Running::start(&b));
    eventually("both groups applied all", || {
        a.stats().consumed == 10 && b.stats().consumed == 10
    })
    .await;
    ra.stop().await;
    rb.stop().await;
    assert!(all_applied_once(&db_a, 10) && all_applied_once(&db_b, 10));
    let stream = format!("{prefix}order.paid");
    let mut conn = conn().await;
    assert_eq!(pending_count(&mut conn, &stream, a.group()).await, 0);
    assert_eq!(pending_count(&mut conn, &stream, b.group()).await, 0);
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_in_one_group_split_the_work() {
    let prefix = unique_prefix("test");
    let group = unique("split");
    let stream = format!("{prefix}order.paid");
    publish(&prefix, (1..=40).map(paid)).await;
    // Each consumer takes at most two messages at a time, and its handlers wait until
    // both consumers have handled something: neither can take everything.
    let both = Arc::new((Mutex::new(HashSet::new()), Condvar::new()));
    let handler = |me: u8| {
        let both = Arc::clone(&both);
        Recorder::with(move |_, _| {
            let (seen, cv) = &*both;
            let mut seen = seen.lock().unwrap();
            seen.insert(me);
            cv.notify_all();
            let _ = cv.wait_timeout_while(seen, Duration::from_secs(30), |s| s.len() < 2);
            Ok(())
        })
    };
    let config = fast_config(&prefix)
        .with_read_count(2)
        .with_max_in_flight(2);
    // Separate stores, so that one consumer's waiting handler does not hold up the
    // other's transaction; the group's work must still be split without overlap.
    let (db1, db2) = (MemoryDb::new(Applied::new()), MemoryDb::new(Applied::new()));
    let (h1, h2) = (handler(1), handler(2));
    let one = consumer(config.clone(), &group, &db1, h1.clone());
    let two = consumer(config, &group, &db2, h2.clone());
    assert_ne!(one.consumer_name(), two.consumer_name());
    let (r1, r2) = (Running::start(&one), Running::start(&two));
    eventually("all 40 applied", || {
        one.stats().consumed + two.stats().consumed == 40
    })
    .await;
    r1.stop().await;
    r2.stop().await;
    let (s1, s2) = (one.stats(), two.stats());
    assert!(s1.consumed > 0 && s2.consumed > 0, "{s1:?} {s2:?}");
    assert_eq!(h1.calls() + h2.calls(), 40, "each message handled once");
    let (k1, k2) = (
        db1.read(|a| a.keys().cloned().collect::<HashSet<_>>()),
        db2.read(|a| a.keys().cloned().collect::<HashSet<_>>()),
    );
    assert!(k1.is_disjoint(&k2));
    assert_eq!(k1.len() + k2.len(), 40);
    assert!(db1.read(|a| a.values().all(|&n| n == 1)) && db2.read(|a| a.values().all(|&n| n == 1)));
    let mut conn = conn().await;
    assert_eq!(pending_count(&mut conn, &stream, &group).await, 0);
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_message_twice_is_applied_once_and_acked_twice() {
    let prefix = unique_prefix("test");
    // A re-publish after a relay crash: two entries, one msg_id.
    publish(&prefix, [paid(7), paid(7)]).await;
    let db = MemoryDb::new(Applied::new());
    let handler = Recorder::ok();
    let c = consumer(fast_config(&prefix), &unique("dup"), &db, handler.clone());
    let running = Running::start(&c);
    eventually("both entries processed", || {
        let s = c.stats();
        s.consumed + s.duplicates == 2
    })
    .await;
    running.stop().await;
    let stats = c.stats();
    assert_eq!((stats.consumed, stats.duplicates), (1, 1));
    assert_eq!(handler.calls(), 1);
    assert!(all_applied_once(&db, 1));
    let mut conn = conn().await;
    assert_eq!(
        pending_count(&mut conn, &format!("{prefix}order.paid"), c.group()).await,
        0
    );
    cleanup(&prefix).await;
}

/// A handler's stop inside its transaction: it tells the test it started, then waits
/// until the test releases it (or drops the release).
struct Hold {
    started: Mutex<mpsc::Sender<()>>,
    released: Mutex<mpsc::Receiver<()>>,
}

impl Hold {
    /// The hold, the test's end of "started" and its release.
    fn new() -> (Self, mpsc::Receiver<()>, mpsc::Sender<()>) {
        let (started_tx, started) = mpsc::channel();
        let (release, released) = mpsc::channel();
        let hold = Self {
            started: Mutex::new(started_tx),
            released: Mutex::new(released),
        };
        (hold, started, release)
    }

    fn stop(&self) {
        // A message read ahead may stop here after the test stopped listening.
        let _ = self.started.lock().unwrap().send(());
        self.released.lock().unwrap().recv().ok();
    }
}

/// Waits, off the runtime's threads, until a handler reached its [`Hold`].
async fn wait_started(started: mpsc::Receiver<()>) {
    tokio::task::spawn_blocking(move || started.recv().unwrap())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_of_a_killed_consumer_is_reclaimed_and_applied_once() {
    let prefix = unique_prefix("test");
    let group = unique("crash");
    let stream = format!("{prefix}order.paid");
    publish(&prefix, [paid(1)]).await;
    let db = MemoryDb::new(Applied::new());

    // The first consumer's handler stalls inside its transaction until released, then
    // fails: the process "dies" mid-transaction, which rolls back.
    let (hold, started, release) = Hold::new();
    let doomed = Recorder::with(move |_, _| {
        hold.stop();
        Err(HandlerError::msg("process killed"))
    });
    // Long enough that the first consumer never retries the entry itself.
    let config = fast_config(&prefix).with_min_idle(Duration::from_secs(3600));
    let first = consumer(config, &group, &db, doomed.clone());
    let running = Running::start(&first);
    wait_started(started).await;
    // Kill it before XACK: the run is dropped with the message in flight.
    running.task.abort();
    assert!(running.task.await.unwrap_err().is_cancelled());
    release.send(()).unwrap();

    let mut conn = conn().await;
    assert_eq!(pending_count(&mut conn, &stream, &group).await, 1);

    let survivor = Recorder::ok();
    let second = consumer(fast_config(&prefix), &group, &db, survivor.clone());
    let running = Running::start(&second);
    eventually("the survivor applied the entry", || {
        second.stats().consumed == 1
    })
    .await;
    running.stop().await;
    let stats = second.stats();
    assert_eq!(stats.reclaimed, 1);
    assert_eq!(survivor.calls(), 1);
    assert_eq!(doomed.calls(), 1);
    // The claim made it the second delivery.
    assert_eq!(survivor.deliveries.lock().unwrap()["order-1"], [2]);
    assert!(all_applied_once(&db, 1));
    assert_eq!(pending_count(&mut conn, &stream, &group).await, 0);
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_failing_on_every_delivery_is_dead_lettered_with_its_reason() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    publish(&prefix, [paid(1), paid(2)]).await;
    let db = MemoryDb::new(Applied::new());
    // order-1 always fails; order-2 succeeds.
    let handler = Recorder::with(|_, e| {
        if e.order_id == "order-1" {
            Err(HandlerError::msg("insufficient funds for order-1"))
        } else {
            Ok(())
        }
    });
    let config = fast_config(&prefix).with_max_deliveries(3);
    let c = consumer(config, &unique("dlq"), &db, handler.clone());
    let running = Running::start(&c);
    eventually("dead-lettered", || c.stats().dead_lettered == 1).await;
    running.stop().await;

    assert_eq!(
        handler.deliveries.lock().unwrap()["order-1"],
        [1, 2, 3],
        "one attempt per delivery, up to the limit"
    );
    let stats = c.stats();
    assert_eq!((stats.consumed, stats.failures), (1, 3));
    let mut conn = conn().await;
    let dead = xrange(&mut conn, &c.dead_letter_stream(&stream)).await;
    assert_eq!(dead.ids.len(), 1);
    let entry = &dead.ids[0];
    assert!(field(entry, "reason").contains("insufficient funds for order-1"));
    assert_eq!(field(entry, "delivery_count"), "3");
    assert_eq!(field(entry, "group"), c.group());
    assert_eq!(field(entry, "stream"), stream);
    assert_eq!(field(entry, "msg_id"), "order-1:OrderPaid");
    assert_eq!(field(entry, "payload"), paid(1).payload);
    let original = xrange(&mut conn, &stream).await;
    assert_eq!(field(entry, "entry_id"), original.ids[0].id);
    assert_eq!(pending_count(&mut conn, &stream, c.group()).await, 0);
    assert!(db.read(|a| a.get("order-1").is_none() && a["order-2"] == 1));
    cleanup(&prefix).await;
}

/// Publishes one entry that two consumers of `group` took and died with (delivered
/// twice, no outcome).
async fn delivered_twice_to_ghosts(prefix: &str, group: &str) -> redis::aio::MultiplexedConnection {
    let stream = format!("{prefix}order.paid");
    publish(prefix, [paid(1)]).await;
    let mut conn = conn().await;
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg(group)
        .arg("0")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(group)
        .arg("ghost")
        .arg("STREAMS")
        .arg(&stream)
        .arg(">")
        .query_async(&mut conn)
        .await
        .unwrap();
    let id = xrange(&mut conn, &stream).await.ids[0].id.clone();
    let _: redis::Value = redis::cmd("XCLAIM")
        .arg(&stream)
        .arg(group)
        .arg("ghost-2")
        .arg(0)
        .arg(&id)
        .query_async(&mut conn)
        .await
        .unwrap();
    conn
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_claimed_past_the_delivery_limit_is_dead_lettered_without_running() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    let group = unique("limit");
    let mut conn = delivered_twice_to_ghosts(&prefix, &group).await;
    let db = MemoryDb::new(Applied::new());
    let handler = Recorder::ok();
    let config = fast_config(&prefix).with_max_deliveries(2);
    let c = consumer(config, &group, &db, handler.clone());
    let running = Running::start(&c);
    eventually("dead-lettered", || c.stats().dead_lettered == 1).await;
    running.stop().await;
    assert_eq!(handler.calls(), 0);
    let dead = xrange(&mut conn, &c.dead_letter_stream(&stream)).await;
    assert!(field(&dead.ids[0], "reason").contains("delivery limit exceeded"));
    assert_eq!(field(&dead.ids[0], "delivery_count"), "3");
    assert_eq!(pending_count(&mut conn, &stream, &group).await, 0);
    cleanup(&prefix).await;
}

/// The same, but the message had been applied and only its XACK was lost: the inbox
/// says so, and the entry is acknowledged instead of raising a false dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_applied_entry_claimed_past_the_limit_is_acked_not_dead_lettered() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    let group = unique("lost-ack");
    let mut conn = delivered_twice_to_ghosts(&prefix, &group).await;
    let db = MemoryDb::new(Applied::new());
    let msg_id = paid(1).msg_id;
    assert_eq!(
        db.process(&group, &msg_id, |_| Ok(())).unwrap(),
        Processed::Applied
    );
    let handler = Recorder::ok();
    let config = fast_config(&prefix).with_max_deliveries(2);
    let c = consumer(config, &group, &db, handler.clone());
    let running = Running::start(&c);
    eventually("acknowledged as a duplicate", || c.stats().duplicates == 1).await;
    running.stop().await;
    assert_eq!(handler.calls(), 0);
    assert_eq!(c.stats().dead_lettered, 0);
    assert_eq!(pending_count(&mut conn, &stream, &group).await, 0);
    cleanup(&prefix).await;
}

/// The in-memory inbox, down for the next `outages` transactions.
struct FlakyInbox {
    db: MemoryDb<Applied>,
    outages: AtomicUsize,
}

impl Inbox for FlakyInbox {
    type Conn = MemoryTx<Applied>;

    fn process<F>(&self, group: &str, msg_id: &MsgId, handle: F) -> outbox_core::Result<Processed>
    where
        F: FnOnce(&mut MemoryTx<Applied>) -> Result<(), HandlerError>,
    {
        let down = self
            .outages
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if down {
            return Err(outbox_core::Error::store("connection refused"));
        }
        self.db.process(group, msg_id, handle)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_does_not_spend_deliveries() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    publish(&prefix, [paid(1)]).await;
    let db = MemoryDb::new(Applied::new());
    let handler = Recorder::ok();
    let inbox = FlakyInbox {
        db: db.clone(),
        outages: AtomicUsize::new(4),
    };
    let c = Consumer::builder(redis_url(), unique("outage"))
        .handle::<OrderPaid, _>(handler.clone())
        .idempotency(inbox)
        .with_config(fast_config(&prefix).with_max_deliveries(2))
        .build()
        .unwrap();
    let running = Running::start(&c);
    eventually("applied after the outage", || c.stats().consumed == 1).await;
    running.stop().await;
    let stats = c.stats();
    assert_eq!((stats.failures, stats.dead_lettered), (4, 0), "{stats:?}");
    // Four deliveries failed on the outage, yet the handler saw a first delivery.
    assert_eq!(handler.deliveries.lock().unwrap()["order-1"], [1]);
    assert!(all_applied_once(&db, 1));
    let mut conn = conn().await;
    assert_eq!(pending_count(&mut conn, &stream, c.group()).await, 0);
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_is_retried_like_a_failing_one() {
    let prefix = unique_prefix("test");
    publish(&prefix, [paid(1)]).await;
    let db = MemoryDb::new(Applied::new());
    let handler = Recorder::with(|call, _| {
        assert!(call > 1, "handler bug on the first call");
        Ok(())
    });
    let c = consumer(fast_config(&prefix), &unique("panic"), &db, handler.clone());
    let running = Running::start(&c);
    eventually("applied on retry", || c.stats().consumed == 1).await;
    running.stop().await;
    assert_eq!(c.stats().failures, 1);
    assert_eq!(handler.deliveries.lock().unwrap()["order-1"], [1, 2]);
    assert!(all_applied_once(&db, 1));
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_or_unhandled_entries_are_dead_lettered_at_once() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    let group = unique("poison");
    let mut conn = conn().await;
    let entries: [&[(&str, &str)]; 3] = [
        &[
            ("msg_id", "order-1:OrderPaid"),
            ("type", "OrderPaid"),
            ("version", "1"),
            ("payload", "this is not json"),
        ],
        &[
            ("msg_id", "order-2:OrderShipped"),
            ("type", "OrderShipped"),
            ("version", "1"),
            ("payload", "{}"),
        ],
        &[("type", "OrderPaid"), ("payload", "{}")],
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
    publish(&prefix, [paid(3)]).await;
    let db = MemoryDb::new(Applied::new());
    let handler = Recorder::ok();
    let c = consumer(fast_config(&prefix), &group, &db, handler.clone());
    let running = Running::start(&c);
    eventually("all four processed", || {
        let s = c.stats();
        s.dead_lettered == 3 && s.consumed == 1
    })
    .await;
    running.stop().await;
    assert_eq!(handler.calls(), 1, "the handler never saw the poison");
    assert_eq!(c.stats().failures, 0);
    let dead = xrange(&mut conn, &c.dead_letter_stream(&stream)).await;
    // Processing is concurrent: find each dead letter by its reason.
    let by_reason = |needle: &str| {
        dead.ids
            .iter()
            .find(|e| field(e, "reason").contains(needle))
            .unwrap_or_else(|| panic!("no dead letter with reason {needle:?}: {dead:?}"))
    };
    let bad_json = by_reason("cannot decode a `OrderPaid` payload");
    assert_eq!(field(bad_json, "payload"), "this is not json");
    assert_eq!(field(bad_json, "msg_id"), "order-1:OrderPaid");
    by_reason("no handler for event type `OrderShipped`");
    by_reason("missing field `msg_id`");
    assert_eq!(dead.ids.len(), 3);
    assert!(dead.ids.iter().all(|e| field(e, "delivery_count") == "1"));
    assert_eq!(pending_count(&mut conn, &stream, &group).await, 0);
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_types_can_be_acked_and_counted_instead() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    let mut conn = conn().await;
    let _: String = redis::cmd("XADD")
        .arg(&stream)
        .arg("*")
        .arg(&[
            ("msg_id", "order-2:OrderShipped"),
            ("type", "OrderShipped"),
            ("version", "1"),
            ("payload", "{}"),
        ])
        .query_async(&mut conn)
        .await
        .unwrap();
    let db = MemoryDb::new(Applied::new());
    let config = fast_config(&prefix).with_ignore_unknown_types(true);
    let c = consumer(config, &unique("ignore"), &db, Recorder::ok());
    let running = Running::start(&c);
    eventually("ignored", || c.stats().ignored == 1).await;
    running.stop().await;
    assert_eq!(c.stats().dead_lettered, 0);
    assert_eq!(pending_count(&mut conn, &stream, c.group()).await, 0);
    let dead: usize = redis::cmd("EXISTS")
        .arg(c.dead_letter_stream(&stream))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(dead, 0);
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_reads_longer_than_500_ms_do_not_error() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    let group = unique("block");
    let mut conn = conn().await;
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg(&group)
        .arg("$")
        .arg("MKSTREAM")
        .query_async(&mut conn)
        .await
        .unwrap();
    // The hazard: with the redis crate's default response timeout (500 ms) a longer
    // BLOCK is cut off by the client.
    let client = redis::Client::open(redis_url()).unwrap();
    let mut default = client
        .get_multiplexed_async_connection_with_config(&AsyncConnectionConfig::new())
        .await
        .unwrap();
    let cut: redis::RedisResult<redis::Value> = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(&group)
        .arg("probe")
        .arg("BLOCK")
        .arg(1500)
        .arg("STREAMS")
        .arg(&stream)
        .arg(">")
        .query_async(&mut default)
        .await;
    assert!(cut.is_err_and(|e| e.is_timeout()));

    // The consumer blocks 1.5 s per read and must go through several empty reads
    // without a single error, then still receive.
    let db = MemoryDb::new(Applied::new());
    let config = fast_config(&prefix)
        .with_block(Duration::from_millis(1500))
        .with_claim_interval(Duration::from_secs(3600));
    let c = consumer(config, &group, &db, Recorder::ok());
    let running = Running::start(&c);
    tokio::time::sleep(Duration::from_millis(3500)).await;
    publish(&prefix, [paid(1)]).await;
    eventually("received after long blocks", || c.stats().consumed == 1).await;
    running.stop().await;
    assert_eq!(c.stats().redis_errors, 0, "{:?}", c.stats());
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_finishes_and_acks_in_flight_messages() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    publish(&prefix, (1..=3).map(paid)).await;
    let db = MemoryDb::new(Applied::new());
    let (hold, started, release) = Hold::new();
    let handler = Recorder::with(move |_, _| {
        // The message read ahead also runs, after the test stopped listening.
        hold.stop();
        Ok(())
    });
    let config = fast_config(&prefix).with_max_in_flight(1);
    let c = consumer(config, &unique("graceful"), &db, handler.clone());
    let mut running = Running::start(&c);
    wait_started(started).await;
    // Shut down while the first message is in its handler, then let it finish.
    let stop = running.stop_signal();
    stop.send(()).unwrap();
    release.send(()).unwrap();
    // A later handler call (the one message read ahead) must not hang the test.
    drop(release);
    (&mut running.task).await.unwrap().unwrap();

    let stats = c.stats();
    assert!(stats.consumed >= 1, "{stats:?}");
    let mut conn = conn().await;
    let pending = pending_count(&mut conn, &stream, c.group()).await;
    assert_eq!(pending, 0, "every message handed to a handler was acked");
    assert!(db.read(|a| a.values().all(|&n| n == 1)));
    // What was not processed is still there for the next run.
    let c2 = consumer(fast_config(&prefix), c.group(), &db, Recorder::ok());
    let running = Running::start(&c2);
    eventually("the rest applied", || all_applied_once(&db, 3)).await;
    running.stop().await;
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_from_end_skips_earlier_entries_and_groups_are_created_idempotently() {
    let prefix = unique_prefix("test");
    publish(&prefix, [paid(1)]).await;
    let db = MemoryDb::new(Applied::new());
    let config = fast_config(&prefix).with_start_from(StartFrom::End);
    let c = consumer(config, &unique("end"), &db, Recorder::ok());
    c.ensure_groups().await.unwrap();
    c.ensure_groups().await.unwrap();
    let running = Running::start(&c);
    publish(&prefix, [paid(2)]).await;
    eventually("the later message applied", || c.stats().consumed == 1).await;
    running.stop().await;
    assert_eq!(
        db.read(|a| a.keys().cloned().collect::<HashSet<_>>()),
        HashSet::from(["order-2".to_owned()])
    );
    cleanup(&prefix).await;
}

#[tokio::test]
async fn builder_reports_mistakes() {
    let db = MemoryDb::new(Applied::new());
    let twice = Consumer::builder(redis_url(), "g")
        .handle::<OrderPaid, _>(Recorder::ok())
        .handle::<OrderPaid, _>(Recorder::ok())
        .idempotency(db.clone())
        .build();
    assert!(
        twice
            .unwrap_err()
            .to_string()
            .contains("already registered")
    );
    let zero = Consumer::builder(redis_url(), "g")
        .handle::<OrderPaid, _>(Recorder::ok())
        .idempotency(db.clone())
        .with_config(ConsumerConfig::default().with_block(Duration::ZERO))
        .build();
    assert!(zero.unwrap_err().is_config());
    let forever = Consumer::builder(redis_url(), "g")
        .handle::<OrderPaid, _>(Recorder::ok())
        .idempotency(db.clone())
        .with_config(ConsumerConfig::default().with_claim_interval(Duration::MAX))
        .build();
    assert!(
        forever.unwrap_err().is_config(),
        "an interval that would overflow a deadline"
    );
    let long_group = Consumer::builder(redis_url(), "g".repeat(65))
        .handle::<OrderPaid, _>(Recorder::ok())
        .idempotency(db.clone())
        .build();
    assert!(
        long_group.unwrap_err().is_config(),
        "a group name consumed_msg cannot hold"
    );
    let bad_url = Consumer::builder("not a url", "g")
        .handle::<OrderPaid, _>(Recorder::ok())
        .idempotency(db)
        .build();
    assert!(bad_url.is_err());
}

/// The builder takes the config whole (issue 11): a consumer name and a batch size given
/// in it both hold. The builder has no shortcut setter that could overwrite either, or
/// be overwritten by the config (`ConsumerBuilder::with_config` has a `compile_fail`
/// doc test for `.batch_size(..)`).
#[tokio::test]
async fn a_config_given_whole_keeps_every_field() {
    let config = ConsumerConfig::default()
        .with_consumer_name("points-1")
        .with_batch_size(7)
        .with_stream_prefix("app:");
    let c = Consumer::builder(redis_url(), "g")
        .handle::<OrderPaid, _>(Recorder::ok())
        .idempotency(MemoryDb::new(Applied::new()))
        .with_config(config.clone())
        .build()
        .unwrap();
    assert_eq!(c.consumer_name(), "points-1");
    assert_eq!(c.config().batch_size, Some(7));
    assert_eq!(c.config(), &config);
    assert!(
        c.streams().all(|s| s.starts_with("app:")),
        "{:?}",
        c.streams().collect::<Vec<_>>()
    );
    // A later `with_config` replaces the earlier one whole: nothing of it lingers.
    let c = Consumer::builder(redis_url(), "g")
        .handle::<OrderPaid, _>(Recorder::ok())
        .idempotency(MemoryDb::new(Applied::new()))
        .with_config(config)
        .with_config(ConsumerConfig::default().with_max_in_flight(3))
        .build()
        .unwrap();
    assert_eq!(c.config(), &ConsumerConfig::default().with_max_in_flight(3));
    assert_ne!(c.consumer_name(), "points-1");
}

/// Build errors are typed: a config rule names its field, a group name too long is a
/// config error of `group`, no handler at all is its own error.
#[tokio::test]
async fn build_errors_name_the_broken_rule() {
    let built = |group: &str, config: ConsumerConfig| {
        Consumer::builder(redis_url(), group)
            .handle::<OrderPaid, _>(Recorder::ok())
            .idempotency(MemoryDb::new(Applied::new()))
            .with_config(config)
            .build()
            .unwrap_err()
    };
    let field = |e: &outbox_redis::Error| match e {
        outbox_redis::Error::Config(e) => e.field().to_owned(),
        other => panic!("not a config error: {other:?}"),
    };
    let e = built("g", ConsumerConfig::default().with_read_count(0));
    assert_eq!(field(&e), "read_count", "{e}");
    assert_eq!(
        e.to_string(),
        "invalid configuration: read_count must be at least 1"
    );
    let e = built("g", ConsumerConfig::default().with_batch_size(0));
    assert_eq!(field(&e), "batch_size", "{e}");
    let e = built(&"g".repeat(65), ConsumerConfig::default());
    assert_eq!(field(&e), "group", "{e}");
    let none = Consumer::builder::<MemoryTx<Applied>>(redis_url(), "g")
        .idempotency(MemoryDb::new(Applied::new()))
        .build()
        .unwrap_err();
    assert!(matches!(none, outbox_redis::Error::NoHandler), "{none:?}");
    assert!(none.is_config());
}

#[tokio::test]
async fn an_unreachable_redis_at_start_is_an_outage_that_run_until_waits_out() {
    let db = MemoryDb::new(Applied::new());
    let c = Consumer::builder("redis://127.0.0.1:1", "g")
        .handle::<OrderPaid, _>(Recorder::ok())
        .idempotency(db)
        .build()
        .unwrap();
    let err = c.ensure_groups().await.unwrap_err();
    assert!(err.is_outage(), "{err:?}");
    // `run_until` backs off and tries again until it is told to stop.
    c.run_until(tokio::time::sleep(std::time::Duration::from_millis(500)))
        .await
        .unwrap();
    assert!(c.stats().redis_errors > 0);
}

#[allow(dead_code)]
fn assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Consumer<MemoryDb<Applied>>>();
    is::<Arc<outbox_redis::RedisPublisher>>();
}

/// Sends "receipts" to an outside system: fails on the first attempt of each order.
#[derive(Clone, Default)]
struct Receipts {
    attempts: Arc<Mutex<Vec<String>>>,
    sent: Arc<Mutex<Vec<String>>>,
}

impl outbox_core::AsyncHandler<OrderPaid> for Receipts {
    async fn handle(&self, e: OrderPaid, d: &outbox_core::Delivery) -> Result<(), HandlerError> {
        tokio::time::sleep(Duration::from_millis(1)).await; // a real await point
        self.attempts.lock().unwrap().push(e.order_id.clone());
        if d.delivery_count == 1 {
            return Err(HandlerError::msg("receipt service unavailable"));
        }
        self.sent.lock().unwrap().push(e.order_id);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_handlers_are_retried_and_applied_once() {
    let prefix = unique_prefix("test");
    publish(&prefix, [paid(1), paid(2), paid(1)]).await;
    let db = MemoryDb::new(Applied::new());
    let receipts = Receipts::default();
    let c = Consumer::builder(redis_url(), unique("receipts"))
        .with_config(fast_config(&prefix))
        .handle_async::<OrderPaid, _>(receipts.clone())
        .idempotency(db.clone())
        .build()
        .unwrap();
    let running = Running::start(&c);
    eventually("both receipts sent", || {
        c.stats().consumed == 2 && c.stats().duplicates == 1
    })
    .await;
    running.stop().await;
    let mut sent = receipts.sent.lock().unwrap().clone();
    sent.sort();
    assert_eq!(sent, ["order-1", "order-2"], "each effect succeeded once");
    assert_eq!(
        receipts.attempts.lock().unwrap().len(),
        5,
        "three entries fail their first delivery; two retries apply, the third entry is a duplicate"
    );
    db.read(|a| {
        assert!(
            a.is_empty(),
            "the async handler wrote nothing to the store: {a:?}"
        )
    });
    cleanup(&prefix).await;
}

/// A handler still running at the shutdown timeout neither holds up `run_until` (its
/// acks' sender lives on in the worker) nor loses its ack: the transaction that
/// commits after the run returned is acknowledged by its worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_running_past_the_shutdown_timeout_is_acked_when_it_commits() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    publish(&prefix, [paid(1)]).await;
    let db = MemoryDb::new(Applied::new());
    let (hold, started, release) = Hold::new();
    let handler = Recorder::with(move |_, _| {
        hold.stop();
        Ok(())
    });
    let config = fast_config(&prefix)
        .with_max_in_flight(1)
        .with_shutdown_timeout(Duration::from_millis(100));
    let c = consumer(config, &unique("late"), &db, handler.clone());
    let mut running = Running::start(&c);
    wait_started(started).await;
    running.stop_signal().send(()).unwrap();
    // The run returns while the handler still waits.
    (&mut running.task).await.unwrap().unwrap();
    assert_eq!(c.stats().consumed, 0);
    release.send(()).unwrap();
    eventually("committed after the run returned", || {
        c.stats().consumed == 1
    })
    .await;
    let mut conn = conn().await;
    for _ in 0..200 {
        if pending_count(&mut conn, &stream, c.group()).await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        pending_count(&mut conn, &stream, c.group()).await,
        0,
        "the late commit was acknowledged"
    );
    assert!(all_applied_once(&db, 1));
    cleanup(&prefix).await;
}

/// A dropped `run_until` leaves no worker thread behind: the runtime that ran it shuts
/// down (it waits for its blocking threads).
#[test]
fn a_dropped_run_leaves_no_worker_behind() {
    let prefix = unique_prefix("test");
    let db = MemoryDb::new(Applied::new());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        publish(&prefix, (1..=3).map(paid)).await;
        let c = consumer(fast_config(&prefix), &unique("drop"), &db, Recorder::ok());
        let run = tokio::spawn({
            let c = c.clone();
            async move { c.run_until(std::future::pending()).await }
        });
        eventually("applied", || c.stats().consumed == 3).await;
        run.abort();
        let _ = run.await;
    });
    // Hangs here if a worker still waits for work.
    drop(runtime);
    assert!(all_applied_once(&db, 3));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(cleanup(&prefix));
}

/// On a current-thread runtime the workers' Redis commands (a dead letter, a delivery
/// count) and pauses are driven by the runtime's one thread, which runs the loop too.
#[tokio::test]
async fn a_current_thread_runtime_runs_retries_and_dead_letters() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    publish(&prefix, (1..=4).map(paid)).await;
    let db = MemoryDb::new(Applied::new());
    let handler = Recorder::with(|_, e| {
        if e.order_id == "order-1" {
            Err(HandlerError::msg("never"))
        } else {
            Ok(())
        }
    });
    let config = fast_config(&prefix)
        .with_max_deliveries(2)
        .with_max_in_flight(2);
    let c = consumer(config, &unique("current"), &db, handler);
    let running = Running::start(&c);
    eventually("applied and dead-lettered", || {
        c.stats().consumed == 3 && c.stats().dead_lettered == 1
    })
    .await;
    running.stop().await;
    let mut conn = conn().await;
    assert_eq!(pending_count(&mut conn, &stream, c.group()).await, 0);
    assert_eq!(
        xrange(&mut conn, &c.dead_letter_stream(&stream))
            .await
            .ids
            .len(),
        1
    );
    assert!(db.read(|a| a.len() == 3 && a.values().all(|&n| n == 1)));
    cleanup(&prefix).await;
}
