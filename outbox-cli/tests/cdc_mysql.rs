//! `outbox migrate --cdc`, `outbox relay --cdc`, `outbox status` and `/readyz` on a
//! mysql:// URL: the binlog CDC relay, against a private MariaDB with the binlog on
//! (`log_bin`, `binlog_format = ROW`; the shared server has it off). Also the refusals:
//! `--cdc` on SQLite, and on a MariaDB without the binlog.

mod fixtures;
#[cfg(feature = "serve")]
mod serve_support;

use std::time::{Duration, Instant};

use diesel::MysqlConnection;
use fixtures::cdc::{
    BULK_ROWS, cdc_relay, emit, free_addr, get, migrate_cdc, relayed_within_memory, status,
};
use fixtures::relay::Streams;
use fixtures::{TestDb, outbox};
use outbox_tests::ScratchMariadb;
use predicates::str::contains;

/// `status --json` once `done` holds of its `cdc`, within a minute (the relay reports
/// every 10 s).
fn status_until(
    url: &str,
    what: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = status(url);
        if done(&s["cdc"]) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: never so; last status {s}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn migrated(server: &ScratchMariadb) -> String {
    let url = server.url();
    outbox()
        .args(["--database-url", &url, "migrate"])
        .assert()
        .success();
    url
}

#[test]
fn binlog_cdc_relay_publishes_in_commit_order_and_status_reports_the_position() {
    let server = ScratchMariadb::start();
    let url = migrated(&server);
    // Committed before CDC mode: published by the backfill.
    emit::<MysqlConnection>(&url, 1..=3);
    outbox()
        .args(["--database-url", &url, "migrate", "--cdc"])
        .assert()
        .success()
        .stdout(contains("CDC relay set up on the binlog"))
        .stdout(contains("NEW rows with ids 1 to 3"));
    let s = status(&url);
    let cdc = &s["cdc"];
    assert_eq!(cdc["database"], "mariadb", "{s}");
    assert_eq!(cdc["slot"], "outbox_cdc", "{s}");
    assert_eq!(cdc["backfill_left"], 3, "{s}");
    assert_eq!(cdc["lost"], false, "{s}");
    assert!(cdc["lag_bytes"].is_null(), "no WAL on MariaDB: {s}");
    assert!(cdc["lag_transactions"].is_u64(), "{s}");
    assert!(
        cdc["position"].is_string() && cdc["server_position"].is_string(),
        "{s}"
    );
    assert!(s["due"].is_null(), "no NEW-row backlog in CDC mode: {s}");

    let streams = Streams::new();
    let admin = free_addr();
    let mut relay = cdc_relay(&url, &streams, admin, &[]);
    streams.wait_for(3, &mut relay);
    emit::<MysqlConnection>(&url, 4..=6);
    emit::<MysqlConnection>(&url, [7]);
    let published = streams.wait_for(7, &mut relay);
    let expected: Vec<String> = (1..=7).map(|n| format!("{n}:Ping")).collect();
    assert_eq!(published, expected, "every message once, in commit order");

    // The lag falls to zero with the relay's next idle report.
    let s = status_until(&url, "lag 0, reporting", |c| {
        c["lag_transactions"] == 0 && c["relay_reporting"] == true
    });
    let cdc = &s["cdc"];
    assert!(cdc["holder_pid"].is_u64(), "the relay holds the lock: {s}");
    assert_eq!(cdc["backfill_left"], 0, "{s}");
    assert_eq!(cdc["parked"], 0, "{s}");
    assert!(cdc["oldest_unconfirmed_age_seconds"].is_null(), "{s}");
    assert!(cdc["hint"].is_null(), "{s}");
    let text = outbox()
        .args(["--database-url", &url, "status"])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8(text).expect("UTF-8");
    assert!(
        text.contains("CDC on the MariaDB binlog (lock outbox_cdc)"),
        "{text}"
    );
    assert!(
        text.contains("position lag:      0 transaction(s)"),
        "{text}"
    );
    assert!(text.contains("lock holder:       connection "), "{text}");
    let ready = get(admin, "/readyz");
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    assert!(ready.contains("\"mariadb\""), "{ready}");
    #[cfg(feature = "serve")]
    the_page_shows_the_binlog_relay(&url);

    // The relayed watermark (what `purge sent` and `--to-polling` go by) reaches 7 within
    // three of the relay's reports.
    outbox_tests::wait_until_within(
        "the relayed watermark at 7",
        Duration::from_secs(120),
        || server.exec("SELECT relayed_through FROM outbox_cdc").trim() == "7",
    );
    relay.stop();
    assert_eq!(streams.msg_ids().len(), 7, "nothing published twice");

    // Stopped: the commits since are the backlog, and they age while nobody reports.
    emit::<MysqlConnection>(&url, [8]);
    let s = status(&url);
    assert_eq!(s["cdc"]["lag_transactions"], 1, "{s}");
    assert!(s["cdc"]["holder_pid"].is_null(), "{s}");

    // Retention: the rows stay NEW; `purge sent` deletes those up to the relayed
    // watermark, not message 8, which no relay read.
    let out = outbox()
        .args([
            "--database-url",
            &url,
            "purge",
            "sent",
            "--older-than",
            "0s",
        ])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let out = String::from_utf8(out).expect("UTF-8");
    assert!(
        out.contains("deleted 7 message(s) the CDC relay published"),
        "{out}"
    );
    let left = server.exec("SELECT GROUP_CONCAT(msg_id ORDER BY id) FROM outbox");
    assert_eq!(left.trim(), "8:Ping", "only the unrelayed message stays");

    // Back to polling: the relay's confirmed messages are SENT, the rest published by a
    // polling relay.
    outbox()
        .args(["--database-url", &url, "migrate", "--to-polling"])
        .assert()
        .success()
        .stdout(contains("CDC mode off"));
    assert!(status(&url)["cdc"].is_null(), "CDC mode off");
}

/// `outbox serve`'s overview (page and JSON) in MariaDB CDC mode, the relay caught up.
#[cfg(feature = "serve")]
fn the_page_shows_the_binlog_relay(url: &str) {
    let server = serve_support::Server::start(url, &["--token", serve_support::TOKEN]);
    let overview = server.json("/api/overview");
    assert_eq!(overview["cdc"]["database"], "mariadb", "{overview}");
    assert_eq!(overview["cdc"]["lag_transactions"], 0, "{overview}");
    let (status, page) = server.get("/");
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("CDC relay on the binlog, lock"), "{page}");
    assert!(page.contains("transactions behind"), "{page}");
    assert!(page.contains("held by connection"), "{page}");
}

#[test]
fn relay_migrate_sets_the_binlog_relay_up_and_recover_slot_moves_the_position() {
    let server = ScratchMariadb::start();
    let url = server.url();
    let streams = Streams::new();
    let admin = free_addr();
    // --migrate: the outbox tables and CDC mode, then the binlog from there.
    let mut relay = cdc_relay(&url, &streams, admin, &["--migrate"]);
    relay.wait_for_log("binlog CDC relay holds the lock", 1);
    emit::<MysqlConnection>(&url, 1..=2);
    emit::<MysqlConnection>(&url, [3]);
    assert_eq!(
        streams.wait_for(3, &mut relay),
        ["1:Ping", "2:Ping", "3:Ping"],
        "in commit order"
    );
    relay.stop();

    // After a purge the binlog no longer holds the stored position: --recover-slot
    // moves it to the binlog's now, and what committed since is the backfill.
    emit::<MysqlConnection>(&url, [4]);
    server.exec("FLUSH BINARY LOGS");
    let logs = server.exec("SHOW BINARY LOGS");
    let newest = logs
        .lines()
        .filter_map(|l| l.split('\t').next())
        .next_back()
        .expect("a binlog");
    // The server keeps a binlog until its checkpoint: purge until only the newest is left.
    outbox_tests::wait_until_within(
        "the old binlogs to be purged",
        Duration::from_secs(30),
        || {
            server.exec(&format!("PURGE BINARY LOGS TO '{newest}'"));
            server.exec("SHOW BINARY LOGS").lines().count() == 1
        },
    );
    let s = status(&url);
    assert_eq!(s["cdc"]["lost"], true, "{s}");
    let hint = s["cdc"]["hint"].as_str().unwrap_or_default();
    assert!(hint.contains("--recover-slot"), "{s}");
    let mut stopped = cdc_relay(&url, &streams, free_addr(), &[]);
    let exit = stopped.wait();
    assert!(!exit.success(), "a purged position stops the relay");
    assert!(
        stopped.log().contains("--recover-slot"),
        "{}",
        stopped.log()
    );
    outbox()
        .args(["--database-url", &url, "migrate", "--cdc", "--recover-slot"])
        .assert()
        .success()
        .stdout(contains("(recovered)"));
    assert_eq!(status(&url)["cdc"]["lost"], false, "recovered");
    // The backfill starts above the relayed watermark: some messages again, 4 among them.
    let mut relay = cdc_relay(&url, &streams, admin, &[]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !streams.msg_ids().contains(&"4:Ping".to_owned()) {
        assert!(
            Instant::now() < deadline,
            "4 never backfilled; log:\n{}",
            relay.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    relay.stop();
}

#[test]
fn cdc_on_sqlite_is_refused_with_the_reason() {
    let db = TestDb::sqlite();
    db.migrate();
    for args in [
        vec!["relay", "--cdc", "--broker", "redis://127.0.0.1:1"],
        vec!["migrate", "--cdc"],
        vec!["migrate", "--to-polling"],
    ] {
        db.outbox()
            .args(&args)
            .assert()
            .failure()
            .stderr(contains("SQLite has neither"))
            .stderr(contains("polling relay"));
    }
}

#[test]
fn cdc_on_a_mariadb_without_the_binlog_is_refused_with_the_setting_to_change() {
    let server = ScratchMariadb::start_with(&[]);
    let url = migrated(&server);
    outbox()
        .args(["--database-url", &url, "migrate", "--cdc"])
        .assert()
        .failure()
        .stderr(contains("log_bin"))
        .stderr(contains("binlog_format = ROW"));
    assert!(status(&url)["cdc"].is_null(), "CDC mode stays off");
}

/// One transaction of 48,000 messages of 3 KB (some 144 MB of payload) is relayed
/// whole, each once, by the binlog relay with its defaults in bounded memory (see
/// tests/cdc.rs; held whole, it peaked at 351 MiB).
#[test]
fn a_transaction_larger_than_memory_is_relayed_within_bounded_memory() {
    let server = ScratchMariadb::start();
    let url = migrated(&server);
    migrate_cdc(&url);
    relayed_within_memory::<MysqlConnection>(
        &url,
        &format!(
            "INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, headers, \
             next_retry_at, created_at) \
             SELECT CONCAT('bulk-', seq, ':Ping'), 'cli.ping', 'Ping', CONCAT('bulk-', seq % 16), \
                    JSON_OBJECT('n', seq, 'pad', REPEAT(MD5(seq), 94)), '{{}}', \
                    UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) \
             FROM seq_1_to_{BULK_ROWS}"
        ),
    );
}
