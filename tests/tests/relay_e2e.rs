//! The relay end to end: PostgreSQL outbox (`outbox-diesel`) → relay (`outbox-core`) →
//! Redis Streams (`outbox-redis`), against the real services. Each test has its own
//! PostgreSQL schema and its own stream prefix, so they run in parallel; a service that
//! is down fails them.
//!
//! What they assert: every committed message arrives exactly once and rolled-back ones
//! never do; several relay instances keep each key in order and lose nothing when one is
//! killed; random broker failures and a broker outage delay but lose, reorder and kill
//! nothing; the NOTIFY path beats the poll interval; a key waits behind its retrying
//! message while other keys go on.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use outbox_core::{
    Error, FailAs, FlakyPublisher, OutageBackoff, OutboxEvent, PublishOutcomes, Publisher,
    Rejected, Relay, RelayConfig, RetryPolicy, StoredMessage,
};
use outbox_diesel::{ClaimOrder, Emit, EmitOptions, PgPool, PgRelayStore};
use outbox_redis::redis::AsyncCommands as _;
use outbox_redis::redis::streams::StreamRangeReply;
use outbox_redis::{PublisherConfig, RedisPublisher};
use outbox_tests::{
    Isolated, ScratchRedis, delete_keys_quietly, eventually_within, redis_conn, redis_url,
    spawn_until, unique_prefix,
};
use serde::{Deserialize, Serialize};

/// One step of an account's history: `seq` counts per account from 0.
#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(key = account)]
struct Step {
    #[outbox(id)]
    id: String,
    account: String,
    seq: u32,
}

fn step(account: &str, seq: u32) -> Step {
    Step {
        id: format!("{account}-{seq}"),
        account: account.to_owned(),
        seq,
    }
}

/// The longest any test waits for a condition.
const PATIENCE: Duration = Duration::from_secs(60);

/// A test's database and stream.
struct Env {
    schema: Isolated,
    prefix: String,
    redis: String,
}

impl Env {
    fn new() -> Self {
        Self::with_redis(redis_url())
    }

    fn with_redis(redis: String) -> Self {
        let schema = Isolated::postgres("e2e");
        let mut c = PgConnection::establish(&schema.url)
            .unwrap_or_else(|e| panic!("PostgreSQL unreachable at {}: {e}", schema.url));
        outbox_diesel::migrate(&mut c).unwrap();
        Self {
            schema,
            prefix: unique_prefix("relay_e2e"),
            redis,
        }
    }

    fn conn(&self) -> PgConnection {
        PgConnection::establish(&self.schema.url).unwrap()
    }

    fn pool(&self, size: u32) -> PgPool {
        Pool::builder()
            .max_size(size)
            .connection_timeout(Duration::from_secs(10))
            .build(ConnectionManager::new(self.schema.url.clone()))
            .unwrap()
    }

    /// A relay store of its own (its own pool and LISTEN connection), as a separate
    /// relay process would have.
    fn store(&self, order: ClaimOrder) -> PgRelayStore {
        PgRelayStore::new(self.pool(2))
            .with_listener(self.schema.url.clone())
            .with_channel(self.schema.name.clone())
            .with_order(order)
    }

    fn emit_options(&self) -> EmitOptions {
        EmitOptions::new().with_channel(self.schema.name.clone())
    }

    fn publisher(&self) -> RedisPublisher {
        self.publisher_to(&self.redis)
    }

    fn publisher_to(&self, url: &str) -> RedisPublisher {
        RedisPublisher::new(url)
            .unwrap()
            .with_config(PublisherConfig::default().with_stream_prefix(self.prefix.clone()))
            .unwrap()
    }

    fn stream(&self) -> String {
        format!("{}step", self.prefix)
    }

    /// The stream's entries in order: (msg_id, payload).
    async fn entries(&self) -> Vec<(String, Step)> {
        read_stream(&self.redis, &self.stream()).await
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
}

impl Drop for Env {
    fn drop(&mut self) {
        // The stream of this test only.
        delete_keys_quietly(&self.redis, &[self.stream()]);
    }
}

async fn read_stream(url: &str, stream: &str) -> Vec<(String, Step)> {
    let mut c = redis_conn(url).await;
    let mut out = Vec::new();
    let mut start = "-".to_owned();
    loop {
        let page: StreamRangeReply = c.xrange_count(stream, &start, "+", 1000).await.unwrap();
        let Some(last) = page.ids.last() else { break };
        start = format!("({}", last.id);
        for e in &page.ids {
            let msg_id: String = e.get("msg_id").expect("msg_id field");
            let payload: String = e.get("payload").expect("payload field");
            out.push((msg_id, serde_json::from_str(&payload).unwrap()));
        }
    }
    out
}

/// Waits until the stream holds at least `n` entries; panics after [`PATIENCE`].
async fn wait_for_entries(url: &str, stream: &str, n: usize) {
    let mut c = redis_conn(url).await;
    let deadline = Instant::now() + PATIENCE;
    loop {
        let len: usize = c.xlen(stream).await.unwrap();
        if len >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{len} of {n} entries arrived within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Settings for fast tests: short poll, short outage pauses.
fn config(batch_size: usize) -> RelayConfig {
    RelayConfig::default()
        .with_batch_size(batch_size)
        .with_poll_interval(Duration::from_millis(200))
        .with_outage_backoff(
            OutageBackoff::default()
                .with_min(Duration::from_millis(20))
                .with_max(Duration::from_millis(200)),
        )
}

/// A relay running in a task until stopped (finishing its batch) or aborted (killed).
struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), Error>>,
}

fn spawn<P: Publisher + 'static>(relay: Relay<PgRelayStore, P>) -> Running {
    let (stop, task) = spawn_until(move |stop| async move { relay.run_until(stop).await });
    Running {
        stop: Some(stop),
        task,
    }
}

impl Running {
    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(PATIENCE, self.task)
            .await
            .expect("the relay stops on its signal")
            .unwrap()
            .expect("the relay ran without a fatal error");
    }
}

/// Counts the messages a publisher handed on.
struct Counting<P> {
    inner: P,
    published: Arc<AtomicUsize>,
}

impl<P: Publisher> Publisher for Counting<P> {
    async fn publish(&self, batch: &[StoredMessage]) -> Result<PublishOutcomes, Error> {
        let out = self.inner.publish(batch).await?;
        self.published
            .fetch_add(out.iter().filter(|r| r.is_ok()).count(), Ordering::Relaxed);
        Ok(out)
    }
}

/// Per key, the sequence numbers in stream order, and how many entries repeated an
/// earlier msg_id.
fn by_key(entries: &[(String, Step)]) -> (HashMap<String, Vec<u32>>, usize) {
    let mut seen = HashSet::new();
    let mut keys: HashMap<String, Vec<u32>> = HashMap::new();
    let mut duplicates = 0;
    for (msg_id, s) in entries {
        if !seen.insert(msg_id.clone()) {
            duplicates += 1;
            continue; // what a consumer's inbox does with a re-published message
        }
        keys.entry(s.account.clone()).or_default().push(s.seq);
    }
    (keys, duplicates)
}

fn assert_in_order(keys: &HashMap<String, Vec<u32>>, n_keys: usize, per_key: u32) {
    assert_eq!(keys.len(), n_keys, "every key arrived");
    let want: Vec<u32> = (0..per_key).collect();
    for (key, seqs) in keys {
        assert_eq!(seqs, &want, "key {key}: a gap or a reordering");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_committed_message_arrives_once_and_rolled_back_ones_never() {
    let env = Env::new();
    let relay = spawn(
        Relay::new(env.store(ClaimOrder::PerKey), env.publisher())
            .with_config(config(500))
            .unwrap(),
    );
    let url = env.schema.url.clone();
    let opts = env.emit_options();
    // Emitted while the relay runs: 100 committed transactions of 100 messages, each
    // followed by a rolled-back one.
    tokio::task::spawn_blocking(move || {
        let mut c = PgConnection::establish(&url).unwrap();
        for t in 0..100u32 {
            c.transaction(|c| {
                c.emit_all_with(
                    &opts,
                    (0..100).map(|i| step(&format!("k{}", i % 50), t * 2 + i / 50)),
                )
                .map(drop)
            })
            .unwrap();
            let rolled_back = c.transaction(|c| {
                c.emit_all_with(&opts, (0..10).map(|i| step(&format!("rb{t}"), i)))?;
                Err::<(), _>(diesel::result::Error::RollbackTransaction)
            });
            assert!(rolled_back.is_err());
        }
    })
    .await
    .unwrap();

    wait_for_entries(&env.redis, &env.stream(), 10_000).await;
    // Drain: nothing NEW is left, so nothing more can arrive.
    eventually_within("the outbox drains", PATIENCE, || {
        env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE status <> 1") == 0
    })
    .await;
    relay.stop().await;

    let entries = env.entries().await;
    assert_eq!(entries.len(), 10_000, "each committed message exactly once");
    let ids: HashSet<&str> = entries.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids.len(), 10_000, "no duplicates");
    assert!(
        !ids.iter().any(|id| id.starts_with("rb")),
        "rolled-back messages never arrive"
    );
    assert_eq!(env.scalar("SELECT COUNT(*) AS n FROM outbox"), 10_000);
    let (keys, _) = by_key(&entries);
    assert_in_order(&keys, 50, 200);
}

/// 3 relay instances, 100 keys of 30 messages, emitted while the relays run; with
/// `kill`, one instance is killed (its task aborted) once a third has arrived.
async fn many_relays(kill: bool) {
    const KEYS: u32 = 100;
    const PER_KEY: u32 = 30;
    const BATCH: usize = 50;
    let env = Env::new();
    let counts: Vec<Arc<AtomicUsize>> = (0..3).map(|_| Arc::default()).collect();
    let mut relays: Vec<Running> = counts
        .iter()
        .map(|published| {
            let publisher = Counting {
                inner: env.publisher(),
                published: published.clone(),
            };
            spawn(
                Relay::new(env.store(ClaimOrder::PerKey), publisher)
                    .with_config(config(BATCH))
                    .unwrap(),
            )
        })
        .collect();

    // One emitter: a key's writes are serialized, so id order is commit order per key.
    let url = env.schema.url.clone();
    let opts = env.emit_options();
    let emitter = tokio::task::spawn_blocking(move || {
        let mut c = PgConnection::establish(&url).unwrap();
        for seq in 0..PER_KEY {
            for chunk in 0..4 {
                c.transaction(|c| {
                    c.emit_all_with(
                        &opts,
                        (chunk * KEYS / 4..(chunk + 1) * KEYS / 4)
                            .map(|k| step(&format!("acct{k}"), seq)),
                    )
                    .map(drop)
                })
                .unwrap();
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    });

    let total = (KEYS * PER_KEY) as usize;
    let mut killed_published = 0;
    if kill {
        wait_for_entries(&env.redis, &env.stream(), total / 3).await;
        let victim = relays.remove(0);
        victim.task.abort();
        let _ = victim.task.await;
        killed_published = counts[0].load(Ordering::Relaxed);
        assert!(
            killed_published > 0,
            "the killed instance had been publishing"
        );
    }
    emitter.await.unwrap();
    wait_for_entries(&env.redis, &env.stream(), total).await;
    eventually_within("the outbox drains", PATIENCE, || {
        env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE status <> 1") == 0
    })
    .await;
    for r in relays {
        r.stop().await;
    }

    let entries = env.entries().await;
    let (keys, duplicates) = by_key(&entries);
    // Read as a consumer does (skipping a msg_id seen before), every key is complete and
    // in order.
    assert_in_order(&keys, KEYS as usize, PER_KEY);
    let survivors: usize = counts[1..].iter().map(|c| c.load(Ordering::Relaxed)).sum();
    if kill {
        // The only duplicates possible: the killed instance's batch in flight, published
        // but never marked SENT, so released by its rollback and published again.
        assert!(
            duplicates <= BATCH,
            "{duplicates} duplicates: more than one batch of the killed instance"
        );
        // Every entry was counted by the instance that added it, except perhaps the
        // killed one's last call, cut off while it awaited Redis's replies.
        assert!(killed_published + survivors <= entries.len());
        assert_eq!(entries.len(), total + duplicates);
        assert!(
            counts[1..].iter().all(|c| c.load(Ordering::Relaxed) > 0),
            "both survivors worked"
        );
    } else {
        assert_eq!(duplicates, 0, "no message twice without a crash");
        assert_eq!(entries.len(), total);
        assert!(
            counts.iter().all(|c| c.load(Ordering::Relaxed) > 0),
            "all three instances shared the work"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_keep_every_key_in_order_and_publish_each_message_once() {
    many_relays(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_one_of_three_relays_loses_and_reorders_nothing() {
    many_relays(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_failing_30_percent_of_calls_delays_but_loses_and_reorders_nothing() {
    let env = Env::new();
    let mut c = env.conn();
    for seq in 0..40 {
        c.transaction(|c| {
            c.emit_all_with(
                &env.emit_options(),
                (0..50).map(|k| step(&format!("k{k}"), seq)),
            )
            .map(drop)
        })
        .unwrap();
    }
    let flaky = Arc::new(FlakyPublisher::new(env.publisher(), FailAs::Outage).fail_ratio(0.3));
    // One attempt only: an outage that spent a retry would show as a DEAD row.
    let cfg = config(37).with_retry(RetryPolicy::default().with_max_attempts(1));
    let relays: Vec<Running> = (0..2)
        .map(|_| {
            spawn(
                Relay::new(env.store(ClaimOrder::PerKey), flaky.clone())
                    .with_config(cfg.clone())
                    .unwrap(),
            )
        })
        .collect();
    wait_for_entries(&env.redis, &env.stream(), 2000).await;
    for r in relays {
        r.stop().await;
    }
    assert!(flaky.failures() > 0, "failures were injected");
    let entries = env.entries().await;
    assert_eq!(entries.len(), 2000, "nothing lost, nothing twice");
    let (keys, duplicates) = by_key(&entries);
    assert_eq!(duplicates, 0);
    assert_in_order(&keys, 50, 40);
    assert_eq!(
        env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE status <> 1 OR retries > 0"),
        0,
        "outages spend no retries"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_kills_nothing_and_everything_arrives_after_the_restart() {
    let mut scratch = ScratchRedis::start();
    let env = Env::with_redis(scratch.url());
    let emit = |from: u32, to: u32| {
        let mut c = env.conn();
        c.transaction(|c| {
            c.emit_all_with(
                &env.emit_options(),
                (from..to).map(|seq| step(&format!("k{}", seq % 10), seq / 10)),
            )
            .map(drop)
        })
        .unwrap();
    };
    let cfg = config(100).with_retry(RetryPolicy::default().with_max_attempts(1));
    let relay = spawn(
        Relay::new(env.store(ClaimOrder::PerKey), env.publisher())
            .with_config(cfg)
            .unwrap(),
    );
    emit(0, 200);
    wait_for_entries(&env.redis, &env.stream(), 200).await;

    scratch.stop();
    emit(200, 500);
    // The relay runs against the dead broker for a while, with 300 messages pending.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE status = 0 AND retries = 0"),
        300,
        "pending, and no retry spent"
    );
    assert_eq!(
        env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE status = 2"),
        0
    );

    scratch.restart(); // empty: it keeps nothing on disk
    wait_for_entries(&env.redis, &env.stream(), 300).await;
    eventually_within("the outbox drains", PATIENCE, || {
        env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE status <> 1") == 0
    })
    .await;
    relay.stop().await;
    assert_eq!(
        env.scalar("SELECT COUNT(*) AS n FROM outbox WHERE status = 2"),
        0,
        "zero DEAD rows"
    );
    let entries = env.entries().await;
    let ids: Vec<u32> = entries
        .iter()
        .map(|(_, s)| s.seq * 10 + s.account[1..].parse::<u32>().unwrap())
        .collect();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        (200..500).collect::<Vec<_>>(),
        "every pending message, once"
    );
    let (keys, _) = by_key(&entries);
    for (key, seqs) in &keys {
        assert_eq!(seqs, &(20..50).collect::<Vec<u32>>(), "key {key} in order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_delivers_before_the_first_poll() {
    let env = Env::new();
    let poll = Duration::from_secs(30);
    let relay = spawn(
        Relay::new(env.store(ClaimOrder::PerKey), env.publisher())
            .with_config(config(100).with_poll_interval(poll))
            .unwrap(),
    );
    // Parked: the relay holds its channel's wake-up lock.
    let (class, key) = outbox_diesel::wake_lock_key(&env.schema.name);
    let holders = format!(
        "SELECT COUNT(*) AS n FROM pg_locks WHERE locktype = 'advisory' \
         AND classid = {class} AND objid = {key} AND objsubid = 2 AND granted"
    );
    eventually_within("the relay parks", PATIENCE, || env.scalar(&holders) > 0).await;
    let parked = Instant::now();
    let mut c = env.conn();
    c.transaction(|c| c.emit_with(&env.emit_options(), step("k", 0)).map(drop))
        .unwrap();
    // The first poll fires a poll interval after parking: arriving before it means the
    // NOTIFY woke the relay.
    let before_poll = poll - Duration::from_secs(5);
    let mut r = redis_conn(&env.redis).await;
    let arrived = tokio::time::timeout(before_poll, async {
        while r.xlen::<_, usize>(env.stream()).await.unwrap() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(
        arrived.is_ok(),
        "not delivered within {before_poll:?} of parking (poll interval {poll:?})"
    );
    assert!(parked.elapsed() < poll);
    relay.stop().await;
}

/// Rejects chosen msg_ids a number of times; publishes everything else through Redis.
struct RejectSome {
    inner: RedisPublisher,
    reject: Mutex<HashMap<String, u32>>,
}

impl Publisher for RejectSome {
    async fn publish(&self, batch: &[StoredMessage]) -> Result<PublishOutcomes, Error> {
        let rejected: Vec<bool> = {
            let mut reject = self.reject.lock().unwrap();
            batch
                .iter()
                .map(|m| match reject.get_mut(m.envelope.msg_id.as_str()) {
                    Some(n) if *n > 0 => {
                        *n -= 1;
                        true
                    }
                    _ => false,
                })
                .collect()
        };
        let pass: Vec<StoredMessage> = batch
            .iter()
            .zip(&rejected)
            .filter(|(_, r)| !**r)
            .map(|(m, _)| m.clone())
            .collect();
        let mut published = self.inner.publish(&pass).await?.into_iter();
        Ok(rejected
            .iter()
            .map(|&r| {
                if r {
                    Err(Rejected::new("rejected by the test"))
                } else {
                    published.next().expect("one result per message")
                }
            })
            .collect())
    }
}

/// Steps a relay by hand: `k-0` is rejected twice (a retry an hour away, made due by
/// the test), `k-1` comes after it; `a-*` is another key.
async fn retry_scenario(order: ClaimOrder) -> Vec<Vec<String>> {
    let env = Env::new();
    let publisher = RejectSome {
        inner: env.publisher(),
        reject: Mutex::new(HashMap::from([("k-0:Step".to_owned(), 2)])),
    };
    let hour = Duration::from_secs(3600);
    let relay = Relay::new(env.store(order), publisher)
        .with_config(
            config(100).with_retry(
                RetryPolicy::default()
                    .with_base_delay(hour)
                    .with_max_delay(hour)
                    .with_jitter(0.0),
            ),
        )
        .unwrap();
    let mut c = env.conn();
    let emit = |c: &mut PgConnection, steps: Vec<Step>| {
        c.transaction(|c| c.emit_all_with(&env.emit_options(), steps).map(drop))
            .unwrap();
    };
    let make_due = || {
        outbox_tests::psql(&format!(
            "UPDATE {}.outbox SET next_retry_at = now() WHERE msg_id = 'k-0:Step'",
            env.schema.name
        ));
    };
    let mut seen = Vec::new();
    let stream = |entries: Vec<(String, Step)>| -> Vec<String> {
        entries
            .into_iter()
            .map(|(id, _)| id.trim_end_matches(":Step").to_owned())
            .collect()
    };

    emit(&mut c, vec![step("k", 0), step("a", 0)]);
    let r = relay.run_once().await.unwrap();
    assert_eq!((r.sent, r.retried), (1, 1));
    seen.push(stream(env.entries().await));

    emit(&mut c, vec![step("k", 1), step("a", 1)]);
    relay.run_once().await.unwrap();
    seen.push(stream(env.entries().await));

    make_due();
    relay.run_once().await.unwrap();
    seen.push(stream(env.entries().await));

    make_due();
    while relay.run_once().await.unwrap().claimed > 0 {}
    seen.push(stream(env.entries().await));
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_waits_for_its_retrying_message_while_other_keys_go_on() {
    let seen = retry_scenario(ClaimOrder::PerKey).await;
    assert_eq!(seen[0], ["a-0"], "k-0 rejected, a-0 published");
    assert_eq!(
        seen[1],
        ["a-0", "a-1"],
        "k-1 waits for k-0's retry; a goes on"
    );
    assert_eq!(
        seen[2],
        ["a-0", "a-1"],
        "k-0 rejected again: k-1, in the same batch, still waits"
    );
    assert_eq!(seen[3], ["a-0", "a-1", "k-0", "k-1"], "k in order");
}

/// The contrast that shows the ordered mode's test can fail: unordered, k-1 overtakes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unordered_mode_lets_a_later_message_overtake_a_retry() {
    let seen = retry_scenario(ClaimOrder::Unordered).await;
    assert_eq!(seen[1], ["a-0", "k-1", "a-1"]);
    assert_eq!(seen[3], ["a-0", "k-1", "a-1", "k-0"]);
}
