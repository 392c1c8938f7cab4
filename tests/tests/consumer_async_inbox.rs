//! Consumers on the async inbox (`AsyncPgInbox` over diesel-async) against real Redis and
//! PostgreSQL: the handler's write through `&mut AsyncPgConnection` commits with the
//! dedup row, so a redelivery, a panicking handler and a consumer dropped mid-transaction
//! never apply a message twice or half; batch mode runs on it too.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use diesel::connection::SimpleConnection as _;
use diesel::{Connection as _, PgConnection, QueryableByName};
use diesel_async::AsyncPgConnection;
use outbox_core::{
    AsyncTxHandler, Delivery, Envelope, HandlerError, Publisher as _, StoredMessage,
};
use outbox_diesel::AsyncPgInbox;
use outbox_examples::AccountTransferred;
use outbox_redis::{AsyncStore, Consumer, ConsumerConfig, PublisherConfig, RedisPublisher};
use outbox_tests::{Isolated, redis_url, unique, unique_prefix};
use tokio::sync::Notify;

type AsyncConsumer = Consumer<AsyncStore<AsyncPgInbox>>;

/// What the handler does on its n-th call, after its write.
#[derive(Clone, Copy)]
enum Then {
    Ok,
    /// Panics on the first call.
    PanicFirst,
    /// Waits forever on the first call, inside its open transaction.
    HangFirst,
}

/// Adds each transfer's amount to bob's points through the transaction's async
/// connection: not idempotent on its own, so a second application would show.
#[derive(Clone)]
struct AddPoints {
    calls: Arc<AtomicU32>,
    then: Then,
    /// Notified when a hanging call has written and hangs.
    hanging: Arc<Notify>,
}

impl AddPoints {
    fn new(then: Then) -> Self {
        Self {
            calls: Arc::default(),
            then,
            hanging: Arc::default(),
        }
    }
}

impl AsyncTxHandler<AccountTransferred> for AddPoints {
    type Conn = AsyncPgConnection;

    async fn handle(
        &self,
        e: AccountTransferred,
        conn: &mut AsyncPgConnection,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        // Here only: its `load` for every type would hide `AtomicU32::load` elsewhere.
        use diesel_async::RunQueryDsl as _;

        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        diesel::sql_query("UPDATE points SET total = total + $1 WHERE who = $2")
            .bind::<diesel::sql_types::BigInt, _>(e.amount)
            .bind::<diesel::sql_types::Text, _>(&e.to)
            .execute(conn)
            .await?;
        match (self.then, call) {
            (Then::PanicFirst, 1) => panic!("points bug"),
            (Then::HangFirst, 1) => {
                self.hanging.notify_one();
                std::future::pending::<()>().await;
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

struct Fixture {
    schema: Isolated,
    prefix: String,
    group: String,
}

impl Fixture {
    fn new() -> Self {
        let schema = Isolated::postgres("e2e_async");
        let mut conn = PgConnection::establish(&schema.url).unwrap();
        outbox_diesel::migrate(&mut conn).unwrap();
        conn.batch_execute("CREATE TABLE points (who TEXT PRIMARY KEY, total BIGINT NOT NULL); INSERT INTO points VALUES ('bob', 0)")
            .unwrap();
        Self {
            schema,
            prefix: unique_prefix("e2e_async"),
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
        let message = StoredMessage {
            id: 1,
            retries: 0,
            envelope,
        };
        let outcomes = publisher.publish(&vec![message; copies]).await.unwrap();
        assert!(outcomes.iter().all(Result::is_ok));
    }

    fn config(&self) -> ConsumerConfig {
        ConsumerConfig::default()
            .with_stream_prefix(self.prefix.clone())
            .with_block(Duration::from_millis(200))
            .with_min_idle(Duration::from_millis(300))
            .with_claim_interval(Duration::from_millis(100))
    }

    fn consumer(&self, config: ConsumerConfig, handler: AddPoints) -> AsyncConsumer {
        Consumer::builder(redis_url(), self.group.clone())
            .with_config(config)
            .handle_tx::<AccountTransferred, _>(handler)
            .idempotency_async(AsyncPgInbox::connect(&self.schema.url, 4).unwrap())
            .build()
            .unwrap()
    }

    fn scalar(&self, sql: &str) -> i64 {
        #[derive(QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let mut conn = PgConnection::establish(&self.schema.url).unwrap();
        diesel::RunQueryDsl::get_result::<N>(diesel::sql_query(sql), &mut conn)
            .unwrap()
            .n
    }

    fn points(&self) -> i64 {
        self.scalar("SELECT total AS n FROM points WHERE who = 'bob'")
    }

    fn consumed_rows(&self) -> i64 {
        self.scalar("SELECT count(*) AS n FROM consumed_msg")
    }

    async fn cleanup(&self) {
        outbox_tests::delete_redis_keys(&self.prefix);
    }
}

/// Runs `consumer` until `done` holds (at most 60 s), then shuts it down gracefully.
async fn run_until(
    consumer: &AsyncConsumer,
    done: impl Fn(&AsyncConsumer) -> bool + Send + 'static,
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

async fn the_same_entry_delivered_twice_applies_once(config: impl Fn(&Fixture) -> ConsumerConfig) {
    let f = Fixture::new();
    f.publish(100, 2).await;
    let handler = AddPoints::new(Then::Ok);
    let consumer = f.consumer(config(&f), handler.clone());
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
async fn the_same_entry_delivered_twice_applies_the_db_write_once() {
    the_same_entry_delivered_twice_applies_once(Fixture::config).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_mode_on_the_async_inbox_applies_once() {
    the_same_entry_delivered_twice_applies_once(|f| f.config().with_batch_size(10)).await;
}

/// A handler that panics is a failed delivery: its write rolls back with the dedup row,
/// the entry is claimed again and applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_is_a_failed_delivery_then_applied_once() {
    let f = Fixture::new();
    f.publish(100, 1).await;
    let handler = AddPoints::new(Then::PanicFirst);
    let consumer = f.consumer(f.config(), handler.clone());
    run_until(&consumer, |c| c.stats().consumed == 1).await;
    assert_eq!(consumer.stats().failures, 1);
    assert_eq!(handler.calls.load(Ordering::SeqCst), 2);
    assert_eq!(f.points(), 100, "the panicked attempt's write rolled back");
    assert_eq!(f.consumed_rows(), 1);
    f.cleanup().await;
}

/// A consumer dropped while its handler hangs inside the transaction (its run cancelled,
/// as a killed process's would end) leaves nothing: its connection is discarded by the
/// pool, the server rolls the transaction back, and another consumer claims the entry and
/// applies it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_of_a_consumer_dropped_mid_transaction_is_reclaimed_and_applied_once() {
    let f = Fixture::new();
    f.publish(100, 1).await;
    let doomed = AddPoints::new(Then::HangFirst);
    let first = f.consumer(
        f.config().with_min_idle(Duration::from_secs(3600)),
        doomed.clone(),
    );
    let task = tokio::spawn(async move { first.run_until(std::future::pending()).await });
    tokio::time::timeout(Duration::from_secs(30), doomed.hanging.notified())
        .await
        .expect("the handler ran");
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());

    let survivor = AddPoints::new(Then::Ok);
    let second = f.consumer(f.config(), survivor.clone());
    run_until(&second, |c| c.stats().consumed == 1).await;
    assert_eq!(second.stats().reclaimed, 1);
    assert_eq!(survivor.calls.load(Ordering::SeqCst), 1);
    assert_eq!(f.points(), 100, "the dropped attempt's write rolled back");
    assert_eq!(f.consumed_rows(), 1);
    f.cleanup().await;
}
