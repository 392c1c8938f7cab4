//! A relay that stalls while it holds a claimed batch (a separate process, stopped with
//! SIGSTOP, as a paused VM or a cut network leaves it) keeps its row locks only for its
//! store's stall timeout: another relay then publishes its keys, in order. And on
//! PostgreSQL the claim is READ COMMITTED even where the database's default is
//! REPEATABLE READ.

mod fixtures;

use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fixtures::{Backend, My, Pg, TestDb, exec, runtime};
use outbox_core::{
    ClaimedBatch as _, Error, MemoryBroker, OutboxEvent, PublishOutcomes, Publisher, Relay,
    RelayConfig, RelayStore as _, StoredMessage,
};
use outbox_diesel::{Emit as _, MysqlRelayStore, PgRelayStore};
use serde::{Deserialize, Serialize};

/// Fail-safe for waits; no assertion relies on it for timing.
const PATIENCE: Duration = Duration::from_secs(90);
/// The stalled relay's stall timeout: short, so that the test is quick.
const STALL: Duration = Duration::from_secs(2);

/// Tells the child test which database to stall on.
const CHILD_URL: &str = "OUTBOX_TEST_STALLED_RELAY_URL";
const CHILD_BACKEND: &str = "OUTBOX_TEST_STALLED_RELAY_BACKEND";
/// What the child prints once it holds its batch.
const HOLDING: &str = "STALLED-RELAY-HOLDS-ITS-BATCH";

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(key = account)]
struct Moved {
    #[outbox(id)]
    n: u32,
    account: String,
}

/// A broker that never answers: the relay that publishes to it sits mid-batch, holding
/// its claim's row locks. It says so on stdout for the parent test.
struct Hung;

impl Publisher for Hung {
    async fn publish(&self, batch: &[StoredMessage]) -> Result<PublishOutcomes, Error> {
        let ids: Vec<i64> = batch.iter().map(|m| m.id).collect();
        {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{HOLDING} {ids:?}");
            let _ = out.flush();
        }
        std::future::pending().await
    }
}

/// The stalled relay: a child process run by the tests below (it does nothing when run
/// on its own). A relay with batches of 2 and the short stall timeout, stuck in its
/// first publish.
#[test]
#[ignore = "the stalled relay of the tests in this file, run by them as a child process"]
fn stalled_relay_child() {
    let (Ok(url), Ok(backend)) = (std::env::var(CHILD_URL), std::env::var(CHILD_BACKEND)) else {
        return;
    };
    let config = RelayConfig::default()
        .with_batch_size(2)
        .with_poll_interval(Duration::from_millis(100));
    runtime().block_on(async move {
        let stopped = match backend.as_str() {
            "pg" => {
                let store =
                    PgRelayStore::new(pool::<diesel::PgConnection>(&url)).with_stall_timeout(STALL);
                Relay::new(store, Hung)
                    .with_config(config)
                    .unwrap()
                    .run_until(std::future::pending())
                    .await
            }
            "mysql" => {
                let store = MysqlRelayStore::new(pool::<diesel::MysqlConnection>(&url))
                    .with_stall_timeout(STALL);
                Relay::new(store, Hung)
                    .with_config(config)
                    .unwrap()
                    .run_until(std::future::pending())
                    .await
            }
            other => panic!("unknown backend {other}"),
        };
        panic!("the stalled relay stopped: {stopped:?}");
    });
}

fn pool<C: diesel::r2d2::R2D2Connection + 'static>(
    url: &str,
) -> diesel::r2d2::Pool<diesel::r2d2::ConnectionManager<C>> {
    diesel::r2d2::Pool::builder()
        .max_size(2)
        .connection_timeout(Duration::from_secs(10))
        .build(diesel::r2d2::ConnectionManager::new(url))
        .unwrap()
}

/// The child relay process; killed (also while stopped) when dropped.
struct StalledRelay(Child);

impl StalledRelay {
    /// Starts the child relay on `db` and waits until it holds a batch; returns the ids
    /// of the batch it holds.
    fn start(db: &TestDb, backend: &str) -> (Self, String) {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "stalled_relay_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_URL, &db.url)
            .env(CHILD_BACKEND, backend)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the test binary runs again as the stalled relay");
        let stdout = child.stdout.take().unwrap();
        let relay = Self(child);
        for line in BufReader::new(stdout).lines() {
            let line = line.unwrap();
            // libtest may print its "test .. ..." on the same line.
            if let Some((_, ids)) = line.split_once(HOLDING) {
                return (relay, ids.trim().to_owned());
            }
        }
        panic!("the stalled relay ended before it held a batch");
    }

    fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{name}"), &self.0.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{name} failed");
    }
}

impl Drop for StalledRelay {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Keys a:[1,3], b:[2,4], c:[5]. The child relay holds rows 1 and 2 (its first batch)
/// and is stopped. A second relay publishes c at once, and, once the stopped relay's
/// claim has timed out, a and b, each in order.
async fn stalled_relay_releases_its_keys<B: Backend>(backend: &str) {
    let db = B::create();
    let mut c = B::connect(&db);
    c.emit_all(
        [(1, "a"), (2, "b"), (3, "a"), (4, "b"), (5, "c")]
            .into_iter()
            .map(|(n, account)| Moved {
                n,
                account: account.into(),
            }),
    )
    .unwrap();
    let (stalled, held) = StalledRelay::start(&db, backend);
    stalled.signal("STOP");
    assert_eq!(held.matches(',').count(), 1, "holds two rows: {held}");

    let broker = MemoryBroker::new();
    let relay = Relay::new(B::store(&db), broker.clone())
        .with_config(RelayConfig::default().with_poll_interval(Duration::from_millis(100)))
        .unwrap();
    let started = Instant::now();
    let published = |b: &MemoryBroker| b.published(Moved::TOPICS[0]).len();
    let all_out = {
        let broker = broker.clone();
        async move {
            while published(&broker) < 5 && started.elapsed() < PATIENCE {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    relay.run_until(all_out).await.unwrap();
    let took = started.elapsed();
    let order: Vec<(String, String)> = broker
        .published(Moved::TOPICS[0])
        .iter()
        .map(|e| (e.key.clone(), e.msg_id.as_str().to_owned()))
        .collect();
    println!("published after {took:?} (stall timeout {STALL:?}): {order:?}");
    assert_eq!(
        order.len(),
        5,
        "the stopped relay's rows were never released: {order:?}"
    );
    for key in ["a", "b"] {
        let of_key: Vec<&str> = order
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, id)| id.as_str())
            .collect();
        let want = if key == "a" {
            ["1:Moved", "3:Moved"]
        } else {
            ["2:Moved", "4:Moved"]
        };
        assert_eq!(of_key, want, "key {key} in order");
    }
    drop(stalled);
}

#[test]
fn pg_stalled_relay_releases_its_keys_after_the_stall_timeout() {
    runtime().block_on(async {
        stalled_relay_releases_its_keys::<Pg>("pg").await;
    });
}

#[test]
fn mysql_stalled_relay_releases_its_keys_after_the_stall_timeout() {
    runtime().block_on(async {
        stalled_relay_releases_its_keys::<My>("mysql").await;
    });
}

/// With `default_transaction_isolation = 'repeatable read'` (here on the store's
/// connections through the URL), a claim whose statement began before another relay
/// marked one of its rows SENT still claims: its transaction is READ COMMITTED. Under
/// REPEATABLE READ it would fail with a serialization error, and the relay back off as
/// after an outage.
///
/// Made deterministic with a table lock: the claim's statement takes its snapshot, then
/// waits for `LOCK TABLE .. IN EXCLUSIVE MODE` while the locking session updates a row
/// and commits.
#[test]
fn pg_claim_is_read_committed_under_a_repeatable_read_default() {
    runtime().block_on(async {
        let db = Pg::create();
        let mut c = Pg::connect(&db);
        c.emit_all((1..=3).map(|n| Moved {
            n,
            account: format!("k{n}"),
        }))
        .unwrap();
        let rr_url = format!(
            "{}%20-cdefault_transaction_isolation%3Drepeatable%5C%20read",
            db.url
        );
        let mut rr = <diesel::PgConnection as diesel::Connection>::establish(&rr_url).unwrap();
        assert_eq!(
            Pg::scalar(
                &mut rr,
                "SELECT (current_setting('default_transaction_isolation') = 'repeatable read')::int::int8 AS n"
            ),
            1,
            "the store's connections default to REPEATABLE READ"
        );
        let store = PgRelayStore::new(pool::<diesel::PgConnection>(&rr_url));

        let mut locker = Pg::connect(&db);
        exec(&mut locker, "BEGIN; LOCK TABLE outbox IN EXCLUSIVE MODE;");
        let claim = tokio::spawn(async move {
            store
                .claim(10)
                .await
                .map(|b| b.messages().iter().map(|m| m.id).collect::<Vec<_>>())
        });
        let waiting = format!(
            "SELECT count(*) AS n FROM pg_locks l JOIN pg_class r ON r.oid = l.relation \
             WHERE NOT l.granted AND r.relname = 'outbox' AND r.relnamespace = '{}'::regnamespace",
            db.name
        );
        let started = Instant::now();
        while Pg::scalar(&mut c, &waiting) == 0 {
            assert!(started.elapsed() < PATIENCE, "the claim never waited for the lock");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Another relay's update of a row the claim is about to lock, committed after
        // the claim's snapshot.
        exec(
            &mut locker,
            "UPDATE outbox SET retries = retries WHERE id = (SELECT min(id) FROM outbox); COMMIT;",
        );
        let claimed = claim.await.unwrap();
        assert!(
            claimed.as_ref().is_ok_and(|ids| ids.len() == 3),
            "the claim failed or missed rows: {claimed:?}"
        );
    });
}
