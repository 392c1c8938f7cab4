//! End to end on PostgreSQL and NATS: emit in the business transaction, the relay
//! (outbox-diesel's store) publishing to JetStream, the consumer applying each message
//! once through the PostgreSQL inbox. On the shared nats-server, and on private ones
//! that are killed and started again.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel::connection::SimpleConnection as _;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use outbox_core::{
    Delivery, Handler, HandlerError, OutageBackoff, OutboxEvent, PublishOutcomes, Publisher,
    RejectKind, Relay, RelayConfig, RetryPolicy, StoredMessage,
};
use outbox_diesel::{ClaimOrder, Emit as _, PgInbox, PgPool, PgRelayStore};
use outbox_nats::{
    Consumer, ConsumerConfig, Naming, NatsPublisher, PublisherConfig, StreamSettings,
};
use outbox_tests::{DropStreams, Isolated, ScratchNats, eventually_within, nats_url, unique};

#[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "account.credited", key = account)]
struct Credited {
    #[outbox(id)]
    id: String,
    account: String,
    amount: i64,
    /// Padding, to make a message too large for a stream.
    pad: String,
}

/// Adds each credit to its account and records the order a key's messages came in:
/// a second application, or one out of order, shows.
#[derive(Clone, Default)]
struct Apply {
    seen: Arc<Mutex<Vec<(String, String)>>>,
}

impl Handler<Credited> for Apply {
    type Conn = PgConnection;
    fn handle(
        &self,
        e: Credited,
        conn: &mut PgConnection,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        diesel::sql_query(
            "INSERT INTO balances VALUES ($1, $2) ON CONFLICT (account) DO UPDATE SET total = balances.total + $2",
        )
        .bind::<diesel::sql_types::Text, _>(&e.account)
        .bind::<diesel::sql_types::BigInt, _>(e.amount)
        .execute(conn)?;
        self.seen.lock().unwrap().push((e.account, e.id));
        Ok(())
    }
}

struct Env {
    _schema: Isolated,
    _streams: DropStreams,
    pool: PgPool,
    naming: Naming,
    group: String,
}

impl Env {
    fn new() -> Self {
        let schema = Isolated::postgres("nats");
        let pool = Pool::builder()
            .max_size(6)
            .build(ConnectionManager::<PgConnection>::new(&schema.url))
            .unwrap();
        let mut conn = pool.get().unwrap();
        outbox_diesel::migrate(&mut *conn).unwrap();
        conn.batch_execute(
            "CREATE TABLE balances (account TEXT PRIMARY KEY, total BIGINT NOT NULL)",
        )
        .unwrap();
        let id = unique("e");
        Self {
            _streams: DropStreams::new(nats_url(), format!("S{id}_")),
            naming: Naming::new(id.clone(), format!("S{id}_")).unwrap(),
            _schema: schema,
            pool,
            group: unique("g"),
        }
    }

    fn emit(&self, from: usize, to: usize, pad: usize) {
        let mut conn = self.pool.get().unwrap();
        for i in from..to {
            conn.transaction::<_, outbox_diesel::Error, _>(|c| {
                c.emit(Credited {
                    id: format!("c{i}"),
                    account: format!("acct-{}", i % 7),
                    amount: 1,
                    pad: "x".repeat(pad),
                })?;
                Ok(())
            })
            .unwrap();
        }
    }

    fn store(&self) -> PgRelayStore {
        PgRelayStore::new(self.pool.clone()).with_order(ClaimOrder::PerKey)
    }

    fn consumer(&self, client: async_nats::Client, handler: Apply) -> Consumer<PgInbox> {
        self.consumer_on(client, handler, StreamSettings::default())
    }

    fn consumer_on(
        &self,
        client: async_nats::Client,
        handler: Apply,
        streams: StreamSettings,
    ) -> Consumer<PgInbox> {
        let config = ConsumerConfig::default()
            .with_naming(self.naming.clone())
            .with_streams(streams)
            .with_fetch_wait(Duration::from_millis(200))
            .with_outage_backoff(backoff());
        Consumer::builder(client, self.group.as_str())
            .handle::<Credited, _>(handler)
            .idempotency(PgInbox::new(self.pool.clone()))
            .with_config(config)
            .build()
            .unwrap()
    }

    /// (status, retries, last_error) of every row, by msg_id.
    fn rows(&self) -> Vec<(String, i16, i32, Option<String>)> {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = diesel::sql_types::Text)]
            msg_id: String,
            #[diesel(sql_type = diesel::sql_types::SmallInt)]
            status: i16,
            #[diesel(sql_type = diesel::sql_types::Integer)]
            retries: i32,
            #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
            last_error: Option<String>,
        }
        let mut conn = self.pool.get().unwrap();
        diesel::sql_query("SELECT msg_id, status, retries, last_error FROM outbox ORDER BY id")
            .load::<Row>(&mut conn)
            .unwrap()
            .into_iter()
            .map(|r| (r.msg_id, r.status, r.retries, r.last_error))
            .collect()
    }

    fn total(&self) -> i64 {
        #[derive(QueryableByName)]
        struct Sum {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            total: i64,
        }
        let mut conn = self.pool.get().unwrap();
        diesel::sql_query("SELECT COALESCE(SUM(total), 0)::BIGINT AS total FROM balances")
            .get_result::<Sum>(&mut conn)
            .unwrap()
            .total
    }
}

fn backoff() -> OutageBackoff {
    OutageBackoff::default()
        .with_min(Duration::from_millis(50))
        .with_max(Duration::from_millis(500))
}

fn relay_config() -> RelayConfig {
    RelayConfig::default()
        .with_batch_size(50)
        .with_poll_interval(Duration::from_millis(100))
        .with_outage_backoff(backoff())
}

/// A task running `relay` until told to stop.
fn spawn_relay<P: Publisher + 'static>(
    relay: Relay<PgRelayStore, P>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        relay
            .run_until(async {
                let _ = rx.await;
            })
            .await
            .expect("the relay ran without a fatal error");
    });
    (tx, task)
}

fn spawn_consumer(
    consumer: &Consumer<PgInbox>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let consumer = consumer.clone();
    let task = tokio::spawn(async move {
        consumer
            .run_until(async {
                let _ = rx.await;
            })
            .await
            .expect("the consumer ran without a fatal error");
    });
    (tx, task)
}

async fn stop(
    running: (
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    ),
) {
    let _ = running.0.send(());
    tokio::time::timeout(Duration::from_secs(30), running.1)
        .await
        .expect("stops on its signal")
        .unwrap();
}

/// The (key, id) of every message of the topic's stream, in stream order.
async fn stream_order(client: &async_nats::Client, naming: &Naming) -> Vec<(String, String)> {
    let js = async_nats::jetstream::new(client.clone());
    let mut stream = js
        .get_stream(naming.stream("account.credited"))
        .await
        .unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut out = Vec::new();
    for seq in 1..=last {
        let m = stream.get_raw_message(seq).await.unwrap();
        let e = outbox_nats::envelope_from_message(Some(&m.headers), &m.payload, "").unwrap();
        let id = e.msg_id.as_str().split(':').next().unwrap().to_owned();
        out.push((e.key, id));
    }
    out
}

/// Each key's messages in id order, each once.
fn in_key_order(seen: &[(String, String)]) -> bool {
    let mut last: std::collections::HashMap<&str, u64> = Default::default();
    seen.iter().all(|(account, id)| {
        let n: u64 = id[1..].parse().unwrap();
        let before = last.insert(account, n);
        before.is_none_or(|b| b < n)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emitted_messages_reach_the_handler_once_each_through_nats() {
    let env = Env::new();
    env.emit(0, 300, 0);
    let client = async_nats::connect(nats_url())
        .await
        .expect("nats-server on 4222");
    let publisher = NatsPublisher::new(
        client.clone(),
        PublisherConfig::default().with_naming(env.naming.clone()),
    )
    .unwrap();
    let relay = spawn_relay(
        Relay::new(env.store(), publisher)
            .with_config(relay_config())
            .unwrap(),
    );
    let apply = Apply::default();
    let consumer = env.consumer(client, apply.clone());
    let running = spawn_consumer(&consumer);
    eventually_within("300 credits applied", Duration::from_secs(60), || {
        env.total() == 300
    })
    .await;
    // Nothing more comes: no message applied twice.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(env.total(), 300);
    assert_eq!(consumer.stats().consumed, 300);
    assert!(
        env.rows().iter().all(|r| r.1 == 1 && r.2 == 0),
        "all SENT, no retry"
    );
    stop(running).await;
    stop(relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_back_after_an_outage_longer_than_every_backoff_loses_nothing_and_costs_no_retry()
{
    let mut server = ScratchNats::start();
    let env = Env::new();
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(server.url())
        .await
        .unwrap();
    let config = PublisherConfig::default()
        .with_naming(env.naming.clone())
        .with_ack_timeout(Duration::from_secs(2));
    let publisher = NatsPublisher::new(client.clone(), config).unwrap();
    let relay = spawn_relay(
        Relay::new(env.store(), publisher)
            .with_config(relay_config())
            .unwrap(),
    );
    let apply = Apply::default();
    let consumer = env.consumer(client.clone(), apply.clone());
    let running = spawn_consumer(&consumer);
    env.emit(0, 100, 0);
    eventually_within("the first 100 applied", Duration::from_secs(60), || {
        env.total() == 100
    })
    .await;

    server.stop();
    env.emit(100, 250, 0);
    // Longer than the relay's and the consumer's longest backoff (500 ms) many times.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        env.rows().iter().skip(100).all(|r| r.1 == 0 && r.2 == 0),
        "NEW, no retry spent while down"
    );
    assert!(!consumer.health().is_ready());
    server.restart();

    eventually_within("all 250 applied", Duration::from_secs(60), || {
        env.total() == 250
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(env.total(), 250, "none applied twice");
    let rows = env.rows();
    assert!(
        rows.iter().all(|r| r.1 == 1 && r.2 == 0),
        "all SENT, no retry spent: {:?}",
        rows.iter().find(|r| r.2 != 0)
    );
    let order = stream_order(&client, &env.naming).await;
    assert_eq!(order.len(), 250, "each stored once");
    assert!(
        in_key_order(&order),
        "each key in order on the stream: {order:?}"
    );
    eventually_within("the consumer ready again", Duration::from_secs(30), || {
        consumer.health().is_ready()
    })
    .await;
    stop(running).await;
    stop(relay).await;
}

/// Each message the publisher was given, in call order, and its refusal if any.
type PublishLog = Arc<Mutex<Vec<(String, Option<RejectKind>)>>>;

/// Records what the publisher did with each message, in call order.
struct Recording {
    inner: NatsPublisher,
    log: PublishLog,
}

impl Publisher for Recording {
    async fn publish(
        &self,
        batch: &[StoredMessage],
    ) -> Result<PublishOutcomes, outbox_core::Error> {
        let outcomes = self.inner.publish(batch).await?;
        let mut log = self.log.lock().unwrap();
        for (m, o) in batch.iter().zip(&outcomes) {
            log.push((
                m.envelope.msg_id.to_string(),
                o.as_ref().err().map(|r| r.kind),
            ));
        }
        Ok(outcomes)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_message_is_retried_then_dead_without_its_key_overtaking_it() {
    let env = Env::new();
    // acct-1 gets c1 (too large), then c8 and c15; the other keys small messages.
    let mut conn = env.pool.get().unwrap();
    for i in 0..21_usize {
        let pad = if i == 1 { 4096 } else { 0 };
        conn.transaction::<_, outbox_diesel::Error, _>(|c| {
            c.emit(Credited {
                id: format!("c{i}"),
                account: format!("acct-{}", i % 7),
                amount: 1,
                pad: "x".repeat(pad),
            })?;
            Ok(())
        })
        .unwrap();
    }
    drop(conn);
    let client = async_nats::connect(nats_url()).await.unwrap();
    let streams = StreamSettings::default().with_max_message_size(2048);
    let config = PublisherConfig::default()
        .with_naming(env.naming.clone())
        .with_streams(streams.clone());
    let log = Arc::new(Mutex::new(Vec::new()));
    let publisher = Recording {
        inner: NatsPublisher::new(client.clone(), config).unwrap(),
        log: Arc::clone(&log),
    };
    let retry = RetryPolicy::default()
        .with_max_attempts(3)
        .with_base_delay(Duration::from_millis(200))
        .with_jitter(0.0);
    let relay = spawn_relay(
        Relay::new(env.store(), publisher)
            .with_config(relay_config().with_retry(retry))
            .unwrap(),
    );
    let apply = Apply::default();
    let consumer = env.consumer_on(client.clone(), apply.clone(), streams);
    let running = spawn_consumer(&consumer);
    eventually_within("the 20 others applied", Duration::from_secs(60), || {
        env.total() == 20
    })
    .await;
    let rows = env.rows();
    let c1 = rows.iter().find(|r| r.0 == "c1:Credited").unwrap();
    assert_eq!((c1.1, c1.2), (2, 3), "DEAD after 3 attempts: {c1:?}");
    assert!(
        c1.3.as_deref().unwrap_or("").contains("max_message_size"),
        "{c1:?}"
    );

    let log = log.lock().unwrap().clone();
    let refusals: Vec<usize> = (log.iter().enumerate())
        .filter(|(_, (id, o))| id == "c1:Credited" && *o == Some(RejectKind::Message))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(refusals.len(), 3, "{log:?}");
    let c8_sent = log
        .iter()
        .position(|(id, o)| id == "c8:Credited" && o.is_none())
        .expect("c8 published");
    assert!(
        c8_sent > refusals[2],
        "c8 went out only after c1 was given up: {log:?}"
    );
    let order = stream_order(&client, &env.naming).await;
    assert!(in_key_order(&order), "{order:?}");
    stop(running).await;
    stop(relay).await;
}
