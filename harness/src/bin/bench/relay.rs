//! The relay on PostgreSQL + Redis (or NATS JetStream): drain rates against a pure-SQL
//! drain, commit→XADD latency, resident memory over a large backlog.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection as _;
use diesel::{Connection as _, PgConnection, RunQueryDsl as _};
use outbox_core::{
    Error, OutboxEvent as _, PublishOutcomes, Publisher, Relay, RelayConfig, StoredMessage,
};
use outbox_diesel::{ClaimOrder, Emit as _, PartitionPolicy, PgRelayStore};
use outbox_examples::AccountTransferred;
use outbox_nats::async_nats;
use outbox_redis::{PublisherConfig, RedisPublisher};

use crate::{BoxError, Service};

/// Where a measured relay publishes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sink {
    /// Takes every message and counts it: the relay's cost without a broker.
    Count,
    Redis,
    /// NATS JetStream (`NATS_URL`, default the local server): a stream of the bench's
    /// own, deleted before each run so that the duplicate window drops nothing.
    Nats,
}

pub(crate) struct RelayBench {
    svc: Service,
    url: String,
    schema: String,
    prefix: String,
    conn: Mutex<PgConnection>,
    /// A client that connects in the background: parts without NATS never wait on it.
    nats: async_nats::Client,
    /// The stream and subject prefixes of the NATS runs.
    naming: outbox_nats::Naming,
}

impl RelayBench {
    pub(crate) async fn new(svc: &Service) -> Result<Self, BoxError> {
        Self::with_layout(svc, false).await
    }

    /// On the partitioned layout if `partitioned` (`migrate_partitioned`, default policy).
    pub(crate) async fn with_layout(svc: &Service, partitioned: bool) -> Result<Self, BoxError> {
        Self::with_policy(svc, partitioned.then(PartitionPolicy::default)).await
    }

    /// On the partitioned layout with `policy`, or on the unpartitioned one.
    pub(crate) async fn with_policy(
        svc: &Service,
        policy: Option<PartitionPolicy>,
    ) -> Result<Self, BoxError> {
        let layout = if policy.is_some() { "_parted" } else { "" };
        let schema = format!("bench_relay_{}{layout}", std::process::id());
        let url = svc.schema(&schema)?;
        let mut conn = PgConnection::establish(&url)?;
        match &policy {
            Some(policy) => drop(outbox_diesel::migrate_partitioned(&mut conn, policy)?),
            None => outbox_diesel::migrate(&mut conn)?,
        }
        let bench = Self {
            svc: svc.clone(),
            url,
            schema,
            prefix: format!("bench{}:", std::process::id()),
            conn: Mutex::new(conn),
            nats: async_nats::ConnectOptions::new()
                .retry_on_initial_connect()
                .connect(outbox_tests::nats_url())
                .await?,
            naming: outbox_nats::Naming::new(
                format!("bench{}", std::process::id()),
                format!("BENCH{}_", std::process::id()),
            )?,
        };
        bench.clear_streams().await?;
        Ok(bench)
    }

    pub(crate) async fn cleanup(&self) {
        self.svc.drop_schema(&self.schema);
        let _ = self.clear_streams().await;
        let _ = self.clear_nats().await;
    }

    /// `n` NEW rows with ~200-byte payloads over `keys` keys, in one statement.
    ///
    /// Without triggers (`session_replication_role = replica`): on the partitioned layout
    /// the msg_id trigger would take one lock per row until commit, more than the
    /// server's lock table holds at this size; the ids are unique by construction.
    pub(crate) fn fill(&self, n: usize, keys: usize) -> Result<(), BoxError> {
        self.conn.lock().unwrap().batch_execute(&format!(
            "TRUNCATE outbox; SET session_replication_role = replica; \
             INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) \
             SELECT 't-' || g || ':AccountTransferred', 'account.transferred', 'AccountTransferred', \
                    'k' || (g % {keys}), \
                    jsonb_build_object('transfer_id', 't-' || g, 'from', 'alice', 'to', 'bob', 'amount', g, \
                                       'memo', repeat('x', 120)) \
             FROM generate_series(1, {n}) g; \
             RESET session_replication_role; ANALYZE outbox; CHECKPOINT;"
        ))?;
        Ok(())
    }

    /// The database URL of the bench's schema.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// Runs `sql` on the bench's connection.
    pub(crate) fn exec(&self, sql: &str) -> Result<(), BoxError> {
        self.conn.lock().unwrap().batch_execute(sql)?;
        Ok(())
    }

    /// A number `sql` selects as `n` on the bench's connection.
    pub(crate) fn scalar(&self, sql: &str) -> Result<i64, BoxError> {
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        Ok(diesel::sql_query(sql)
            .get_result::<N>(&mut *self.conn.lock().unwrap())?
            .n)
    }

    fn due(&self) -> Result<u64, BoxError> {
        Ok(outbox_diesel::backlog(&mut *self.conn.lock().unwrap())?.due)
    }

    /// The baseline: one connection claims a batch with the relay's unordered claim
    /// shape in the relay's transaction (its `BEGIN`: no wait for the WAL flush at
    /// commit), marks it SENT and commits, until nothing is left. Messages/s.
    pub(crate) async fn sql_drain(&self, n: usize, batch: usize) -> Result<f64, BoxError> {
        let url = self.url.clone();
        let started = Instant::now();
        tokio::task::spawn_blocking(move || -> Result<(), BoxError> {
            let mut conn = PgConnection::establish(&url)?;
            loop {
                // The relay's BEGIN (its isolation, commit and planner settings).
                outbox_diesel::__private::begin_claim(&mut conn, Duration::ZERO)?;
                let rows: Vec<ClaimedRow> = diesel::sql_query(format!(
                    "SELECT id, msg_id, topic, event_type, msg_key, payload::text AS payload, headers::text AS headers \
                     FROM outbox WHERE status = 0 AND next_retry_at <= now() \
                     ORDER BY id LIMIT {batch} FOR UPDATE SKIP LOCKED"
                ))
                .load(&mut conn)?;
                // The mark and the COMMIT in one round trip, as the relay sends them.
                let ids: Vec<String> = rows.iter().map(|r| r.id.to_string()).collect();
                conn.batch_execute(&format!(
                    "UPDATE outbox SET status = 1, sent_at = now() WHERE status = 0 \
                     AND id = ANY('{{{}}}'::int8[]); COMMIT",
                    ids.join(",")
                ))?;
                let claimed = rows.len();
                if claimed == 0 {
                    return Ok(());
                }
            }
        })
        .await??;
        let rate = n as f64 / started.elapsed().as_secs_f64();
        self.check_drained()?;
        Ok(rate)
    }

    fn check_drained(&self) -> Result<(), BoxError> {
        match self.due()? {
            0 => Ok(()),
            left => Err(format!("the drain left {left} rows behind").into()),
        }
    }

    pub(crate) fn publisher(
        &self,
        sink: Sink,
        max_len: Option<usize>,
    ) -> Result<AnyPublisher, BoxError> {
        Ok(match sink {
            Sink::Count => AnyPublisher::Count,
            Sink::Redis => AnyPublisher::Redis(Box::new(
                RedisPublisher::new(self.svc.redis_url.as_str())?.with_config(
                    PublisherConfig::default()
                        .with_stream_prefix(self.prefix.clone())
                        .with_max_len(max_len),
                )?,
            )),
            Sink::Nats => AnyPublisher::Nats(Box::new(outbox_nats::NatsPublisher::new(
                self.nats.clone(),
                outbox_nats::PublisherConfig::default().with_naming(self.naming.clone()),
            )?)),
        })
    }

    /// The relay's configuration in the bench: `batch` per claim, polled every 200 ms.
    pub(crate) fn config(batch: usize) -> RelayConfig {
        RelayConfig::default()
            .with_batch_size(batch)
            .with_poll_interval(Duration::from_millis(200))
    }

    /// `instances` relays as a user runs them (`PgRelayStore::connect`, `run_until`)
    /// drain the `n` rows in the table. Messages/s.
    pub(crate) async fn relays(
        &self,
        n: usize,
        instances: usize,
        sink: Sink,
        order: ClaimOrder,
        batch: usize,
    ) -> Result<f64, BoxError> {
        self.clear_streams().await?;
        if sink == Sink::Nats {
            self.clear_nats().await?;
        }
        let published = Arc::new(AtomicUsize::new(0));
        let mut relays = Vec::new();
        for _ in 0..instances {
            let url = self.url.clone();
            let store = tokio::task::spawn_blocking(move || PgRelayStore::connect(&url, 2))
                .await??
                .with_order(order);
            let publisher = Counted {
                inner: self.publisher(sink, None)?,
                published: Arc::clone(&published),
            };
            relays.push(Relay::new(store, publisher).with_config(Self::config(batch))?);
        }
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for relay in relays {
            let mut stopped = stopped.clone();
            tasks.spawn(async move {
                relay
                    .run_until(async move {
                        let _ = stopped.wait_for(|s| *s).await;
                    })
                    .await
            });
        }
        let deadline = started + Duration::from_secs(600);
        while published.load(Ordering::Relaxed) < n {
            if Instant::now() > deadline {
                return Err("the relays did not drain the outbox in 10 minutes".into());
            }
            if tasks.len() < instances {
                break; // a relay stopped: its error is reported below
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let _ = stop.send(true);
        while let Some(done) = tasks.join_next().await {
            done??;
        }
        let rate = n as f64 / started.elapsed().as_secs_f64();
        self.check_drained()?;
        Ok(rate)
    }

    /// Commit-to-XADD latency at a steady `rate` for `duration`: one event per
    /// transaction, one relay with the LISTEN wake-up, parked between messages.
    /// Milliseconds, one per message.
    pub(crate) async fn latency(
        &self,
        rate: u32,
        duration: Duration,
    ) -> Result<Vec<f64>, BoxError> {
        self.fill(0, 1)?;
        self.clear_streams().await?;
        let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let publisher = TimingPublisher::new(self.publisher(Sink::Redis, None)?);
        let published = Arc::clone(&publisher.published);
        let url = self.url.clone();
        let store = tokio::task::spawn_blocking(move || PgRelayStore::connect(&url, 2)).await??;
        let relay = Relay::new(store, publisher).with_config(Self::config(500))?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let relay_task =
            tokio::spawn(
                async move { relay.run_until(async { stopped.await.unwrap_or(()) }).await },
            );
        tokio::time::sleep(Duration::from_millis(300)).await; // let it park

        let total = (f64::from(rate) * duration.as_secs_f64()) as usize;
        let url = self.url.clone();
        let log = Arc::clone(&committed);
        tokio::task::spawn_blocking(move || -> Result<(), BoxError> {
            let mut conn = PgConnection::establish(&url)?;
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
        let mut lat: Vec<f64> = committed
            .iter()
            .filter_map(|(id, c)| {
                published
                    .get(id)
                    .map(|p| p.saturating_duration_since(*c).as_secs_f64() * 1e3)
            })
            .collect();
        if lat.len() < total {
            return Err(format!("{} of {total} messages published", lat.len()).into());
        }
        lat.sort_by(f64::total_cmp);
        Ok(lat)
    }

    /// Resident memory (KiB) before, at the peak and after one relay drains `n` rows
    /// into Redis (trimmed streams), and the drain rate.
    pub(crate) async fn memory(&self, n: usize) -> Result<(u64, u64, u64, f64), BoxError> {
        self.fill(n, 1000)?;
        self.clear_streams().await?;
        let before = rss_kib();
        let peak = Arc::new(AtomicU64::new(before));
        let sampler = {
            let peak = Arc::clone(&peak);
            tokio::spawn(async move {
                loop {
                    peak.fetch_max(rss_kib(), Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        };
        let published = Arc::new(AtomicUsize::new(0));
        let url = self.url.clone();
        let store = tokio::task::spawn_blocking(move || PgRelayStore::connect(&url, 2)).await??;
        let relay = Relay::new(
            store,
            Counted {
                inner: self.publisher(Sink::Redis, Some(100_000))?,
                published: Arc::clone(&published),
            },
        )
        .with_config(Self::config(500))?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let started = Instant::now();
        let task = tokio::spawn(async move {
            let mut stopped = stopped;
            relay
                .run_until(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
        });
        while published.load(Ordering::Relaxed) < n && !task.is_finished() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = stop.send(true);
        task.await??;
        let rate = n as f64 / started.elapsed().as_secs_f64();
        sampler.abort();
        self.check_drained()?;
        Ok((before, peak.load(Ordering::Relaxed), rss_kib(), rate))
    }

    /// Deletes the NATS stream of the bench's topic, if there: a run publishes the
    /// msg_ids of the last again, which the duplicate window would drop.
    async fn clear_nats(&self) -> Result<(), BoxError> {
        let js = async_nats::jetstream::new(self.nats.clone());
        let stream = self.naming.stream(AccountTransferred::TOPICS[0]);
        match js.delete_stream(&stream).await {
            Ok(_) => Ok(()),
            Err(e) if e.to_string().contains("not found") => Ok(()),
            Err(e) => Err(format!("delete stream {stream}: {e}").into()),
        }
    }

    async fn clear_streams(&self) -> Result<(), BoxError> {
        let mut conn = redis::Client::open(self.svc.redis_url.as_str())?
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

pub(crate) enum AnyPublisher {
    Count,
    Redis(Box<RedisPublisher>),
    Nats(Box<outbox_nats::NatsPublisher>),
}

impl Publisher for AnyPublisher {
    async fn publish(&self, batch: &[StoredMessage]) -> Result<PublishOutcomes, Error> {
        match self {
            Self::Count => Ok(vec![Ok(()); batch.len()]),
            Self::Redis(redis) => redis.publish(batch).await,
            Self::Nats(nats) => nats.publish(batch).await,
        }
    }
}

/// Counts what its publisher took, so that the run knows when the outbox is drained.
struct Counted {
    inner: AnyPublisher,
    published: Arc<AtomicUsize>,
}

impl Publisher for Counted {
    async fn publish(&self, batch: &[StoredMessage]) -> Result<PublishOutcomes, Error> {
        let outcomes = self.inner.publish(batch).await?;
        let ok = outcomes.iter().filter(|o| o.is_ok()).count();
        self.published.fetch_add(ok, Ordering::Relaxed);
        Ok(outcomes)
    }
}

/// Notes when each message's XADD was acknowledged.
pub(crate) struct TimingPublisher {
    inner: AnyPublisher,
    pub(crate) published: Arc<Mutex<HashMap<String, Instant>>>,
}

impl TimingPublisher {
    pub(crate) fn new(inner: AnyPublisher) -> Self {
        Self {
            inner,
            published: Arc::default(),
        }
    }
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
