//! Consumers survive Redis outages: a private `redis-server` (AOF on, so a restart loses
//! nothing) is killed, kept down, and started again while consumers with the PostgreSQL
//! inbox run. Afterwards every entry, old and new, is applied exactly once.
//!
//! The outages are chosen around the run loop's timings: shorter than the claim interval,
//! and longer than the claim interval plus the longest outage backoff (the case where a
//! consumer once stopped reading for good), with the default settings and with short ones.

use std::time::Duration;

use diesel::connection::SimpleConnection as _;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use outbox_core::{
    Delivery, Envelope, Handler, HandlerError, OutageBackoff, OutboxEvent, Publisher as _,
    StoredMessage,
};
use outbox_diesel::{PgInbox, PgPool};
use outbox_redis::{Consumer, ConsumerConfig, PublisherConfig, RedisPublisher};
use outbox_tests::{Isolated, ScratchRedis, unique_prefix};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
struct Tick {
    #[outbox(id)]
    n: String,
}

/// Counts each application per message: a second application shows as `times = 2`.
struct CountApplications;

impl Handler<Tick> for CountApplications {
    type Conn = PgConnection;

    fn handle(&self, e: Tick, conn: &mut PgConnection, _: &Delivery) -> Result<(), HandlerError> {
        diesel::sql_query(
            "INSERT INTO applied (n, times) VALUES ($1, 1) \
             ON CONFLICT (n) DO UPDATE SET times = applied.times + 1",
        )
        .bind::<diesel::sql_types::Text, _>(&e.n)
        .execute(conn)?;
        Ok(())
    }
}

#[derive(QueryableByName)]
struct Applied {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    messages: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    most: i64,
}

struct Case {
    consumers: usize,
    batch: bool,
    /// Short claim interval and backoff instead of the defaults.
    short: bool,
    fault: Fault,
}

enum Fault {
    /// The server killed, kept down this long, and started again.
    Restart(Duration),
    /// `CLIENT KILL TYPE normal` about every second, this long.
    ClientKills(Duration),
}

struct Fixture {
    _schema: Isolated,
    pool: PgPool,
    redis: ScratchRedis,
    prefix: String,
}

impl Fixture {
    fn new() -> Self {
        let schema = Isolated::postgres("e2e");
        let pool = Pool::builder()
            .max_size(8)
            .build(ConnectionManager::<PgConnection>::new(&schema.url))
            .unwrap();
        let mut conn = pool.get().unwrap();
        outbox_diesel::migrate(&mut *conn).unwrap();
        conn.batch_execute("CREATE TABLE applied (n TEXT PRIMARY KEY, times BIGINT NOT NULL)")
            .unwrap();
        Self {
            _schema: schema,
            pool,
            redis: ScratchRedis::start_persistent(),
            prefix: unique_prefix("outage"),
        }
    }

    fn applied(&self) -> Applied {
        diesel::sql_query(
            "SELECT count(*) AS messages, coalesce(max(times), 0)::BIGINT AS most FROM applied",
        )
        .get_result(&mut *self.pool.get().unwrap())
        .unwrap()
    }

    /// Publishes ticks `range`, retrying while the restarted server is still loading.
    async fn publish(&self, range: std::ops::Range<usize>) {
        let config = PublisherConfig::default().with_stream_prefix(self.prefix.clone());
        let publisher = RedisPublisher::new(self.redis.url().as_str())
            .unwrap()
            .with_config(config)
            .unwrap();
        let batch: Vec<StoredMessage> = range
            .map(|i| StoredMessage {
                id: i as i64 + 1,
                retries: 0,
                envelope: Envelope::from_event(&Tick { n: format!("t{i}") }, 1 << 20).unwrap(),
            })
            .collect();
        for _ in 0..200 {
            if let Ok(outcomes) = publisher.publish(&batch).await
                && outcomes.iter().all(Result::is_ok)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the scratch Redis did not take the entries");
    }

    async fn wait_applied(&self, n: i64, what: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        loop {
            let applied = self.applied();
            assert!(applied.most <= 1, "a message was applied twice ({what})");
            if applied.messages == n {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: {} of {n} messages applied after 90 s",
                applied.messages
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn config(&self, case: &Case) -> ConsumerConfig {
        let mut config = ConsumerConfig::default()
            .with_stream_prefix(self.prefix.clone())
            .with_batch_size(case.batch.then_some(20));
        if case.short {
            config.block = Duration::from_millis(200);
            config.claim_interval = Duration::from_millis(200);
            config.min_idle = Duration::from_secs(1);
            config.outage_backoff = OutageBackoff::default()
                .with_min(Duration::from_millis(50))
                .with_max(Duration::from_secs(1));
        }
        config
    }
}

async fn survives(case: Case) {
    let mut fx = Fixture::new();
    let config = fx.config(&case);
    let longest_pause = config.outage_backoff.max + config.claim_interval;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut running = Vec::new();
    for _ in 0..case.consumers {
        let consumer = Consumer::builder(fx.redis.url(), "ticks")
            .with_config(config.clone())
            .handle::<Tick, _>(CountApplications)
            .idempotency(PgInbox::new(fx.pool.clone()))
            .build()
            .unwrap();
        let mut stopped = stopped.clone();
        running.push(tokio::spawn(async move {
            consumer
                .run_until(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
        }));
    }

    fx.publish(0..100).await;
    fx.wait_applied(100, "before the outage").await;

    match case.fault {
        Fault::Restart(outage) => tokio::task::block_in_place(|| {
            fx.redis.stop();
            std::thread::sleep(outage);
            fx.redis.restart();
        }),
        Fault::ClientKills(during) => {
            let client = redis::Client::open(fx.redis.url()).unwrap();
            let until = tokio::time::Instant::now() + during;
            while tokio::time::Instant::now() < until {
                let mut conn = client.get_multiplexed_async_connection().await.unwrap();
                // Kills every normal client, this one included.
                let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("normal")
                    .query_async(&mut conn)
                    .await;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    fx.publish(100..200).await;
    fx.wait_applied(
        200,
        &format!("after the fault (claim interval + longest backoff {longest_pause:?})"),
    )
    .await;

    stop.send(true).unwrap();
    for run in running {
        tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .expect("the consumer stops within 30 s of its shutdown signal")
            .unwrap()
            .unwrap();
    }
    let applied = fx.applied();
    assert_eq!((applied.messages, applied.most), (200, 1));
}

/// The case a user met: default settings, down for longer than the claim interval plus
/// the longest backoff. Before the fix the consumer never read again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_consumer_reads_again_after_a_12_s_outage() {
    survives(Case {
        consumers: 1,
        batch: false,
        short: false,
        fault: Fault::Restart(Duration::from_secs(12)),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_default_batch_consumers_read_again_after_a_12_s_outage() {
    survives(Case {
        consumers: 2,
        batch: true,
        short: false,
        fault: Fault::Restart(Duration::from_secs(12)),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_consumer_survives_an_outage_shorter_than_the_claim_interval() {
    survives(Case {
        consumers: 1,
        batch: false,
        short: false,
        fault: Fault::Restart(Duration::from_secs(2)),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_settings_two_consumers_survive_a_long_outage() {
    survives(Case {
        consumers: 2,
        batch: false,
        short: true,
        fault: Fault::Restart(Duration::from_secs(4)),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_settings_batch_consumer_survives_a_short_outage() {
    survives(Case {
        consumers: 1,
        batch: true,
        short: true,
        fault: Fault::Restart(Duration::from_millis(150)),
    })
    .await;
}

/// What a user saw stop two consumers for good: every client killed about every second
/// for 15 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_default_consumers_survive_15_s_of_client_kills() {
    survives(Case {
        consumers: 2,
        batch: false,
        short: false,
        fault: Fault::ClientKills(Duration::from_secs(15)),
    })
    .await;
}

/// A consumer started while Redis is down (a deploy before Redis, a restart during its
/// own) waits for it instead of failing, and consumes once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_started_while_redis_is_down_waits_for_it() {
    let mut fx = Fixture::new();
    fx.publish(0..10).await;
    tokio::task::block_in_place(|| fx.redis.stop());
    let consumer = Consumer::builder(fx.redis.url(), "ticks")
        .with_config(fx.config(&Case {
            consumers: 1,
            batch: false,
            short: true,
            fault: Fault::Restart(Duration::ZERO),
        }))
        .handle::<Tick, _>(CountApplications)
        .idempotency(PgInbox::new(fx.pool.clone()))
        .build()
        .unwrap();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let run = tokio::spawn({
        let consumer = consumer.clone();
        async move {
            consumer
                .run_until(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
        }
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !run.is_finished(),
        "run_until waits for Redis instead of failing"
    );
    tokio::task::block_in_place(|| fx.redis.restart());
    fx.publish(10..20).await;
    fx.wait_applied(20, "after Redis came up").await;
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the consumer stops")
        .unwrap()
        .unwrap();
    assert!(consumer.stats().redis_errors > 0);
}
