//! The CDC relay publishes each transaction's outbox rows as committed (issue 35): a row
//! inserted and then deleted (or truncated) in the same transaction is never published, one inserted
//! and then updated is published as updated (as the polling relay reads it), one
//! inserted as SENT or DEAD is skipped; updates and deletes of rows of earlier
//! transactions (the relay's own writes, purges, mass updates) publish nothing and stall
//! nothing. Both layouts; a private PostgreSQL with `wal_level = logical`.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use diesel::connection::SimpleConnection as _;
use outbox_cdc::CdcConfig;
use outbox_tests::eventually_within;

/// Commits one marker row of key `z` and waits for it: whatever committed before it
/// was read by then.
async fn through_marker(db: &Db, name: &str, n: u32) -> Vec<String> {
    insert_each(db, "z", n..n + 1);
    wait_for_all(name, &[msg_id("z", n)])
}

/// Insert then delete, insert then update (payload and headers, and a toasted payload
/// left unchanged by an update of the headers), insert then mark SENT, insert as SENT
/// or DEAD: each transaction's rows as committed.
/// `config`'s `transaction_memory` decides which transactions are held whole and which
/// are spilled (read back from the table).
async fn folded(partitioned: bool, config: CdcConfig) {
    let db = Db::start(partitioned);
    db.setup(&config);
    let (publisher, name) = publisher();
    let (stop, task) = spawn_relay(&db, publisher, config);
    let mut c = db.conn();
    c.batch_execute(
        "BEGIN; \
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) VALUES \
           ('a:1', 'cdc.test', 'Ping', 'a', '{\"n\": 1}'), \
           ('a:2', 'cdc.test', 'Ping', 'a', '{\"n\": 2}'), \
           ('a:3', 'cdc.test', 'Ping', 'a', '{\"n\": 3}'); \
         DELETE FROM outbox WHERE msg_id = 'a:1'; \
         UPDATE outbox SET payload = '{\"n\": 20}', headers = '{\"h\": \"v\"}' WHERE msg_id = 'a:2'; \
         UPDATE outbox SET payload = '{\"n\": 21}' WHERE msg_id = 'a:2'; \
         COMMIT",
    )
    .unwrap();
    // A payload stored out of line (TOAST), unchanged by the update of the headers:
    // pgoutput sends it as 'unchanged'.
    c.batch_execute(
        "BEGIN; \
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) \
           SELECT 'big:1', 'cdc.test', 'Ping', 'big', \
                  json_build_object('s', string_agg(md5(i::text || random()::text), ''))::jsonb \
           FROM generate_series(1, 2000) i; \
         UPDATE outbox SET headers = '{\"after\": \"update\"}' WHERE msg_id = 'big:1'; \
         COMMIT",
    )
    .unwrap();
    c.batch_execute(
        "BEGIN; \
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) \
           VALUES ('b:1', 'cdc.test', 'Ping', 'b', '{}'); \
         UPDATE outbox SET status = 1, sent_at = now() WHERE msg_id = 'b:1'; \
         COMMIT; \
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, status) VALUES \
           ('c:1', 'cdc.test', 'Ping', 'c', '{}', 1), ('c:2', 'cdc.test', 'Ping', 'c', '{}', 2); \
         BEGIN; \
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) \
           VALUES ('d:1', 'cdc.test', 'Ping', 'd', '{}'); \
         DELETE FROM outbox WHERE msg_id = 'd:1'; \
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) \
           VALUES ('d:1', 'cdc.test', 'Ping', 'd', '{\"again\": true}'); \
         COMMIT; \
         BEGIN; \
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, headers) \
           VALUES ('h:1', 'cdc.test', 'Ping', 'h', '{}', '[\"not an object\"]'); \
         UPDATE outbox SET headers = '{}' WHERE msg_id = 'h:1'; \
         COMMIT",
    )
    .unwrap();
    through_marker(&db, &name, 1).await;
    let got = entries(&name);
    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");

    let ids: Vec<&str> = got.iter().map(|e| e.0.as_str()).collect();
    // h:1 was unreadable as inserted (headers not an object) and is readable as
    // committed: published, not DEAD.
    assert_eq!(ids, ["a:2", "a:3", "big:1", "d:1", "h:1", "z:1"]);
    let by_id: HashMap<&str, &(String, String, String)> =
        got.iter().map(|e| (e.0.as_str(), e)).collect();
    assert_eq!(by_id["a:2"].1, r#"{"n": 21}"#, "the committed payload");
    assert!(by_id["a:2"].2.contains(r#""h":"v""#), "{:?}", by_id["a:2"]);
    assert_eq!(by_id["a:3"].1, r#"{"n": 3}"#);
    assert_eq!(by_id["d:1"].1, r#"{"again": true}"#);
    let big = &by_id["big:1"];
    let stored =
        db.scalar("SELECT length(payload::text)::bigint AS v FROM outbox WHERE msg_id = 'big:1'");
    assert!(
        stored > 60_000,
        "the payload must be large enough to be toasted"
    );
    assert_eq!(big.1.len() as i64, stored, "the toasted payload, whole");
    assert!(big.2.contains("update"), "the committed headers: {big:?}");
    // The polling relay's rule: only NEW rows are messages.
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM outbox WHERE status = 0"),
        6
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn each_transaction_is_published_as_committed_unpartitioned() {
    folded(false, fast()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn each_transaction_is_published_as_committed_partitioned() {
    folded(true, fast()).await;
}

/// A `TRUNCATE outbox` in the transaction that inserted rows: those rows never commit,
/// and are not published; the rows it inserts after the truncate are.
async fn truncated(partitioned: bool) {
    let db = Db::start(partitioned);
    db.setup(&fast());
    let (publisher, name) = publisher();
    let (stop, task) = spawn_relay(&db, publisher, fast());
    insert_each(&db, "a", 1..2);
    wait_for_all(&name, &[msg_id("a", 1)]);
    db.conn()
        .batch_execute(
            "BEGIN; \
             INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) VALUES \
               ('t:1', 'cdc.test', 'Ping', 't', '{}'), ('t:2', 'cdc.test', 'Ping', 't', '{}'); \
             TRUNCATE outbox; \
             INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) \
               VALUES ('t:3', 'cdc.test', 'Ping', 't', '{}'); \
             COMMIT",
        )
        .unwrap();
    let got = through_marker(&db, &name, 1).await;
    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");
    assert_eq!(got, [msg_id("a", 1), msg_id("t", 3), msg_id("z", 1)]);
}

#[tokio::test(flavor = "multi_thread")]
async fn rows_truncated_by_their_own_transaction_are_not_published_unpartitioned() {
    truncated(false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn rows_truncated_by_their_own_transaction_are_not_published_partitioned() {
    truncated(true).await;
}

/// Every transaction spilled (each outgrows one byte): its rows read back from the table
/// are the committed ones, the same as when held whole.
#[tokio::test(flavor = "multi_thread")]
async fn a_spilled_transaction_is_published_as_committed_unpartitioned() {
    folded(false, fast().with_transaction_memory(1)).await;
}

/// Only the transaction with the toasted payload outgrows 16 KiB: spilled commits and
/// commits held whole, published in commit order.
#[tokio::test(flavor = "multi_thread")]
async fn a_spilled_transaction_among_others_partitioned() {
    folded(true, fast().with_transaction_memory(16 << 10)).await;
}

/// One transaction of 3,000 messages over a 64 KiB `transaction_memory`, between small
/// commits, published in batches of 100: every message once, in commit order; its first
/// message, which the broker refuses once, is parked, and so are the later ones of its
/// key, 30 batches on: published again in order after the others. An outage in the
/// middle resumes at the batch it failed: nothing before it is published again.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_larger_than_transaction_memory_is_read_back_in_batches() {
    let db = Db::start(false);
    let config = fast()
        .with_transaction_memory(64 << 10)
        .with_batch_size(100);
    db.setup(&config);
    let (inner, name) = publisher();
    let publisher = std::sync::Arc::new(DownOnce {
        inner: Refusing::new(inner, &[("r:0", 1)]),
        trigger: "k3:1501",
        fired: false.into(),
    });
    let (stop, task) = spawn_relay(&db, publisher.clone(), config);
    insert_each(&db, "a", 0..3);
    let mut c = db.conn();
    c.batch_execute(
        "BEGIN; \
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) \
           VALUES ('r:0', 'cdc.test', 'Ping', 'r', '{}'); \
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) \
           SELECT 'k' || (i % 7) || ':' || i, 'cdc.test', 'Ping', 'k' || (i % 7), \
                  json_build_object('n', i, 'pad', repeat('x', 100))::jsonb \
           FROM generate_series(0, 2999) i; \
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) VALUES \
           ('r:1', 'cdc.test', 'Ping', 'r', '{}'), ('r:2', 'cdc.test', 'Ping', 'r', '{}'); \
         COMMIT",
    )
    .unwrap();
    insert_each(&db, "b", 0..3);
    let mut expected: Vec<String> = (0..3).map(|n| msg_id("a", n)).collect();
    expected.push(msg_id("r", 0));
    expected.extend((0..3000).map(|i| format!("k{}:{i}", i % 7)));
    expected.extend((1..3).map(|n| msg_id("r", n)));
    expected.extend((0..3).map(|n| msg_id("b", n)));
    let got = wait_for_all(&name, &expected);
    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");

    assert!(publisher.fired.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(got.len(), expected.len(), "each message once");
    // Commit order, except r (parked behind its refused first message, published
    // again in order after the others).
    let others: Vec<&String> = got.iter().filter(|m| !m.starts_with("r:")).collect();
    let want: Vec<&String> = expected.iter().filter(|m| !m.starts_with("r:")).collect();
    assert_eq!(others, want);
    let r: Vec<&str> = got
        .iter()
        .filter(|m| m.starts_with("r:"))
        .map(String::as_str)
        .collect();
    assert_eq!(r, ["r:0", "r:1", "r:2"]);
}

/// Updates and deletes of rows committed earlier: the relay's own parking and DEAD
/// writes, a hand edit, a purge, a mass UPDATE to SENT like `switch_to_polling`'s:
/// nothing is published again, nothing stalls, the slot is confirmed past them.
async fn earlier_rows(partitioned: bool) {
    let db = Db::start(partitioned);
    db.setup(&fast());
    let (inner, name) = publisher();
    // e:0 is refused once (parked, its retry written), f:0 always (DEAD).
    let publisher = std::sync::Arc::new(Refusing::new(inner, &[("e:0", 1), ("f:0", u32::MAX)]));
    let retry = outbox_core::RetryPolicy::default()
        .with_max_attempts(2)
        .with_base_delay(Duration::from_millis(200))
        .with_jitter(0.0);
    let (stop, task) = spawn_relay(&db, publisher.clone(), fast().with_retry(retry));
    insert_each(&db, "e", 0..5);
    insert_each(&db, "f", 0..1);
    let first: Vec<String> = (0..5).map(|n| msg_id("e", n)).collect();
    wait_for_all(&name, &first);
    eventually_within("f:0 to be DEAD", Duration::from_secs(30), || {
        db.scalar("SELECT count(*) AS v FROM outbox WHERE status = 2") == 1
    })
    .await;
    insert_each(&db, "g", 0..2000);
    let g: Vec<String> = (0..2000).map(|n| msg_id("g", n)).collect();
    wait_for_all(&name, &g);
    db.conn()
        .batch_execute(
            "UPDATE outbox SET payload = '{\"edited\": 1}' WHERE msg_id = 'e:1'; \
             DELETE FROM outbox WHERE msg_id = 'e:2'; \
             UPDATE outbox SET status = 1, sent_at = now() WHERE status = 0; \
             DELETE FROM outbox WHERE msg_id LIKE 'g:1%'",
        )
        .unwrap();
    outbox_cdc::purge_relayed(&mut db.conn(), Duration::ZERO, 100).unwrap();
    let started = std::time::Instant::now();
    through_marker(&db, &name, 1).await;
    let through = started.elapsed();
    let end = db.scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint AS v");
    eventually_within(
        "the slot confirmed past it all",
        Duration::from_secs(20),
        || {
            db.scalar(
                "SELECT coalesce(pg_wal_lsn_diff(confirmed_flush_lsn, '0/0'), 0)::bigint AS v \
             FROM pg_replication_slots",
            ) >= end
        },
    )
    .await;
    let got = stream(&name);
    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");
    eprintln!("marker through after the updates and deletes of 2006 rows in {through:?}");
    let mut expected = first.clone();
    expected.extend(g);
    expected.push(msg_id("z", 1));
    let mut sorted = got.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), got.len(), "a message was published twice");
    expected.sort();
    assert_eq!(sorted, expected, "each message once, nothing republished");
    assert_eq!(got.last(), Some(&msg_id("z", 1)));
}

#[tokio::test(flavor = "multi_thread")]
async fn updates_and_deletes_of_earlier_rows_publish_nothing_unpartitioned() {
    earlier_rows(false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn updates_and_deletes_of_earlier_rows_publish_nothing_partitioned() {
    earlier_rows(true).await;
}

/// A publication made by an earlier `outbox migrate --cdc` publishes inserts only, and
/// partitions made by an earlier `outbox partitions maintain` have no replica identity:
/// the relay's start check refuses both, naming the fix, and setup mends them (before
/// the publication publishes deletes, which such a partition would refuse).
async fn upgrade(partitioned: bool) {
    let db = Db::start(partitioned);
    db.setup(&fast());
    let mode = outbox_cdc::cdc_mode(&mut db.conn()).unwrap().unwrap();
    let mut c = db.conn();
    c.batch_execute(&format!(
        "ALTER PUBLICATION {} SET (publish = 'insert')",
        mode.publication
    ))
    .unwrap();
    let err = outbox_cdc::check(&mut db.conn()).unwrap_err().to_string();
    assert!(
        err.contains("updates, deletes and truncates") && err.contains("migrate --cdc"),
        "{err}"
    );
    if partitioned {
        c.batch_execute(
            "DO $$ DECLARE p regclass; BEGIN \
               FOR p IN SELECT inhrelid::regclass FROM pg_inherits \
                        WHERE inhparent = 'outbox'::regclass LOOP \
                 EXECUTE format('ALTER TABLE %s REPLICA IDENTITY DEFAULT', p); \
               END LOOP; END $$",
        )
        .unwrap();
        c.batch_execute(&format!(
            "ALTER PUBLICATION {} SET (publish = 'insert, update, delete, truncate')",
            mode.publication
        ))
        .unwrap();
        let err = outbox_cdc::check(&mut db.conn()).unwrap_err().to_string();
        assert!(err.contains("replica identity"), "{err}");
        c.batch_execute(&format!(
            "ALTER PUBLICATION {} SET (publish = 'insert')",
            mode.publication
        ))
        .unwrap();
    }
    let report = db.setup(&fast());
    assert!(report.publication_created, "setup altered the publication");
    outbox_cdc::check(&mut db.conn()).expect("the altered publication passes");
    assert!(!db.setup(&fast()).publication_created, "idempotent");
    // Updates and deletes work on every partition, and the relay publishes as committed.
    let (publisher, name) = publisher();
    let (stop, task) = spawn_relay(&db, publisher, fast());
    c.batch_execute(
        "BEGIN; \
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) VALUES \
           ('u:1', 'cdc.test', 'Ping', 'u', '{}'), ('u:2', 'cdc.test', 'Ping', 'u', '{}'); \
         DELETE FROM outbox WHERE msg_id = 'u:1'; \
         COMMIT",
    )
    .unwrap();
    let got = through_marker(&db, &name, 1).await;
    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");
    assert_eq!(got, [msg_id("u", 2), msg_id("z", 1)]);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_earlier_setup_is_refused_then_mended_unpartitioned() {
    upgrade(false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_earlier_setup_is_refused_then_mended_partitioned() {
    upgrade(true).await;
}
