//! The SQLite relay's single-relay lock: an idle relay takes no write lock, a relay in
//! another process keeps a second one out with a typed error until it dies (SIGKILL
//! frees the database at once), a removed lock file stops the relay, and databases
//! without a file fall back to a lease row.

mod fixtures;

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use diesel::r2d2::{ConnectionManager, Pool};
use diesel::{Connection as _, QueryableByName, RunQueryDsl as _, SqliteConnection};
use fixtures::{Backend, Lite, exec, runtime};
use outbox_core::{OutboxEvent, RelayStore};
use outbox_diesel::{Emit as _, Error, SqliteCustomizer, SqlitePool, SqliteRelayStore};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
struct Pinged {
    #[outbox(id)]
    n: u32,
}

#[derive(QueryableByName)]
struct DataVersion {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    data_version: i64,
}

/// A pool whose connections give up on a lock after 200 ms, so that a claim that needed
/// the write lock fails quickly instead of waiting.
fn impatient_pool(db: &str) -> SqlitePool {
    Pool::builder()
        .max_size(2)
        .connection_customizer(Box::new(
            SqliteCustomizer::default().busy_timeout(Duration::from_millis(200)),
        ))
        .build(ConnectionManager::<SqliteConnection>::new(db))
        .unwrap()
}

/// SQLite fails a deferred read-then-write transaction when another connection holds or
/// took the write lock in between, so an idle relay must neither write nor take the
/// write lock. Checked both ways: claims succeed while the application holds the write
/// lock, and they commit nothing (the database's `data_version` does not move).
#[test]
fn idle_claims_take_no_write_lock_and_write_nothing() {
    let db = Lite::create();
    let store = SqliteRelayStore::new(impatient_pool(&db.url)).unwrap();
    let mut app = Lite::connect(&db);
    // One message waiting for its retry: there are NEW rows, none due.
    app.emit(Pinged { n: 1 }).unwrap();
    exec(
        &mut app,
        "UPDATE outbox SET next_retry_at = strftime('%Y-%m-%d %H:%M:%f', 'now', '+1 hour');",
    );
    let rt = runtime();

    exec(
        &mut app,
        "BEGIN IMMEDIATE; UPDATE accounts SET balance = balance + 1;",
    );
    for _ in 0..3 {
        let batch = rt
            .block_on(store.claim(10))
            .expect("an idle claim does not wait for the write lock");
        assert!(outbox_core::ClaimedBatch::messages(&batch).is_empty());
    }
    rt.block_on(store.backlog()).expect("the backlog is a read");
    exec(&mut app, "COMMIT;");

    let mut observer = Lite::connect(&db);
    let version = |c: &mut SqliteConnection| {
        diesel::sql_query("PRAGMA data_version")
            .get_result::<DataVersion>(c)
            .unwrap()
            .data_version
    };
    let before = version(&mut observer);
    for _ in 0..5 {
        let batch = rt.block_on(store.claim(10)).unwrap();
        assert!(outbox_core::ClaimedBatch::messages(&batch).is_empty());
        rt.block_on(store.backlog()).unwrap();
    }
    assert_eq!(
        version(&mut observer),
        before,
        "idle claims committed a write"
    );
}

/// The crate docs' advice for SQLite: a transaction that reads, then writes, run with
/// `immediate_transaction` on a connection with a busy timeout, waits for a relay that is
/// busy writing (marking batches SENT) instead of failing with `database is locked`.
/// (With a plain `transaction` instead, 62 to 95 of the 2,000 failed in four runs here.)
#[test]
fn immediate_transactions_wait_for_a_working_relay() {
    let db = Lite::create();
    let store = SqliteRelayStore::new(Lite::pool(&db, 2)).unwrap();
    let broker = outbox_core::MemoryBroker::new();
    let config = outbox_core::RelayConfig::default().with_poll_interval(Duration::from_millis(10));
    let relay = outbox_core::Relay::new(store, broker.clone())
        .with_config(config)
        .unwrap();
    let rt = runtime();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = rt.spawn(async move {
        relay
            .run_until(async {
                let _ = stopped.await;
            })
            .await
    });

    let mut app = Lite::connect(&db); // busy_timeout 5 s, WAL
    const N: u32 = 2000;
    let mut failed = Vec::new();
    for n in 1..=N {
        let done = app.immediate_transaction(|c| {
            let balance = diesel::sql_query("SELECT balance AS n FROM accounts WHERE id = 'alice'")
                .get_result::<Balance>(c)?
                .n;
            diesel::sql_query(format!(
                "UPDATE accounts SET balance = {} WHERE id = 'alice'",
                balance - 1
            ))
            .execute(c)?;
            c.emit(Pinged { n })?;
            Ok::<_, diesel::result::Error>(())
        });
        if let Err(e) = done {
            failed.push(e.to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        failed.first()
    );
    // The relay was working all along: it publishes every message.
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(60), async {
            while broker.published("pinged").len() < N as usize {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("every message published");
    });
    stop.send(()).unwrap();
    rt.block_on(running).unwrap().unwrap();
}

#[derive(QueryableByName)]
struct Balance {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

/// A relay in another process holds the database: a second one gets the typed error
/// naming it and the lock file. Once that process is killed with SIGKILL, which runs no
/// clean-up, a new relay starts at once.
#[test]
fn relay_of_a_live_process_excludes_and_a_sigkilled_one_frees_at_once() {
    let db = Lite::create();
    let (mut holder, holder_owner) = start_holder(&db.url);
    assert!(
        holder_owner.starts_with(&format!("pid{}-", holder.id())),
        "{holder_owner}"
    );

    let err = SqliteRelayStore::new(Lite::pool(&db, 2)).unwrap_err();
    assert!(err.is_relay_conflict(), "{err}");
    match &err {
        Error::RelayAlreadyRunning { owner, lock } => {
            assert_eq!(owner, &holder_owner);
            assert!(lock.ends_with(".outbox-relay.lock"), "{lock}");
        }
        other => panic!("expected RelayAlreadyRunning, got {other}"),
    }

    holder.kill().expect("SIGKILL"); // std's kill is SIGKILL on Unix
    holder.wait().expect("reaped");
    let store = SqliteRelayStore::new(Lite::pool(&db, 2)).expect("no wait after SIGKILL");
    let mut app = Lite::connect(&db);
    app.emit(Pinged { n: 1 }).unwrap();
    let batch = runtime().block_on(store.claim(10)).unwrap();
    assert_eq!(outbox_core::ClaimedBatch::messages(&batch).len(), 1);
}

/// The environment variable that turns [`holder_process`] into a relay holder.
const HOLDER_DB: &str = "OUTBOX_DIESEL_TEST_HOLDER_DB";

/// Not a test of its own: run by [`start_holder`] in a child process, where it takes the
/// relay lock of the database in [`HOLDER_DB`], prints its owner token and waits to be
/// killed.
#[test]
#[ignore = "a helper process of relay_of_a_live_process_excludes_and_a_sigkilled_one_frees_at_once"]
fn holder_process() {
    let Ok(db) = std::env::var(HOLDER_DB) else {
        return;
    };
    let store = SqliteRelayStore::new(outbox_diesel::sqlite_pool(&db, 1).unwrap()).unwrap();
    println!("holding {}", store.owner());
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// This test binary, running only [`holder_process`] on `db`; returns once it holds the
/// lock, with its owner token.
fn start_holder(db: &str) -> (Child, String) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["holder_process", "--exact", "--ignored", "--nocapture"])
        .env(HOLDER_DB, db)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the holder process");
    let stdout = BufReader::new(child.stdout.take().unwrap());
    for line in stdout.lines() {
        let line = line.expect("the holder's output");
        if let Some(owner) = line.strip_prefix("holding ") {
            return (child, owner.to_owned());
        }
    }
    let status = child.wait().unwrap();
    panic!("the holder process exited ({status}) without taking the lock");
}

/// A lock file removed while its relay runs lets another relay lock a new one: the
/// first relay notices at its next claim and stops instead of running alongside.
#[test]
fn removed_lock_file_stops_the_relay() {
    let db = Lite::create();
    let stale = SqliteRelayStore::new(Lite::pool(&db, 2)).unwrap();
    let path = stale.lock_file().expect("a file database has a lock file");
    assert!(
        path.to_str().unwrap().ends_with(".db.outbox-relay.lock"),
        "{path:?}"
    );
    std::fs::remove_file(path).unwrap();
    let fresh = SqliteRelayStore::new(Lite::pool(&db, 2)).expect("a new lock file");
    runtime().block_on(async {
        let e = stale.claim(10).await.unwrap_err();
        assert!(!e.is_outage(), "losing the lock is no outage: {e}");
        let outbox_core::Error::RelayConflict(inner) = &e else {
            panic!("expected a relay conflict, got {e}");
        };
        let inner = inner.downcast_ref::<Error>().unwrap();
        assert!(
            matches!(inner, Error::LeaseLost { owner } if owner == fresh.owner()),
            "{inner}"
        );
        // The stale relay stops instead of retrying forever.
        let relay = outbox_core::Relay::new(stale, outbox_core::MemoryBroker::new());
        let stopped = tokio::time::timeout(
            Duration::from_secs(60),
            relay.run_until(std::future::pending()),
        )
        .await
        .expect("the stale relay stops by itself");
        assert!(
            matches!(stopped, Err(outbox_core::Error::RelayConflict(_))),
            "{stopped:?}"
        );
        fresh.claim(10).await.unwrap();
    });
}

/// A lock file that cannot be opened is a typed error naming it, not a panic.
#[test]
fn unusable_lock_file_is_a_typed_error() {
    let db = Lite::create();
    let lock = format!("{}.outbox-relay.lock", db.url);
    std::fs::create_dir(&lock).unwrap();
    let err = SqliteRelayStore::new(Lite::pool(&db, 2)).unwrap_err();
    std::fs::remove_dir(&lock).unwrap();
    match &err {
        Error::RelayLock { path, .. } => assert_eq!(path.to_str(), Some(lock.as_str())),
        other => panic!("expected RelayLock, got {other}"),
    }
    assert!(err.to_string().contains(&lock), "{err}");
}

/// A database without a file lives in one process: there the store takes the lease row
/// once and gives it up when dropped, so two stores on one shared in-memory database
/// exclude each other.
#[test]
fn in_memory_database_takes_the_lease_row() {
    let url = format!(
        "file:{}?mode=memory&cache=shared",
        outbox_tests::unique("outbox_mem")
    );
    // Kept open: a shared in-memory database lives while a connection to it does.
    let mut keeper = SqliteConnection::establish(&url).unwrap();
    outbox_diesel::migrate(&mut keeper).unwrap();
    let pool = || {
        Pool::builder()
            .max_size(1)
            .build(ConnectionManager::<SqliteConnection>::new(&url))
            .unwrap()
    };
    let first = SqliteRelayStore::new(pool()).unwrap();
    assert_eq!(first.lock_file(), None);
    match SqliteRelayStore::new(pool()).unwrap_err() {
        Error::RelayAlreadyRunning { owner, lock } => {
            assert_eq!(owner, first.owner());
            assert!(lock.contains("outbox_relay_lease"), "{lock}");
        }
        other => panic!("expected RelayAlreadyRunning, got {other}"),
    }
    keeper.emit(Pinged { n: 1 }).unwrap();
    let batch = runtime().block_on(first.claim(10)).unwrap();
    assert_eq!(outbox_core::ClaimedBatch::messages(&batch).len(), 1);
    drop(batch);
    drop(first);
    SqliteRelayStore::new(pool()).expect("released on drop");
}
