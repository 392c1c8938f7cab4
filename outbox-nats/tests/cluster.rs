//! A JetStream cluster of three private servers and a stream of three replicas: the
//! stream's leader is killed (SIGKILL) while the relay publishes and the consumer
//! applies; nothing is lost, nothing applied twice, no retry spent.

use std::time::Duration;

use diesel::connection::SimpleConnection as _;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use outbox_core::{
    Delivery, Handler, HandlerError, OutageBackoff, OutboxEvent, Relay, RelayConfig,
};
use outbox_diesel::{ClaimOrder, Emit as _, PgInbox, PgPool, PgRelayStore};
use outbox_nats::{
    Consumer, ConsumerConfig, Naming, NatsPublisher, PublisherConfig, StreamSettings,
};
use outbox_tests::{Isolated, ScratchNats, eventually_within, unique};

#[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "ledger.posted")]
struct Posted {
    #[outbox(id)]
    id: u64,
}

struct Count;

impl Handler<Posted> for Count {
    type Conn = PgConnection;
    fn handle(&self, _: Posted, conn: &mut PgConnection, _: &Delivery) -> Result<(), HandlerError> {
        conn.batch_execute("UPDATE applied SET n = n + 1")?;
        Ok(())
    }
}

fn applied(pool: &PgPool) -> i64 {
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let mut conn = pool.get().unwrap();
    diesel::sql_query("SELECT n FROM applied")
        .get_result::<N>(&mut conn)
        .unwrap()
        .n
}

fn retried(pool: &PgPool) -> i64 {
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let mut conn = pool.get().unwrap();
    diesel::sql_query("SELECT COUNT(*) AS n FROM outbox WHERE retries > 0 OR status <> 1")
        .get_result::<N>(&mut conn)
        .unwrap()
        .n
}

async fn connect(nodes: &[ScratchNats]) -> async_nats::Client {
    let addrs: Vec<async_nats::ServerAddr> =
        nodes.iter().map(|n| n.url().parse().unwrap()).collect();
    async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(addrs)
        .await
        .unwrap()
}

/// The index in `nodes` of the server that leads `stream`.
async fn leader(
    js: &async_nats::jetstream::Context,
    stream: &str,
    nodes: &[ScratchNats],
) -> Option<usize> {
    let mut s = js.get_stream(stream).await.ok()?;
    let name = s.info().await.ok()?.cluster.as_ref()?.leader.clone()?;
    nodes.iter().position(|n| name == format!("n{}", n.port()))
}

fn database(schema: &Isolated) -> PgPool {
    let pool: PgPool = Pool::builder()
        .max_size(6)
        .build(ConnectionManager::new(&schema.url))
        .unwrap();
    let mut conn = pool.get().unwrap();
    outbox_diesel::migrate(&mut *conn).unwrap();
    conn.batch_execute("CREATE TABLE applied (n BIGINT NOT NULL); INSERT INTO applied VALUES (0)")
        .unwrap();
    pool
}

/// Creates the R3 stream once the cluster has elected its JetStream leader: until then
/// stream requests fail as an outage.
async fn create_stream(publisher: &NatsPublisher) {
    for _ in 0..60 {
        match publisher.ensure_streams(["ledger.posted"]).await {
            Ok(()) => return,
            Err(e) => {
                assert!(e.is_outage(), "{e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    panic!("the R3 stream was not created within 30 s");
}

fn backoff() -> OutageBackoff {
    OutageBackoff::default()
        .with_min(Duration::from_millis(50))
        .with_max(Duration::from_millis(500))
}

/// A task that runs `run` until the returned sender is used or dropped.
fn spawn_until<F, Fut, E>(
    run: F,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), E>>,
)
where
    F: FnOnce(tokio::sync::oneshot::Receiver<()>) -> Fut,
    Fut: std::future::Future<Output = Result<(), E>> + Send + 'static,
    E: Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    (tx, tokio::spawn(run(rx)))
}

/// Emits `n` messages, one every 10 ms, in their own transactions.
fn produce(pool: PgPool, n: u64) -> tokio::task::JoinHandle<()> {
    tokio::task::spawn_blocking(move || {
        let mut conn = pool.get().unwrap();
        for i in 0..n {
            conn.transaction::<_, outbox_diesel::Error, _>(|c| {
                c.emit(Posted { id: i })?;
                Ok(())
            })
            .unwrap();
            std::thread::sleep(Duration::from_millis(10));
        }
    })
}

fn relay(pool: &PgPool, publisher: NatsPublisher) -> Relay<PgRelayStore, NatsPublisher> {
    let store = PgRelayStore::new(pool.clone()).with_order(ClaimOrder::PerKey);
    let config = RelayConfig::default()
        .with_batch_size(20)
        .with_poll_interval(Duration::from_millis(50))
        .with_outage_backoff(backoff());
    Relay::new(store, publisher).with_config(config).unwrap()
}

fn consumer(
    client: async_nats::Client,
    naming: &Naming,
    streams: StreamSettings,
    pool: &PgPool,
) -> Consumer<PgInbox> {
    let config = ConsumerConfig::default()
        .with_naming(naming.clone())
        .with_streams(streams)
        .with_fetch_wait(Duration::from_millis(300))
        .with_ack_wait(Duration::from_secs(5))
        .with_outage_backoff(backoff());
    Consumer::builder(client, unique("g"))
        .handle::<Posted, _>(Count)
        .idempotency(PgInbox::new(pool.clone()))
        .with_config(config)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_stream_leader_of_an_r3_stream_loses_nothing() {
    const N: usize = 400;
    let mut nodes = ScratchNats::start_cluster();
    let schema = Isolated::postgres("natscl");
    let pool = database(&schema);
    let id = unique("cl");
    let naming = Naming::new(id.clone(), format!("S{id}_")).unwrap();
    let streams = StreamSettings::default().with_replicas(3);
    let client = connect(&nodes).await;
    let config = PublisherConfig::default()
        .with_naming(naming.clone())
        .with_streams(streams.clone())
        .with_ack_timeout(Duration::from_secs(2));
    let publisher = NatsPublisher::new(client.clone(), config).unwrap();
    create_stream(&publisher).await;

    let relay = relay(&pool, publisher);
    let consumer = consumer(client.clone(), &naming, streams, &pool);
    let relay = spawn_until(|stop| async move {
        relay
            .run_until(async {
                let _ = stop.await;
            })
            .await
    });
    let consumer = spawn_until(|stop| async move {
        consumer
            .run_until(async {
                let _ = stop.await;
            })
            .await
    });
    let producer = produce(pool.clone(), N as u64);

    eventually_within("a third applied", Duration::from_secs(60), || {
        applied(&pool) as usize >= N / 3
    })
    .await;
    let js = async_nats::jetstream::new(client.clone());
    let stream = naming.stream("ledger.posted");
    let victim = leader(&js, &stream, &nodes)
        .await
        .expect("the stream has a leader among the nodes");
    nodes[victim].stop();
    producer.await.unwrap();
    eventually_within("every message applied", Duration::from_secs(120), || {
        applied(&pool) as usize == N
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(applied(&pool) as usize, N, "none applied twice");
    assert_eq!(retried(&pool), 0, "every row SENT, no retry spent");
    let new_leader = leader(&js, &stream, &nodes).await;
    assert!(new_leader.is_some_and(|l| l != victim), "{new_leader:?}");
    let _ = relay.0.send(());
    relay
        .1
        .await
        .unwrap()
        .expect("the relay ran without a fatal error");
    let _ = consumer.0.send(());
    consumer
        .1
        .await
        .unwrap()
        .expect("the consumer ran without a fatal error");
}
