//! Run with: cargo run --release -p outbox-examples --bin relay_bench
//!
//! Measures the relay on PostgreSQL + Redis against baselines taken in the same run:
//!
//! 1. drain rate of a pure-SQL claim-and-mark loop (same batch size, no publishing);
//! 2. one relay into a sink that only counts, and into Redis (unordered and per-key
//!    ordered), and two relays at once;
//! 3. commit-to-XADD latency p50/p99 at a steady 1,000 messages/s with the LISTEN wake-up;
//! 4. resident memory while draining a large backlog.
//!
//! Options (environment): `BENCH_MESSAGES` (default 100000), `BENCH_BACKLOG` (default
//! 1000000; 0 skips the memory run), `BENCH_BATCH` (default 500), `DATABASE_URL`,
//! `REDIS_URL`. The machine is shared: compare the ratios, not the absolute figures.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection as _;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::{Connection as _, PgConnection, RunQueryDsl as _};
use outbox_core::{Error, PublishOutcomes, Publisher, Relay, RelayConfig, StoredMessage};
use outbox_diesel::{ClaimOrder, Emit as _, PgPool, PgRelayStore};
use outbox_examples::AccountTransferred;
use outbox_redis::{PublisherConfig, RedisPublisher};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const UNORDERED: ClaimOrder = ClaimOrder::Unordered;
const PER_KEY: ClaimOrder = ClaimOrder::PerKey;

/// What drains the outbox in a measured run.
enum Drain {
    /// The pure-SQL baseline.
    Sql,
    /// This many relays into this sink, claiming in this order.
    Relays(usize, Sink, ClaimOrder),
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Bench {
    url: String,
    pool: PgPool,
    redis_url: String,
    prefix: String,
    batch: usize,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let messages = env_usize("BENCH_MESSAGES", 100_000);
    let backlog = env_usize("BENCH_BACKLOG", 1_000_000);
    let batch = env_usize("BENCH_BATCH", 500);
    let base = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let schema = format!("relay_bench_{}", std::process::id());
    PgConnection::establish(&base)?.batch_execute(&format!("CREATE SCHEMA {schema}"))?;
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}options=-c%20search_path%3D{schema}");
    let pool = Pool::builder()
        .max_size(8)
        .build(ConnectionManager::<PgConnection>::new(&url))?;
    outbox_diesel::migrate(&mut *pool.get()?)?;
    let bench = Bench {
        url,
        pool,
        redis_url,
        prefix: format!("bench{}:", std::process::id()),
        batch,
    };

    let result = bench.run_all(messages, backlog).await;
    PgConnection::establish(&base)?.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))?;
    bench.clear_streams().await?;
    result
}

impl Bench {
    async fn run_all(&self, messages: usize, backlog: usize) -> Result<(), BoxError> {
        println!(
            "relay benchmark: {messages} messages, batches of {}, 1000 keys\n",
            self.batch
        );
        use Drain::{Relays, Sql};
        let sql = self
            .measure("pure-SQL claim-and-mark drain (baseline)", messages, Sql)
            .await?;
        let sink = self
            .measure(
                "relay → counting sink",
                messages,
                Relays(1, Sink::Count, UNORDERED),
            )
            .await?;
        let redis = self
            .measure(
                "relay → Redis, unordered",
                messages,
                Relays(1, Sink::Redis, UNORDERED),
            )
            .await?;
        let keyed = self
            .measure(
                "relay → Redis, per-key order",
                messages,
                Relays(1, Sink::Redis, PER_KEY),
            )
            .await?;
        let two = self
            .measure(
                "2 relays → Redis, unordered",
                messages,
                Relays(2, Sink::Redis, UNORDERED),
            )
            .await?;
        let two_keyed = self
            .measure(
                "2 relays → Redis, per-key order",
                messages,
                Relays(2, Sink::Redis, PER_KEY),
            )
            .await?;
        println!();
        println!(
            "relay → Redis / SQL drain:         {:.2}  (target ≥ 0.55)",
            redis / sql
        );
        println!("relay → counting sink / SQL drain: {:.2}", sink / sql);
        println!(
            "per-key / unordered, 1 relay:      {:.2}  (target ≥ 0.7)",
            keyed / redis
        );
        println!("per-key / unordered, 2 relays:     {:.2}", two_keyed / two);
        println!("2 relays / 1 relay, unordered:     {:.2}", two / redis);
        self.latency(1_000, Duration::from_secs(10)).await?;
        if backlog > 0 {
            self.memory(backlog).await?;
        }
        Ok(())
    }

    /// Fills the outbox with `n` NEW rows, runs `drain`, prints and returns messages/s.
    async fn measure(&self, name: &str, n: usize, drain: Drain) -> Result<f64, BoxError> {
        self.fill(n)?;
        self.clear_streams().await?;
        let started = Instant::now();
        match drain {
            Drain::Sql => self.sql_drain().await?,
            Drain::Relays(instances, sink, order) => self.relays(instances, sink, order).await?,
        }
        let secs = started.elapsed().as_secs_f64();
        let left = outbox_diesel::backlog(&mut *self.pool.get()?)?.due;
        assert_eq!(left, 0, "{name}: the drain left rows behind");
        let rate = n as f64 / secs;
        println!("{name:<42} {rate:>10.0} msg/s  ({secs:.2} s)");
        Ok(rate)
    }

    /// `n` NEW rows with ~200-byte payloads over 1000 keys, in one statement.
    fn fill(&self, n: usize) -> Result<(), BoxError> {
        let mut conn = self.pool.get()?;
        conn.batch_execute(&format!(
            "TRUNCATE outbox; \
             INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) \
             SELECT 't-' || g || ':AccountTransferred', 'account.transferred', 'AccountTransferred', \
                    'k' || (g % 1000), \
                    jsonb_build_object('transfer_id', 't-' || g, 'from', 'alice', 'to', 'bob', 'amount', g, \
                                       'memo', repeat('x', 120)) \
             FROM generate_series(1, {n}) g; \
             ANALYZE outbox;"
        ))?;
        Ok(())
    }

    /// The baseline: claim a batch with the relay's own query shape, mark it SENT, commit.
    async fn sql_drain(&self) -> Result<(), BoxError> {
        let pool = self.pool.clone();
        let batch = self.batch;
        tokio::task::spawn_blocking(move || -> Result<(), BoxError> {
            let mut conn = pool.get()?;
            loop {
                let claimed = conn.transaction(|c| {
                    let rows: Vec<ClaimedRow> = diesel::sql_query(format!(
                        "SELECT id, msg_id, topic, event_type, msg_key, payload::text AS payload, headers::text AS headers \
                         FROM outbox WHERE status = 0 AND next_retry_at <= now() \
                         ORDER BY id LIMIT {batch} FOR UPDATE SKIP LOCKED"
                    ))
                    .load(c)?;
                    let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
                    diesel::sql_query("UPDATE outbox SET status = 1, sent_at = now() WHERE id = ANY($1)")
                        .bind::<diesel::sql_types::Array<diesel::sql_types::BigInt>, _>(&ids)
                        .execute(c)?;
                    diesel::QueryResult::Ok(rows.len())
                })?;
                if claimed == 0 {
                    return Ok(());
                }
            }
        })
        .await?
    }

    fn store(&self, order: ClaimOrder) -> PgRelayStore {
        PgRelayStore::new(self.pool.clone())
            .with_listener(self.url.clone())
            .with_order(order)
    }

    fn redis(&self) -> Result<RedisPublisher, BoxError> {
        let config = PublisherConfig::default().with_stream_prefix(self.prefix.clone());
        Ok(RedisPublisher::new(self.redis_url.as_str())?.with_config(config)?)
    }

    fn config(&self) -> RelayConfig {
        RelayConfig::default()
            .with_batch_size(self.batch)
            .with_poll_interval(Duration::from_millis(200))
    }

    /// Runs `instances` relays until the backlog is empty.
    async fn relays(
        &self,
        instances: usize,
        sink: Sink,
        order: ClaimOrder,
    ) -> Result<(), BoxError> {
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..instances {
            let publisher = match sink {
                Sink::Count => AnyPublisher::Count(CountingSink::default()),
                Sink::Redis => AnyPublisher::Redis(Box::new(self.redis()?)),
            };
            let relay = Relay::new(self.store(order), publisher).with_config(self.config())?;
            tasks.spawn(async move {
                loop {
                    let report = relay.run_once().await?;
                    if report.claimed == 0 {
                        return Ok::<_, Error>(());
                    }
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done??;
        }
        Ok(())
    }

    /// Commit-to-XADD latency at a steady `rate` for `duration`: one event per
    /// transaction, the relay parked on LISTEN between bursts.
    async fn latency(&self, rate: u32, duration: Duration) -> Result<(), BoxError> {
        self.fill(0)?;
        let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let publisher = TimingPublisher {
            inner: self.redis()?,
            published: Arc::default(),
        };
        let published = Arc::clone(&publisher.published);
        let relay = Relay::new(self.store(PER_KEY), publisher).with_config(self.config())?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let relay_task =
            tokio::spawn(
                async move { relay.run_until(async { stopped.await.unwrap_or(()) }).await },
            );
        tokio::time::sleep(Duration::from_millis(300)).await; // let it park

        let total = (u64::from(rate) * duration.as_secs()) as usize;
        let pool = self.pool.clone();
        let log = Arc::clone(&committed);
        tokio::task::spawn_blocking(move || -> Result<(), BoxError> {
            let mut conn = pool.get()?;
            let period = Duration::from_secs(1) / rate;
            let start = Instant::now();
            for i in 0..total {
                let due = start + period * i as u32;
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                let e = AccountTransferred::new(&format!("lat-{i}"), "alice", "bob", 1);
                let id = conn.transaction(|c| c.emit(e))?;
                log.lock().unwrap().insert(id.into_string(), Instant::now());
            }
            Ok(())
        })
        .await??;
        let deadline = Instant::now() + Duration::from_secs(30);
        while published.lock().unwrap().len() < total && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = stop.send(());
        relay_task.await??;

        let committed = committed.lock().unwrap();
        let published = published.lock().unwrap();
        let mut lat: Vec<Duration> = committed
            .iter()
            .filter_map(|(id, c)| published.get(id).map(|p| p.saturating_duration_since(*c)))
            .collect();
        lat.sort();
        let pct = |p: f64| {
            lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
                .copied()
        };
        println!(
            "\ncommit → XADD at {rate}/s for {}s: {} of {total} published, p50 {:.2} ms, p99 {:.2} ms (targets 2 / 5 ms)",
            duration.as_secs(),
            lat.len(),
            pct(0.50).unwrap_or_default().as_secs_f64() * 1e3,
            pct(0.99).unwrap_or_default().as_secs_f64() * 1e3,
        );
        Ok(())
    }

    /// Resident memory while one relay drains `n` rows into Redis (trimmed streams).
    async fn memory(&self, n: usize) -> Result<(), BoxError> {
        self.fill(n)?;
        self.clear_streams().await?;
        let config = PublisherConfig::default()
            .with_stream_prefix(self.prefix.clone())
            .with_max_len(Some(100_000));
        let relay = Relay::new(
            self.store(PER_KEY),
            RedisPublisher::new(self.redis_url.as_str())?.with_config(config)?,
        )
        .with_config(self.config())?;
        let before = rss_kib();
        let peak = Arc::new(std::sync::atomic::AtomicU64::new(before));
        let sampler = {
            let peak = Arc::clone(&peak);
            tokio::spawn(async move {
                loop {
                    peak.fetch_max(rss_kib(), std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        };
        let started = Instant::now();
        loop {
            if relay.run_once().await?.claimed == 0 {
                break;
            }
        }
        sampler.abort();
        let secs = started.elapsed().as_secs_f64();
        println!(
            "\ndrained a {n}-row backlog into Redis in {secs:.1} s ({:.0} msg/s): RSS {} MiB before, peak {} MiB, after {} MiB",
            n as f64 / secs,
            before / 1024,
            peak.load(std::sync::atomic::Ordering::Relaxed) / 1024,
            rss_kib() / 1024,
        );
        Ok(())
    }

    async fn clear_streams(&self) -> Result<(), BoxError> {
        let mut conn = redis::Client::open(self.redis_url.as_str())?
            .get_multiplexed_async_connection()
            .await?;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.prefix))
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            let () = redis::cmd("DEL").arg(keys).query_async(&mut conn).await?;
        }
        Ok(())
    }
}

#[derive(diesel::QueryableByName)]
#[allow(dead_code)] // reason: loaded to cost what the relay's claim costs, never read
struct ClaimedRow {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: i64,
    #[diesel(sql_type = diesel::sql_types::Text)]
    msg_id: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    topic: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    event_type: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    msg_key: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    payload: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    headers: String,
}

#[derive(Clone, Copy)]
enum Sink {
    Count,
    Redis,
}

/// Takes every message and counts it: the relay's cost without a broker.
#[derive(Default)]
struct CountingSink {
    count: std::sync::atomic::AtomicU64,
}

enum AnyPublisher {
    Count(CountingSink),
    Redis(Box<RedisPublisher>),
}

impl Publisher for AnyPublisher {
    async fn publish(&self, batch: &[StoredMessage]) -> Result<PublishOutcomes, Error> {
        match self {
            Self::Count(sink) => {
                sink.count
                    .fetch_add(batch.len() as u64, std::sync::atomic::Ordering::Relaxed);
                Ok(vec![Ok(()); batch.len()])
            }
            Self::Redis(redis) => redis.publish(batch).await,
        }
    }
}

/// Notes when each message's XADD was acknowledged.
struct TimingPublisher {
    inner: RedisPublisher,
    published: Arc<Mutex<HashMap<String, Instant>>>,
}

impl Publisher for TimingPublisher {
    async fn publish(&self, batch: &[StoredMessage]) -> Result<PublishOutcomes, Error> {
        let outcomes = self.inner.publish(batch).await?;
        let now = Instant::now();
        let mut published = self.published.lock().unwrap();
        for (m, o) in batch.iter().zip(&outcomes) {
            if o.is_ok() {
                published
                    .entry(m.envelope.msg_id.to_string())
                    .or_insert(now);
            }
        }
        Ok(outcomes)
    }
}

/// This process's resident set size in KiB (Linux).
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}
