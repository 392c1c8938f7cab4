//! `outbox migrate --partitioned` and `outbox partitions` on PostgreSQL: an unpartitioned
//! outbox converted while a relay process publishes and emits go on, with nothing lost or
//! doubled; a maintenance process stopped while it holds the maintenance lock holds up
//! neither the partitions ahead nor, for long, the next run; other backends refused with
//! a clear error.

mod fixtures;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use fixtures::process::Background;
use fixtures::relay::{Streams, start_relay};
use fixtures::{Engine, TestDb};
use predicates::str::contains;

/// Emits `Ping` 1, 2, .. one per transaction until told to stop; the last n emitted.
fn emit_until(db: &TestDb, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u32> {
    let url = db.url.clone();
    let emitted = Arc::new(AtomicU32::new(0));
    std::thread::spawn(move || {
        use diesel::Connection as _;
        use outbox_diesel::Emit as _;
        let mut c = diesel::PgConnection::establish(&url).expect("connect");
        while !stop.load(Ordering::Relaxed) {
            let n = emitted.load(Ordering::Relaxed) + 1;
            c.transaction(|c| c.emit(fixtures::Ping { n }).map(drop))
                .expect("emit");
            emitted.store(n, Ordering::Relaxed);
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        emitted.load(Ordering::Relaxed)
    })
}

#[test]
fn a_live_outbox_is_partitioned_with_nothing_lost_or_doubled() {
    let db = &TestDb::postgres();
    db.migrate();
    let streams = Streams::new();
    let mut relay = start_relay(db, &streams.prefix, &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let emitter = emit_until(db, Arc::clone(&stop));
    streams.wait_for(50, &mut relay);

    db.outbox()
        .args([
            "migrate",
            "--partitioned",
            "--partition-interval",
            "1h",
            "--premake",
            "2",
        ])
        .assert()
        .success()
        .stdout(contains("created outbox_p"))
        .stdout(contains("outbox tables are partitioned by time"));
    let converted_at = streams.msg_ids().len();
    streams.wait_for(converted_at + 50, &mut relay);
    stop.store(true, Ordering::Relaxed);
    let emitted = emitter.join().unwrap() as usize;

    let published = streams.wait_for(emitted, &mut relay);
    let expected: Vec<String> = (1..=emitted).map(|n| format!("{n}:Ping")).collect();
    assert_eq!(
        published, expected,
        "every message once, in order, across the conversion"
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS n FROM outbox WHERE status <> 1"),
        0
    );
    assert!(db.scalar("SELECT count(*) AS n FROM outbox_legacy") > 0);
    assert!(
        db.scalar(
            "SELECT count(*) AS n FROM outbox WHERE tableoid::regclass::text <> 'outbox_legacy'"
        ) > 0,
        "later emits went to the new partitions"
    );

    // The relay restarted on the partitioned layout keeps it (its start runs migrate).
    relay.signal("TERM");
    assert!(relay.wait().success(), "log:\n{}", relay.log());
    let mut relay = start_relay(db, &streams.prefix, &[]);
    db.emit([emitted as u32 + 1]);
    streams.wait_for(emitted + 1, &mut relay);
    let list = db
        .outbox()
        .args(["partitions", "list", "--json"])
        .output()
        .unwrap();
    let list: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    let outbox: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["table"] == "outbox")
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(outbox.first(), Some(&"outbox_legacy"), "{list}");
    assert!(
        outbox.len() >= 3,
        "the legacy one, the current one and two ahead: {list}"
    );
    db.outbox()
        .args(["partitions", "maintain"])
        .assert()
        .success();
}

/// `outbox partitions maintain` SIGSTOPped while it holds the maintenance lock (caught
/// dropping an orphan that a reader keeps locked): emits go on for longer than the
/// partitions made ahead last, all of them find their partition (other runs make them),
/// and the next run gets the lock once the server has ended the stopped one's session.
#[test]
fn a_stopped_maintenance_run_holds_up_neither_emits_nor_the_next_run() {
    use diesel::Connection as _;
    use outbox_diesel::Emit as _;
    let db = &TestDb::postgres();
    db.outbox()
        .args(["migrate", "--partitioned", "--partition-interval", "1s"])
        .args(["--premake", "2", "--retention", "1h"])
        .assert()
        .success();
    let orphan = "outbox_p20200101t000000";
    db.exec(&format!("CREATE TABLE {orphan} (LIKE outbox)"));
    let mut reader = diesel::PgConnection::establish(&db.url).unwrap();
    diesel::connection::SimpleConnection::batch_execute(
        &mut reader,
        &format!("BEGIN; SELECT count(*) FROM {orphan}"),
    )
    .unwrap();
    let holder = Background::spawn(
        &["--database-url", &db.url, "partitions", "maintain"],
        "info",
    );
    let dropping = format!(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
         AND query LIKE '%DROP TABLE {orphan}%' AND datname = current_database()"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while db.scalar(&dropping) == 0 {
        assert!(std::time::Instant::now() < deadline, "{}", holder.log());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    holder.signal("STOP");

    // 6 s of emits, past the 3 s the partitions ahead cover; a run beside them as a
    // relay's would be, every 250 ms.
    let mut c = diesel::PgConnection::establish(&db.url).unwrap();
    let mut m = diesel::PgConnection::establish(&db.url).unwrap();
    let mut failed = Vec::new();
    for n in 1..=60u32 {
        if n % 3 == 0 {
            outbox_diesel::maintain_partitions(&mut m).unwrap();
        }
        if let Err(e) = c.transaction(|c| c.emit(fixtures::Ping { n }).map(drop)) {
            failed.push(format!("{n}: {e}"));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(failed, Vec::<String>::new(), "emits failed");

    // The stopped run's lock is released within its lock wait and idle limit (5 + 10 s).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while outbox_diesel::maintain_partitions(&mut m).unwrap().busy {
        assert!(std::time::Instant::now() < deadline, "still busy");
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    holder.signal("CONT");
}

#[test]
fn other_backends_are_refused_with_the_reason() {
    for engine in [Engine::Mariadb, Engine::Sqlite] {
        let db = TestDb::new(engine);
        db.migrate();
        db.outbox()
            .args(["migrate", "--partitioned"])
            .assert()
            .failure()
            .stderr(contains("--partitioned is for PostgreSQL only"));
        db.outbox()
            .args(["partitions", "maintain"])
            .assert()
            .failure()
            .stderr(contains("outbox partitions is for PostgreSQL only"));
    }
    let db = TestDb::postgres();
    db.migrate();
    db.outbox()
        .args(["partitions", "maintain"])
        .assert()
        .success()
        .stdout(contains("not partitioned"));
    db.outbox()
        .args(["migrate", "--partitioned", "--partition-interval", "500ms"])
        .assert()
        .failure()
        .stderr(contains("invalid partition policy"));
}
