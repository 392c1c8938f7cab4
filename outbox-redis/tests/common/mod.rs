//! Helpers shared by the tests: the real Redis at `REDIS_URL` (default
//! `redis://127.0.0.1:6379`), unique names per test, a test event and a scriptable
//! handler over the in-memory inbox.
// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::{
    Delivery, Envelope, Handler, HandlerError, MemoryDb, MemoryTx, OutboxEvent, Publisher,
    StoredMessage,
};
use outbox_redis::redis::aio::MultiplexedConnection;
use outbox_redis::redis::streams::{StreamPendingReply, StreamRangeReply};
use outbox_redis::redis::{self, AsyncConnectionConfig, Value};
use outbox_redis::{Consumer, ConsumerConfig, PublisherConfig, RedisPublisher};

pub(crate) fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A stream prefix no other test (or run) uses.
pub(crate) fn unique_prefix() -> String {
    format!("test:{}:{:016x}:", std::process::id(), fastrand::u64(..))
}

/// A direct connection for checks; fails the test if Redis is down.
pub(crate) async fn conn() -> MultiplexedConnection {
    let client = redis::Client::open(redis_url()).expect("REDIS_URL");
    let config = AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(10)));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .expect("Redis must be running at REDIS_URL for these tests")
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
pub(crate) struct OrderPaid {
    #[outbox(id)]
    pub(crate) order_id: String,
    pub(crate) amount_cents: i64,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
pub(crate) struct OrderRefunded {
    #[outbox(id)]
    pub(crate) order_id: String,
}

pub(crate) fn paid(n: usize) -> Envelope {
    let e = OrderPaid {
        order_id: format!("order-{n}"),
        amount_cents: 100 * n as i64,
    };
    Envelope::from_event(&e, 1 << 20).unwrap()
}

pub(crate) fn stored(envelopes: impl IntoIterator<Item = Envelope>) -> Vec<StoredMessage> {
    envelopes
        .into_iter()
        .enumerate()
        .map(|(i, envelope)| StoredMessage {
            id: i as i64 + 1,
            retries: 0,
            envelope,
        })
        .collect()
}

pub(crate) fn publisher(prefix: &str) -> RedisPublisher {
    let config = PublisherConfig::default().with_stream_prefix(prefix.to_owned());
    RedisPublisher::new(redis_url())
        .unwrap()
        .with_config(config)
        .unwrap()
}

/// Publishes and asserts that every message was accepted.
pub(crate) async fn publish(prefix: &str, envelopes: impl IntoIterator<Item = Envelope>) {
    let batch = stored(envelopes);
    let outcomes = publisher(prefix).publish(&batch).await.expect("publish");
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
}

pub(crate) async fn xrange(conn: &mut MultiplexedConnection, stream: &str) -> StreamRangeReply {
    redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(conn)
        .await
        .unwrap()
}

pub(crate) fn field(entry: &redis::streams::StreamId, name: &str) -> String {
    entry
        .get::<String>(name)
        .unwrap_or_else(|| panic!("field `{name}` missing in {entry:?}"))
}

pub(crate) async fn pending_count(
    conn: &mut MultiplexedConnection,
    stream: &str,
    group: &str,
) -> usize {
    let reply: StreamPendingReply = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .query_async(conn)
        .await
        .unwrap();
    reply.count()
}

/// Deletes every key under `prefix`.
pub(crate) async fn cleanup(prefix: &str) {
    let mut conn = conn().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    if !keys.is_empty() {
        let _: Value = redis::cmd("DEL")
            .arg(&keys)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

/// Waits for `cond`, failing the test after a generous bound (never a timing assertion).
pub(crate) async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The consumer's data: how many times each order's handler committed.
pub(crate) type Applied = BTreeMap<String, u32>;

type Behave = dyn Fn(usize, &OrderPaid) -> Result<(), HandlerError> + Send + Sync;

/// Records every call and commits `+1` for the order, after `behave` (given the
/// 1-based call number) lets it.
#[derive(Clone)]
pub(crate) struct Recorder {
    pub(crate) calls: Arc<AtomicUsize>,
    pub(crate) deliveries: Arc<Mutex<HashMap<String, Vec<u64>>>>,
    behave: Arc<Behave>,
}

impl Recorder {
    pub(crate) fn ok() -> Self {
        Self::with(|_, _| Ok(()))
    }

    pub(crate) fn with(
        behave: impl Fn(usize, &OrderPaid) -> Result<(), HandlerError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            calls: Arc::default(),
            deliveries: Arc::default(),
            behave: Arc::new(behave),
        }
    }

    pub(crate) fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Handler<OrderPaid> for Recorder {
    type Conn = MemoryTx<Applied>;

    fn handle(
        &self,
        e: OrderPaid,
        tx: &mut MemoryTx<Applied>,
        d: &Delivery,
    ) -> Result<(), HandlerError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        self.deliveries
            .lock()
            .unwrap()
            .entry(e.order_id.clone())
            .or_default()
            .push(d.delivery_count);
        (self.behave)(n, &e)?;
        *tx.data().entry(e.order_id).or_default() += 1;
        Ok(())
    }
}

/// Settings that make retries and reclaims quick.
pub(crate) fn fast_config(prefix: &str) -> ConsumerConfig {
    ConsumerConfig {
        stream_prefix: prefix.to_owned(),
        block: Duration::from_millis(200),
        min_idle: Duration::from_millis(300),
        claim_interval: Duration::from_millis(100),
        outage_backoff: outbox_core::OutageBackoff::default()
            .with_min(Duration::from_millis(10))
            .with_max(Duration::from_millis(100)),
        ..ConsumerConfig::default()
    }
}

pub(crate) fn consumer(
    config: ConsumerConfig,
    group: &str,
    db: &MemoryDb<Applied>,
    handler: Recorder,
) -> Consumer<MemoryDb<Applied>> {
    Consumer::builder(redis_url(), group)
        .handle::<OrderPaid, _>(handler)
        .idempotency(db.clone())
        .config(config)
        .build()
        .unwrap()
}

/// A consumer running in a task, stopped through its channel.
pub(crate) struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub(crate) task: tokio::task::JoinHandle<outbox_redis::Result<()>>,
}

impl Running {
    pub(crate) fn start<I>(consumer: &Consumer<I>) -> Self
    where
        I: outbox_core::Inbox<Conn = MemoryTx<Applied>>,
    {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let consumer = consumer.clone();
        let task = tokio::spawn(async move {
            consumer
                .run_until(async {
                    stopped.await.ok();
                })
                .await
        });
        Self {
            stop: Some(stop),
            task,
        }
    }

    /// The shutdown sender, for tests that wait on the task themselves.
    pub(crate) fn stop_signal(&mut self) -> tokio::sync::oneshot::Sender<()> {
        self.stop.take().unwrap()
    }

    /// Signals shutdown and waits for the run to end; it must end `Ok`.
    pub(crate) async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        (&mut self.task).await.unwrap().unwrap();
    }
}
