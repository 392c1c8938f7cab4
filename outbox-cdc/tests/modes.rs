//! Switching between the polling relay and CDC both ways, a lost slot and its recovery,
//! and partition retention in CDC mode.

mod common;

use std::time::Duration;

use common::*;
use diesel::connection::SimpleConnection as _;
use outbox_cdc::CdcError;
use outbox_core::{Relay, RelayConfig};
use outbox_diesel::PgRelayStore;
use outbox_tests::{Stoppable, eventually, spawn_until};

fn polling(db: &Db, name: &str) -> Stoppable<Result<(), outbox_core::Error>> {
    let relay = Relay::new(PgRelayStore::new(db.pool.clone()), publisher_for(name))
        .with_config(RelayConfig::default().with_poll_interval(Duration::from_millis(100)))
        .expect("config");
    spawn_until(move |stop| async move { relay.run_until(stop).await })
}

fn ids(range: std::ops::Range<u32>) -> Vec<String> {
    range.map(|n| msg_id("p", n)).collect()
}

/// Waits until the relayed watermark reaches the highest id.
async fn wait_watermark(db: &Db) {
    eventually("the watermark to reach the last row", || {
        let mode = outbox_cdc::cdc_mode(&mut db.conn()).unwrap().unwrap();
        mode.relayed_through >= db.scalar("SELECT max(id) AS v FROM outbox")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn switching_polling_to_cdc_and_back_loses_nothing() {
    let db = Db::start(false);
    let (_, name) = publisher();
    let (stop, task) = polling(&db, &name);
    insert_each(&db, "p", 0..20);
    wait_for_all(&name, &ids(0..20));
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    // Committed while no relay runs, before CDC mode: the backfill's.
    insert_each(&db, "p", 20..30);

    let report = db.setup(&fast());
    assert!(report.backfill.1 >= 30);
    // A polling relay started by mistake refuses, with the reason.
    assert_refused_in_cdc_mode(polling(&db, &name), "CDC relay").await;

    let (stop, task) = spawn_relay(&db, publisher_for(&name), fast());
    insert_each(&db, "p", 30..40);
    wait_for_all(&name, &ids(0..40));
    wait_watermark(&db).await;
    insert_each(&db, "p", 40..45);
    wait_for_all(&name, &ids(0..45));
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    // Committed after the CDC relay stopped: the polling relay's.
    insert_each(&db, "p", 45..50);

    let switched = outbox_cdc::switch_to_polling(&mut db.conn()).unwrap();
    assert!(switched.marked_sent >= 20, "{switched:?}");
    assert!(outbox_cdc::cdc_mode(&mut db.conn()).unwrap().is_none());
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM pg_replication_slots"),
        0
    );
    let (stop, task) = polling(&db, &name);
    let got = wait_for_all(&name, &ids(0..50));
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    assert_eq!(
        firsts(&got),
        ids(0..50),
        "nothing lost, first copies in order"
    );
    // Only what the CDC relay published above its last watermark comes twice.
    assert!(got.len() <= 50 + 5, "{} copies for 50 messages", got.len());
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM outbox WHERE status <> 1"),
        0
    );
}

/// Writes WAL and checkpoints until the slot is invalidated by max_slot_wal_keep_size.
fn lose_the_slot(db: &Db) {
    let mut c = db.conn();
    for _ in 0..20 {
        c.batch_execute(
            "CREATE TABLE IF NOT EXISTS filler (v text); \
             INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 20000); \
             SELECT pg_switch_wal(); CHECKPOINT;",
        )
        .unwrap();
        if db.scalar("SELECT count(*) AS v FROM pg_replication_slots WHERE wal_status = 'lost'")
            == 1
        {
            return;
        }
    }
    panic!("the slot was never invalidated");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_invalidated_slot_is_a_clear_error_and_recovers_without_loss() {
    let db = Db::start_with(false, &[("max_slot_wal_keep_size", "1MB")]);
    db.setup(&fast());
    let (_, name) = publisher();
    let (stop, task) = spawn_relay(&db, publisher_for(&name), fast());
    insert_each(&db, "p", 0..10);
    wait_for_all(&name, &ids(0..10));
    wait_watermark(&db).await;
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();

    lose_the_slot(&db);
    insert_each(&db, "p", 10..20); // committed while the slot is lost
    let err = outbox_cdc::check(&mut db.conn()).unwrap_err();
    assert!(matches!(err, CdcError::SlotInvalidated { .. }), "{err}");
    assert!(err.to_string().contains("recover_lost_slot"), "{err}");
    let lag = outbox_cdc::lag(&mut db.conn()).unwrap();
    assert_eq!(lag.wal_status.as_deref(), Some("lost"));
    // The relay stops with that error instead of waiting.
    let (_stop, task) = spawn_relay(&db, publisher_for(&name), fast());
    let err = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the relay stops")
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, CdcError::SlotInvalidated { .. }), "{err}");
    assert!(!err.is_outage());

    let report = outbox_cdc::recover_lost_slot(&mut db.conn()).unwrap();
    assert!(report.slot_created);
    let (stop, task) = spawn_relay(&db, publisher_for(&name), fast());
    insert_each(&db, "p", 20..25);
    let got = wait_for_all(&name, &ids(0..25));
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    assert_eq!(firsts(&got), ids(0..25));
    assert_eq!(
        got.len(),
        25,
        "the backfill started at the watermark: nothing twice"
    );
}

/// A private cluster with the partitioned layout, a partition a second that expires at
/// once, set up for CDC.
fn partitioned_by_the_second() -> Db {
    let db = Db::start(false);
    let policy = outbox_diesel::PartitionPolicy::default()
        .with_interval(Duration::from_secs(1))
        .with_premake(30)
        .with_retention(Duration::ZERO);
    outbox_diesel::migrate_partitioned(&mut db.conn(), &policy).unwrap();
    outbox_diesel::maintain_partitions(&mut db.conn()).unwrap();
    db.setup(&fast());
    db
}

#[tokio::test(flavor = "multi_thread")]
async fn retention_drops_relayed_partitions_and_keeps_parked_rows() {
    let db = partitioned_by_the_second();
    let (inner, name) = publisher();
    let publisher = std::sync::Arc::new(Refusing::new(inner, &[("r:0", u32::MAX)]));
    let retry = outbox_core::RetryPolicy::default().with_max_attempts(1000);
    let (stop, task) = spawn_relay(&db, publisher, fast().with_retry(retry));
    insert_each(&db, "p", 0..5);
    let relayed_partition = db
        .scalar("SELECT count(DISTINCT tableoid)::bigint AS v FROM outbox WHERE msg_id LIKE 'p:%'");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    insert_each(&db, "r", 0..1); // refused for ever: parked
    wait_for_all(&name, &ids(0..5));
    wait_watermark(&db).await;
    tokio::time::sleep(Duration::from_millis(1100)).await; // both partitions expired

    // The relay's own upkeep may have dropped the relayed partition already; this run,
    // with no relay beside it, reports the kept one.
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    let report = outbox_diesel::maintain_partitions(&mut db.conn()).unwrap();
    assert!(relayed_partition >= 1);
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM outbox WHERE msg_id LIKE 'p:%'"),
        0,
        "the relayed rows' partitions were dropped: {report:?}"
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM outbox WHERE msg_id = 'r:0' AND status = 0"),
        1,
        "the parked row's partition is kept: {report:?}"
    );
    assert!(
        report
            .kept
            .iter()
            .any(|(_, why)| why.contains("CDC relay has not published")),
        "{report:?}"
    );
}

/// A transaction open across the expiry of its row's partition (its `created_at` is the
/// transaction's start, so the row lands in a partition that expires while the
/// transaction is still open, below rows already published): retention keeps that
/// partition, maintenance run by hand meanwhile neither drops it nor hangs on it, and
/// the row is published once committed. The watermark's step 2 waits for it.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_open_across_its_partitions_expiry_is_published() {
    let db = partitioned_by_the_second();
    let (_, name) = publisher();
    let (stop, task) = spawn_relay(&db, publisher_for(&name), fast());
    let mut late = db.conn();
    late.batch_execute("BEGIN").unwrap();
    insert(&mut late, "late", 0);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    insert_each(&db, "p", 0..5);
    wait_for_all(&name, &ids(0..5));
    tokio::time::sleep(Duration::from_millis(2100)).await; // late's partition expired
    // Run by hand while the relay's own upkeep may hold the maintenance lock (then
    // `busy`, nothing done): asked again until a run went through.
    let report = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::task::spawn_blocking({
            let mut c = db.conn();
            move || loop {
                let report = outbox_diesel::maintain_partitions(&mut c).unwrap();
                if !report.busy {
                    return report;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }),
    )
    .await
    .expect("maintenance does not wait for the open transaction")
    .unwrap();
    assert!(
        report
            .kept
            .iter()
            .any(|(_, why)| why.contains("a transaction open since")),
        "{report:?}"
    );
    late.batch_execute("COMMIT").unwrap();
    let got = wait_for_all(&name, &[msg_id("late", 0)]);
    assert!(got.contains(&msg_id("late", 0)), "{report:?}");
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM outbox WHERE msg_id = 'late:0'"),
        1,
        "its partition was kept: {report:?}"
    );
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn purge_relayed_deletes_published_rows_only() {
    let db = Db::start(false);
    db.setup(&fast());
    let (inner, name) = publisher();
    let publisher = std::sync::Arc::new(Refusing::new(inner, &[("x:0", u32::MAX)]));
    let retry = outbox_core::RetryPolicy::default().with_max_attempts(1000);
    let (stop, task) = spawn_relay(&db, publisher, fast().with_retry(retry));
    insert_each(&db, "x", 0..1); // refused for ever: parked
    insert_each(&db, "p", 0..5);
    wait_for_all(&name, &ids(0..5));
    wait_watermark(&db).await;
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    insert_each(&db, "p", 5..8); // above the watermark: not known to be published

    let mut c = db.conn();
    assert_eq!(
        outbox_cdc::purge_relayed(&mut c, Duration::from_secs(3600), 100).unwrap(),
        0,
        "nothing is old enough"
    );
    assert_eq!(
        outbox_cdc::purge_relayed(&mut c, Duration::ZERO, 3).unwrap(),
        3
    );
    assert_eq!(
        outbox_cdc::purge_relayed(&mut c, Duration::ZERO, 100).unwrap(),
        2
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM outbox WHERE msg_id IN ('x:0', 'p:5', 'p:6', 'p:7')"),
        4,
        "the parked row and the rows above the watermark stay"
    );
    assert_eq!(db.scalar("SELECT count(*) AS v FROM outbox"), 4);
}
