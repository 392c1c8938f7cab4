//! The binlog relay (feature `mysql`) against a private MariaDB with the binlog on, as
//! the PostgreSQL relay's tests run against a private cluster: commit order, rollbacks
//! invisible, the restart from the stored position, the start check, the backfill, a
//! purged binlog, and one reader at a time with takeover.

mod common;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{
    Refusing, TOPIC, assert_refused_in_cdc_mode, fast, firsts, msg_id, publisher, publisher_for,
    stream, wait_for_all,
};
use mysql_async::Conn;
use mysql_async::prelude::Queryable as _;
use outbox_cdc::mysql::{self as binlog, MysqlCdcRelay};
use outbox_cdc::{CdcConfig, CdcError};
use outbox_core::{Error, PublishOutcomes, Publisher, StoredMessage};
use outbox_tests::{PATIENCE, ScratchMariadb, Stoppable, eventually, spawn_until, until_some};

/// A private MariaDB with the outbox migrated in database `test`.
struct Db {
    server: ScratchMariadb,
    url: String,
}

impl Db {
    async fn start() -> Self {
        let server = ScratchMariadb::start();
        let url = server.url();
        let db = Self { server, url };
        db.conn()
            .await
            .query_drop(outbox_diesel::MYSQL_MIGRATION.up)
            .await
            .expect("migration");
        db
    }

    async fn conn(&self) -> Conn {
        Conn::from_url(&self.url)
            .await
            .expect("connect to the scratch MariaDB")
    }

    async fn setup(&self) -> outbox_cdc::SetupReport {
        binlog::setup(&mut self.conn().await, &CdcConfig::default())
            .await
            .expect("setup")
    }

    async fn stored(&self) -> String {
        let (_, position) = binlog::cdc_mode(&mut self.conn().await)
            .await
            .expect("mode")
            .expect("CDC mode on");
        position.to_string()
    }
}

/// Inserts message `n` of `key` on `c`, as emit does.
async fn insert(c: &mut Conn, key: &str, n: u32) {
    c.exec_drop(
        "INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, headers, \
         next_retry_at, created_at) VALUES (?, ?, 'Ping', ?, ?, '{}', UTC_TIMESTAMP(6), \
         UTC_TIMESTAMP(6))",
        (
            msg_id(key, n),
            TOPIC,
            key,
            format!("{{\"n\": {n}, \"é\": true}}"),
        ),
    )
    .await
    .expect("insert");
}

/// Inserts messages `range` of `key`, each in its own transaction.
async fn insert_each(db: &Db, key: &str, range: std::ops::Range<u32>) {
    let mut c = db.conn().await;
    for n in range {
        insert(&mut c, key, n).await;
    }
}

fn ids(key: &str, range: std::ops::Range<u32>) -> Vec<String> {
    range.map(|n| msg_id(key, n)).collect()
}

type Relay = Stoppable<outbox_cdc::Result<()>>;

/// A relay task, stopped by the returned sender.
fn spawn_relay(db: &Db, publisher: impl outbox_core::Publisher + 'static) -> Relay {
    spawn_relay_with(db, publisher, fast())
}

fn spawn_relay_with(
    db: &Db,
    publisher: impl outbox_core::Publisher + 'static,
    config: CdcConfig,
) -> Relay {
    let relay = MysqlCdcRelay::new(&db.url, publisher)
        .expect("relay")
        .with_config(config)
        .expect("config");
    spawn_until(move |stop| async move { relay.run_until(stop).await })
}

async fn stop(relay: Relay) {
    let _ = relay.0.send(());
    tokio::time::timeout(Duration::from_secs(20), relay.1)
        .await
        .expect("the relay stops")
        .expect("relay task")
        .expect("the relay ends cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_or_user_that_cannot_serve_the_relay_is_refused_with_the_fix() {
    // The shared MariaDB runs without the binlog.
    let mut shared = Conn::from_url(outbox_tests::mysql_url())
        .await
        .expect("shared MariaDB");
    let err = binlog::check_server(&mut shared).await.unwrap_err();
    assert!(
        matches!(&err, CdcError::BinlogSetting { setting, .. } if setting == "log_bin"),
        "{err}"
    );
    assert!(err.to_string().contains("set log_bin = ON"), "{err}");

    let db = Db::start().await;
    binlog::check_server(&mut db.conn().await)
        .await
        .expect("root on the binlog server passes");
    for host in ["localhost", "127.0.0.1"] {
        db.server.exec(&format!(
            "CREATE USER 'plain'@'{host}'; GRANT ALL ON test.* TO 'plain'@'{host}'"
        ));
    }
    let plain = format!("mysql://plain@127.0.0.1:{}/test", db.server.port());
    let err = binlog::check_server(&mut Conn::from_url(&plain).await.expect("plain user"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, CdcError::MissingPrivilege { privilege, .. } if privilege == "REPLICATION SLAVE"),
        "{err}"
    );
    assert!(!err.is_outage());
    // The relay stops with the same error instead of waiting.
    binlog::setup(&mut db.conn().await, &CdcConfig::default())
        .await
        .expect("setup as root");
    let (p, _) = publisher();
    let relay = MysqlCdcRelay::new(&plain, p)
        .expect("relay")
        .with_config(fast())
        .expect("config");
    let ran = tokio::time::timeout(
        Duration::from_secs(20),
        relay.run_until(std::future::pending()),
    )
    .await
    .expect("the relay stops by itself");
    assert!(
        matches!(ran, Err(CdcError::MissingPrivilege { .. })),
        "{ran:?}"
    );
    // Without PROCESS the relay cannot read the open transactions behind its
    // watermark: refused at start, with the grant named, not a relay that quietly
    // stops storing its position and reports.
    for host in ["localhost", "127.0.0.1"] {
        db.server.exec(&format!(
            "CREATE USER 'noproc'@'{host}'; GRANT ALL ON test.* TO 'noproc'@'{host}'; \
             GRANT REPLICATION SLAVE, BINLOG MONITOR ON *.* TO 'noproc'@'{host}'"
        ));
    }
    let noproc = format!("mysql://noproc@127.0.0.1:{}/test", db.server.port());
    let err = binlog::check_server(&mut Conn::from_url(&noproc).await.expect("noproc user"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, CdcError::MissingPrivilege { privilege, .. } if privilege == "PROCESS"),
        "{err}"
    );
    assert!(err.to_string().contains("GRANT PROCESS ON *.*"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_are_published_in_commit_order_and_a_rolled_back_insert_never() {
    let db = Db::start().await;
    db.setup().await;
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    // a:1 takes the lower id but commits after b:1 and b:2.
    let (mut a, mut b) = (db.conn().await, db.conn().await);
    a.query_drop("BEGIN").await.unwrap();
    insert(&mut a, "a", 1).await;
    b.query_drop("BEGIN").await.unwrap();
    insert(&mut b, "b", 1).await;
    insert(&mut b, "b", 2).await;
    b.query_drop("COMMIT").await.unwrap();
    a.query_drop("COMMIT").await.unwrap();
    b.query_drop("BEGIN").await.unwrap();
    insert(&mut b, "r", 1).await;
    b.query_drop("ROLLBACK").await.unwrap();
    insert_each(&db, "c", 1..4).await;
    let want: Vec<String> = ["b:1", "b:2", "a:1", "c:1", "c:2", "c:3"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    let got = wait_for_all(&name, &want);
    assert_eq!(firsts(&got), want, "commit order, not id order");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !stream(&name).contains(&msg_id("r", 1)),
        "a rolled-back insert was published"
    );
    stop(relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_relay_resumes_from_the_stored_position() {
    let db = Db::start().await;
    db.setup().await;
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    insert_each(&db, "k", 0..3).await;
    wait_for_all(&name, &ids("k", 0..3));
    stop(relay).await;
    let stored = db.stored().await;
    assert!(!stored.is_empty(), "a position was stored");
    // Committed while no relay runs.
    insert_each(&db, "k", 3..5).await;
    let relay = spawn_relay(&db, publisher_for(&name));
    wait_for_all(&name, &ids("k", 0..5));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        stream(&name),
        ids("k", 0..5),
        "each message once: the restart resumed after what was published"
    );
    stop(relay).await;
    assert_ne!(db.stored().await, stored, "the position moved on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_committed_before_setup_are_backfilled_first() {
    let db = Db::start().await;
    insert_each(&db, "old", 0..3).await;
    let report = db.setup().await;
    assert_eq!(report.backfill, (0, 3));
    insert_each(&db, "new", 0..2).await;
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    let mut want = ids("old", 0..3);
    want.extend(ids("new", 0..2));
    let got = wait_for_all(&name, &want);
    assert_eq!(firsts(&got), want);
    stop(relay).await;
    let mut c = db.conn().await;
    let left: Option<(i64, i64)> = c
        .query_first("SELECT backfill_from, backfill_upto FROM outbox_cdc")
        .await
        .unwrap();
    assert_eq!(left, Some((3, 3)), "the backfill is done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_binlog_stops_the_relay_and_the_recovery_backfills_what_it_missed() {
    let db = Db::start().await;
    db.setup().await;
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    insert_each(&db, "k", 0..2).await;
    wait_for_all(&name, &ids("k", 0..2));
    stop(relay).await;
    insert_each(&db, "k", 2..5).await;
    // The binlogs holding the stored position are gone, as after
    // binlog_expire_logs_seconds. (The server keeps a binlog a dump thread still reads:
    // wait until the stopped relay's is gone.)
    outbox_tests::wait_until_within(
        "the stopped relay's dump to end",
        Duration::from_secs(30),
        || {
            db.server.exec(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%'",
        )
        .trim()
            == "0"
        },
    );
    db.server.exec("FLUSH BINARY LOGS");
    let last = db.server.exec("SHOW BINARY LOGS");
    let newest = last
        .lines()
        .last()
        .and_then(|l| l.split('\t').next())
        .unwrap()
        .to_owned();
    // The server also keeps a binlog until its binlog checkpoint (InnoDB flushed its
    // transactions): purge until only the newest is left.
    outbox_tests::wait_until_within(
        "the old binlogs to be purged",
        Duration::from_secs(30),
        || {
            db.server.exec(&format!("PURGE BINARY LOGS TO '{newest}'"));
            db.server.exec("SHOW BINARY LOGS").lines().count() == 1
        },
    );

    let relay = MysqlCdcRelay::new(&db.url, publisher_for(&name))
        .unwrap()
        .with_config(fast())
        .unwrap();
    let ran = tokio::time::timeout(
        Duration::from_secs(30),
        relay.run_until(std::future::pending()),
    )
    .await
    .expect("the relay stops by itself");
    let err = ran.unwrap_err();
    assert!(matches!(err, CdcError::PositionLost { .. }), "{err}");
    assert!(!err.is_outage());
    assert!(err.to_string().contains("recover_lost_position"), "{err}");

    let report = binlog::recover_lost_position(&mut db.conn().await)
        .await
        .expect("recovery");
    assert_eq!(report.backfill.1, 5, "the backfill reaches the newest row");
    let relay = spawn_relay(&db, publisher_for(&name));
    insert_each(&db, "k", 5..6).await;
    let got = wait_for_all(&name, &ids("k", 0..6));
    assert_eq!(firsts(&got), ids("k", 0..6), "nothing lost, in order");
    stop(relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relay_reads_and_another_takes_over_when_its_session_is_killed_or_silent() {
    let db = Db::start().await;
    db.setup().await;
    // A silent holder: the lock taken on a session that then runs nothing (a frozen
    // process). The relay ends that session after takeover_after (3 s) and reads.
    let mut frozen = db.conn().await;
    let got: Option<i64> = frozen
        .query_first("SELECT GET_LOCK('outbox_cdc', 0)")
        .await
        .unwrap();
    assert_eq!(got, Some(1));
    let (p, name) = publisher();
    let first = spawn_relay(&db, p);
    let second = spawn_relay(&db, publisher_for(&name));
    insert_each(&db, "k", 0..3).await;
    let started = Instant::now();
    wait_for_all(&name, &ids("k", 0..3));
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "published while the lock was held"
    );
    assert!(
        frozen.query_drop("DO 1").await.is_err(),
        "the silent holder's session was ended"
    );

    // The holder's session killed (as when its process dies): the other one reads on.
    for round in 1..=2u32 {
        // The killed holder may publish what it read before it sees the kill, so the
        // other relay may not hold the lock yet when the messages are in.
        let holder = wait_for_holder(&db).await;
        db.server.exec(&format!("KILL CONNECTION {holder}"));
        let from = round * 10;
        insert_each(&db, "k", from..from + 3).await;
        let mut want = ids("k", 0..3);
        want.extend((1..=round).flat_map(|r| ids("k", r * 10..r * 10 + 3)));
        let got = wait_for_all(&name, &want);
        assert_eq!(firsts(&got), want, "order kept across the takeover");
    }
    stop(first).await;
    stop(second).await;
}

/// A publisher whose broker is down (an outage) while `down` is set, and whose publish
/// hangs (a broker that does not answer) while `hang` is set.
struct Outage<P> {
    inner: P,
    down: Arc<AtomicBool>,
    hang: Arc<AtomicBool>,
}

impl<P> Outage<P> {
    /// A broker that is down while `down` is set.
    fn down_while(inner: P, down: &Arc<AtomicBool>) -> Self {
        Self {
            inner,
            down: Arc::clone(down),
            hang: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A broker that does not answer while `hang` is set.
    fn hanging_while(inner: P, hang: &Arc<AtomicBool>) -> Self {
        Self {
            inner,
            down: Arc::new(AtomicBool::new(false)),
            hang: Arc::clone(hang),
        }
    }
}

impl<P: Publisher> Publisher for Outage<P> {
    async fn publish(&self, batch: &[StoredMessage]) -> Result<PublishOutcomes, Error> {
        while self.hang.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if self.down.load(Ordering::SeqCst) {
            return Err(Error::broker_unavailable("the test's broker is down"));
        }
        self.inner.publish(batch).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_publish_hangs_longer_than_takeover_after_keeps_the_lock() {
    let db = Db::start().await;
    db.setup().await;
    let (p, name) = publisher();
    let hang = Arc::new(AtomicBool::new(true));
    let first = spawn_relay(&db, Outage::hanging_while(p, &hang));
    let holder = wait_for_holder(&db).await;
    insert_each(&db, "k", 0..3).await;
    let second = spawn_relay(&db, publisher_for(&name));
    // The first relay's publish of k:0..3 hangs for longer than takeover_after (3 s).
    let relays = [first, second];
    holder_kept_the_lock(&db, holder, &name, &hang, &ids("k", 0..3), relays).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_waiting_out_a_broker_outage_in_the_backfill_keeps_the_lock() {
    let db = Db::start().await;
    insert_each(&db, "old", 0..3).await;
    db.setup().await;
    let (p, name) = publisher();
    let down = Arc::new(AtomicBool::new(true));
    let first = spawn_relay(&db, Outage::down_while(p, &down));
    let holder = wait_for_holder(&db).await;
    let second = spawn_relay(&db, publisher_for(&name));
    // A holder that ran nothing on its lock's session while it waited out the broker
    // would be ended, and the second relay would publish the batch the first one
    // publishes after.
    let relays = [first, second];
    holder_kept_the_lock(&db, holder, &name, &down, &ids("old", 0..3), relays).await;
}

/// The end of the two tests above: after longer than `takeover_after` (3 s) and a
/// standby poll, `holder` still holds the lock and nothing reached the stream; once
/// `broker_stuck` is cleared, `want` are published once each. Stops both relays.
async fn holder_kept_the_lock(
    db: &Db,
    holder: i64,
    name: &str,
    broker_stuck: &AtomicBool,
    want: &[String],
    relays: [Relay; 2],
) {
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        wait_for_holder(db).await,
        holder,
        "the holder kept the lock"
    );
    assert!(stream(name).is_empty(), "nothing published while stuck");
    broker_stuck.store(false, Ordering::SeqCst);
    assert_eq!(wait_for_all(name, want), want, "each published once");
    for relay in relays {
        stop(relay).await;
    }
}

/// The session holding the readers' lock, once a relay holds it (up to 30 s).
async fn wait_for_holder(db: &Db) -> i64 {
    let mut c = db.conn().await;
    until_some("a relay to take the lock", PATIENCE, async || {
        let holder: Option<Option<i64>> = c
            .query_first("SELECT IS_USED_LOCK('outbox_cdc')")
            .await
            .unwrap();
        holder.flatten()
    })
    .await
}

const CHILD_URL: &str = "OUTBOX_CDC_MYSQL_CHILD_URL";
const CHILD_STREAM: &str = "OUTBOX_CDC_MYSQL_CHILD_STREAM";

/// Not a test: the relay process the SIGKILL test starts (`--ignored --exact`); it does
/// nothing unless that test started it.
#[test]
#[ignore = "a relay process started by the SIGKILL test"]
fn child_mysql_relay() {
    let (Ok(url), Ok(stream)) = (std::env::var(CHILD_URL), std::env::var(CHILD_STREAM)) else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let relay = MysqlCdcRelay::new(&url, publisher_for(&stream))
            .expect("relay")
            .with_config(fast())
            .expect("config");
        relay
            .run_until(std::future::pending())
            .await
            .expect("the child relay runs");
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_in_this_process_takes_over_from_a_sigkilled_holder_process() {
    let db = Db::start().await;
    db.setup().await;
    let (_, name) = publisher();
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "child_mysql_relay",
            "--exact",
            "--ignored",
            "--test-threads=1",
        ])
        .env(CHILD_URL, &db.url)
        .env(CHILD_STREAM, &name)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("child relay starts");
    insert_each(&db, "k", 0..3).await;
    wait_for_all(&name, &ids("k", 0..3));
    let relay = spawn_relay(&db, publisher_for(&name));
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    insert_each(&db, "k", 3..6).await;
    let got = wait_for_all(&name, &ids("k", 0..6));
    assert_eq!(firsts(&got), ids("k", 0..6));
    stop(relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_message_is_parked_with_its_key_and_retried_while_other_keys_go_on() {
    let db = Db::start().await;
    db.setup().await;
    let (inner, name) = publisher();
    // k1:0 is refused twice, then taken.
    let publisher = std::sync::Arc::new(Refusing::new(inner, &[("k1:0", 2)]));
    let retry = outbox_core::RetryPolicy::default()
        .with_max_attempts(5)
        .with_base_delay(Duration::from_secs(1))
        .with_jitter(0.0);
    let relay = spawn_relay_with(&db, publisher.clone(), fast().with_retry(retry));
    insert_each(&db, "k1", 0..1).await;
    eventually("k1:0 to be attempted", || {
        publisher
            .attempts
            .lock()
            .unwrap()
            .contains(&msg_id("k1", 0))
    })
    .await;
    insert_each(&db, "k1", 1..3).await;
    insert_each(&db, "k3", 0..3).await;
    // Other keys are not held back; k1's later messages wait behind k1:0.
    let early = wait_for_all(&name, &ids("k3", 0..3));
    assert!(
        !early.contains(&msg_id("k1", 1)),
        "k1:1 overtook its refused predecessor"
    );
    let got = wait_for_all(&name, &ids("k1", 0..3));
    let k1: Vec<String> = firsts(&got)
        .into_iter()
        .filter(|m| m.starts_with("k1:"))
        .collect();
    assert_eq!(k1, ids("k1", 0..3), "k1 in order after the retries");
    let mut c = db.conn().await;
    until_some("the parked messages to be unparked", PATIENCE, async || {
        let parked: Option<i64> = c
            .query_first("SELECT COUNT(*) FROM outbox_cdc_parked")
            .await
            .unwrap();
        (parked == Some(0)).then_some(())
    })
    .await;
    let retries: Option<(i64, i64)> = c
        .query_first("SELECT retries, status FROM outbox WHERE msg_id = 'k1:0'")
        .await
        .unwrap();
    assert_eq!(
        retries,
        Some((2, 1)),
        "two attempts spent, then SENT by the retry round"
    );
    stop(relay).await;
}

fn polling(db: &Db, name: &str) -> Stoppable<Result<(), outbox_core::Error>> {
    let pool = diesel::r2d2::Pool::builder()
        .max_size(4)
        .build(diesel::r2d2::ConnectionManager::<diesel::MysqlConnection>::new(&db.url))
        .expect("pool");
    let relay = outbox_core::Relay::new(
        outbox_diesel::MysqlRelayStore::new(pool),
        publisher_for(name),
    )
    .with_config(outbox_core::RelayConfig::default().with_poll_interval(Duration::from_millis(100)))
    .expect("config");
    spawn_until(move |stop| async move { relay.run_until(stop).await })
}

/// Waits until the relayed watermark reaches the highest id.
async fn wait_watermark(db: &Db) {
    let mut c = db.conn().await;
    until_some(
        "the watermark to reach the last row",
        PATIENCE,
        async || {
            let (mode, _) = binlog::cdc_mode(&mut c).await.unwrap().unwrap();
            let max: Option<i64> = c.query_first("SELECT MAX(id) FROM outbox").await.unwrap();
            (mode.relayed_through >= max.unwrap_or(0)).then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_polling_to_cdc_and_back_loses_nothing() {
    let db = Db::start().await;
    let (_, name) = publisher();
    let (stop_polling, task) = polling(&db, &name);
    insert_each(&db, "p", 0..20).await;
    wait_for_all(&name, &ids("p", 0..20));
    stop_polling.send(()).unwrap();
    task.await.unwrap().unwrap();
    // Committed while no relay runs, before CDC mode: the backfill's.
    insert_each(&db, "p", 20..30).await;

    let report = db.setup().await;
    assert!(report.backfill.1 >= 30, "{report:?}");
    // A polling relay started by mistake refuses, with the reason.
    assert_refused_in_cdc_mode(polling(&db, &name), "binlog CDC relay").await;

    let relay = spawn_relay(&db, publisher_for(&name));
    insert_each(&db, "p", 30..40).await;
    wait_for_all(&name, &ids("p", 0..40));
    wait_watermark(&db).await;
    insert_each(&db, "p", 40..45).await;
    wait_for_all(&name, &ids("p", 0..45));
    stop(relay).await;
    // Committed after the CDC relay stopped: the polling relay's.
    insert_each(&db, "p", 45..50).await;

    let switched = binlog::switch_to_polling(&mut db.conn().await)
        .await
        .unwrap();
    assert!(switched.marked_sent >= 20, "{switched:?}");
    assert!(
        binlog::cdc_mode(&mut db.conn().await)
            .await
            .unwrap()
            .is_none()
    );
    let (stop_polling, task) = polling(&db, &name);
    let got = wait_for_all(&name, &ids("p", 0..50));
    stop_polling.send(()).unwrap();
    task.await.unwrap().unwrap();
    assert_eq!(
        firsts(&got),
        ids("p", 0..50),
        "nothing lost, first copies in order"
    );
    // Only what the CDC relay published above its last watermark comes twice.
    assert!(got.len() <= 50 + 5, "{} copies for 50 messages", got.len());
    let left: Option<i64> = db
        .conn()
        .await
        .query_first("SELECT COUNT(*) FROM outbox WHERE status <> 1")
        .await
        .unwrap();
    assert_eq!(left, Some(0));
}

/// `outbox dead redrive` (outbox_diesel::redrive) in CDC mode: the binlog relay publishes
/// inserts only, so a redrive's UPDATE would leave the row NEW and never published. It is
/// refused with the way out, and the row stays DEAD.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_in_cdc_mode_is_refused_and_the_row_stays_dead() {
    use diesel::Connection as _;
    let db = Db::start().await;
    db.setup().await;
    insert_each(&db, "r", 0..1).await;
    let mut c = db.conn().await;
    c.query_drop("UPDATE outbox SET status = 2").await.unwrap();
    let url = db.url.clone();
    let refused = tokio::task::spawn_blocking(move || {
        let mut conn = diesel::MysqlConnection::establish(&url).expect("connect");
        outbox_diesel::redrive_all(&mut conn)
    })
    .await
    .unwrap()
    .unwrap_err();
    assert!(
        matches!(refused, outbox_diesel::Error::RedriveInCdcMode { .. }),
        "{refused:?}"
    );
    assert!(
        refused.to_string().contains("switch_to_polling"),
        "{refused}"
    );
    let dead: Option<i64> = c
        .query_first("SELECT COUNT(*) FROM outbox WHERE status = 2")
        .await
        .unwrap();
    assert_eq!(dead, Some(1), "the row stays DEAD");
}

/// An XA transaction's rows come in a group ended by `XA PREPARE`, not by a commit the
/// relay can follow: the relay stops with the reason instead of skipping them (before,
/// the next group replaced it and its messages were never published, silently).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xa_transaction_writing_the_outbox_stops_the_relay_instead_of_being_skipped() {
    let db = Db::start().await;
    db.setup().await;
    let (p, name) = publisher();
    let relay = spawn_relay(&db, p);
    let mut c = db.conn().await;
    c.query_drop("XA START 'x1'").await.unwrap();
    insert(&mut c, "x", 1).await;
    c.query_drop("XA END 'x1'").await.unwrap();
    c.query_drop("XA PREPARE 'x1'").await.unwrap();
    c.query_drop("XA COMMIT 'x1'").await.unwrap();
    insert_each(&db, "y", 1..2).await;
    let ended = tokio::time::timeout(Duration::from_secs(30), relay.1)
        .await
        .expect("the relay stops")
        .expect("relay task")
        .expect_err("the relay refuses the XA transaction");
    assert!(ended.to_string().contains("XA"), "{ended}");
    assert!(
        !stream(&name).contains(&msg_id("y", 1)),
        "a later message went out past the XA transaction's"
    );
}

/// The msg_ids left in `outbox`, in id order.
async fn left(db: &Db) -> Vec<String> {
    db.conn()
        .await
        .query("SELECT msg_id FROM outbox ORDER BY id")
        .await
        .expect("rows left")
}

/// `outbox purge sent` in CDC mode: the relayed rows stay NEW, so only the watermark
/// tells which the broker took. A parked row, rows read while the broker is down and
/// rows committed while no relay runs all stay; once published they go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_relayed_deletes_only_rows_the_broker_took() {
    let db = Db::start().await;
    let mut c = db.conn().await;
    let off = binlog::purge_relayed(&mut c, Duration::ZERO, 100).await;
    assert!(matches!(off, Err(CdcError::NotSetUp)), "{off:?}");
    db.setup().await;
    let zero = binlog::purge_relayed(&mut c, Duration::ZERO, 0).await;
    assert!(matches!(zero, Err(CdcError::Config(_))), "{zero:?}");

    let (_, name) = publisher();
    let down = Arc::new(AtomicBool::new(false));
    let outage = |down: &Arc<AtomicBool>| {
        let refusing = Refusing::new(publisher_for(&name), &[("x:0", u32::MAX)]);
        Outage::down_while(refusing, down)
    };
    let retry = outbox_core::RetryPolicy::default().with_max_attempts(1000);
    let relay = spawn_relay_with(&db, outage(&down), fast().with_retry(retry.clone()));
    insert_each(&db, "x", 0..1).await; // refused for ever: parked
    insert_each(&db, "p", 0..5).await;
    wait_for_all(&name, &ids("p", 0..5));
    wait_watermark(&db).await;
    // The broker goes down: the relay reads p:5..8 and cannot publish them.
    down.store(true, Ordering::SeqCst);
    insert_each(&db, "p", 5..8).await;
    tokio::time::sleep(Duration::from_secs(2)).await; // ten reports
    stop(relay).await;
    insert_each(&db, "p", 8..10).await; // no relay runs

    let hour = Duration::from_secs(3600);
    assert_eq!(binlog::purge_relayed(&mut c, hour, 100).await.unwrap(), 0);
    assert_eq!(
        binlog::purge_relayed(&mut c, Duration::ZERO, 3)
            .await
            .unwrap(),
        3
    );
    assert_eq!(
        binlog::purge_relayed(&mut c, Duration::ZERO, 3)
            .await
            .unwrap(),
        2
    );
    assert_eq!(
        binlog::purge_relayed(&mut c, Duration::ZERO, 3)
            .await
            .unwrap(),
        0
    );
    let mut unpublished = ids("x", 0..1);
    unpublished.extend(ids("p", 5..10));
    assert_eq!(left(&db).await, unpublished, "only p:0..5 were published");
    assert!(
        !stream(&name).contains(&msg_id("p", 5)),
        "the test's broker was down"
    );

    // The broker back: the relay publishes p:5..10, then they go; x:0 stays parked.
    down.store(false, Ordering::SeqCst);
    let relay = spawn_relay_with(&db, outage(&down), fast().with_retry(retry));
    wait_for_all(&name, &ids("p", 0..10));
    wait_watermark(&db).await;
    stop(relay).await;
    assert_eq!(
        binlog::purge_relayed(&mut c, Duration::ZERO, 100)
            .await
            .unwrap(),
        5
    );
    assert_eq!(left(&db).await, ids("x", 0..1), "the parked row stays");
}
