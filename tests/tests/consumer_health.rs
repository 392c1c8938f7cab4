//! A consumer's probes over real HTTP (`outbox_redis::health_router`) while its private
//! `redis-server` is killed, kept down longer than every timeout and backoff of the
//! consumer, and started again: `/readyz` answers 503 during the outage and 200 after
//! it, `/healthz` stays 200 throughout (an outage is no reason to restart the process),
//! and the consumer applies what was published after the restart.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection as _;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use outbox_core::{
    Delivery, Envelope, Handler, HandlerError, OutageBackoff, OutboxEvent, Publisher as _,
    StoredMessage,
};
use outbox_diesel::{PgInbox, PgPool};
use outbox_redis::{Consumer, ConsumerConfig, PublisherConfig, RedisPublisher};
use outbox_tests::{Isolated, ScratchRedis, eventually_within, http_get, unique_prefix};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
struct Ping {
    #[outbox(id)]
    n: String,
}

struct Record;

impl Handler<Ping> for Record {
    type Conn = PgConnection;

    fn handle(&self, e: Ping, conn: &mut PgConnection, _: &Delivery) -> Result<(), HandlerError> {
        diesel::sql_query("INSERT INTO seen (n) VALUES ($1)")
            .bind::<diesel::sql_types::Text, _>(&e.n)
            .execute(conn)?;
        Ok(())
    }
}

/// The status code of `GET path` on `addr`.
fn status(addr: SocketAddr, path: &str) -> u16 {
    http_get(addr, path, Duration::from_secs(5)).status
}

fn seen(pool: &PgPool) -> i64 {
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    diesel::sql_query("SELECT count(*) AS n FROM seen")
        .get_result::<N>(&mut *pool.get().unwrap())
        .unwrap()
        .n
}

async fn publish(redis_url: &str, prefix: &str, n: &str) {
    let publisher = RedisPublisher::new(redis_url)
        .unwrap()
        .with_config(PublisherConfig::default().with_stream_prefix(prefix))
        .unwrap();
    let message = StoredMessage {
        id: 1,
        retries: 0,
        envelope: Envelope::from_event(&Ping { n: n.into() }, 1 << 20).unwrap(),
    };
    // The restarted server may still be loading: retry for a while.
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
async fn the_probes_follow_a_redis_outage_and_the_consumer_recovers() {
    let schema = Isolated::postgres("health");
    let pool = Pool::builder()
        .max_size(4)
        .build(ConnectionManager::<PgConnection>::new(&schema.url))
        .unwrap();
    {
        let mut conn = pool.get().unwrap();
        outbox_diesel::migrate(&mut *conn).unwrap();
        conn.batch_execute("CREATE TABLE seen (n TEXT PRIMARY KEY)")
            .unwrap();
    }
    let mut redis = ScratchRedis::start_persistent();
    let prefix = unique_prefix("health");
    let config = ConsumerConfig::default()
        .with_stream_prefix(prefix.clone())
        .with_block(Duration::from_millis(200))
        .with_response_timeout(Duration::from_secs(1))
        .with_connect_timeout(Duration::from_secs(1))
        .with_claim_interval(Duration::from_millis(500))
        .with_outage_backoff(
            OutageBackoff::default()
                .with_min(Duration::from_millis(100))
                .with_max(Duration::from_secs(1)),
        );
    let consumer = Consumer::builder(redis.url().as_str(), "health")
        .handle::<Ping, _>(Record)
        .idempotency(PgInbox::new(pool.clone()))
        .with_config(config)
        .build()
        .unwrap();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        axum::serve(listener, outbox_redis::health_router(consumer.clone())).into_future(),
    );
    let probe = move |path: &'static str| {
        let addr = addr;
        move || {
            std::thread::spawn(move || status(addr, path))
                .join()
                .unwrap()
        }
    };
    assert_eq!(probe("/healthz")(), 503, "not running yet: not live");
    assert_eq!(probe("/readyz")(), 503, "not running yet: not ready");

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = consumer.clone();
    let run = tokio::spawn(async move {
        running
            .run_until(async {
                let _ = stopped.await;
            })
            .await
    });
    let (live, ready) = (probe("/healthz"), probe("/readyz"));
    eventually_within("ready after start", Duration::from_secs(20), || {
        ready() == 200
    })
    .await;
    publish(&redis.url(), &prefix, "before").await;
    eventually_within("the first ping applied", Duration::from_secs(20), || {
        seen(&pool) == 1
    })
    .await;

    redis.stop();
    eventually_within(
        "unready while Redis is down",
        Duration::from_secs(20),
        || ready() == 503,
    )
    .await;
    // Down for longer than the response timeout, the claim interval and the longest
    // backoff together: live throughout, never ready.
    let down_until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < down_until {
        assert_eq!(
            live(),
            200,
            "an outage is no reason to restart the consumer"
        );
        assert_eq!(ready(), 503, "not ready while Redis is down");
        let health = consumer.health();
        assert!(
            health.broker_failures > 0 && health.last_error.is_some(),
            "{health:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    redis.restart();
    eventually_within(
        "ready again after the restart",
        Duration::from_secs(30),
        || ready() == 200,
    )
    .await;
    publish(&redis.url(), &prefix, "after").await;
    eventually_within(
        "the ping after the restart applied",
        Duration::from_secs(30),
        || seen(&pool) == 2,
    )
    .await;
    assert_eq!(consumer.health().last_error, None);

    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(live(), 503, "a stopped consumer is not live");
    server.abort();
}
