//! A consumer's probes over real HTTP (`outbox_nats::health_router`, feature `http`)
//! while its private nats-server is killed, kept down longer than every backoff of the
//! consumer, and started again: `/readyz` answers 503 during the outage and 200 after
//! it, `/healthz` stays 200 throughout (an outage is no reason to restart the process),
//! and the consumer applies what was published after the restart.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use outbox_core::{
    Delivery, Envelope, Handler, HandlerError, MemoryDb, MemoryTx, OutageBackoff, OutboxEvent,
    Publisher as _, StoredMessage,
};
use outbox_nats::{Consumer, ConsumerConfig, Naming, NatsPublisher, PublisherConfig};
use outbox_tests::{HttpResponse, ScratchNats, eventually_within, http_get, unique};

#[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "health.ping")]
struct Ping {
    #[outbox(id)]
    n: String,
}

/// Counts the pings applied.
struct Count;

impl Handler<Ping> for Count {
    type Conn = MemoryTx<u32>;
    fn handle(&self, _: Ping, tx: &mut Self::Conn, _: &Delivery) -> Result<(), HandlerError> {
        *tx.data() += 1;
        Ok(())
    }
}

/// `GET path` on `addr`, from a thread (the test's runtime keeps serving).
fn get(addr: SocketAddr, path: &'static str) -> HttpResponse {
    std::thread::spawn(move || http_get(addr, path, Duration::from_secs(5)))
        .join()
        .unwrap()
}

async fn publish(publisher: &NatsPublisher, n: &str) {
    let message = StoredMessage {
        id: 1,
        retries: 0,
        envelope: Envelope::from_event(&Ping { n: n.into() }, 1 << 20).unwrap(),
    };
    // The restarted server may still be recovering its streams: retry for a while.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match publisher.publish(std::slice::from_ref(&message)).await {
            Ok(outcomes) if outcomes.iter().all(Result::is_ok) => return,
            _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(100)).await,
            other => panic!("cannot publish {n}: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probes_follow_a_nats_outage_and_the_consumer_recovers() {
    let mut server = ScratchNats::start();
    let id = unique("h");
    let naming = Naming::new(id.clone(), format!("S{id}_")).unwrap();
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(server.url())
        .await
        .unwrap();
    let publisher = NatsPublisher::new(
        client.clone(),
        PublisherConfig::default()
            .with_naming(naming.clone())
            .with_ack_timeout(Duration::from_secs(2)),
    )
    .unwrap();
    let config = ConsumerConfig::default()
        .with_naming(naming)
        .with_fetch_wait(Duration::from_millis(200))
        .with_outage_backoff(
            OutageBackoff::default()
                .with_min(Duration::from_millis(100))
                .with_max(Duration::from_secs(1)),
        );
    let db = MemoryDb::new(0u32);
    let consumer = Consumer::builder(client.clone(), "health")
        .handle::<Ping, _>(Count)
        .idempotency(db.clone())
        .with_config(config)
        .build()
        .unwrap();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let http = tokio::spawn(
        axum::serve(listener, outbox_nats::health_router(consumer.clone())).into_future(),
    );
    let status = move |path| get(addr, path).status;
    assert_eq!(status("/healthz"), 503, "not running yet: not live");
    assert_eq!(status("/readyz"), 503, "not running yet: not ready");

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = consumer.clone();
    let run = tokio::spawn(async move {
        running
            .run_until(async {
                let _ = stopped.await;
            })
            .await
    });
    eventually_within("ready after start", Duration::from_secs(20), || {
        status("/readyz") == 200
    })
    .await;
    let body = get(addr, "/readyz");
    assert!(
        body.body().contains(r#""broker":"nats""#) && body.body().contains(r#""ok":true"#),
        "{}",
        body.text
    );
    publish(&publisher, "before").await;
    eventually_within("the first ping applied", Duration::from_secs(20), || {
        db.read(|n| *n) == 1
    })
    .await;

    server.stop();
    eventually_within(
        "unready while NATS is down",
        Duration::from_secs(20),
        || status("/readyz") == 503,
    )
    .await;
    // Down for longer than the longest backoff many times: live throughout, never ready.
    let down_until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < down_until {
        assert_eq!(
            status("/healthz"),
            200,
            "an outage is no reason to restart the consumer"
        );
        assert_eq!(status("/readyz"), 503, "not ready while NATS is down");
        let health = consumer.health();
        assert!(
            health.broker_failures > 0 && health.last_error.is_some(),
            "{health:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    server.restart();
    eventually_within(
        "ready again after the restart",
        Duration::from_secs(30),
        || status("/readyz") == 200,
    )
    .await;
    publish(&publisher, "after").await;
    eventually_within(
        "the ping after the restart applied",
        Duration::from_secs(30),
        || db.read(|n| *n) == 2,
    )
    .await;
    assert_eq!(consumer.health().last_error, None);

    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(status("/healthz"), 503, "a stopped consumer is not live");
    http.abort();
}
