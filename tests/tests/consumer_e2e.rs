//! Consumers against real Redis with the PostgreSQL idempotency store: the handler's own
//! write commits with the dedup row, so redelivery, reclaim after a crash and failing
//! handlers never apply a message twice or half.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use diesel::connection::SimpleConnection as _;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use outbox_core::Relay;
use outbox_core::{Delivery, Envelope, Handler, HandlerError, Publisher as _, StoredMessage};
use outbox_diesel::{Emit as _, EmitOptions, PgInbox, PgPool, PgRelayStore};
use outbox_examples::AccountTransferred;
use outbox_redis::{Consumer, ConsumerConfig, PublisherConfig, RedisPublisher};
use outbox_tests::{Isolated, redis_url, unique, unique_prefix};

/// Adds each transfer's amount to bob's points: not idempotent on its own, so a second
/// application would show.
#[derive(Clone)]
struct AddPoints {
    calls: Arc<AtomicU32>,
    headers: Arc<Mutex<Vec<outbox_core::Headers>>>,
    behaviour: Arc<dyn Fn(u32) -> Result<(), HandlerError> + Send + Sync>,
}

impl AddPoints {
    fn new(behaviour: impl Fn(u32) -> Result<(), HandlerError> + Send + Sync + 'static) -> Self {
        Self {
            calls: Arc::default(),
            headers: Arc::default(),
            behaviour: Arc::new(behaviour),
        }
    }
}

impl Handler<AccountTransferred> for AddPoints {
    type Conn = PgConnection;

    fn handle(
        &self,
        e: AccountTransferred,
        conn: &mut PgConnection,
        d: &Delivery,
    ) -> Result<(), HandlerError> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        self.headers
            .lock()
            .unwrap()
            .push(d.envelope.headers.clone());
        diesel::sql_query("UPDATE points SET total = total + $1 WHERE who = $2")
            .bind::<diesel::sql_types::BigInt, _>(e.amount)
            .bind::<diesel::sql_types::Text, _>(&e.to)
            .execute(conn)?;
        (self.behaviour)(call)
    }
}

struct Fixture {
    _schema: Isolated,
    pool: PgPool,
    prefix: String,
    group: String,
}

impl Fixture {
    fn new() -> Self {
        let schema = Isolated::postgres("e2e");
        let pool = Pool::builder()
            .max_size(4)
            .build(ConnectionManager::<PgConnection>::new(&schema.url))
            .unwrap();
        let mut conn = pool.get().unwrap();
        outbox_diesel::migrate(&mut *conn).unwrap();
        conn.batch_execute("CREATE TABLE points (who TEXT PRIMARY KEY, total BIGINT NOT NULL); INSERT INTO points VALUES ('bob', 0)")
            .unwrap();
        Self {
            _schema: schema,
            pool,
            prefix: unique_prefix("e2e"),
            group: unique("points"),
        }
    }

    /// Publishes the transfer `copies` times, as a relay that crashed before marking it
    /// SENT would.
    async fn publish(&self, amount: i64, copies: usize) {
        let config = PublisherConfig::default().with_stream_prefix(self.prefix.clone());
        let publisher = RedisPublisher::new(redis_url().as_str())
            .unwrap()
            .with_config(config)
            .unwrap();
        let envelope = Envelope::from_event(
            &AccountTransferred::new("t-1", "alice", "bob", amount),
            1 << 20,
        )
        .unwrap();
        let batch = vec![
            StoredMessage {
                id: 1,
                retries: 0,
                envelope
            };
            copies
        ];
        assert!(
            publisher
                .publish(&batch)
                .await
                .unwrap()
                .iter()
                .all(Result::is_ok)
        );
    }

    fn config(&self) -> ConsumerConfig {
        ConsumerConfig::default()
            .with_stream_prefix(self.prefix.clone())
            .with_block(Duration::from_millis(200))
            .with_min_idle(Duration::from_millis(300))
            .with_claim_interval(Duration::from_millis(100))
    }

    fn consumer(&self, config: ConsumerConfig, handler: AddPoints) -> Consumer<PgInbox> {
        Consumer::builder(redis_url(), self.group.clone())
            .with_config(config)
            .handle::<AccountTransferred, _>(handler)
            .idempotency(PgInbox::new(self.pool.clone()))
            .build()
            .unwrap()
    }

    fn points(&self) -> i64 {
        let mut conn = self.pool.get().unwrap();
        #[derive(QueryableByName)]
        struct Total {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            total: i64,
        }
        diesel::sql_query("SELECT total FROM points WHERE who = 'bob'")
            .get_result::<Total>(&mut *conn)
            .unwrap()
            .total
    }

    fn consumed_rows(&self) -> i64 {
        #[derive(QueryableByName)]
        struct Count {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        diesel::sql_query("SELECT count(*) AS n FROM consumed_msg")
            .get_result::<Count>(&mut *self.pool.get().unwrap())
            .unwrap()
            .n
    }

    async fn cleanup(&self) {
        outbox_tests::delete_redis_keys(&self.prefix);
    }
}

/// Runs `consumer` until `done` holds (at most 60 s), then shuts it down gracefully.
async fn run_until(
    consumer: &Consumer<PgInbox>,
    done: impl Fn(&Consumer<PgInbox>) -> bool + Send + 'static,
) {
    let watcher = consumer.clone();
    let stop = async move {
        while !done(&watcher) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), consumer.run_until(stop))
        .await
        .expect("condition reached within 60 s")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_entry_delivered_twice_applies_the_db_write_once() {
    let f = Fixture::new();
    f.publish(100, 2).await;
    let handler = AddPoints::new(|_| Ok(()));
    let consumer = f.consumer(f.config(), handler.clone());
    run_until(&consumer, |c| {
        c.stats().consumed + c.stats().duplicates == 2
    })
    .await;
    assert_eq!(
        (consumer.stats().consumed, consumer.stats().duplicates),
        (1, 1)
    );
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        1,
        "the duplicate never reaches the handler"
    );
    assert_eq!(f.points(), 100);
    assert_eq!(f.consumed_rows(), 1);
    f.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_of_a_consumer_killed_before_xack_is_reclaimed_and_applied_once() {
    let f = Fixture::new();
    f.publish(100, 1).await;

    // The first consumer writes, then stalls inside its open transaction; it is killed
    // there, and its transaction rolls back when the stalled call finally gives up.
    let (entered_tx, entered) = mpsc::channel::<()>();
    let (release, released) = mpsc::channel::<()>();
    let (entered_tx, released) = (Mutex::new(entered_tx), Mutex::new(released));
    let doomed = AddPoints::new(move |_| {
        entered_tx.lock().unwrap().send(()).unwrap();
        released.lock().unwrap().recv().ok();
        Err(HandlerError::msg("process killed"))
    });
    let first = f.consumer(
        f.config().with_min_idle(Duration::from_secs(3600)),
        doomed.clone(),
    );
    let task = tokio::spawn(async move { first.run_until(std::future::pending()).await });
    tokio::task::spawn_blocking(move || entered.recv().unwrap())
        .await
        .unwrap();
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    release.send(()).unwrap();

    let survivor = AddPoints::new(|_| Ok(()));
    let second = f.consumer(f.config(), survivor.clone());
    run_until(&second, |c| c.stats().consumed == 1).await;
    assert_eq!(second.stats().reclaimed, 1);
    assert_eq!(survivor.calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        f.points(),
        100,
        "the killed attempt's write rolled back; the reclaim applied once"
    );
    assert_eq!(f.consumed_rows(), 1);
    f.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_failing_every_time_is_dead_lettered_and_leaves_no_write() {
    let f = Fixture::new();
    f.publish(100, 1).await;
    let failing = AddPoints::new(|call| {
        Err(HandlerError::msg(format!(
            "points service refused (attempt {call})"
        )))
    });
    let consumer = f.consumer(f.config().with_max_deliveries(3), failing.clone());
    run_until(&consumer, |c| c.stats().dead_lettered == 1).await;
    assert_eq!(failing.calls.load(Ordering::SeqCst), 3);
    assert_eq!(f.points(), 0, "every failed attempt rolled back its write");
    assert_eq!(f.consumed_rows(), 0, "and its dedup row");

    let mut conn = redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let dead = consumer.dead_letter_stream(&format!("{}account.transferred", f.prefix));
    let entries: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(&dead)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(entries.ids.len(), 1);
    let entry = &entries.ids[0];
    let field = |name: &str| entry.get::<String>(name).unwrap_or_default();
    assert_eq!(
        field("reason"),
        "handler failed: points service refused (attempt 3)"
    );
    assert_eq!(field("delivery_count"), "3");
    assert_eq!(field("msg_id"), "t-1:AccountTransferred");
    f.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_context_travels_from_emit_to_the_handler() {
    let f = Fixture::new();
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let options = EmitOptions::new().with_header(outbox_core::TRACEPARENT, traceparent);
    f.pool
        .get()
        .unwrap()
        .transaction(|c| c.emit_with(&options, AccountTransferred::new("t-9", "alice", "bob", 5)))
        .unwrap();
    let config = PublisherConfig::default().with_stream_prefix(f.prefix.clone());
    let publisher = RedisPublisher::new(redis_url().as_str())
        .unwrap()
        .with_config(config)
        .unwrap();
    let relay = Relay::new(PgRelayStore::new(f.pool.clone()), publisher);
    assert_eq!(relay.run_once().await.unwrap().sent, 1);

    let handler = AddPoints::new(|_| Ok(()));
    let consumer = f.consumer(f.config(), handler.clone());
    run_until(&consumer, |c| c.stats().consumed == 1).await;
    let headers = handler.headers.lock().unwrap().clone();
    assert_eq!(headers.len(), 1);
    assert_eq!(
        headers[0].get("traceparent").map(String::as_str),
        Some(traceparent)
    );
    assert_eq!(f.points(), 5);
    f.cleanup().await;
}
