//! A rough drain rate, CDC beside polling, on one private cluster and the shared Redis
//! (the bench measures it properly). Run with `--ignored --nocapture`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use diesel::connection::SimpleConnection as _;
use outbox_core::{Relay, RelayConfig};
use outbox_diesel::PgRelayStore;

const N: u32 = 20_000;

fn backlog(db: &Db, key_prefix: &str) {
    db.conn()
        .batch_execute(&format!(
            "INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) \
             SELECT '{key_prefix}' || (g % 100) || ':' || g, '{TOPIC}', 'Ping', \
             '{key_prefix}' || (g % 100), '{{\"n\": 1}}' FROM generate_series(1, {N}) g"
        ))
        .unwrap();
}

fn wait_len(name: &str, n: usize) {
    let client = redis::Client::open(outbox_tests::redis_url()).unwrap();
    let mut c = client.get_connection().unwrap();
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let len: usize = redis::cmd("XLEN").arg(name).query(&mut c).unwrap();
        if len >= n {
            return;
        }
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "a measurement: run with --ignored --nocapture"]
async fn drain_rate_cdc_beside_polling() {
    let db = Db::start(false);
    // Polling first.
    backlog(&db, "p");
    let (_, name) = publisher();
    let relay = Relay::new(PgRelayStore::new(db.pool.clone()), publisher_for(&name))
        .with_config(RelayConfig::default().with_poll_interval(Duration::from_millis(50)))
        .unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let start = Instant::now();
    let task = tokio::spawn(async move {
        relay
            .run_until(async {
                let _ = rx.await;
            })
            .await
    });
    wait_len(&name, N as usize);
    let polling = start.elapsed();
    tx.send(()).unwrap();
    task.await.unwrap().unwrap();

    // CDC: the backlog committed after the slot.
    db.setup(&fast());
    backlog(&db, "c");
    let (_, name) = publisher();
    let start = Instant::now();
    let (tx, task) = spawn_relay(&db, publisher_for(&name), fast());
    wait_len(&name, N as usize);
    let cdc = start.elapsed();
    tx.send(()).unwrap();
    task.await.unwrap().unwrap();
    // The same transaction committed while the relay runs.
    let (_, name) = publisher();
    let (tx, task) = spawn_relay(&db, publisher_for(&name), fast());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let start = Instant::now();
    backlog(&db, "l");
    let inserted = start.elapsed();
    wait_len(&name, N as usize);
    let live = start.elapsed();
    tx.send(()).unwrap();
    task.await.unwrap().unwrap();
    eprintln!(
        "one transaction of {N} while the relay runs: inserted in {inserted:?}, published after {live:?}"
    );
    eprintln!(
        "drain of {N}: polling {:.0}/s, CDC {:.0}/s ({:.2}x)",
        f64::from(N) / polling.as_secs_f64(),
        f64::from(N) / cdc.as_secs_f64(),
        polling.as_secs_f64() / cdc.as_secs_f64()
    );
}
