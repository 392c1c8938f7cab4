//! `outbox relay` on a SQLite file, as an application and a supervisor meet it: an idle
//! relay must not make the application's transactions fail, a relay killed with SIGKILL
//! is replaced at once, and a second live relay on the same file is refused.

mod fixtures;

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection as _;
use diesel::{Connection as _, QueryableByName, RunQueryDsl as _, SqliteConnection};
use fixtures::process::Background;
use fixtures::relay::{Streams, start_relay};
use fixtures::{TestDb, redis_url};
use predicates::str::contains;

/// Fail-safe for waits on the subprocess and Redis; no test relies on it for timing.
const PATIENCE: Duration = Duration::from_secs(60);

/// An idle relay polling every 100 ms, next to an application whose transactions read,
/// then write (diesel's default `transaction`: a deferred `BEGIN`). SQLite fails such a
/// transaction with `database is locked` when another connection wrote (or held the write
/// lock) between its read and its write, so a relay that writes while it has nothing to
/// do breaks the application's transactions at random. It must write nothing.
#[test]
fn idle_sqlite_relay_does_not_fail_deferred_transactions() {
    let db = TestDb::sqlite();
    db.migrate();
    db.exec(
        "CREATE TABLE counter (id INTEGER PRIMARY KEY, n INTEGER NOT NULL);
         INSERT INTO counter (id, n) VALUES (1, 0);",
    );
    let streams = Streams::new();
    let mut relay = start_relay(&db, &streams.prefix, &[]);
    // The relay is up and polling once it has published a message and marked it SENT;
    // from then on it has nothing to do.
    db.emit([1]);
    streams.wait_for(1, &mut relay);
    wait_until_sent(&db, 1, &mut relay);

    let mut app = app_connection(&db);
    let (mut applied, mut locked, mut other) = (0_i64, 0_u32, Vec::new());
    // Long enough for ~30 polls; the assertions do not depend on how many there were.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let done = app.transaction(|c| {
            let n = diesel::sql_query("SELECT n FROM counter WHERE id = 1")
                .get_result::<N>(c)?
                .n;
            diesel::sql_query(format!("UPDATE counter SET n = {} WHERE id = 1", n + 1))
                .execute(c)?;
            Ok::<_, diesel::result::Error>(())
        });
        match done {
            Ok(()) => applied += 1,
            Err(e) if e.to_string().contains("database is locked") => locked += 1,
            Err(e) => other.push(e.to_string()),
        }
    }
    println!("{applied} transactions applied, {locked} failed with `database is locked`");
    assert_eq!(
        relay.child.try_wait().expect("try_wait"),
        None,
        "the relay stopped during the test; log:\n{}",
        relay.log()
    );
    assert_eq!(
        locked,
        0,
        "an idle relay made {locked} of {} transactions fail with `database is locked`",
        applied + i64::from(locked)
    );
    assert!(other.is_empty(), "other failures: {other:?}");
    let n = diesel::sql_query("SELECT n FROM counter WHERE id = 1")
        .get_result::<N>(&mut app)
        .unwrap()
        .n;
    assert!(
        applied > 0 && n == applied,
        "{applied} applied, counter {n}"
    );

    // It was polling all along: a message committed now is published without a restart.
    db.emit([2]);
    assert_eq!(streams.wait_for(2, &mut relay), ["1:Ping", "2:Ping"]);
    relay.stop();
}

/// A supervisor restarts a relay killed with SIGKILL at once: the new one must run, not
/// be refused until some lease of the dead one expires.
#[test]
fn sqlite_relay_killed_with_sigkill_is_replaced_at_once() {
    let db = TestDb::sqlite();
    db.migrate();
    db.emit([1]);
    let streams = Streams::new();
    let mut first = start_relay(&db, &streams.prefix, &[]);
    streams.wait_for(1, &mut first);

    first.child.kill().expect("SIGKILL"); // std's kill is SIGKILL on Unix
    let status = first.wait();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "{status}"
    );

    let mut second = start_relay(&db, &streams.prefix, &[]);
    db.emit([2]);
    let published = streams.wait_for(2, &mut second);
    assert_eq!(published, ["1:Ping", "2:Ping"]);
    assert!(
        !second.log().contains("another relay"),
        "log:\n{}",
        second.log()
    );
    second.stop();
}

/// SQLite has no row locks: one relay per database file. A second one started while the
/// first runs is refused with a clear message; the first goes on.
#[test]
fn second_live_sqlite_relay_is_refused() {
    let db = TestDb::sqlite();
    db.migrate();
    db.emit([1]);
    let streams = Streams::new();
    let mut first = start_relay(&db, &streams.prefix, &[]);
    streams.wait_for(1, &mut first);

    let pid = first.child.id();
    db.outbox()
        .args([
            "relay",
            "--redis-url",
            &redis_url(),
            "--stream-prefix",
            &streams.prefix,
        ])
        .timeout(PATIENCE)
        .assert()
        .code(1)
        .stderr(contains("error: cannot start the relay"))
        .stderr(contains(format!("another relay (pid{pid}-")))
        .stderr(contains(".outbox-relay.lock"))
        .stderr(contains("hint: stop the other relay"));

    db.emit([2]);
    assert_eq!(streams.wait_for(2, &mut first), ["1:Ping", "2:Ping"]);
    first.stop();
}

#[derive(QueryableByName)]
struct N {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

/// The application's connection, set up as the crate's docs advise (WAL, a busy timeout).
fn app_connection(db: &TestDb) -> SqliteConnection {
    let mut c = SqliteConnection::establish(db.sqlite_path().to_str().unwrap()).expect("open");
    c.batch_execute("PRAGMA busy_timeout = 5000; PRAGMA journal_mode = WAL;")
        .expect("pragmas");
    c
}

/// Waits until `<n>:Ping` is SENT, reading the database (a reader takes no write lock).
fn wait_until_sent(db: &TestDb, n: u32, relay: &mut Background) {
    let deadline = Instant::now() + PATIENCE;
    let mut c = app_connection(db);
    loop {
        let sent = diesel::sql_query(format!(
            "SELECT count(*) AS n FROM outbox WHERE msg_id = '{n}:Ping' AND status = 1"
        ))
        .get_result::<N>(&mut c)
        .unwrap()
        .n;
        if sent == 1 {
            return;
        }
        assert!(relay.child.try_wait().unwrap().is_none(), "{}", relay.log());
        assert!(Instant::now() < deadline, "not SENT; log:\n{}", relay.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}
