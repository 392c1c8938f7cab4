//! `outbox relay` as operators run it: a subprocess publishing to the real Redis until a
//! signal stops it.

mod fixtures;

use std::fs::File;
use std::net::TcpListener;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fixtures::relay::{Streams, scrape, start_relay, start_relay_on};
use fixtures::{Backend, Mariadb, Postgres, Sqlite, TestDb, outbox, redis_url, unique};
use predicates::str::contains;

/// Fail-safe for waits on the subprocess and Redis; no test relies on it for timing.
const PATIENCE: Duration = Duration::from_secs(60);

outbox_tests::on_every_backend! {
    postgres => Postgres, mariadb => Mariadb, sqlite => Sqlite;
    relay_publishes_committed_messages_and_stops_on_sigterm,
    relay_process_publishes_everything_after_a_12_s_redis_outage,
}

#[test]
fn postgres_stalled_relay_process_releases_its_rows() {
    stalled_relay_process_releases_its_rows(&TestDb::postgres());
}

#[test]
fn mariadb_stalled_relay_process_releases_its_rows() {
    stalled_relay_process_releases_its_rows(&TestDb::mysql());
}

fn relay_publishes_committed_messages_and_stops_on_sigterm<B: Backend>() {
    let db = &TestDb::new(B::ENGINE);
    db.migrate();
    db.emit(1..=5);
    let streams = Streams::new();
    let mut relay = start_relay(db, &streams.prefix, &[]);

    streams.wait_for(5, &mut relay);
    // Committed while the relay runs: picked up without a restart.
    db.emit(6..=7);
    let published = streams.wait_for(7, &mut relay);
    let expected: Vec<String> = (1..=7).map(|n| format!("{n}:Ping")).collect();
    assert_eq!(published, expected, "every message once, in commit order");

    relay.signal("TERM");
    let status = relay.wait();
    assert!(
        status.success(),
        "exit {status} after SIGTERM; log:\n{}",
        relay.log()
    );
    assert!(
        relay.log().contains("relay stopped"),
        "log:\n{}",
        relay.log()
    );
    let backlog = db.status();
    assert_eq!(
        (backlog["due"].as_u64(), backlog["dead"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(
        db.json(&["dead", "show", "7:Ping", "--json"])["status"],
        "SENT"
    );
}

/// The relay process against a private Redis (AOF on) killed for 12 s, longer than the
/// claim interval plus the longest outage backoff: it publishes what was committed
/// before, during and after, each message once and in order, spends no retry, and still
/// stops on SIGTERM.
fn relay_process_publishes_everything_after_a_12_s_redis_outage<B: Backend>() {
    let db = &TestDb::new(B::ENGINE);
    db.migrate();
    let mut redis = outbox_tests::ScratchRedis::start_persistent();
    let streams = Streams::on(&redis.url());
    let mut relay = start_relay_on(db, &redis.url(), &streams.prefix, &[]);
    db.emit(1..=20);
    streams.wait_for(20, &mut relay);

    redis.stop();
    db.emit(21..=40);
    std::thread::sleep(Duration::from_secs(12));
    redis.restart();
    db.emit(41..=60);

    let published = streams.wait_for(60, &mut relay);
    let expected: Vec<String> = (1..=60).map(|n| format!("{n}:Ping")).collect();
    assert_eq!(published, expected, "every message once, in commit order");
    let backlog = db.status();
    assert_eq!(
        (backlog["due"].as_u64(), backlog["dead"].as_u64()),
        (Some(0), Some(0)),
        "an outage spends no retry"
    );
    relay.signal("TERM");
    assert!(relay.wait().success(), "log:\n{}", relay.log());
}

/// `outbox relay --stall-timeout 2s` SIGSTOPped while it works through a backlog (so it
/// holds a claimed batch): the database ends its transaction after the bound and a
/// second relay publishes every message, where it would otherwise wait for the stopped
/// process's locks for as long as TCP keeps the connection (hours).
fn stalled_relay_process_releases_its_rows(db: &TestDb) {
    db.migrate();
    for chunk in 0..10 {
        db.emit(chunk * 2000 + 1..=(chunk + 1) * 2000);
    }
    let streams = Streams::new();
    let bound = ["--stall-timeout", "2s", "--batch-size", "200"];
    let mut stalled = start_relay(db, &streams.prefix, &bound);
    streams.wait_for(1, &mut stalled);
    stalled.signal("STOP");
    let mut rescuer = start_relay(db, &streams.prefix, &bound);
    let deadline = Instant::now() + PATIENCE;
    loop {
        let mut published = streams.msg_ids();
        published.sort();
        published.dedup();
        if published.len() == 20_000 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} of 20000 published with one relay stopped; log:\n{}",
            published.len(),
            rescuer.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    stalled.signal("CONT");
    rescuer.signal("TERM");
    assert!(rescuer.wait().success(), "log:\n{}", rescuer.log());
}

/// A supervisor's SIGTERM while the relay is still starting (here: connecting to a
/// server that accepts the connection and never answers) ends it with exit 0, not with
/// death by the signal. Found by the chaos run.
#[test]
fn sigterm_during_start_up_exits_0() {
    let silent = TcpListener::bind("127.0.0.1:0").expect("a free port");
    let port = silent.local_addr().unwrap().port();
    let log = std::env::temp_dir().join(format!("{}.log", unique("outbox_relay")));
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "info")
        .args([
            "--database-url",
            &format!("postgres://postgres@127.0.0.1:{port}/test"),
            "relay",
            "--redis-url",
            &redis_url(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(&log).expect("log file"))
        .spawn()
        .expect("start the relay");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the relay is still starting"
    );
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill runs");
    let deadline = Instant::now() + PATIENCE;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the relay did not stop");
        std::thread::sleep(Duration::from_millis(20));
    };
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    drop(silent);
    assert!(status.success(), "exit {status}; log:\n{output}");
}

#[test]
fn unordered_relay_publishes_everything_once() {
    let db = TestDb::postgres();
    db.migrate();
    db.emit(1..=5);
    let streams = Streams::new();
    let mut relay = start_relay(&db, &streams.prefix, &["--order", "unordered"]);
    let published = streams.wait_for(5, &mut relay);
    let mut sorted = published.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 5, "every message once: {published:?}");
    relay.signal("TERM");
    assert!(relay.wait().success(), "log:\n{}", relay.log());
    assert!(
        relay.log().contains("Unordered"),
        "the order is logged:\n{}",
        relay.log()
    );
}

#[test]
fn sqlite_relay_serves_metrics_is_alone_and_stops_on_sigint() {
    let db = TestDb::sqlite();
    db.migrate();
    db.emit(1..=3);
    let streams = Streams::new();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], outbox_tests::ports::free_port()));
    let mut relay = start_relay(&db, &streams.prefix, &["--admin-addr", &addr.to_string()]);
    streams.wait_for(3, &mut relay);

    let metrics = scrape(addr);
    assert!(
        metrics.contains("outbox_relay_published_total"),
        "metrics:\n{metrics}"
    );
    assert!(
        metrics.contains("outbox_backlog_due"),
        "metrics:\n{metrics}"
    );

    // SQLite has no row locks: a second relay on the same file is refused.
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
        .stderr(contains("another relay"))
        .stderr(contains("hint: stop the other relay"));

    relay.signal("INT");
    let status = relay.wait();
    assert!(
        status.success(),
        "exit {status} after SIGINT; log:\n{}",
        relay.log()
    );

    // The lease was given up on the way out: a new relay may start.
    let mut next = start_relay(&db, &streams.prefix, &[]);
    db.emit([4]);
    assert_eq!(streams.wait_for(4, &mut next).len(), 4);
    next.signal("TERM");
    assert!(next.wait().success(), "log:\n{}", next.log());
}

#[test]
fn relay_start_failures_are_reported() {
    let db = TestDb::sqlite();
    // A broker URL that does not parse is a usage error, reported before anything
    // connects or migrates: the tables are still missing afterwards.
    db.outbox()
        .args(["relay", "--migrate", "--redis-url", "not a url"])
        .timeout(PATIENCE)
        .assert()
        .code(2)
        .stderr(contains("error: invalid broker URL `not a url`"))
        .stderr(contains(
            "caused by: not a URL: expected e.g. redis://HOST:PORT",
        ));
    assert!(!db.sqlite_path().exists(), "nothing was migrated");
    outbox()
        .args([
            "--database-url",
            "postgres://postgres@127.0.0.1:1/test",
            "relay",
            "--redis-url",
            &redis_url(),
        ])
        .timeout(PATIENCE)
        .assert()
        .code(1)
        .stderr(contains("error: PostgreSQL is not reachable at"));
}

/// A PostgreSQL that accepts connections but says nothing for longer than the pool's
/// 10 s start timeout (a stalled proxy; or the relay itself SIGSTOPped while it connects,
/// as the chaos run found): the relay tries its start once more instead of exiting, and
/// publishes.
#[test]
fn a_start_that_timed_out_without_an_error_is_tried_again() {
    let db = TestDb::postgres();
    db.migrate();
    db.emit(1..=3);
    let streams = Streams::new();
    let (scheme_user, rest) = db.url.split_once('@').expect("a URL with a user");
    let (server, path) = rest.split_once('/').expect("a URL with a database");
    let proxy = silent_proxy(server, Duration::from_secs(11));
    let url = format!("{scheme_user}@{proxy}/{path}");
    let mut relay = fixtures::process::Background::spawn(
        &[
            "--database-url",
            &url,
            "relay",
            "--redis-url",
            &redis_url(),
            "--stream-prefix",
            &streams.prefix,
            "--poll-interval",
            "100ms",
        ],
        "info",
    );
    let published = streams.wait_for(3, &mut relay);
    assert_eq!(published, ["1:Ping", "2:Ping", "3:Ping"]);
    assert!(relay.log().contains("trying once more"), "{}", relay.log());
    relay.signal("TERM");
    assert!(relay.wait().success(), "{}", relay.log());
}

/// A TCP proxy to `server` that forwards its first connection (the command's look at
/// the database before the relay starts) at once, and holds the later ones (the pool's)
/// silent until `silence` after the second one came, then forwards them.
fn silent_proxy(server: &str, silence: Duration) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = server.to_owned();
    std::thread::spawn(move || {
        let mut until = None;
        for (n, client) in listener.incoming().flatten().enumerate() {
            let hold = match n {
                0 => Instant::now(),
                _ => *until.get_or_insert_with(|| Instant::now() + silence),
            };
            let server = server.clone();
            std::thread::spawn(move || {
                std::thread::sleep(hold.saturating_duration_since(Instant::now()));
                let Ok(upstream) = std::net::TcpStream::connect(&server) else {
                    return;
                };
                let mut up_read = upstream.try_clone().unwrap();
                let mut client_write = client.try_clone().unwrap();
                std::thread::spawn(move || std::io::copy(&mut up_read, &mut client_write));
                let (mut client_read, mut up_write) = (client, upstream);
                let _ = std::io::copy(&mut client_read, &mut up_write);
            });
        }
    });
    addr
}
