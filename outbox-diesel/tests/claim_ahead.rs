//! `Relay::run_until` claims ahead on PostgreSQL (`PgRelayStore::claims_ahead`): with
//! per-key claims every key still reaches the broker in id order and every message once,
//! also on a pool of one connection while the relay reads its backlog often, and when
//! the broker rejects whole batches (a batch claimed ahead of a rejected one is
//! released, not published before the retries).

mod fixtures;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use diesel::PgConnection;
use diesel::r2d2::{ConnectionManager, Pool};
use fixtures::{Backend, Pg, runtime};
use outbox_core::{
    FailAs, FlakyPublisher, MemoryBroker, OutboxEvent, Publisher, Relay, RelayConfig, RetryPolicy,
};
use outbox_diesel::{ClaimOrder, Emit, PgRelayStore};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(key = account)]
struct Moved {
    #[outbox(id)]
    n: u32,
    account: String,
}

#[test]
fn pg_a_relay_claiming_ahead_on_a_pool_of_one_keeps_key_order_and_publishes_once() {
    // One connection, and a check-out that would wait far longer than the test: a relay
    // that waited for its own batch's connection would never finish in time.
    let broker = MemoryBroker::new();
    drain_in_key_order(1, broker.clone(), &broker, RetryPolicy::default());
}

#[test]
fn pg_a_relay_claiming_ahead_keeps_key_order_when_the_broker_rejects_whole_batches() {
    let broker = MemoryBroker::new();
    let flaky = FlakyPublisher::new(broker.clone(), FailAs::Rejection).fail_ratio(0.3);
    let retry = RetryPolicy::default()
        .with_max_attempts(1000)
        .with_base_delay(Duration::ZERO)
        .with_jitter(0.0);
    drain_in_key_order(4, flaky, &broker, retry);
}

/// Emits 3,000 messages over 7 keys, runs a per-key relay with batches of 100 on a pool
/// of `pool_size` into `publisher` until `broker` holds them all, and checks that each
/// arrived once, every key in id order, and every row is SENT.
fn drain_in_key_order(
    pool_size: u32,
    publisher: impl Publisher + 'static,
    broker: &MemoryBroker,
    retry: RetryPolicy,
) {
    const MESSAGES: u32 = 3000;
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    for chunk in (0..MESSAGES).collect::<Vec<_>>().chunks(500) {
        c.emit_all(chunk.iter().map(|&n| Moved {
            n,
            account: format!("acct-{}", n % 7),
        }))
        .unwrap();
    }
    let pool = Pool::builder()
        .max_size(pool_size)
        .connection_timeout(Duration::from_secs(120))
        .build(ConnectionManager::<PgConnection>::new(db.url.clone()))
        .unwrap();
    let store = PgRelayStore::new(pool).with_order(ClaimOrder::PerKey);
    let relay = Relay::new(store, publisher)
        .with_config(
            RelayConfig::default()
                .with_batch_size(100)
                .with_poll_interval(Duration::from_millis(100))
                .with_backlog_interval(Duration::from_millis(20))
                .with_retry(retry),
        )
        .unwrap();
    runtime().block_on(async {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task =
            tokio::spawn(
                async move { relay.run_until(async { stopped.await.unwrap_or(()) }).await },
            );
        let deadline = Instant::now() + Duration::from_secs(60);
        while broker.published("moved").len() < MESSAGES as usize {
            assert!(
                Instant::now() < deadline,
                "{} of {MESSAGES} published",
                broker.published("moved").len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
    });
    let published = broker.published("moved");
    assert_eq!(published.len(), MESSAGES as usize, "each message once");
    let mut last: HashMap<String, u32> = HashMap::new();
    for e in &published {
        let n: u32 = e
            .msg_id
            .as_str()
            .trim_end_matches(":Moved")
            .parse()
            .unwrap();
        if let Some(&before) = last.get(&e.key) {
            assert!(before < n, "key {} out of order: {before} then {n}", e.key);
        }
        last.insert(e.key.clone(), n);
    }
    let left = Pg::scalar(&mut c, "SELECT count(*) AS n FROM outbox WHERE status <> 1");
    assert_eq!(left, 0, "every row SENT");
}
