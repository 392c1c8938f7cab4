//! Consumers against real Redis and PostgreSQL where handlers are slow or stuck: a slow
//! handler's entry is not claimed while it runs, a small pool is back-pressure and not
//! an outage, and a consumer stuck in a lock wait still shuts down within its bound.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection as _;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use outbox_core::{
    Delivery, Envelope, Handler, HandlerError, OutboxEvent, Publisher as _, StoredMessage,
};
use outbox_diesel::{PgInbox, PgPool};
use outbox_redis::{Consumer, ConsumerConfig, ConsumerStats, PublisherConfig, RedisPublisher};
use outbox_tests::{Isolated, eventually, redis_url, unique_prefix};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
struct Job {
    #[outbox(id)]
    n: String,
}

type Behave = dyn Fn(u32, &mut PgConnection) -> Result<(), HandlerError> + Send + Sync;

/// Counts calls, records the application, then behaves as told (given the call number).
#[derive(Clone)]
struct Work {
    calls: Arc<AtomicU32>,
    behave: Arc<Behave>,
}

impl Work {
    fn new(
        behave: impl Fn(u32, &mut PgConnection) -> Result<(), HandlerError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            calls: Arc::default(),
            behave: Arc::new(behave),
        }
    }
}

impl Handler<Job> for Work {
    type Conn = PgConnection;

    fn handle(&self, e: Job, conn: &mut PgConnection, _: &Delivery) -> Result<(), HandlerError> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        diesel::sql_query(
            "INSERT INTO applied (n, times) VALUES ($1, 1) \
             ON CONFLICT (n) DO UPDATE SET times = applied.times + 1",
        )
        .bind::<diesel::sql_types::Text, _>(&e.n)
        .execute(conn)?;
        (self.behave)(call, conn)
    }
}

struct Fixture {
    schema: Isolated,
    prefix: String,
}

impl Fixture {
    fn new() -> Self {
        let schema = Isolated::postgres("e2e");
        let mut conn = PgConnection::establish(&schema.url).unwrap();
        outbox_diesel::migrate(&mut conn).unwrap();
        conn.batch_execute(
            "CREATE TABLE applied (n TEXT PRIMARY KEY, times BIGINT NOT NULL);
             CREATE TABLE hot (id INT PRIMARY KEY, v INT NOT NULL); INSERT INTO hot VALUES (1, 0), (2, 0);",
        )
        .unwrap();
        Self {
            schema,
            prefix: unique_prefix("faults"),
        }
    }

    fn pool(&self, size: u32, checkout: Duration) -> PgPool {
        Pool::builder()
            .max_size(size)
            .connection_timeout(checkout)
            .build(ConnectionManager::<PgConnection>::new(&self.schema.url))
            .unwrap()
    }

    fn config(&self) -> ConsumerConfig {
        ConsumerConfig::default()
            .with_stream_prefix(self.prefix.clone())
            .with_block(Duration::from_millis(200))
            .with_claim_interval(Duration::from_millis(100))
            .with_min_idle(Duration::from_millis(300))
    }

    fn consumer(&self, config: ConsumerConfig, work: Work, pool: PgPool) -> Consumer<PgInbox> {
        Consumer::builder(redis_url(), "work")
            .with_config(config)
            .handle::<Job, _>(work)
            .idempotency(PgInbox::new(pool))
            .build()
            .unwrap()
    }

    async fn publish(&self, n: usize) {
        let config = PublisherConfig::default().with_stream_prefix(self.prefix.clone());
        let publisher = RedisPublisher::new(redis_url().as_str())
            .unwrap()
            .with_config(config)
            .unwrap();
        let batch: Vec<StoredMessage> = (0..n)
            .map(|i| StoredMessage {
                id: i as i64 + 1,
                retries: 0,
                envelope: Envelope::from_event(&Job { n: format!("j{i}") }, 1 << 20).unwrap(),
            })
            .collect();
        let outcomes = publisher.publish(&batch).await.unwrap();
        assert!(outcomes.iter().all(Result::is_ok));
    }

    /// `(messages applied, most applications of one)`.
    fn applied(&self) -> (i64, i64) {
        #[derive(QueryableByName)]
        struct Applied {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            messages: i64,
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            most: i64,
        }
        let a: Applied = diesel::sql_query(
            "SELECT count(*) AS messages, coalesce(max(times), 0)::BIGINT AS most FROM applied",
        )
        .get_result(&mut PgConnection::establish(&self.schema.url).unwrap())
        .unwrap();
        (a.messages, a.most)
    }

    async fn cleanup(&self) {
        outbox_tests::delete_redis_keys(&self.prefix);
    }
}

/// Runs `consumers` until `n` messages are applied (at most 60 s), then stops them.
async fn run_until_applied(fx: &Fixture, consumers: &[Consumer<PgInbox>], n: i64) {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let runs: Vec<_> = consumers
        .iter()
        .map(|c| {
            let c = c.clone();
            let mut stopped = stopped.clone();
            tokio::spawn(async move {
                c.run_until(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while fx.applied().0 < n {
        assert!(
            Instant::now() < deadline,
            "{:?} of {n} applied",
            fx.applied()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(true).unwrap();
    for run in runs {
        tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .expect("the consumer stops within its shutdown timeout")
            .unwrap()
            .unwrap();
    }
}

/// A handler that runs five times `min_idle`: neither the other consumer nor its own
/// consumer claims the entry meanwhile (which would count deliveries and run a second,
/// blocked dedup transaction beside the first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_keeps_its_entry_from_being_claimed() {
    let fx = Fixture::new();
    fx.publish(1).await;
    let stream = format!("{}job", fx.prefix);
    let deliveries = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&deliveries);
    let work = Work::new(move |_, _| {
        std::thread::sleep(Duration::from_millis(1500));
        // What Redis counted while the handler ran.
        let mut redis = redis::Client::open(redis_url())
            .unwrap()
            .get_connection()
            .unwrap();
        let pending: redis::streams::StreamPendingCountReply = redis::cmd("XPENDING")
            .arg(&stream)
            .arg("work")
            .arg("-")
            .arg("+")
            .arg(10)
            .query(&mut redis)
            .unwrap();
        seen.store(pending.ids[0].times_delivered as u32, Ordering::SeqCst);
        Ok(())
    });
    let pool = fx.pool(4, Duration::from_secs(30));
    let consumers = [
        fx.consumer(fx.config(), work.clone(), pool.clone()),
        fx.consumer(fx.config(), work.clone(), pool),
    ];
    run_until_applied(&fx, &consumers, 1).await;
    let stats: Vec<ConsumerStats> = consumers.iter().map(Consumer::stats).collect();
    assert_eq!(fx.applied(), (1, 1));
    assert_eq!(work.calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        deliveries.load(Ordering::SeqCst),
        1,
        "no delivery was counted while the handler ran"
    );
    assert!(
        stats.iter().all(|s| s.reclaimed == 0 && s.duplicates == 0),
        "nobody claimed the entry while it was handled: {stats:?}"
    );
    fx.cleanup().await;
}

/// A slow handler failing once, with two deliveries allowed: its own consumer did not
/// count extra deliveries while it ran, so the second delivery applies it instead of a
/// false dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_failing_handler_is_not_pushed_to_the_dead_letters_by_its_own_claims() {
    let fx = Fixture::new();
    fx.publish(1).await;
    let work = Work::new(|call, _| {
        std::thread::sleep(Duration::from_millis(1500));
        if call == 1 {
            Err(HandlerError::msg("first delivery fails"))
        } else {
            Ok(())
        }
    });
    let config = fx.config().with_max_deliveries(2);
    let consumer = fx.consumer(config, work.clone(), fx.pool(4, Duration::from_secs(30)));
    run_until_applied(&fx, std::slice::from_ref(&consumer), 1).await;
    assert_eq!(fx.applied(), (1, 1));
    assert_eq!(work.calls.load(Ordering::SeqCst), 2);
    assert_eq!(consumer.stats().dead_lettered, 0);
    fx.cleanup().await;
}

/// A pool of 2 under 16 messages in flight: the runner waits for connections instead of
/// timing out on check-out, so nothing is counted as a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_pool_is_back_pressure_not_an_outage() {
    let fx = Fixture::new();
    fx.publish(20).await;
    let work = Work::new(|_, _| {
        std::thread::sleep(Duration::from_millis(300));
        Ok(())
    });
    // Check-outs that wait longer than a handler fail: without back-pressure in the
    // runner, most of the 16 tasks would.
    let consumer = fx.consumer(
        fx.config(),
        work.clone(),
        fx.pool(2, Duration::from_millis(200)),
    );
    run_until_applied(&fx, std::slice::from_ref(&consumer), 20).await;
    assert_eq!(fx.applied(), (20, 1));
    let stats = consumer.stats();
    assert_eq!((stats.failures, stats.consumed), (0, 20), "{stats:?}");
    fx.cleanup().await;
}

/// A batch-mode consumer whose handlers wait on a row lock held elsewhere: its shutdown
/// still returns within `shutdown_timeout`, the messages stay pending, and once the lock
/// is released another consumer applies each exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_stuck_in_lock_waits_shuts_down_within_its_bound() {
    let fx = Fixture::new();
    fx.publish(10).await;
    let mut locker = PgConnection::establish(&fx.schema.url).unwrap();
    locker
        .batch_execute("BEGIN; UPDATE hot SET v = v + 1 WHERE id = 1;")
        .unwrap();
    let work = Work::new(|_, conn| {
        diesel::sql_query("UPDATE hot SET v = v + 1 WHERE id = 1").execute(conn)?;
        Ok(())
    });
    let config = fx
        .config()
        .with_batch_size(5)
        .with_shutdown_timeout(Duration::from_secs(1));
    let stuck = fx.consumer(config, work.clone(), fx.pool(4, Duration::from_secs(30)));
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let run = {
        let stuck = stuck.clone();
        tokio::spawn(async move {
            stuck
                .run_until(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
        })
    };
    // Both batches are in their lock waits.
    eventually("the handlers to run", || {
        work.calls.load(Ordering::SeqCst) >= 2
    })
    .await;
    let asked = Instant::now();
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(15), run)
        .await
        .expect("run_until returns within its shutdown timeout, not after the lock wait")
        .unwrap()
        .unwrap();
    let took = asked.elapsed();
    assert_eq!(stuck.stats().consumed, 0);

    locker.batch_execute("COMMIT").unwrap();
    let rescuer = fx.consumer(
        fx.config(),
        Work::new(|_, _| Ok(())),
        fx.pool(4, Duration::from_secs(30)),
    );
    run_until_applied(&fx, std::slice::from_ref(&rescuer), 10).await;
    assert_eq!(fx.applied(), (10, 1), "each message applied exactly once");
    eprintln!("shutdown took {took:?} with a 1 s shutdown timeout");
    fx.cleanup().await;
}

/// A handler whose first run is the victim of a real deadlock, with one delivery
/// allowed: the consumer runs it again at once instead of counting a failed delivery,
/// so the message is applied once and not dead-lettered.
async fn a_deadlocked_handler_runs_again(batch: Option<usize>) {
    let fx = Fixture::new();
    fx.publish(3).await;
    // The rival holds row 2, then (told to) asks for row 1, which the handler holds
    // while it waits for row 2. Its own deadlock check waits 60 s, so the handler's
    // session (PostgreSQL's default 1 s) finds the deadlock and is the victim.
    let (go, told) = std::sync::mpsc::channel::<()>();
    let url = fx.schema.url.clone();
    let rival = std::thread::spawn(move || {
        let mut conn = PgConnection::establish(&url).unwrap();
        conn.batch_execute(
            "SET deadlock_timeout = '60s'; BEGIN; UPDATE hot SET v = v + 1 WHERE id = 2;",
        )
        .unwrap();
        told.recv().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        conn.batch_execute("UPDATE hot SET v = v + 1 WHERE id = 1; COMMIT;")
            .unwrap();
    });
    let go = std::sync::Mutex::new(Some(go));
    let work = Work::new(move |call, conn| {
        diesel::sql_query("UPDATE hot SET v = v + 1 WHERE id = 1").execute(conn)?;
        if call == 1 {
            go.lock().unwrap().take().unwrap().send(()).unwrap();
        }
        diesel::sql_query("UPDATE hot SET v = v + 1 WHERE id = 2").execute(conn)?;
        Ok(())
    });
    // One message (or batch) at a time: a second handler queued for row 1 would meet
    // the rival in a deadlock of its own, and the test would show a different story.
    let config = fx
        .config()
        .with_max_deliveries(1)
        .with_batch_size(batch)
        .with_max_in_flight(1);
    let consumer = fx.consumer(config, work, fx.pool(4, Duration::from_secs(30)));
    run_until_applied(&fx, std::slice::from_ref(&consumer), 3).await;
    rival.join().unwrap();
    assert_eq!(fx.applied(), (3, 1));
    let stats = consumer.stats();
    assert!(stats.conflicts >= 1, "the deadlock was seen: {stats:?}");
    assert_eq!(
        (stats.failures, stats.dead_lettered, stats.consumed),
        (0, 0, 3),
        "{stats:?}"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlocked_handler_runs_again_instead_of_spending_a_delivery() {
    a_deadlocked_handler_runs_again(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_in_a_batch_runs_the_message_again_on_its_own() {
    a_deadlocked_handler_runs_again(Some(10)).await;
}
