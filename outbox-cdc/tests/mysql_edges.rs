//! The binlog relay (feature `mysql`) against what a hostile user or an unlucky
//! production does to the outbox (issue 35): savepoints, multi-row and REPLACE
//! statements, rows changed or deleted before their commit, purges and TRUNCATE,
//! large rows and transactions, hand-inserted bad rows, DDL, other tables and
//! databases, a lost privilege and a dropped dump. Each against a private MariaDB with
//! the binlog.

mod common;

use std::time::Duration;

use common::{DownOnce, TOPIC, fast, firsts, publisher, publisher_for, stream, wait_for_all};
use mysql_async::Conn;
use mysql_async::prelude::Queryable as _;
use outbox_cdc::mysql::{self as binlog, MysqlCdcRelay};
use outbox_cdc::{CdcConfig, CdcError};
use outbox_redis::RedisPublisher;
use outbox_tests::{ScratchMariadb, Stoppable, spawn_until};

/// A private MariaDB (the binlog as the relay needs it, plus `extra`) with the outbox
/// migrated in `test` and CDC mode set up.
struct Db {
    server: ScratchMariadb,
    url: String,
}

impl Db {
    async fn start() -> Self {
        Self::start_with(&[]).await
    }

    async fn start_with(extra: &[&str]) -> Self {
        let mut settings = ScratchMariadb::BINLOG.to_vec();
        settings.extend_from_slice(extra);
        let server = ScratchMariadb::start_with(&settings);
        let url = server.url();
        let db = Self { server, url };
        let mut c = db.conn().await;
        c.query_drop(outbox_diesel::MYSQL_MIGRATION.up)
            .await
            .expect("migration");
        binlog::setup(&mut c, &CdcConfig::default())
            .await
            .expect("setup");
        db
    }

    async fn conn(&self) -> Conn {
        Conn::from_url(&self.url).await.expect("connect")
    }

    /// One number of `sql`.
    async fn count(&self, sql: &str) -> i64 {
        self.conn()
            .await
            .query_first(sql)
            .await
            .expect(sql)
            .expect("a row")
    }
}

/// The VALUES of message `n` of `key`, as emit writes them, with `payload`.
fn row(key: &str, n: u32, payload: &str) -> String {
    format!(
        "('{key}:{n}', '{TOPIC}', 'Ping', '{key}', '{payload}', '{{}}', UTC_TIMESTAMP(6), \
         UTC_TIMESTAMP(6))"
    )
}

const COLUMNS: &str =
    "(msg_id, topic, event_type, msg_key, payload, headers, next_retry_at, created_at)";

const COLUMNS_STATUS: &str = "(msg_id, topic, event_type, msg_key, payload, headers, \
     next_retry_at, created_at, status)";

/// `INSERT INTO outbox` of the `rows` in one statement.
fn insert_sql(rows: &[String]) -> String {
    format!("INSERT INTO outbox {COLUMNS} VALUES {}", rows.join(", "))
}

async fn insert(c: &mut Conn, key: &str, n: u32) {
    c.query_drop(insert_sql(&[row(key, n, &format!("{{\"n\": {n}}}"))]))
        .await
        .expect("insert");
}

fn ids(key: &str, range: std::ops::Range<u32>) -> Vec<String> {
    range.map(|n| format!("{key}:{n}")).collect()
}

/// The stream's entries: (msg_id, payload), in stream order.
fn entries(stream: &str) -> Vec<(String, String)> {
    common::entries(stream)
        .into_iter()
        .map(|(id, payload, _)| (id, payload))
        .collect()
}

type Relay = Stoppable<outbox_cdc::Result<()>>;

fn spawn_relay_at(url: &str, p: RedisPublisher) -> Relay {
    spawn_relay_with(url, p, fast())
}

fn spawn_relay_with<P: outbox_core::Publisher + Send + Sync + 'static>(
    url: &str,
    p: P,
    config: CdcConfig,
) -> Relay {
    let relay = MysqlCdcRelay::new(url, p)
        .expect("relay")
        .with_config(config)
        .expect("config");
    spawn_until(move |stop| async move { relay.run_until(stop).await })
}

/// Every transaction spilled: each outgrows one byte, its rows are read back from the
/// table.
fn spilling() -> CdcConfig {
    fast().with_transaction_memory(1)
}

fn spawn_relay(db: &Db, p: RedisPublisher) -> Relay {
    spawn_relay_at(&db.url, p)
}

async fn stop(relay: Relay) {
    let _ = relay.0.send(());
    tokio::time::timeout(Duration::from_secs(20), relay.1)
        .await
        .expect("the relay stops")
        .expect("relay task")
        .expect("the relay ends cleanly");
}

/// Ends the sessions matching `filter` (a PROCESSLIST condition); at least one.
async fn kill(db: &Db, filter: &str) {
    let mut c = db.conn().await;
    let sessions: Vec<u64> = c
        .query(format!(
            "SELECT ID FROM information_schema.PROCESSLIST WHERE {filter}"
        ))
        .await
        .expect("sessions");
    assert!(!sessions.is_empty(), "no session where {filter}");
    for id in sessions {
        // A session may have ended meanwhile.
        let _ = c.query_drop(format!("KILL {id}")).await;
    }
}

/// A marker message committed last: once it is on the stream, everything committed
/// before it was read.
async fn fence(db: &Db, name: &str) -> Vec<String> {
    insert(&mut db.conn().await, "fence", 0).await;
    wait_for_all(name, &ids("fence", 0..1))
}

/// The stream without the fence.
fn without_fence(got: &[String]) -> Vec<String> {
    got.iter()
        .filter(|m| !m.starts_with("fence:"))
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_rolled_back_to_a_savepoint_are_not_published() {
    let db = Db::start().await;
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    let mut c = db.conn().await;
    c.query_drop("BEGIN").await.unwrap();
    insert(&mut c, "s", 1).await;
    c.query_drop("SAVEPOINT sp").await.unwrap();
    insert(&mut c, "s", 2).await;
    insert(&mut c, "other", 1).await;
    c.query_drop("ROLLBACK TO SAVEPOINT sp").await.unwrap();
    insert(&mut c, "s", 3).await;
    c.query_drop("COMMIT").await.unwrap();
    let got = fence(&db, &name).await;
    assert_eq!(without_fence(&got), ["s:1", "s:3"], "only the kept rows");
    stop(relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_row_insert_and_insert_select_are_published_in_id_order() {
    let db = Db::start().await;
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    let mut c = db.conn().await;
    let rows: Vec<String> = (0..50).map(|n| row("m", n, "{}")).collect();
    c.query_drop(insert_sql(&rows)).await.unwrap();
    // INSERT ... SELECT from the sequence engine: 20 rows in one statement.
    c.query_drop(format!(
        "INSERT INTO outbox {COLUMNS} SELECT CONCAT('sel:', seq), '{TOPIC}', 'Ping', 'sel', \
         '{{}}', '{{}}', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) FROM seq_0_to_19"
    ))
    .await
    .unwrap();
    let mut want = ids("m", 0..50);
    want.extend(ids("sel", 0..20));
    let got = fence(&db, &name).await;
    assert_eq!(firsts(&without_fence(&got)), want);
    stop(relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_row_is_published_with_what_was_committed() {
    let db = Db::start().await;
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    let mut c = db.conn().await;
    c.query_drop(insert_sql(&[row("r", 1, "{\"v\": 1}")]))
        .await
        .unwrap();
    wait_for_all(&name, &ids("r", 1..2));
    // REPLACE of a relayed message: a new row (a new id, status NEW) which the polling
    // relay would publish; InnoDB logs it as an UPDATE of the old row.
    c.query_drop(format!(
        "REPLACE INTO outbox {COLUMNS} VALUES {}",
        row("r", 1, "{\"v\": 2}")
    ))
    .await
    .unwrap();
    // ON DUPLICATE KEY UPDATE of a row inserted in the same transaction: the
    // committed row is the updated one.
    c.query_drop("BEGIN").await.unwrap();
    c.query_drop(insert_sql(&[row("d", 1, "{\"v\": 1}")]))
        .await
        .unwrap();
    c.query_drop(format!(
        "{} ON DUPLICATE KEY UPDATE payload = VALUES(payload)",
        insert_sql(&[row("d", 1, "{\"v\": 2}")])
    ))
    .await
    .unwrap();
    c.query_drop("COMMIT").await.unwrap();
    fence(&db, &name).await;
    let got = entries(&name);
    let payloads = |id: &str| -> Vec<String> {
        got.iter()
            .filter(|(m, _)| m == id)
            .map(|(_, p)| p.clone())
            .collect()
    };
    assert_eq!(
        payloads("r:1").last().map(String::as_str),
        Some("{\"v\": 2}"),
        "the replacement was not published: {got:?}"
    );
    assert_eq!(
        payloads("d:1"),
        ["{\"v\": 2}"],
        "the committed version, once"
    );
    stop(relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_changed_or_deleted_before_its_commit_is_published_as_committed() {
    changed_or_deleted(fast()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spilled_transaction_is_published_as_committed() {
    changed_or_deleted(spilling()).await;
}

async fn changed_or_deleted(config: CdcConfig) {
    let db = Db::start().await;
    let (p, name) = publisher();
    let relay = spawn_relay_with(&db.url, p, config);
    let mut c = db.conn().await;
    c.query_drop("BEGIN").await.unwrap();
    c.query_drop(insert_sql(&[
        row("u", 1, "{\"v\": 1}"),
        row("x", 1, "{}"),
        row("u", 2, "{\"v\": 1}"),
    ]))
    .await
    .unwrap();
    c.query_drop("UPDATE outbox SET payload = '{\"v\": 2}' WHERE msg_id = 'u:1'")
        .await
        .unwrap();
    c.query_drop("DELETE FROM outbox WHERE msg_id = 'x:1'")
        .await
        .unwrap();
    c.query_drop("COMMIT").await.unwrap();
    fence(&db, &name).await;
    let got: Vec<(String, String)> = entries(&name)
        .into_iter()
        .filter(|(m, _)| !m.starts_with("fence:"))
        .collect();
    let want: Vec<(String, String)> = [("u:1", "{\"v\": 2}"), ("u:2", "{\"v\": 1}")]
        .iter()
        .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
        .collect();
    assert_eq!(got, want, "as committed: u:1 changed, x:1 never committed");
    stop(relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_or_truncate_while_the_relay_runs_loses_nothing_after_it() {
    let db = Db::start().await;
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    let mut c = db.conn().await;
    for n in 0..3 {
        insert(&mut c, "t", n).await;
    }
    wait_for_all(&name, &ids("t", 0..3));
    c.query_drop("DELETE FROM outbox WHERE msg_key = 't'")
        .await
        .unwrap();
    insert(&mut c, "t", 3).await;
    c.query_drop("TRUNCATE TABLE outbox").await.unwrap();
    // The ids start again at 1.
    for n in 4..7 {
        insert(&mut c, "t", n).await;
    }
    wait_for_all(&name, &ids("t", 0..7));
    stop(relay).await;
    // And after a restart, from the stored position.
    for n in 7..9 {
        insert(&mut c, "t", n).await;
    }
    let relay = spawn_relay(&db, publisher_for(&name));
    let got = fence(&db, &name).await;
    assert_eq!(firsts(&without_fence(&got)), ids("t", 0..9));
    assert_eq!(without_fence(&got).len(), 9, "each once: {got:?}");
    stop(relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_near_max_allowed_packet_is_published() {
    let db = Db::start_with(&["--max-allowed-packet=2M"]).await;
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    let mut c = db.conn().await;
    let big = format!("{{\"x\": \"{}\"}}", "a".repeat(2 * 1024 * 1024 - 2048));
    c.exec_drop(
        format!(
            "INSERT INTO outbox {COLUMNS} VALUES ('big:1', '{TOPIC}', 'Ping', 'big', ?, '{{}}', \
             UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
        ),
        (big.clone(),),
    )
    .await
    .expect("the row fits the packet");
    insert(&mut c, "big", 2).await;
    let want = ids("big", 1..3);
    let stream = name.clone();
    let got = tokio::task::spawn_blocking(move || wait_for_all(&stream, &want)).await;
    if got.is_err() || relay.1.is_finished() {
        let ended = relay.1.await;
        panic!("the big row was not published; the relay: {ended:?}");
    }
    let e = entries(&name);
    assert_eq!(e[0].0, "big:1");
    assert_eq!(e[0].1.len(), big.len(), "the payload whole");
    stop(relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_rows_in_one_commit_are_published_in_order() {
    ten_thousand_rows(fast(), None).await;
}

/// Over a 64 KiB `transaction_memory`: read back from the table 500 at a time; an
/// outage in the middle resumes at the batch it failed, nothing published twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_rows_spilled_are_published_in_order_each_once() {
    ten_thousand_rows(fast().with_transaction_memory(64 << 10), Some("bulk:5001")).await;
}

/// 10,000 rows in one commit; the publish call carrying `outage`, if any, fails once.
async fn ten_thousand_rows(config: CdcConfig, outage: Option<&'static str>) {
    let db = Db::start().await;
    let (inner, name) = publisher();
    let p = std::sync::Arc::new(DownOnce {
        inner,
        trigger: outage.unwrap_or_default(),
        fired: false.into(),
    });
    let relay = spawn_relay_with(&db.url, p.clone(), config);
    let mut c = db.conn().await;
    c.query_drop("BEGIN").await.unwrap();
    c.query_drop(format!(
        "INSERT INTO outbox {COLUMNS} SELECT CONCAT('bulk:', seq), '{TOPIC}', 'Ping', \
         CONCAT('k', seq % 7), '{{}}', '{{}}', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) \
         FROM seq_0_to_9999"
    ))
    .await
    .unwrap();
    c.query_drop("COMMIT").await.unwrap();
    let got = without_fence(&fence(&db, &name).await);
    assert_eq!(got, ids("bulk", 0..10_000), "each once, in order");
    assert_eq!(
        p.fired.load(std::sync::atomic::Ordering::SeqCst),
        outage.is_some()
    );
    stop(relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hand_inserted_bad_rows_become_dead_with_the_reason_and_the_relay_goes_on() {
    let db = Db::start().await;
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    let mut c = db.conn().await;
    // Headers not a JSON object, an empty key, a payload that is not JSON, an empty
    // msg_id.
    c.query_drop(format!(
        "INSERT INTO outbox {COLUMNS} VALUES \
         ('h:1', '{TOPIC}', 'Ping', 'h', '{{}}', 'not json', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
    ))
    .await
    .unwrap();
    c.query_drop(insert_sql(&[row("", 1, "{}")])).await.unwrap();
    c.query_drop(insert_sql(&[row("p", 1, "not json {")]))
        .await
        .unwrap();
    c.query_drop(format!(
        "INSERT INTO outbox {COLUMNS} VALUES \
         ('', '{TOPIC}', 'Ping', 'e', '{{}}', '{{}}', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
    ))
    .await
    .unwrap();
    // Invalid UTF-8 is refused by the server (strict mode), before the binlog.
    let refused = c
        .query_drop(format!(
            "INSERT INTO outbox {COLUMNS} VALUES \
             ('u:1', '{TOPIC}', 'Ping', 'u', X'FFFE', '{{}}', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
        ))
        .await;
    assert!(refused.is_err(), "invalid UTF-8 stored");
    // A row written as SENT (copied back from an archive) is not a message to send,
    // as for the polling relay and the backfill.
    c.query_drop(format!(
        "INSERT INTO outbox {COLUMNS_STATUS} VALUES \
         ('sent:1', '{TOPIC}', 'Ping', 's', '{{}}', '{{}}', UTC_TIMESTAMP(6), \
         UTC_TIMESTAMP(6), 1)"
    ))
    .await
    .unwrap();
    // A NULL key, once the column allows it.
    c.query_drop("ALTER TABLE outbox MODIFY msg_key VARCHAR(255) NULL")
        .await
        .unwrap();
    c.query_drop(format!(
        "INSERT INTO outbox {COLUMNS} VALUES \
         ('nk:1', '{TOPIC}', 'Ping', NULL, '{{}}', '{{}}', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
    ))
    .await
    .unwrap();
    insert(&mut c, "h", 2).await;
    let got = fence(&db, &name).await;
    assert!(!got.contains(&"sent:1".to_owned()), "{got:?}");
    // What the relay can read is published as stored (the payload is opaque text).
    let published = without_fence(&got);
    assert!(published.contains(&":1".to_owned()), "{published:?}");
    assert!(published.contains(&"p:1".to_owned()), "{published:?}");
    assert!(published.contains(&"h:2".to_owned()), "{published:?}");
    assert!(!published.contains(&"h:1".to_owned()), "{published:?}");
    // The DEAD marks are written after the batch's publish.
    let mut dead: Vec<(String, String)> = Vec::new();
    for _ in 0..100 {
        dead = c
            .query("SELECT msg_id, last_error FROM outbox WHERE status = 2 ORDER BY id")
            .await
            .unwrap();
        if dead.len() >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(dead.len(), 3, "{dead:?}");
    assert_eq!(dead[0].0, "h:1");
    assert!(dead[0].1.contains("headers"), "{dead:?}");
    assert_eq!(dead[1].0, "");
    assert!(!dead[1].1.is_empty(), "{dead:?}");
    assert_eq!(dead[2].0, "nk:1");
    assert!(dead[2].1.contains("msg_key"), "{dead:?}");
    stop(relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alter_table_while_the_relay_runs_keeps_publishing() {
    let db = Db::start().await;
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    let mut c = db.conn().await;
    insert(&mut c, "a", 0).await;
    c.query_drop("ALTER TABLE outbox ADD COLUMN tenant VARCHAR(32) NULL")
        .await
        .unwrap();
    insert(&mut c, "a", 1).await;
    c.query_drop("ALTER TABLE outbox ADD COLUMN first_col INT NOT NULL DEFAULT 7 FIRST")
        .await
        .unwrap();
    insert(&mut c, "a", 2).await;
    c.query_drop("ALTER TABLE outbox DROP COLUMN first_col, DROP COLUMN tenant")
        .await
        .unwrap();
    insert(&mut c, "a", 3).await;
    let got = fence(&db, &name).await;
    assert_eq!(firsts(&without_fence(&got)), ids("a", 0..4));
    stop(relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_tables_and_another_databases_outbox_are_ignored() {
    let db = Db::start().await;
    db.server.exec(
        "CREATE DATABASE other; CREATE TABLE other.outbox LIKE test.outbox; \
         CREATE TABLE test.orders (id INT PRIMARY KEY, note TEXT); \
         CREATE TABLE test.Outbox_x LIKE test.outbox",
    );
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    let mut c = db.conn().await;
    c.query_drop("BEGIN").await.unwrap();
    c.query_drop("INSERT INTO orders VALUES (1, 'x')")
        .await
        .unwrap();
    insert(&mut c, "k", 1).await;
    c.query_drop(format!(
        "INSERT INTO other.outbox {COLUMNS} VALUES {}",
        row("no", 1, "{}")
    ))
    .await
    .unwrap();
    c.query_drop(format!(
        "INSERT INTO Outbox_x {COLUMNS} VALUES {}",
        row("no", 2, "{}")
    ))
    .await
    .unwrap();
    c.query_drop("COMMIT").await.unwrap();
    c.query_drop(format!(
        "INSERT INTO other.outbox {COLUMNS} VALUES {}",
        row("no", 3, "{}")
    ))
    .await
    .unwrap();
    c.query_drop("USE other").await.unwrap();
    c.query_drop(insert_sql(&[row("no", 4, "{}")]))
        .await
        .unwrap();
    c.query_drop("USE test").await.unwrap();
    insert(&mut c, "k", 2).await;
    let got = fence(&db, &name).await;
    assert_eq!(without_fence(&got), ids("k", 1..3));
    stop(relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_dump_resumes_and_a_lost_privilege_stops_the_relay_with_its_name() {
    let db = Db::start().await;
    for host in ["localhost", "127.0.0.1"] {
        db.server.exec(&format!(
            "CREATE USER 'relay'@'{host}'; GRANT ALL ON test.* TO 'relay'@'{host}'; \
             GRANT REPLICATION SLAVE, BINLOG MONITOR, PROCESS ON *.* TO 'relay'@'{host}'"
        ));
    }
    let url = format!("mysql://relay@127.0.0.1:{}/test", db.server.port());
    let (p, name) = publisher();
    let relay = spawn_relay_at(&url, p);
    let mut c = db.conn().await;
    insert(&mut c, "d", 0).await;
    wait_for_all(&name, &ids("d", 0..1));
    // The dump's session ends (a network cut, a server-side kill): the relay reads
    // again from its position.
    kill(&db, "COMMAND LIKE 'Binlog Dump%'").await;
    for n in 1..4 {
        insert(&mut c, "d", n).await;
    }
    wait_for_all(&name, &ids("d", 0..4));
    // The grant revoked and the sessions cut: the relay stops with the privilege named,
    // instead of retrying in silence.
    for host in ["localhost", "127.0.0.1"] {
        db.server.exec(&format!(
            "REVOKE REPLICATION SLAVE ON *.* FROM 'relay'@'{host}'"
        ));
    }
    kill(&db, "USER = 'relay'").await;
    insert(&mut c, "d", 4).await;
    let ended = tokio::time::timeout(Duration::from_secs(30), relay.1)
        .await
        .expect("the relay stops by itself")
        .expect("relay task");
    assert!(
        matches!(&ended, Err(CdcError::MissingPrivilege { privilege, .. }) if privilege == "REPLICATION SLAVE"),
        "{ended:?}"
    );
    // Granted again: a new relay publishes what was committed meanwhile.
    for host in ["localhost", "127.0.0.1"] {
        db.server.exec(&format!(
            "GRANT REPLICATION SLAVE ON *.* TO 'relay'@'{host}'"
        ));
    }
    let relay = spawn_relay_at(&url, publisher_for(&name));
    let got = fence(&db, &name).await;
    assert_eq!(firsts(&without_fence(&got)), ids("d", 0..5));
    assert_eq!(
        db.count("SELECT COUNT(*) FROM outbox WHERE status = 0")
            .await,
        6
    );
    stop(relay).await;
}

/// Waits for the relay to stop by itself; its error.
async fn stopped_with(relay: Relay) -> CdcError {
    tokio::time::timeout(Duration::from_secs(30), relay.1)
        .await
        .expect("the relay stops by itself")
        .expect("relay task")
        .expect_err("the relay stops with an error")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_row_logged_without_all_its_columns_stops_the_relay_with_the_cause() {
    let db = Db::start().await;
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    let mut c = db.conn().await;
    // binlog_row_image is a session variable any user may set: an UPDATE or DELETE
    // then logs the id only, and the relay goes on.
    c.query_drop("SET SESSION binlog_row_image = MINIMAL")
        .await
        .unwrap();
    insert(&mut db.conn().await, "k", 1).await;
    c.query_drop("UPDATE outbox SET retries = 3 WHERE msg_key = 'k'")
        .await
        .unwrap();
    c.query_drop("DELETE FROM outbox WHERE msg_key = 'k'")
        .await
        .unwrap();
    fence(&db, &name).await;
    // An insert logs only the columns it named: not a message the relay can read,
    // nor a bad row: it stops, naming the setting, and the row stays NEW.
    insert(&mut c, "min", 1).await;
    let err = stopped_with(relay).await;
    assert!(
        matches!(&err, CdcError::Decode(why) if why.contains("binlog_row_image")),
        "{err}"
    );
    assert!(!stream(&name).contains(&"min:1".to_owned()));
    assert_eq!(
        db.count("SELECT COUNT(*) FROM outbox WHERE msg_id = 'min:1' AND status = 0")
            .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insert_logged_as_a_statement_stops_the_relay_instead_of_vanishing() {
    let db = Db::start().await;
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    let mut c = db.conn().await;
    // A session with BINLOG ADMIN may log its statements instead of their rows.
    c.query_drop("SET SESSION binlog_format = STATEMENT")
        .await
        .unwrap();
    c.query_drop("CREATE TABLE notes (id INT PRIMARY KEY)")
        .await
        .unwrap();
    c.query_drop("INSERT INTO notes VALUES (1)").await.unwrap();
    fence(&db, &name).await;
    insert(&mut c, "stmt", 1).await;
    let err = stopped_with(relay).await;
    assert!(
        matches!(&err, CdcError::Decode(why) if why.contains("binlog_format")),
        "{err}"
    );
    assert!(!stream(&name).contains(&"stmt:1".to_owned()));
}

/// A `mariadbd` this test started again on a scratch server's files, ended on drop.
struct Restarted(std::process::Child);

impl Drop for Restarted {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Shuts the scratch server down (`SHUTDOWN`, as an orderly restart does) and starts
/// `mariadbd` again on the same files and port, with the binlog.
async fn restart(db: &Db) -> Restarted {
    let paths: (String, String, String, String) = db
        .conn()
        .await
        .query_first("SELECT @@datadir, @@tmpdir, @@socket, @@pid_file")
        .await
        .expect("paths")
        .expect("a row");
    let _ = db.server.sql("SHUTDOWN");
    let port = db.server.port();
    outbox_tests::wait_until_within("the server to stop", Duration::from_secs(30), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err()
    });
    let (data, tmp, socket, pid) = paths;
    let child = std::process::Command::new("setpriv")
        .args(["--pdeathsig=KILL", "--", "mariadbd", "--no-defaults"])
        .args([
            format!("--datadir={data}"),
            format!("--tmpdir={tmp}"),
            format!("--socket={socket}"),
            format!("--pid-file={pid}"),
            format!("--port={port}"),
        ])
        .args(["--user=root", "--bind-address=127.0.0.1"])
        .args(["--innodb-buffer-pool-size=32M"])
        .args(ScratchMariadb::BINLOG)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("mariadbd starts again");
    let restarted = Restarted(child);
    outbox_tests::wait_until_within("the server to serve again", Duration::from_secs(60), || {
        db.server.sql("SELECT 1").is_ok()
    });
    let serving = std::fs::read_to_string(&pid).expect("the pid file");
    assert_eq!(
        serving.trim(),
        restarted.0.id().to_string(),
        "the server serving is the restarted one"
    );
    restarted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_mid_stream_loses_nothing_and_keeps_the_order() {
    let db = Db::start().await;
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    let mut c = db.conn().await;
    for n in 0..3 {
        insert(&mut c, "r", n).await;
    }
    wait_for_all(&name, &ids("r", 0..3));
    // Committed just before the shutdown: maybe read, maybe not.
    for n in 3..6 {
        insert(&mut c, "r", n).await;
    }
    drop(c);
    let _server = restart(&db).await;
    let mut c = db.conn().await;
    for n in 6..9 {
        insert(&mut c, "r", n).await;
    }
    let got = tokio::time::timeout(Duration::from_secs(40), fence(&db, &name)).await;
    assert!(
        !relay.1.is_finished(),
        "the relay stopped: {:?}",
        relay.1.await
    );
    let got = got.expect("the relay published after the restart");
    assert_eq!(firsts(&without_fence(&got)), ids("r", 0..9));
    stop(relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_spelling_the_database_in_other_case_still_relays_under_lower_case_names() {
    // lower_case_table_names = 1 (a server configured as on Windows or macOS): the
    // URL's `TEST` is the database `test`, which the binlog names in lower case.
    let db = Db::start_with(&["--lower-case-table-names=1"]).await;
    let url = db.url.replace("/test", "/TEST");
    let (p, name) = publisher();
    let relay = spawn_relay_at(&url, p);
    let mut c = db.conn().await;
    for n in 0..3 {
        insert(&mut c, "u", n).await;
    }
    let got = fence(&db, &name).await;
    assert_eq!(without_fence(&got), ids("u", 0..3), "every row, once");
    stop(relay).await;
}
