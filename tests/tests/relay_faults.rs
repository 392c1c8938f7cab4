//! The relay against Redis faults that hit part of a batch: a pipeline too large for
//! the response timeout, a server that runs out of memory in the middle of a pipeline,
//! a stream key of the wrong type, and durability waits (`WAIT`, `WAITAOF`) that are not
//! met. PostgreSQL outbox (`outbox-diesel`) → relay (`outbox-core`) → Redis
//! (`outbox-redis`), against the real services; each test has its own schema and stream
//! prefix, and a private `redis-server` where it changes the server's settings.
//!
//! What they assert: what Redis accepted is marked SENT and never published twice; what
//! it did not accept stays NEW without spending a retry; nothing is dead-lettered for a
//! fault of the server or of the stream; and once the fault is gone everything arrives,
//! each message once, in order per key.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use outbox_core::{BatchReport, OutageBackoff, OutboxEvent, Relay, RelayConfig, RetryPolicy};
use outbox_diesel::{ClaimOrder, Emit, EmitOptions, PgRelayStore};
use outbox_redis::redis::AsyncCommands as _;
use outbox_redis::redis::streams::StreamRangeReply;
use outbox_redis::{Durability, PublisherConfig, RedisPublisher};
use outbox_tests::{
    Isolated, ScratchRedis, ScratchSentinel, delete_keys_quietly, redis_conn, redis_url,
    spawn_until, unique_prefix,
};
use serde::{Deserialize, Serialize};

/// One step of an account's history, with a filler that sets the entry's size.
#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(key = account)]
struct Step {
    #[outbox(id)]
    id: String,
    account: String,
    seq: u32,
    filler: String,
}

/// Another topic, to show that a broken stream holds back only its own messages.
#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
struct Note {
    #[outbox(id)]
    id: String,
}

fn step(account: &str, seq: u32, size: usize) -> Step {
    Step {
        id: format!("{account}-{seq}"),
        account: account.to_owned(),
        seq,
        filler: "x".repeat(size),
    }
}

/// The longest any test waits for a condition.
const PATIENCE: Duration = Duration::from_secs(90);

/// A test's database and stream prefix.
struct Env {
    schema: Isolated,
    prefix: String,
    redis: String,
}

impl Env {
    fn with_redis(redis: String) -> Self {
        let schema = Isolated::postgres("e2e");
        let mut c = PgConnection::establish(&schema.url)
            .unwrap_or_else(|e| panic!("PostgreSQL unreachable at {}: {e}", schema.url));
        outbox_diesel::migrate(&mut c).unwrap();
        Self {
            schema,
            prefix: unique_prefix("relay_faults"),
            redis,
        }
    }

    fn conn(&self) -> PgConnection {
        PgConnection::establish(&self.schema.url).unwrap()
    }

    fn store(&self) -> PgRelayStore {
        let pool = Pool::builder()
            .max_size(2)
            .connection_timeout(Duration::from_secs(10))
            .build(ConnectionManager::new(self.schema.url.clone()))
            .unwrap();
        PgRelayStore::new(pool).with_order(ClaimOrder::PerKey)
    }

    fn emit(&self, events: impl IntoIterator<Item = Step>) {
        let options = EmitOptions::new().with_max_payload_bytes(4 << 20);
        self.conn()
            .transaction(|c| c.emit_all_with(&options, events).map(drop))
            .unwrap();
    }

    fn publisher_config(&self) -> PublisherConfig {
        PublisherConfig::default().with_stream_prefix(self.prefix.clone())
    }

    fn publisher(&self, config: PublisherConfig) -> RedisPublisher {
        RedisPublisher::new(self.redis.as_str())
            .unwrap()
            .with_config(config)
            .unwrap()
    }

    fn stream(&self) -> String {
        format!("{}step", self.prefix)
    }

    /// msg_ids on the step stream, in stream order.
    async fn entries(&self) -> Vec<String> {
        read_ids(&self.redis, &self.stream()).await
    }

    fn scalar(&self, sql: &str) -> i64 {
        #[derive(QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        diesel::sql_query(sql)
            .get_result::<N>(&mut self.conn())
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .n
    }

    /// (status, retries) per msg_id, in id order.
    fn rows(&self) -> Vec<(String, i16, i32)> {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = diesel::sql_types::Text)]
            msg_id: String,
            #[diesel(sql_type = diesel::sql_types::SmallInt)]
            status: i16,
            #[diesel(sql_type = diesel::sql_types::Integer)]
            retries: i32,
        }
        diesel::sql_query("SELECT msg_id, status, retries FROM outbox ORDER BY id")
            .load::<Row>(&mut self.conn())
            .unwrap()
            .into_iter()
            .map(|r| (r.msg_id, r.status, r.retries))
            .collect()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // This test's keys only.
        let keys = [self.stream(), format!("{}note", self.prefix)];
        delete_keys_quietly(&self.redis, &keys);
    }
}

async fn read_ids(url: &str, stream: &str) -> Vec<String> {
    let mut c = redis_conn(url).await;
    let mut out = Vec::new();
    let mut start = "-".to_owned();
    loop {
        let page: StreamRangeReply = c.xrange_count(stream, &start, "+", 100).await.unwrap();
        let Some(last) = page.ids.last() else { break };
        start = format!("({}", last.id);
        out.extend(page.ids.iter().map(|e| e.get::<String>("msg_id").unwrap()));
    }
    out
}

/// Retries that come back at once, so that a test sees quickly whether they are spent.
fn config(max_attempts: u32) -> RelayConfig {
    RelayConfig::default()
        .with_batch_size(100)
        .with_poll_interval(Duration::from_millis(100))
        .with_retry(
            RetryPolicy::default()
                .with_max_attempts(max_attempts)
                .with_base_delay(Duration::ZERO)
                .with_jitter(0.0),
        )
        .with_outage_backoff(
            OutageBackoff::default()
                .with_min(Duration::from_millis(20))
                .with_max(Duration::from_millis(200)),
        )
}

fn ids(account: &str, seqs: std::ops::Range<u32>) -> Vec<String> {
    seqs.map(|s| format!("{account}-{s}:Step")).collect()
}

/// One relay call that claims something. A batch that a failed call drops is unlocked
/// in the background, so a call right after it may find nothing to claim yet.
async fn run_claiming<S, P>(relay: &Relay<S, P>) -> Result<BatchReport, outbox_core::Error>
where
    S: outbox_core::RelayStore,
    P: outbox_core::Publisher,
{
    let deadline = Instant::now() + PATIENCE;
    loop {
        match relay.run_once().await {
            Ok(report) if report.claimed == 0 => {
                assert!(Instant::now() < deadline, "no row became claimable");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => return other,
        }
    }
}

/// A TCP proxy in front of Redis whose client-to-server direction carries at most
/// `bytes_per_sec`: a slow link, on which a large pipeline takes longer than the
/// response timeout while a small one does not. Dropping it stops accepting; open
/// connections end with their client.
struct SlowLink {
    port: u16,
    stop: Arc<AtomicBool>,
}

impl SlowLink {
    fn to(upstream: &str, bytes_per_sec: u64) -> Self {
        let upstream = upstream
            .trim_start_matches("redis://")
            .trim_end_matches('/')
            .to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        client.set_nonblocking(false).unwrap();
                        let server = TcpStream::connect(&upstream).unwrap();
                        Self::pipe(client, server, bytes_per_sec);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Self { port, stop }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn pipe(client: TcpStream, server: TcpStream, bytes_per_sec: u64) {
        let (mut c_read, mut c_write) = (client.try_clone().unwrap(), client);
        let (mut s_read, mut s_write) = (server.try_clone().unwrap(), server);
        std::thread::spawn(move || {
            let started = Instant::now();
            let mut sent = 0u64;
            let mut buf = [0u8; 8192];
            while let Ok(n) = c_read.read(&mut buf) {
                if n == 0 || s_write.write_all(&buf[..n]).is_err() {
                    break;
                }
                sent += n as u64;
                let due = Duration::from_secs_f64(sent as f64 / bytes_per_sec as f64);
                if let Some(ahead) = due.checked_sub(started.elapsed()) {
                    std::thread::sleep(ahead);
                }
            }
            let _ = s_write.shutdown(Shutdown::Both);
            let _ = c_read.shutdown(Shutdown::Both);
        });
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n) = s_read.read(&mut buf) {
                // A client that went away (it timed out) ends the connection, so that
                // what it had not sent yet never reaches Redis.
                if n == 0 || c_write.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = c_write.shutdown(Shutdown::Both);
            let _ = s_read.shutdown(Shutdown::Both);
        });
    }
}

impl Drop for SlowLink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Waits until no row is NEW, running `relay` meanwhile; panics after [`PATIENCE`].
async fn drain<S, P>(env: &Env, relay: Relay<S, P>) -> Result<(), outbox_core::Error>
where
    S: outbox_core::RelayStore + 'static,
    P: outbox_core::Publisher + 'static,
{
    let (stop, task) = spawn_until(move |stop| async move { relay.run_until(stop).await });
    let deadline = Instant::now() + PATIENCE;
    while env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE status = 0") > 0 {
        assert!(
            Instant::now() < deadline,
            "the outbox did not drain within {PATIENCE:?}: {} rows NEW",
            env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE status = 0")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    tokio::time::timeout(PATIENCE, task)
        .await
        .expect("the relay stops on its signal")
        .unwrap()
}

/// Item 3 of issue 8: a batch that cannot cross the link within the response timeout in
/// one pipeline used to time out on every attempt, forever, while its partial XADDs piled
/// up on the stream. Pipelines are now capped by bytes, what a timed-out call had
/// accepted before is recorded, and the cap shrinks after a timeout: the batch gets
/// through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_too_large_for_the_response_timeout_gets_through_in_smaller_pipelines() {
    let scratch = ScratchRedis::start();
    let link = SlowLink::to(&scratch.url(), 2 << 20); // 2 MiB/s
    let env = Env::with_redis(scratch.url());
    // 24 entries of 256 KiB: 6 MiB, three seconds on the link; the timeout is one second.
    env.emit((0..24).map(|seq| step("acct", seq, 256 << 10)));
    let publisher = RedisPublisher::new(link.url().as_str())
        .unwrap()
        .with_config(
            env.publisher_config()
                .with_response_timeout(Duration::from_secs(1)),
        )
        .unwrap();
    let relay = Relay::new(env.store(), publisher)
        .with_config(config(3))
        .unwrap();
    drain(&env, relay).await.unwrap();

    let rows = env.rows();
    assert!(
        rows.iter()
            .all(|(_, status, retries)| (*status, *retries) == (1, 0)),
        "all SENT, no retry spent: {rows:?}"
    );
    let mut entries = env.entries().await;
    entries.sort_unstable();
    entries.dedup();
    let mut want = ids("acct", 0..24);
    want.sort_unstable();
    assert_eq!(entries, want, "every message reached the stream");
}

/// The same link and batch with pipelines capped at 512 KiB: each pipeline crosses the
/// link well within the timeout, so the batch goes through in one relay call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelines_capped_by_bytes_fit_the_response_timeout() {
    let scratch = ScratchRedis::start();
    let link = SlowLink::to(&scratch.url(), 2 << 20);
    let env = Env::with_redis(scratch.url());
    env.emit((0..24).map(|seq| step("acct", seq, 256 << 10)));
    let publisher = RedisPublisher::new(link.url().as_str())
        .unwrap()
        .with_config(
            env.publisher_config()
                .with_response_timeout(Duration::from_secs(1))
                .with_max_pipeline_bytes(512 << 10),
        )
        .unwrap();
    let relay = Relay::new(env.store(), publisher)
        .with_config(config(3))
        .unwrap();
    let report = run_claiming(&relay).await.unwrap();
    assert_eq!((report.claimed, report.sent), (24, 24));
    assert_eq!(
        env.entries().await,
        ids("acct", 0..24),
        "each once, in order"
    );
}

/// The used memory of a server, from `INFO memory`.
async fn used_memory(c: &mut outbox_redis::redis::aio::MultiplexedConnection) -> u64 {
    let info: String = outbox_redis::redis::cmd("INFO")
        .arg("memory")
        .query_async(c)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory in INFO memory")
}

async fn config_set(
    c: &mut outbox_redis::redis::aio::MultiplexedConnection,
    name: &str,
    value: &str,
) {
    let _: () = outbox_redis::redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query_async(c)
        .await
        .unwrap();
}

/// Item 4 of issue 8: Redis runs out of memory in the middle of a pipeline. The entries
/// it accepted are SENT (publishing them again would duplicate them and break the key's
/// order), the rest stay NEW without spending a retry, and the relay backs off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_in_the_middle_of_a_pipeline_records_what_redis_accepted() {
    let scratch = ScratchRedis::start();
    let env = Env::with_redis(scratch.url());
    let mut admin = redis_conn(&scratch.url()).await;
    config_set(&mut admin, "maxmemory-policy", "noeviction").await;
    let limit = used_memory(&mut admin).await + 400_000;
    config_set(&mut admin, "maxmemory", &limit.to_string()).await;
    // 40 entries of 32 KiB, one key: about a third fits under the limit.
    env.emit((0..40).map(|seq| step("acct", seq, 32 << 10)));
    let relay = Relay::new(env.store(), env.publisher(env.publisher_config()))
        .with_config(config(1))
        .unwrap();

    let err = run_claiming(&relay).await.unwrap_err();
    assert!(err.is_outage(), "out of memory is an outage: {err}");
    let rows = env.rows();
    let sent = rows.iter().filter(|(_, status, _)| *status == 1).count();
    assert!(
        sent > 0 && sent < 40,
        "Redis took part of the pipeline, and that part is SENT: {sent} of 40"
    );
    for (i, (msg_id, status, retries)) in rows.iter().enumerate() {
        let want = if i < sent { 1 } else { 0 };
        assert_eq!(
            (*status, *retries),
            (want, 0),
            "{msg_id}: SENT prefix, then NEW, no retry"
        );
    }
    assert_eq!(
        env.entries().await,
        ids("acct", 0..sent as u32),
        "the stream holds the SENT rows"
    );

    // A second attempt while memory is still short publishes nothing and spends nothing.
    assert!(run_claiming(&relay).await.unwrap_err().is_outage());
    assert_eq!(
        env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE retries > 0 OR status = 2"),
        0
    );

    config_set(&mut admin, "maxmemory", "0").await;
    let report = run_claiming(&relay).await.unwrap();
    assert_eq!(report.sent, 40 - sent);
    assert_eq!(
        env.entries().await,
        ids("acct", 0..40),
        "each message once, in order: nothing accepted was published again"
    );
}

/// Item 9 of issue 8: a key of another type at the stream's name refuses every entry of
/// that topic (`WRONGTYPE`). That is a fault of the stream, not of the messages: it used
/// to walk every message of the topic to DEAD. They now stay NEW with their retries
/// untouched, other topics go on, the relay backs off (and logs an error), and once the
/// key is gone everything is published in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_key_of_the_wrong_type_backs_off_without_spending_retries() {
    let env = Env::with_redis(redis_url());
    let mut c = redis_conn(&env.redis).await;
    let _: () = c.set(env.stream(), "not a stream").await.unwrap();
    env.emit((0..5).map(|seq| step("acct", seq, 10)));
    env.conn()
        .transaction(|c| c.emit(Note { id: "n1".into() }).map(drop))
        .unwrap();
    let relay = Relay::new(env.store(), env.publisher(env.publisher_config()))
        .with_config(config(2))
        .unwrap();

    for attempt in 0..4 {
        let err = run_claiming(&relay).await.unwrap_err();
        assert!(err.is_outage(), "attempt {attempt}: backs off: {err}");
        assert!(
            outbox_core::error_chain(&err)
                .to_string()
                .contains("WRONGTYPE"),
            "{err}"
        );
    }
    assert_eq!(
        env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE status = 2"),
        0,
        "no DEAD row"
    );
    assert_eq!(
        env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE status = 0 AND retries = 0"),
        5,
        "the step rows stay NEW, no retry spent"
    );
    let notes = read_ids(&env.redis, &format!("{}note", env.prefix)).await;
    assert_eq!(notes, ["n1:Note"], "another topic is not held back");

    let _: () = c.del(env.stream()).await.unwrap();
    let report = run_claiming(&relay).await.unwrap();
    assert_eq!(report.sent, 5);
    assert_eq!(env.entries().await, ids("acct", 0..5));
}

/// Item 11 of issue 8: with `Durability::Replicas`, a row is SENT only once the replicas
/// acknowledged it. `WAIT 1` on a Redis without replicas is not met: the rows stay NEW
/// without spending a retry (they would be DEAD after one with `max_attempts = 1`), and
/// with a wait that can be met they are published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmet_replica_wait_marks_nothing_sent_and_spends_no_retry() {
    let env = Env::with_redis(redis_url());
    env.emit((0..3).map(|seq| step("acct", seq, 10)));
    let waiting_for = |replicas| {
        env.publisher(
            env.publisher_config()
                .with_durability(Durability::Replicas {
                    replicas,
                    timeout: Duration::from_millis(50),
                }),
        )
    };
    let relay = Relay::new(env.store(), waiting_for(1))
        .with_config(config(1))
        .unwrap();
    for _ in 0..3 {
        let err = run_claiming(&relay).await.unwrap_err();
        assert!(err.is_outage(), "{err}");
    }
    assert_eq!(
        env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE status = 0 AND retries = 0"),
        3,
        "NEW, no retry spent"
    );
    let relay = Relay::new(env.store(), waiting_for(0))
        .with_config(config(1))
        .unwrap();
    assert_eq!(run_claiming(&relay).await.unwrap().sent, 3);
}

/// Issue 34 §7: `Durability::Replicas { replicas: 1, timeout: 1 s }` on a primary whose
/// only replica was SIGKILLed (the primary and replica of a `ScratchSentinel`; the
/// sentinels see no failover to make). Every `WAIT` is unmet, an outage: the rows stay
/// NEW. The relay used to append the same batch again at each try, one per backoff, for
/// as long as no replica came back; now one unmet wait appends at most one batch and the
/// tries after it write nothing until the replicas have caught up. The state is held for
/// longer than every backoff; once a replica is back every message is on the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_replica_left_an_unmet_wait_appends_its_batch_once() {
    const BATCH: usize = 50;
    const HOLD: Duration = Duration::from_secs(130);
    let mut servers = tokio::task::block_in_place(ScratchSentinel::start);
    let [primary, replica] = servers.data_ports();
    let env = Env::with_redis(format!("redis://127.0.0.1:{primary}"));
    let publisher = env.publisher(
        env.publisher_config()
            .with_durability(Durability::Replicas {
                replicas: 1,
                timeout: Duration::from_secs(1),
            }),
    );
    // The default outage backoff (up to 5 s): the pace of a relay in production.
    let relay = Relay::new(env.store(), publisher)
        .with_config(RelayConfig::default().with_batch_size(BATCH))
        .unwrap();
    let (stop, task) = spawn_until(move |stop| async move { relay.run_until(stop).await });
    let steps =
        |seqs: std::ops::Range<u32>| seqs.map(|seq| step(&format!("acct{}", seq % 4), seq, 10));
    let new_rows = || env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE status = 0");
    let mut admin = redis_conn(&env.redis).await;
    env.emit(steps(0..100));
    let deadline = Instant::now() + PATIENCE;
    while new_rows() > 0 {
        assert!(
            Instant::now() < deadline,
            "the first 100 were not published"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let len: usize = admin.xlen(env.stream()).await.unwrap();
    assert_eq!(len, 100);

    servers.kill(1);
    env.emit(steps(100..300));
    let until = Instant::now() + HOLD;
    let mut longest = 0;
    while Instant::now() < until {
        let len: usize = admin.xlen(env.stream()).await.unwrap();
        longest = longest.max(len);
        assert!(
            len <= 100 + BATCH,
            "{len} entries for the 100 published and 200 waiting: without a replica the \
             relay appends what it already appended"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert_eq!(new_rows(), 200, "an unmet wait publishes nothing");
    assert_eq!(
        env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE retries > 0 OR status = 2"),
        0,
        "an outage spends no retry"
    );

    tokio::task::block_in_place(|| {
        servers.start_data(1, Some(primary), "");
        servers.wait_replica_synced(replica, primary);
    });
    let deadline = Instant::now() + PATIENCE;
    while new_rows() > 0 {
        assert!(
            Instant::now() < deadline,
            "not published once a replica is back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    task.await.unwrap().unwrap();
    let entries = env.entries().await;
    eprintln!(
        "no replica for {HOLD:?}: at most {longest} entries; after: {} for 300 messages",
        entries.len()
    );
    let distinct: std::collections::BTreeSet<&String> = entries.iter().collect();
    let all: std::collections::BTreeSet<String> = (0..300)
        .map(|seq| format!("acct{}-{seq}:Step", seq % 4))
        .collect();
    assert_eq!(
        distinct,
        all.iter().collect(),
        "every message on the stream"
    );
    assert!(
        entries.len() <= 300 + BATCH,
        "{} entries for 300 messages: at most the one batch of the unmet wait twice",
        entries.len()
    );
}

/// `Durability::Aof` on a Redis before 7.2 (no `WAITAOF`) stops the relay with a
/// configuration error before anything is written; the rows stay NEW.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waitaof_on_a_redis_without_it_stops_the_relay_with_a_config_error() {
    let env = Env::with_redis(redis_url());
    env.emit((0..3).map(|seq| step("acct", seq, 10)));
    let publisher = env.publisher(env.publisher_config().with_durability(Durability::Aof {
        local: false,
        replicas: 0,
        timeout: Duration::from_millis(100),
    }));
    let relay = Relay::new(env.store(), publisher)
        .with_config(config(1))
        .unwrap();
    let run = tokio::time::timeout(PATIENCE, relay.run_until(std::future::pending()))
        .await
        .expect("the relay stops by itself");
    let err = run.unwrap_err();
    assert!(matches!(err, outbox_core::Error::Config(_)), "{err:?}");
    assert!(err.to_string().contains("WAITAOF"), "{err}");
    assert_eq!(
        env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE status = 0 AND retries = 0"),
        3
    );
    assert!(env.entries().await.is_empty(), "nothing written");
}
