//! `outbox migrate --partitioned` and `outbox partitions` on PostgreSQL: an unpartitioned
//! outbox converted while a relay process publishes and emits go on, with nothing lost or
//! doubled; other backends refused with a clear error.

mod fixtures;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

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
