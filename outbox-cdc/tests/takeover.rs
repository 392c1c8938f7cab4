//! Several relay processes share the slot: one holds it, the others wait and take over
//! within seconds when the holder stops (SIGTERM), dies (SIGKILL) or freezes (SIGSTOP).
//! The relays are real processes: this test binary started again as `child_relay`.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use diesel::connection::SimpleConnection as _;
use outbox_cdc::CdcRelay;

const CHILD_URL: &str = "OUTBOX_CDC_CHILD_URL";
const CHILD_STREAM: &str = "OUTBOX_CDC_CHILD_STREAM";

/// Not a test: the relay process the takeover tests start (`--ignored --exact`); it
/// does nothing unless they started it.
#[test]
#[ignore = "a relay process started by the takeover tests"]
fn child_relay() {
    let (Ok(url), Ok(stream)) = (std::env::var(CHILD_URL), std::env::var(CHILD_STREAM)) else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let pool = diesel::r2d2::Pool::builder()
            .max_size(4)
            .build(diesel::r2d2::ConnectionManager::new(&url))
            .expect("pool");
        let relay = CdcRelay::new(&url, pool, publisher_for(&stream))
            .expect("relay")
            .with_config(fast())
            .expect("config");
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        relay
            .run_until(async move {
                term.recv().await;
            })
            .await
            .expect("the child relay ends cleanly");
    });
}

fn spawn_child(db: &Db, stream: &str) -> Child {
    Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "child_relay",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_URL, &db.url)
        .env(CHILD_STREAM, stream)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("child relay starts")
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(ok.success(), "kill -{sig} {}", child.id());
}

/// The OS pid of the process holding the slot (from its application_name), if any.
fn holder(db: &Db) -> Option<u32> {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        name: String,
    }
    use diesel::RunQueryDsl as _;
    let rows: Vec<Row> = diesel::sql_query(
        "SELECT r.application_name AS name FROM pg_stat_replication r \
         JOIN pg_replication_slots s ON s.active_pid = r.pid",
    )
    .load(&mut db.conn())
    .ok()?;
    rows.first()?
        .name
        .strip_prefix("outbox-cdc-")?
        .split('-')
        .next()?
        .parse()
        .ok()
}

/// Waits until `who` holds the slot; how long it took.
fn wait_holder(db: &Db, who: &Child, within: Duration) -> Duration {
    let start = Instant::now();
    while holder(db) != Some(who.id()) {
        assert!(
            start.elapsed() < within,
            "process {} did not hold the slot within {within:?} (holder: {:?})",
            who.id(),
            holder(db)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    start.elapsed()
}

/// Inserts `range` of key `k`, one row per transaction, `gap` apart, on a thread.
fn produce(db: &Db, range: std::ops::Range<u32>, gap: Duration) -> std::thread::JoinHandle<()> {
    let url = db.url.clone();
    std::thread::spawn(move || {
        use diesel::Connection as _;
        let mut c = diesel::PgConnection::establish(&url).expect("connect");
        for n in range {
            insert(&mut c, "k", n);
            std::thread::sleep(gap);
        }
    })
}

fn check_stream(name: &str, n: u32) {
    let expected: Vec<String> = (0..n).map(|i| msg_id("k", i)).collect();
    let got = wait_for_all(name, &expected);
    assert_eq!(
        firsts(&got),
        expected,
        "first copies in commit order, none lost"
    );
}

struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn a_waiting_relay_takes_over_after_sigterm_and_sigkill() {
    let db = Db::start(false);
    db.setup(&fast());
    let (_, name) = publisher();
    let mut kids = Children(vec![spawn_child(&db, &name)]);
    wait_holder(&db, &kids.0[0], Duration::from_secs(60));
    kids.0.push(spawn_child(&db, &name));
    kids.0.push(spawn_child(&db, &name));
    let producer = produce(&db, 0..300, Duration::from_millis(10));
    std::thread::sleep(Duration::from_millis(700));

    // SIGTERM: the holder releases the slot, a waiting relay takes it.
    signal(&kids.0[0], "TERM");
    let status = kids.0[0].wait().expect("wait");
    assert!(
        status.success(),
        "the relay stopped by SIGTERM exits cleanly: {status}"
    );
    let start = Instant::now();
    let next = loop {
        match holder(&db) {
            Some(pid) if pid == kids.0[1].id() => break 1,
            Some(pid) if pid == kids.0[2].id() => break 2,
            _ => assert!(
                start.elapsed() < Duration::from_secs(5),
                "no takeover after SIGTERM"
            ),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!("takeover after SIGTERM: {:?}", start.elapsed());

    // SIGKILL: the connection closes, the other waiting relay takes the slot.
    std::thread::sleep(Duration::from_millis(700));
    kids.0[next].kill().expect("SIGKILL");
    kids.0[next].wait().expect("wait");
    let other = 3 - next;
    let took = wait_holder(&db, &kids.0[other], Duration::from_secs(5));
    eprintln!("takeover after SIGKILL: {took:?}");
    producer.join().unwrap();
    check_stream(&name, 300);
}

#[test]
fn a_waiting_relay_takes_over_from_a_frozen_holder_which_then_publishes_nothing_stale() {
    let db = Db::start(false);
    db.setup(&fast());
    let (_, name) = publisher();
    let mut kids = Children(vec![spawn_child(&db, &name)]);
    wait_holder(&db, &kids.0[0], Duration::from_secs(60));
    kids.0.push(spawn_child(&db, &name));
    let producer = produce(&db, 0..400, Duration::from_millis(10));
    std::thread::sleep(Duration::from_millis(800));

    // SIGSTOP: the holder's connection stays up, its walsender would keep the slot
    // until wal_sender_timeout (60 s); the waiting relay ends it after 3 s of silence.
    signal(&kids.0[0], "STOP");
    let took = wait_holder(&db, &kids.0[1], Duration::from_secs(3 + 5));
    eprintln!("takeover from a frozen holder: {took:?}");
    std::thread::sleep(Duration::from_millis(1000));
    // Resumed: it finds the slot taken and publishes nothing more.
    signal(&kids.0[0], "CONT");
    producer.join().unwrap();
    check_stream(&name, 400);
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(
        holder(&db),
        Some(kids.0[1].id()),
        "the resumed relay took the slot back"
    );
    let got = stream(&name);
    assert_eq!(firsts(&got).len(), 400);
    eprintln!("copies on the stream: {} for 400 messages", got.len());
}

/// The application names that held the slot, sampled every 20 ms until `stop`.
fn sample_holders(
    url: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<std::collections::BTreeSet<String>> {
    std::thread::spawn(move || {
        use diesel::{Connection as _, RunQueryDsl as _};
        #[derive(diesel::QueryableByName)]
        struct Row {
            #[diesel(sql_type = diesel::sql_types::Text)]
            name: String,
        }
        let mut c = diesel::PgConnection::establish(&url).expect("connect");
        let mut seen = std::collections::BTreeSet::new();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let rows: Vec<Row> = diesel::sql_query(
                "SELECT r.application_name || '/' || r.pid AS name FROM pg_stat_replication r \
                 JOIN pg_replication_slots s ON s.active_pid = r.pid",
            )
            .load(&mut c)
            .unwrap_or_default();
            seen.extend(rows.into_iter().map(|r| r.name));
            std::thread::sleep(Duration::from_millis(20));
        }
        seen
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_long_transaction_does_not_make_the_holder_look_frozen() {
    let db = Db::start(false);
    let config = fast().with_takeover_after(Duration::from_millis(600));
    db.setup(&config);
    let (publisher, name) = publisher();
    let (stop_a, task_a) = spawn_relay(&db, publisher, config.clone());
    wait_until_held(&db).await;
    let (stop_b, task_b) = spawn_relay(&db, publisher_for(&name), config);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = sample_holders(db.url.clone(), stop.clone());
    // One transaction of 20,000 rows, streamed for about as long as takeover_after:
    // the waiting relay must not take it for a frozen holder (its heartbeat, not the
    // walsender's reply_time, which the server reads late while it streams).
    const N: u32 = 20_000;
    db.conn()
        .batch_execute(&format!(
            "INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) \
             SELECT 'big:' || g, '{TOPIC}', 'Ping', 'big', '{{}}' FROM generate_series(0, {}) g",
            N - 1
        ))
        .unwrap();
    let inserted = Instant::now();
    let client = redis::Client::open(outbox_tests::redis_url()).unwrap();
    let mut c = client.get_connection().unwrap();
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut first = None;
    loop {
        let len: u64 = redis::cmd("XLEN").arg(&name).query(&mut c).unwrap();
        if len > 0 && first.is_none() {
            first = Some(inserted.elapsed());
        }
        if len >= u64::from(N) {
            eprintln!(
                "first entry after {first:?}, all after {:?}",
                inserted.elapsed()
            );
            break;
        }
        assert!(Instant::now() < deadline, "only {len} of {N} published");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let holders = sampler.join().unwrap();
    stop_a.send(()).unwrap();
    stop_b.send(()).unwrap();
    task_a.await.unwrap().unwrap();
    task_b.await.unwrap().unwrap();
    let len: u64 = redis::cmd("XLEN").arg(&name).query(&mut c).unwrap();
    assert_eq!(holders.len(), 1, "the slot changed hands: {holders:?}");
    assert_eq!(len, u64::from(N), "the transaction was published once");
}

async fn wait_until_held(db: &Db) {
    let held = || db.scalar("SELECT count(*) AS v FROM pg_replication_slots WHERE active") > 0;
    outbox_tests::eventually_within("a relay to hold the slot", Duration::from_secs(60), held)
        .await;
}
