//! Run with: cargo run --release -p outbox-examples --bin consumer_bench
//!
//! Measures the consumer's full path on PostgreSQL + Redis (XREADGROUP → dedup
//! transaction with the handler's UPDATE → XACK) against the same SQL issued from a
//! plain loop, all in one run:
//!
//! 1. plain SQL loop, one transaction per message (dedup INSERT + UPDATE), on 1 and on
//!    8 connections;
//! 2. the consumer in single mode (one transaction per message), 1 and 8 in flight;
//! 3. the consumer in batch mode (`batch_size`: one transaction per batch, a savepoint
//!    per message), 1 and 8 in flight.
//!
//! The messages are published once to a stream under a random prefix; each consumer run
//! is a new consumer group that drains them from the beginning. The database work goes
//! to an isolated schema, dropped at the end, as is the stream.
//!
//! Options (environment): `BENCH_MESSAGES` (default 10000, which keeps a run under a
//! minute on a 2-core machine; more gives steadier figures), `BENCH_BATCH` (default
//! 100), `DATABASE_URL`, `REDIS_URL`. The machine is shared: compare the ratios, not the
//! absolute figures, and repeat a run before trusting one.

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection as _;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::{Integer, Text};
use diesel::{Connection as _, PgConnection, RunQueryDsl as _};
use outbox_core::{
    Delivery, Envelope, Handler, HandlerError, OutboxEvent, Publisher as _, StoredMessage,
};
use outbox_diesel::PgInbox;
use outbox_redis::{Consumer, ConsumerConfig, PublisherConfig, RedisPublisher};
use serde::{Deserialize, Serialize};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const CONCURRENCY: usize = 8;

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
struct PointsEarned {
    #[outbox(id)]
    award_id: String,
    account: i32,
}

/// The handler's write: one UPDATE of the account's row.
fn credit(conn: &mut PgConnection, account: i32) -> diesel::QueryResult<usize> {
    diesel::sql_query("UPDATE points SET n = n + 1 WHERE id = $1")
        .bind::<Integer, _>(account)
        .execute(conn)
}

struct Award;

impl Handler<PointsEarned> for Award {
    type Conn = PgConnection;

    fn handle(
        &self,
        e: PointsEarned,
        conn: &mut PgConnection,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        credit(conn, e.account)?;
        Ok(())
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Setup {
    admin_url: String,
    url: String,
    schema: String,
    redis_url: String,
    prefix: String,
    messages: usize,
}

impl Setup {
    fn new(messages: usize) -> Result<Self, BoxError> {
        let admin_url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let redis_url =
            std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let tag = format!("{:012x}", random_u64() & 0xffff_ffff_ffff);
        let schema = format!("bench_consumer_{tag}");
        let mut admin = PgConnection::establish(&admin_url)?;
        admin.batch_execute(&format!("CREATE SCHEMA {schema}"))?;
        let sep = if admin_url.contains('?') { '&' } else { '?' };
        let url = format!("{admin_url}{sep}options=-csearch_path%3D{schema}");
        let mut conn = PgConnection::establish(&url)?;
        outbox_diesel::migrate(&mut conn)?;
        conn.batch_execute(&format!(
            "CREATE TABLE points (id INT PRIMARY KEY, n BIGINT NOT NULL);
             INSERT INTO points (id, n) SELECT g, 0 FROM generate_series(0, {}) g;
             ANALYZE points;",
            messages - 1
        ))?;
        Ok(Self {
            admin_url,
            url,
            schema,
            redis_url,
            prefix: format!("bench:{tag}:"),
            messages,
        })
    }

    fn stream(&self) -> String {
        format!("{}{}", self.prefix, PointsEarned::TOPIC)
    }

    fn event(i: usize) -> PointsEarned {
        PointsEarned {
            award_id: format!("award-{i}"),
            account: i32::try_from(i).expect("fewer than 2^31 messages"),
        }
    }

    async fn publish(&self) -> Result<(), BoxError> {
        let config = PublisherConfig::default().with_stream_prefix(self.prefix.clone());
        let publisher = RedisPublisher::new(self.redis_url.as_str())?.with_config(config)?;
        let all: Vec<usize> = (0..self.messages).collect();
        for chunk in all.chunks(500) {
            let batch = chunk
                .iter()
                .map(|&i| {
                    Ok(StoredMessage {
                        id: i as i64 + 1,
                        retries: 0,
                        envelope: Envelope::from_event(&Self::event(i), 1 << 20)?,
                    })
                })
                .collect::<Result<Vec<_>, outbox_core::Error>>()?;
            let outcomes = publisher.publish(&batch).await?;
            if let Some(Err(e)) = outcomes.into_iter().find(Result::is_err) {
                return Err(format!("publish rejected: {e:?}").into());
            }
        }
        Ok(())
    }

    /// The baseline: each of `conns` threads runs its share of the messages, one
    /// transaction per message with the dedup INSERT and the UPDATE.
    fn plain_loop(&self, conns: usize, group: &str) -> Result<f64, BoxError> {
        let mut connections = (0..conns)
            .map(|_| PgConnection::establish(&self.url))
            .collect::<Result<Vec<_>, _>>()?;
        let started = Instant::now();
        std::thread::scope(|s| {
            let workers: Vec<_> = connections
                .iter_mut()
                .enumerate()
                .map(|(t, conn)| {
                    s.spawn(move || -> diesel::QueryResult<()> {
                        for i in (t..self.messages).step_by(conns) {
                            let e = Self::event(i);
                            let msg_id = e.msg_id().expect("valid id");
                            conn.transaction(|c| {
                                diesel::sql_query(
                                    "INSERT INTO consumed_msg (consumer_group, msg_id) \
                                     VALUES ($1, $2) ON CONFLICT DO NOTHING",
                                )
                                .bind::<Text, _>(group)
                                .bind::<Text, _>(msg_id.as_str())
                                .execute(c)?;
                                credit(c, e.account)?;
                                Ok::<_, diesel::result::Error>(())
                            })?;
                        }
                        Ok(())
                    })
                })
                .collect();
            workers
                .into_iter()
                .try_for_each(|w| w.join().expect("worker panicked"))
        })?;
        Ok(self.messages as f64 / started.elapsed().as_secs_f64())
    }

    /// The consumer draining the stream as a new group: single mode, or batch mode with
    /// `batch` messages per transaction.
    async fn consumer(
        &self,
        in_flight: usize,
        batch: Option<usize>,
        group: &str,
    ) -> Result<f64, BoxError> {
        // r2d2 pings each connection on checkout by default (`SELECT 1`, one more round
        // trip per transaction); the plain loop does not, so neither does this pool.
        let pool = Pool::builder()
            .max_size(u32::try_from(in_flight)?)
            .test_on_check_out(false)
            .build(ConnectionManager::<PgConnection>::new(self.url.clone()))?;
        let config = ConsumerConfig {
            stream_prefix: self.prefix.clone(),
            max_in_flight: in_flight,
            batch_size: batch,
            block: Duration::from_millis(100),
            ..ConsumerConfig::default()
        };
        let consumer = Consumer::builder(self.redis_url.as_str(), group)
            .handle::<PointsEarned, _>(Award)
            .idempotency(PgInbox::new(pool))
            .config(config)
            .build()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let started = Instant::now();
        let running = {
            let consumer = consumer.clone();
            tokio::spawn(async move {
                consumer
                    .run_until(async {
                        stopped.await.ok();
                    })
                    .await
            })
        };
        let deadline = started + Duration::from_secs(300);
        loop {
            let stats = consumer.stats();
            if stats.consumed as usize >= self.messages {
                break;
            }
            if Instant::now() > deadline || stats.dead_lettered > 0 {
                return Err(format!("the consumer did not finish: {stats:?}").into());
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let elapsed = started.elapsed();
        let _ = stop.send(());
        running.await??;
        let stats = consumer.stats();
        if stats.failures > 0 || stats.duplicates > 0 {
            eprintln!("  note: {stats:?}");
        }
        Ok(self.messages as f64 / elapsed.as_secs_f64())
    }

    async fn cleanup(&self) {
        if let Ok(mut admin) = PgConnection::establish(&self.admin_url) {
            let _ = admin.batch_execute(&format!("DROP SCHEMA {} CASCADE", self.schema));
        }
        if let Ok(client) = redis::Client::open(self.redis_url.as_str())
            && let Ok(mut conn) = client.get_multiplexed_async_connection().await
        {
            let _: redis::RedisResult<i64> = redis::cmd("DEL")
                .arg(self.stream())
                .arg(format!("{}:dead", self.stream()))
                .query_async(&mut conn)
                .await;
        }
    }
}

/// A random number without another dependency: the standard library's hasher is
/// randomly keyed per process.
fn random_u64() -> u64 {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

async fn run(setup: &Setup, batch: usize) -> Result<(), BoxError> {
    let n = setup.messages;
    println!("consumer bench: {n} messages, PostgreSQL + Redis, batch size {batch}");
    let started = Instant::now();
    setup.publish().await?;
    println!(
        "published {n} messages in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let row = |what: &str, rate: f64| println!("{what:<44} {rate:>9.0} msg/s");

    let plain_1 = tokio::task::block_in_place(|| setup.plain_loop(1, "plain-1"))?;
    row("plain SQL loop, 1 connection", plain_1);
    let plain_8 = tokio::task::block_in_place(|| setup.plain_loop(CONCURRENCY, "plain-8"))?;
    row("plain SQL loop, 8 connections", plain_8);
    let single_1 = setup.consumer(1, None, "single-1").await?;
    row("consumer, single mode, 1 in flight", single_1);
    let single_8 = setup.consumer(CONCURRENCY, None, "single-8").await?;
    row("consumer, single mode, 8 in flight", single_8);
    let batch_1 = setup.consumer(1, Some(batch), "batch-1").await?;
    row("consumer, batch mode, 1 batch in flight", batch_1);
    let batch_8 = setup.consumer(CONCURRENCY, Some(batch), "batch-8").await?;
    row("consumer, batch mode, 8 batches in flight", batch_8);

    println!();
    let ratio = |what: &str, r: f64| println!("{what:<44} {r:>9.2}x");
    ratio(
        "single / plain, 1 connection (aim >= 0.8)",
        single_1 / plain_1,
    );
    ratio(
        "single / plain, 8 connections (aim >= 0.8)",
        single_8 / plain_8,
    );
    ratio(
        "batch / single, 1 connection (aim >= 2)",
        batch_1 / single_1,
    );
    ratio(
        "batch / single, 8 connections (aim >= 2)",
        batch_8 / single_8,
    );
    ratio("batch / plain, 1 connection", batch_1 / plain_1);
    ratio("batch / plain, 8 connections", batch_8 / plain_8);
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let messages = env_usize("BENCH_MESSAGES", 10_000).max(1);
    let batch = env_usize("BENCH_BATCH", 100).max(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let setup = Setup::new(messages)?;
        let result = run(&setup, batch).await;
        setup.cleanup().await;
        result
    })
}
