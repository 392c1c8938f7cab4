//! The partitioned layout on PostgreSQL (`migrate_partitioned`): msg_id stays unique
//! across partitions (on both layouts, as users rely on it), partitions are made ahead and
//! dropped whole with their NEW and DEAD rows kept, an unpartitioned table is converted
//! with its rows, and the relay keeps the partitions by itself.

mod fixtures;

use std::sync::mpsc;
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::sql_types::Text;
use diesel::{Connection, PgConnection, QueryableByName, RunQueryDsl};
use fixtures::{Backend, Pg, PgParted, TestDb, exec, runtime};
use outbox_core::{ClaimedBatch, Inbox, MsgId, OutboxEvent, RelayStore};
use outbox_diesel::{DieselInbox, Emit, PartitionPolicy, PartitionReport};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
}

fn paid(id: &str) -> OrderPaid {
    OrderPaid {
        order_id: id.into(),
    }
}

fn msg(id: &str) -> String {
    MsgId::from_parts(id, "OrderPaid").unwrap().into_string()
}

/// Partitions of one second, `premake` ahead, kept `retention` after they end.
fn seconds(premake: u32, retention: u64) -> PartitionPolicy {
    PartitionPolicy::default()
        .with_interval(Duration::from_secs(1))
        .with_premake(premake)
        .with_retention(Duration::from_secs(retention))
}

/// A schema with the partitioned layout under `policy`.
fn partitioned(policy: &PartitionPolicy) -> (TestDb, PgConnection) {
    let db = TestDb::postgres("part");
    let mut c = Pg::connect(&db);
    let report = outbox_diesel::migrate_partitioned(&mut c, policy).unwrap();
    assert_eq!(report.failed, [], "{report:?}");
    (db, c)
}

/// Sleeps until the server's clock is past its next whole second.
fn next_second(c: &mut PgConnection) {
    let ms = Pg::scalar(
        c,
        "SELECT (1000 - (extract(milliseconds FROM clock_timestamp())::bigint % 1000))::bigint AS n",
    );
    std::thread::sleep(Duration::from_millis(ms as u64 + 30));
}

/// The partition holding `msg_id`.
fn partition_of(c: &mut PgConnection, msg_id: &str) -> String {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Text)]
        name: String,
    }
    diesel::sql_query("SELECT tableoid::regclass::text AS name FROM outbox WHERE msg_id = $1")
        .bind::<Text, _>(msg_id)
        .get_result::<Row>(c)
        .unwrap()
        .name
}

fn names(c: &mut PgConnection, table: &str) -> Vec<String> {
    outbox_diesel::partitions(c)
        .unwrap()
        .into_iter()
        .filter(|p| p.table == table)
        .map(|p| p.name)
        .collect()
}

fn maintain(c: &mut PgConnection) -> PartitionReport {
    let report = outbox_diesel::maintain_partitions(c).unwrap();
    assert_eq!(report.failed, [], "{report:?}");
    assert!(!report.busy);
    report
}

/// Maintains until every partition of `names` is dropped (a transaction of another test
/// on the shared server, begun before a partition's end, keeps it while it is open); the
/// run that dropped the last of them.
fn maintain_until_dropped(c: &mut PgConnection, names: &[&str]) -> PartitionReport {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut dropped = Vec::new();
    loop {
        let report = maintain(c);
        dropped.extend(report.dropped.iter().cloned());
        if names.iter().all(|n| dropped.iter().any(|d| d == n)) {
            return report;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{names:?} not dropped: {report:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Claims every due row and marks it SENT; their msg_ids.
fn claim_all(db: &TestDb) -> Vec<String> {
    let store = Pg::store(db);
    runtime().block_on(async {
        let batch = store.claim(100).await.unwrap();
        let ids: Vec<String> = batch
            .messages()
            .iter()
            .map(|m| m.envelope.msg_id.to_string())
            .collect();
        let sent = batch.messages().iter().map(|m| m.id).collect();
        let outcome = outbox_core::RelayBatchOutcome {
            sent,
            ..Default::default()
        };
        batch.complete(outcome).await.unwrap();
        ids
    })
}

/// A second emit of a msg_id emitted earlier (in an earlier partition on the partitioned
/// layout) is refused as a duplicate; the transaction stays usable.
fn a_duplicate_of_an_older_message_is_refused<B: Backend<Conn = PgConnection>>() {
    let (_db, mut c) = layout::<B>();
    c.transaction(|c| c.emit(paid("o-1")).map(drop)).unwrap();
    let first = partition_of(&mut c, &msg("o-1"));
    next_second(&mut c);
    c.transaction(|c| {
        let e = c.emit(paid("o-1")).unwrap_err();
        assert!(e.is_duplicate(), "{e}");
        c.emit(paid("o-2")).map(drop)
    })
    .unwrap();
    assert_eq!(Pg::scalar(&mut c, "SELECT count(*) AS n FROM outbox"), 2);
    if B::NAME == PgParted::NAME {
        assert_ne!(
            first,
            partition_of(&mut c, &msg("o-2")),
            "in another partition"
        );
    }
}

/// Two transactions emit the same msg_id at once, the second in the next partition: it
/// waits for the first and, once that commits, is refused.
fn a_concurrent_duplicate_waits_and_is_refused<B: Backend<Conn = PgConnection>>() {
    let (db, mut c) = layout::<B>();
    let (emitted, go_on) = (mpsc::channel(), mpsc::channel::<()>());
    let url = db.url.clone();
    let first = std::thread::spawn(move || {
        let mut c = PgConnection::establish(&url).unwrap();
        c.transaction(|c| {
            c.emit(paid("race"))?;
            emitted.0.send(()).unwrap();
            go_on.1.recv().unwrap();
            Ok::<_, diesel::result::Error>(())
        })
        .unwrap();
    });
    emitted.1.recv().unwrap();
    next_second(&mut c);
    let second = std::thread::spawn(move || {
        c.transaction(|c| c.emit(paid("race")).map(drop))
            .map_err(|e| e.is_duplicate())
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(!second.is_finished(), "the second emit waits for the first");
    go_on.0.send(()).unwrap();
    first.join().unwrap();
    assert_eq!(second.join().unwrap(), Err(true), "refused as a duplicate");
    let mut c = Pg::connect(&db);
    assert_eq!(Pg::scalar(&mut c, "SELECT count(*) AS n FROM outbox"), 1);
}

/// Under REPEATABLE READ a concurrent duplicate is a transient error (retry the
/// transaction) on both layouts, never a second row.
fn a_concurrent_duplicate_under_repeatable_read_is_transient<B: Backend<Conn = PgConnection>>() {
    let (db, mut c) = layout::<B>();
    let mut rival = Pg::connect(&db);
    exec(&mut rival, "BEGIN");
    rival.emit(paid("rr")).unwrap();
    let second = std::thread::spawn(move || {
        c.build_transaction()
            .repeatable_read()
            .run(|c| c.emit(paid("rr")).map(drop))
            .unwrap_err()
    });
    std::thread::sleep(Duration::from_millis(300));
    exec(&mut rival, "COMMIT");
    let e = second.join().unwrap();
    assert!(e.is_transient(), "{e}");
    assert_eq!(
        Pg::scalar(&mut rival, "SELECT count(*) AS n FROM outbox"),
        1
    );
}

/// The schema of layout `B`, partitioned by the second.
fn layout<B: Backend<Conn = PgConnection>>() -> (TestDb, PgConnection) {
    if B::NAME == PgParted::NAME {
        partitioned(&seconds(5, 3600))
    } else {
        let db = TestDb::postgres("plain");
        let mut c = Pg::connect(&db);
        outbox_diesel::migrate(&mut c).unwrap();
        (db, c)
    }
}

outbox_tests::on_every_backend! {
    plain => Pg, partitioned => PgParted;
    a_duplicate_of_an_older_message_is_refused,
    a_concurrent_duplicate_waits_and_is_refused,
    a_concurrent_duplicate_under_repeatable_read_is_transient,
}

/// Expired partitions go whole once they hold only SENT rows; one with a NEW or a DEAD
/// row stays (and is reported) until that row is sent or purged; partitions are made
/// ahead; consumed_msg is kept the same way.
#[test]
fn maintenance_drops_expired_partitions_but_never_new_or_dead_rows() {
    let (db, mut c) = partitioned(&seconds(2, 1));
    for id in ["sent", "new", "dead"] {
        c.transaction(|c| c.emit(paid(id)).map(drop)).unwrap();
        next_second(&mut c);
        maintain(&mut c);
    }
    let inbox = DieselInbox::<PgConnection>::new(Pg::pool(&db, 1));
    inbox
        .process("g", &MsgId::new(msg("sent")).unwrap(), |_| Ok(()))
        .unwrap();
    let [sent, new, dead] = ["sent", "new", "dead"].map(|id| partition_of(&mut c, &msg(id)));
    exec(
        &mut c,
        &format!(
            "UPDATE outbox SET status = 1, sent_at = now() WHERE msg_id = '{}'; \
             UPDATE outbox SET status = 2, last_error = 'x' WHERE msg_id = '{}'",
            msg("sent"),
            msg("dead")
        ),
    );
    let consumed_before = names(&mut c, "consumed_msg");
    std::thread::sleep(Duration::from_millis(2100));

    let report = maintain_until_dropped(&mut c, &[&sent]);
    let kept: Vec<&str> = report.kept.iter().map(|(n, _)| n.as_str()).collect();
    assert!(
        kept.contains(&new.as_str()) && kept.contains(&dead.as_str()),
        "{report:?}"
    );
    assert!(
        report
            .kept
            .iter()
            .any(|(n, why)| *n == new && why.contains("1 NEW"))
    );
    assert_eq!(
        Pg::scalar(&mut c, "SELECT count(*) AS n FROM outbox"),
        2,
        "the NEW and the DEAD row are still there"
    );
    assert!(
        consumed_before
            .iter()
            .any(|p| !names(&mut c, "consumed_msg").contains(p)),
        "an expired consumed_msg partition was dropped"
    );
    let ahead = Pg::scalar(
        &mut c,
        "SELECT count(*) AS n FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid \
         WHERE i.inhparent = 'outbox'::regclass AND p.relname > 'outbox_p' || \
         to_char(now() AT TIME ZONE 'UTC', 'YYYYMMDD\"t\"HH24MISS')",
    );
    assert!(ahead >= 2, "partitions are made ahead: {ahead}");

    // Sent and purged: the partitions go at the next run.
    exec(
        &mut c,
        "UPDATE outbox SET status = 1, sent_at = now() WHERE status = 0",
    );
    let dead_id = Pg::scalar(&mut c, "SELECT id AS n FROM outbox WHERE status = 2");
    assert_eq!(outbox_diesel::purge_dead(&mut c, &[dead_id]).unwrap(), 1);
    maintain_until_dropped(&mut c, &[&new, &dead]);
    assert_eq!(Pg::scalar(&mut c, "SELECT count(*) AS n FROM outbox"), 0);
}

/// A detach that waits for a transaction still reading the expired partition (begun after
/// its end: one begun before would keep it) does not hold up the partitions ahead:
/// maintenance makes every table's first, so emits and inbox inserts find their
/// partition while the detach waits.
#[test]
fn partitions_ahead_are_made_before_a_detach_waits() {
    let (db, mut c) = partitioned(&seconds(2, 1));
    c.transaction(|c| c.emit(paid("old")).map(drop)).unwrap();
    exec(&mut c, "UPDATE outbox SET status = 1, sent_at = now()");
    let old = partition_of(&mut c, &msg("old"));
    next_second(&mut c);
    let mut reader = Pg::connect(&db);
    exec(&mut reader, "BEGIN; SELECT count(*) FROM outbox");
    // Past the partitions made ahead (2 of a second), and the old one expired.
    std::thread::sleep(Duration::from_millis(3100));
    let mut m = Pg::connect(&db);
    let maintenance = std::thread::spawn(move || outbox_diesel::maintain_partitions(&mut m));

    let inbox = DieselInbox::<PgConnection>::new(Pg::pool(&db, 1));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut n = 0;
    loop {
        n += 1;
        let id = format!("late-{n}");
        let emitted = c.transaction(|c| c.emit(paid(&id)).map(drop));
        let consumed = emitted.as_ref().map(|()| {
            inbox
                .process("g", &MsgId::new(msg(&id)).unwrap(), |_| Ok(()))
                .map(drop)
        });
        if matches!(consumed, Ok(Ok(()))) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no partition for now while the detach waits: emit {emitted:?}, inbox {consumed:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !maintenance.is_finished(),
        "the detach was not waiting for the reader"
    );
    exec(&mut reader, "COMMIT");
    let report = maintenance.join().unwrap().unwrap();
    assert!(report.dropped.contains(&old), "{report:?}");
    assert_eq!(report.failed, [], "{report:?}");
}

/// A partition detached by a run that ended before dropping it (its process killed) is
/// dropped by the next run; one that holds a NEW row is attached back, and its row is
/// claimed.
#[test]
fn a_detached_leftover_is_dropped_unless_it_holds_new_rows() {
    let (db, mut c) = partitioned(&seconds(3, 3600));
    c.transaction(|c| c.emit(paid("left")).map(drop)).unwrap();
    let holding = partition_of(&mut c, &msg("left"));
    let empty = names(&mut c, "outbox").pop().unwrap();
    exec(
        &mut c,
        &format!(
            "ALTER TABLE outbox DETACH PARTITION {holding}; ALTER TABLE outbox DETACH PARTITION {empty}"
        ),
    );
    let report = maintain(&mut c);
    assert!(report.dropped.contains(&empty), "{report:?}");
    assert!(
        report
            .kept
            .iter()
            .any(|(n, why)| *n == holding && why.contains("attached back, holds 1 NEW")),
        "{report:?}"
    );
    assert!(names(&mut c, "outbox").contains(&holding));
    assert_eq!(claim_all(&db), [msg("left")]);
}

/// A detach whose session is killed while it waits for a transaction that wrote to the
/// partition leaves it detach-pending; that transaction then commits its row there,
/// which no claim sees. The next run finishes the detach and attaches the partition
/// back: the row is claimed.
#[test]
fn a_row_committed_into_a_detach_pending_partition_is_claimed() {
    let (db, mut c) = partitioned(&seconds(3, 3600));
    let mut writer = Pg::connect(&db);
    exec(&mut writer, "BEGIN");
    writer.emit(paid("late")).unwrap();
    let part = partition_of(&mut writer, &msg("late"));
    let mut detacher = Pg::connect(&db);
    let pid = Pg::scalar(&mut detacher, "SELECT pg_backend_pid()::int8 AS n");
    let detach = std::thread::spawn(move || {
        let sql = format!("ALTER TABLE outbox DETACH PARTITION {part} CONCURRENTLY");
        detacher.batch_execute(&sql).unwrap_err()
    });
    let waiting = format!(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE pid = {pid} AND wait_event_type = 'Lock'"
    );
    while Pg::scalar(&mut c, &waiting) == 0 {
        std::thread::sleep(Duration::from_millis(20));
    }
    exec(&mut c, &format!("SELECT pg_terminate_backend({pid})"));
    detach.join().unwrap();
    exec(&mut writer, "COMMIT");
    assert!(
        outbox_diesel::partitions(&mut c)
            .unwrap()
            .iter()
            .any(|p| p.detaching),
        "the detach was left pending"
    );
    assert_eq!(
        claim_all(&db),
        Vec::<String>::new(),
        "invisible while pending"
    );

    maintain(&mut c);
    assert_eq!(claim_all(&db), [msg("late")]);
}

/// A transaction begun before its partition's end, still open when the partition expires:
/// the partition is not detached under it (its emit, which goes to the partition of its
/// start, would fail), and its row, committed later, is claimed.
#[test]
fn a_transaction_open_across_the_retention_boundary_emits_and_is_claimed() {
    let (db, mut c) = partitioned(&seconds(3, 1));
    let mut writer = Pg::connect(&db);
    exec(&mut writer, "BEGIN; SELECT 1");
    // Its start's partition has ended, and its retention too.
    std::thread::sleep(Duration::from_millis(2500));
    maintain(&mut c);
    writer.emit(paid("long")).unwrap();
    let part = partition_of(&mut writer, &msg("long"));
    std::thread::sleep(Duration::from_millis(1000));
    let report = maintain(&mut c);
    assert!(report.kept.iter().any(|(n, _)| *n == part), "{report:?}");
    exec(&mut writer, "COMMIT");
    maintain(&mut c);
    assert_eq!(claim_all(&db), [msg("long")]);
}

/// A prepared transaction (two-phase commit) holds its rows' partition past retention
/// like an open one: it has no session, so only its locks tell, and once it commits its
/// row is claimed. On a private server: the shared one allows no prepared transactions.
#[test]
fn a_prepared_transaction_across_the_retention_boundary_is_claimed_once_committed() {
    let server = outbox_tests::ScratchPostgres::start_with(&[("max_prepared_transactions", "4")]);
    let db = TestDb {
        engine: outbox_tests::Engine::Postgres,
        name: outbox_tests::unique("prepared"),
        url: server.url(),
    };
    let mut c = Pg::connect(&db);
    let report = outbox_diesel::migrate_partitioned(&mut c, &seconds(3, 1)).unwrap();
    assert_eq!(report.failed, [], "{report:?}");
    let mut writer = Pg::connect(&db);
    exec(&mut writer, "BEGIN");
    writer.emit(paid("two-phase")).unwrap();
    let part = partition_of(&mut writer, &msg("two-phase"));
    exec(&mut writer, "PREPARE TRANSACTION 'outbox_two_phase'");
    drop(writer);
    // Its partition has ended, and its retention too.
    std::thread::sleep(Duration::from_millis(3000));
    // Its partition is kept; so are the others: their detach would wait for it (and
    // fail after a while, at every run).
    let report = maintain(&mut c);
    assert!(
        report.kept.iter().any(|(n, _)| *n == part),
        "{part}: {report:?}"
    );
    let others: Vec<_> = report.kept.iter().filter(|(n, _)| *n != part).collect();
    assert!(
        !others.is_empty()
            && others
                .iter()
                .all(|(_, why)| why.contains("outbox_two_phase")),
        "{report:?}"
    );
    exec(&mut c, "COMMIT PREPARED 'outbox_two_phase'");
    maintain(&mut c);
    assert_eq!(claim_all(&db), [msg("two-phase")]);
}

/// An unpartitioned outbox becomes the first partition with its rows and ids: its NEW
/// rows are claimed, its msg_ids are still refused, new ids follow the old ones, and once
/// it expires with only SENT rows it is dropped without taking the id sequence along.
#[test]
fn an_unpartitioned_table_is_converted_with_its_rows() {
    let db = TestDb::postgres("conv");
    let mut c = Pg::connect(&db);
    outbox_diesel::migrate(&mut c).unwrap();
    let ids: Vec<String> = (0..50).map(|i| format!("old-{i}")).collect();
    c.transaction(|c| c.emit_all(ids.iter().map(|i| paid(i))).map(drop))
        .unwrap();
    exec(
        &mut c,
        "UPDATE outbox SET status = 1, sent_at = now() WHERE id % 2 = 0",
    );
    let inbox = DieselInbox::<PgConnection>::new(Pg::pool(&db, 1));
    inbox
        .process("g", &MsgId::new(msg("old-1")).unwrap(), |_| Ok(()))
        .unwrap();
    let max_id = Pg::scalar(&mut c, "SELECT max(id) AS n FROM outbox");

    let report = outbox_diesel::migrate_partitioned(&mut c, &seconds(1, 2)).unwrap();
    assert_eq!(report.failed, [], "{report:?}");
    assert_eq!(partition_of(&mut c, &msg("old-0")), "outbox_legacy");
    assert_eq!(Pg::scalar(&mut c, "SELECT count(*) AS n FROM outbox"), 50);
    let e = c
        .transaction(|c| c.emit(paid("old-3")).map(drop))
        .unwrap_err();
    assert!(e.is_duplicate(), "{e}");
    c.transaction(|c| c.emit(paid("after")).map(drop)).unwrap();
    assert!(
        Pg::scalar(
            &mut c,
            &format!(
                "SELECT id AS n FROM outbox WHERE msg_id = '{}'",
                msg("after")
            )
        ) > max_id
    );
    assert_eq!(
        inbox
            .process("g", &MsgId::new(msg("old-1")).unwrap(), |_| Ok(()))
            .unwrap(),
        outbox_core::Processed::Duplicate,
        "consumed before the conversion: still a duplicate"
    );

    // The relay drains the old NEW rows and the new one.
    let store = Pg::store(&db);
    let sent = runtime().block_on(async {
        let batch = store.claim(100).await.unwrap();
        let sent: Vec<i64> = batch.messages().iter().map(|m| m.id).collect();
        let n = sent.len();
        let outcome = outbox_core::RelayBatchOutcome {
            sent,
            ..Default::default()
        };
        batch.complete(outcome).await.unwrap();
        n
    });
    assert_eq!(sent, 26);
    drop(store);

    // Once expired, the legacy partition, all SENT now, goes; ids go on from the sequence.
    std::thread::sleep(Duration::from_millis(2100));
    maintain_until_dropped(&mut c, &["outbox_legacy"]);
    c.transaction(|c| c.emit(paid("later")).map(drop)).unwrap();
    assert!(
        Pg::scalar(
            &mut c,
            &format!(
                "SELECT id AS n FROM outbox WHERE msg_id = '{}'",
                msg("later")
            )
        ) > max_id
    );
}

/// The relay store makes partitions ahead by itself while it claims.
#[test]
fn the_relay_makes_partitions_ahead() {
    let (db, mut c) = partitioned(&seconds(1, 3600));
    let before = names(&mut c, "outbox");
    let store = Pg::store(&db);
    runtime().block_on(async {
        for _ in 0..30 {
            drop(store.claim(10).await.unwrap());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let after = names(&mut c, "outbox");
    assert!(
        after.iter().any(|p| !before.contains(p)),
        "no partition made: {before:?} -> {after:?}"
    );
}
