//! The CDC relay against a private PostgreSQL with `wal_level = logical` and the shared
//! Redis: commit order, rollbacks, no per-message UPDATE, restart, backfill, refusals.

mod common;

use std::time::Duration;

use common::*;
use diesel::Connection as _;
use diesel::connection::SimpleConnection as _;
use outbox_tests::{eventually, eventually_within, spawn_until};

/// A row with a higher id whose transaction commits first arrives first; a rolled-back
/// row never arrives; the success path writes nothing to `outbox`.
async fn commit_order(partitioned: bool) {
    let db = Db::start(partitioned);
    db.setup(&fast());
    let (publisher, name) = publisher();
    let (stop, task) = spawn_relay(&db, publisher, fast());

    // `early` draws its id first and commits last.
    let mut early = db.conn();
    early.batch_execute("BEGIN").unwrap();
    insert(&mut early, "a", 1);
    let mut late = db.conn();
    late.transaction(|c| {
        insert(c, "b", 1);
        Ok::<_, diesel::result::Error>(())
    })
    .unwrap();
    let mut rolled_back = db.conn();
    rolled_back.batch_execute("BEGIN").unwrap();
    insert(&mut rolled_back, "c", 1);
    rolled_back.batch_execute("ROLLBACK").unwrap();
    early.batch_execute("COMMIT").unwrap();
    insert_each(&db, "d", 1..21);

    let mut expected = vec![msg_id("b", 1), msg_id("a", 1)];
    expected.extend((1..21).map(|n| msg_id("d", n)));
    let got = wait_for_all(&name, &expected);
    assert!(
        db.scalar("SELECT (SELECT id FROM outbox WHERE msg_id = 'a:1') - (SELECT id FROM outbox WHERE msg_id = 'b:1') AS v") < 0,
        "a:1 must have the lower id for this test to mean anything"
    );
    assert_eq!(firsts(&got), expected, "commit order, not id order");
    // A moment for a late copy of the rolled-back row to show, if it were relayed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !stream(&name).contains(&msg_id("c", 1)),
        "a rolled-back row was relayed"
    );

    // No UPDATE and no DELETE of outbox rows on the success path (the statistics are
    // flushed lazily: wait until they count the inserts).
    let stats = |col: &str| {
        db.scalar(&format!(
            "SELECT coalesce(sum({col}), 0)::bigint AS v FROM pg_stat_user_tables \
             WHERE relname ~ '^outbox(_p[0-9]{{8}}t[0-9]{{6}})?$'"
        ))
    };
    eventually_within(
        "the statistics to count the inserts",
        Duration::from_secs(20),
        || stats("n_tup_ins") >= 22,
    )
    .await;
    assert_eq!(
        stats("n_tup_upd"),
        0,
        "the success path updated outbox rows"
    );
    assert_eq!(
        stats("n_tup_del"),
        0,
        "the success path deleted outbox rows"
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM outbox WHERE status <> 0"),
        0
    );

    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");
}

#[tokio::test(flavor = "multi_thread")]
async fn commits_arrive_in_commit_order_without_updates_unpartitioned() {
    commit_order(false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn commits_arrive_in_commit_order_without_updates_partitioned() {
    commit_order(true).await;
}

/// The slot's confirmed position as a number.
fn confirmed(db: &Db) -> i64 {
    db.scalar(
        "SELECT coalesce(pg_wal_lsn_diff(confirmed_flush_lsn, '0/0'), 0)::bigint AS v \
         FROM pg_replication_slots",
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restart_resumes_from_the_confirmed_position() {
    let db = Db::start(false);
    db.setup(&fast());
    let (publisher, name) = publisher();
    let (stop, task) = spawn_relay(&db, publisher, fast());
    insert_each(&db, "k", 0..50);
    let first: Vec<String> = (0..50).map(|n| msg_id("k", n)).collect();
    wait_for_all(&name, &first);
    // Confirmed past the last insert: the relay's status update reached the server.
    let end = db.scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint AS v");
    eventually_within(
        "the relay to confirm what it published",
        Duration::from_secs(20),
        || confirmed(&db) >= end,
    )
    .await;
    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");

    // Committed while no relay runs.
    insert_each(&db, "k", 50..100);
    let (stop, task) = spawn_relay(&db, publisher_for(&name), fast());
    let all: Vec<String> = (0..100).map(|n| msg_id("k", n)).collect();
    let got = wait_for_all(&name, &all);
    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");
    assert_eq!(
        got, all,
        "resumed at the confirmed position: nothing lost, nothing again"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn rows_older_than_the_slot_are_backfilled_first() {
    let db = Db::start(true);
    // Committed before CDC mode: one of them failed once under the polling relay and
    // waits for its retry (due now), holding back the later row of its key.
    insert_each(&db, "old", 0..20);
    insert_each(&db, "retried", 0..2);
    db.conn()
        .batch_execute(
            "UPDATE outbox SET retries = 1, last_error = 'earlier' WHERE msg_id = 'retried:0'; \
             UPDATE outbox SET status = 1 WHERE msg_id = 'old:0'",
        )
        .unwrap();
    let report = db.setup(&fast());
    assert!(report.slot_created && report.publication_created && report.partitioned);
    assert_eq!(report.backfill.0, 0);
    assert!(report.backfill.1 >= 22);
    insert_each(&db, "new", 0..10);

    let (publisher, name) = publisher();
    let (stop, task) = spawn_relay(&db, publisher, fast());
    let mut expected: Vec<String> = (1..20).map(|n| msg_id("old", n)).collect();
    expected.extend((0..2).map(|n| msg_id("retried", n)));
    expected.extend((0..10).map(|n| msg_id("new", n)));
    let got = firsts(&wait_for_all(&name, &expected));
    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");
    assert!(
        !got.contains(&msg_id("old", 0)),
        "a SENT row was backfilled"
    );
    let pos = |m: &str| got.iter().position(|g| g == m).unwrap();
    for n in 1..20 {
        assert!(
            pos(&msg_id("old", n)) < pos(&msg_id("new", 0)),
            "backfill before the stream"
        );
    }
    for n in 2..20 {
        assert!(
            pos(&msg_id("old", n - 1)) < pos(&msg_id("old", n)),
            "backfill in id order"
        );
    }
    assert!(
        pos("retried:0") < pos("retried:1"),
        "the retried row's key kept its order"
    );
    for n in 1..10 {
        assert!(pos(&msg_id("new", n - 1)) < pos(&msg_id("new", n)));
    }
    let mode = outbox_cdc::cdc_mode(&mut db.conn()).unwrap().unwrap();
    assert_eq!(
        mode.backfill.0, mode.backfill.1,
        "the backfill is recorded as done"
    );
    assert_eq!(db.scalar("SELECT count(*) AS v FROM outbox_cdc_parked"), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_message_is_retried_then_dead_without_holding_back_other_keys() {
    let db = Db::start(false);
    db.setup(&fast());
    let (inner, name) = publisher();
    // k1:0 is refused every time (dead after 1 + 2 + 4 s); k2:0 twice, then taken.
    let publisher = std::sync::Arc::new(Refusing::new(inner, &[("k1:0", u32::MAX), ("k2:0", 2)]));
    let retry = outbox_core::RetryPolicy::default()
        .with_max_attempts(4)
        .with_base_delay(Duration::from_secs(1))
        .with_jitter(0.0);
    let (stop, task) = spawn_relay(&db, publisher.clone(), fast().with_retry(retry));
    // The first message of each refused key is refused before the later ones commit: a
    // later message published in the same call as a refused one is not held back (as
    // with the polling relay; counted in outbox_relay_key_order_broken_total).
    insert_each(&db, "k1", 0..1);
    insert_each(&db, "k2", 0..1);
    eventually("k2:0 to be attempted", || {
        publisher
            .attempts
            .lock()
            .unwrap()
            .contains(&msg_id("k2", 0))
    })
    .await;
    insert_each(&db, "k1", 1..3);
    insert_each(&db, "k2", 1..3);
    insert_each(&db, "k3", 0..3);
    // Other keys are not held back: k3 is published while k1:0 and k2:0 wait.
    let k3: Vec<String> = (0..3).map(|n| msg_id("k3", n)).collect();
    let early = wait_for_all(&name, &k3);
    assert!(
        !early.contains(&msg_id("k1", 1)),
        "k1:1 overtook its refused predecessor"
    );

    let mut expected = k3.clone();
    expected.extend((0..3).map(|n| msg_id("k2", n)));
    expected.extend((1..3).map(|n| msg_id("k1", n)));
    let got = firsts(&wait_for_all(&name, &expected));
    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");
    let pos = |m: &str| got.iter().position(|g| g == m).unwrap();
    assert!(
        pos("k2:0") < pos("k2:1") && pos("k2:1") < pos("k2:2"),
        "{got:?}"
    );
    assert!(pos("k1:1") < pos("k1:2"), "{got:?}");
    assert!(
        !got.contains(&msg_id("k1", 0)),
        "k1:0 was refused every time"
    );
    // k1:0 is dead after 4 attempts, with its error, as `outbox dead` lists it.
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM outbox WHERE status = 2"),
        1
    );
    assert_eq!(
        db.scalar(
            "SELECT retries::bigint AS v FROM outbox WHERE msg_id = 'k1:0' AND status = 2 \
                   AND last_error LIKE '%refused by the test%'"
        ),
        4
    );
    // k2:0 spent two retries and was then published.
    assert_eq!(
        db.scalar("SELECT retries::bigint AS v FROM outbox WHERE msg_id = 'k2:0'"),
        2
    );
    assert_eq!(
        db.scalar("SELECT status::bigint AS v FROM outbox WHERE msg_id = 'k2:0'"),
        1
    );
    assert_eq!(db.scalar("SELECT count(*) AS v FROM outbox_cdc_parked"), 0);
    let attempts = publisher.attempts.lock().unwrap().clone();
    assert_eq!(attempts.iter().filter(|m| *m == "k1:0").count(), 4);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_redriven_dead_message_is_published_and_lag_is_reported() {
    let db = Db::start(false);
    db.setup(&fast());
    let (inner, name) = publisher();
    // d:0 is refused once and dies at once (one attempt).
    let publisher = std::sync::Arc::new(Refusing::new(inner, &[("d:0", 1)]));
    let retry = outbox_core::RetryPolicy::default().with_max_attempts(1);
    let (stop, task) = spawn_relay(&db, publisher, fast().with_retry(retry));
    insert_each(&db, "d", 0..3);
    wait_for_all(&name, &[msg_id("d", 1), msg_id("d", 2)]);
    eventually("d:0 to be DEAD", || {
        db.scalar("SELECT count(*) AS v FROM outbox WHERE status = 2") > 0
    })
    .await;
    // As `outbox dead redrive` and the page do it: outbox-diesel's redrive, which parks
    // the row in CDC mode (the log shows no UPDATE).
    assert_eq!(outbox_diesel::redrive_all(&mut db.conn()).unwrap(), 1);
    let got = wait_for_all(&name, &[msg_id("d", 0)]);
    assert_eq!(got.last().map(String::as_str), Some("d:0"), "{got:?}");
    assert_eq!(db.scalar("SELECT count(*) AS v FROM outbox_cdc_parked"), 0);

    // The relay's report: a slot that keeps up, a relay that reports.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let lag = outbox_cdc::lag(&mut db.conn()).unwrap();
    assert!(lag.relay_reporting, "{lag:?}");
    assert!(lag.active_pid.is_some(), "{lag:?}");
    assert!(lag.bytes.is_some_and(|b| b < 1 << 20), "{lag:?}");
    assert_eq!((lag.parked, lag.backfill_left), (0, 0), "{lag:?}");
    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");

    // No relay: the slot falls behind as rows commit, and the age shows it.
    insert_each(&db, "e", 0..5);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let lag = outbox_cdc::lag(&mut db.conn()).unwrap();
    assert!(!lag.relay_reporting, "{lag:?}");
    assert_eq!(lag.active_pid, None);
    assert!(lag.bytes.is_some_and(|b| b > 0), "{lag:?}");
    assert!(
        lag.oldest_unconfirmed_age
            .is_some_and(|a| a >= Duration::from_millis(600)),
        "{lag:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_start_check_names_what_the_server_lacks() {
    use diesel::Connection as _;
    // The shared PostgreSQL runs with wal_level = replica.
    let mut shared = diesel::PgConnection::establish(&outbox_tests::database_url()).unwrap();
    let err = outbox_cdc::check_server(&mut shared).unwrap_err();
    assert!(
        matches!(&err, outbox_cdc::CdcError::WalLevelNotLogical { found } if found == "replica"),
        "{err}"
    );
    assert!(err.to_string().contains("wal_level = logical"), "{err}");

    let db = Db::start(false);
    // CDC mode not set up yet.
    let err = outbox_cdc::check(&mut db.conn()).unwrap_err();
    assert!(matches!(err, outbox_cdc::CdcError::NotSetUp), "{err}");
    // A role without REPLICATION.
    db.conn()
        .batch_execute("CREATE ROLE app LOGIN PASSWORD 'app-pass'")
        .unwrap();
    let url = db.url.replace(
        &format!("postgres:{}@", outbox_tests::ScratchPostgres::PASSWORD),
        "app:app-pass@",
    );
    let mut app = diesel::PgConnection::establish(&url).unwrap();
    let err = outbox_cdc::setup(&mut app, &fast()).unwrap_err();
    assert!(
        matches!(&err, outbox_cdc::CdcError::MissingReplicationPrivilege { role } if role == "app"),
        "{err}"
    );
    assert!(
        err.to_string().contains("ALTER ROLE \"app\" REPLICATION"),
        "{err}"
    );
    // A slot dropped behind the relay's back.
    db.setup(&fast());
    db.conn()
        .batch_execute("SELECT pg_drop_replication_slot('outbox_cdc')")
        .unwrap();
    let err = outbox_cdc::check(&mut db.conn()).unwrap_err();
    assert!(
        matches!(err, outbox_cdc::CdcError::SlotMissing { .. }),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broker_outage_spends_no_retry_and_loses_nothing() {
    let db = Db::start(false);
    db.setup(&fast());
    let (inner, name) = publisher();
    // The first 5 publish calls fail as a whole (the broker down).
    let publisher = std::sync::Arc::new(
        outbox_core::FlakyPublisher::new(inner, outbox_core::FailAs::Outage).fail_first(5),
    );
    insert_each(&db, "o", 0..30);
    let (stop, task) = spawn_relay(&db, publisher.clone(), fast());
    let all: Vec<String> = (0..30).map(|n| msg_id("o", n)).collect();
    let got = wait_for_all(&name, &all);
    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");
    assert_eq!(publisher.failures(), 5, "the outage was injected");
    assert_eq!(firsts(&got), all);
    assert_eq!(
        db.scalar("SELECT coalesce(sum(retries), 0)::bigint AS v FROM outbox"),
        0
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM outbox WHERE status <> 0"),
        0
    );
    assert_eq!(db.scalar("SELECT count(*) AS v FROM outbox_cdc_parked"), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_replication_connection_reconnects_and_loses_nothing() {
    let db = Db::start(false);
    db.setup(&fast());
    let (publisher, name) = publisher();
    let (stop, task) = spawn_relay(&db, publisher, fast());
    let url = db.url.clone();
    let producer = std::thread::spawn(move || {
        let mut c = diesel::PgConnection::establish(&url).unwrap();
        for n in 0..200 {
            insert(&mut c, "r", n);
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    // The relay's server process ended under it, twice (an operator, a failover).
    for _ in 0..2 {
        eventually("the relay to hold the slot", || {
            db.scalar("SELECT count(*) AS v FROM pg_replication_slots WHERE active") > 0
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        db.conn()
            .batch_execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE active",
            )
            .unwrap();
    }
    producer.join().unwrap();
    let all: Vec<String> = (0..200).map(|n| msg_id("r", n)).collect();
    let got = wait_for_all(&name, &all);
    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");
    assert_eq!(
        firsts(&got),
        all,
        "nothing lost, first copies in commit order"
    );
}

/// The database work beside the stream (the retry poll, the report, the holder check)
/// never holds the stream back: with every connection of the relay's pool taken, the
/// commits that stream in are still published at once. (Run in line, the retry poll
/// waited for a connection, up to the pool's timeout, before the stream went on: on a
/// loaded server its round trips stalled the stream once a second.)
#[tokio::test(flavor = "multi_thread")]
async fn the_stream_does_not_wait_for_the_database_work_beside_it() {
    use diesel::r2d2::{ConnectionManager, Pool};

    let db = Db::start(false);
    db.setup(&fast());
    let pool_timeout = Duration::from_secs(30);
    let pool = Pool::builder()
        .max_size(2)
        .connection_timeout(pool_timeout)
        .build(ConnectionManager::<diesel::PgConnection>::new(&db.url))
        .unwrap();
    // The holder check before a publish is due only after half of this.
    let config = fast().with_takeover_after(Duration::from_secs(300));
    let (publisher, name) = publisher();
    let relay = outbox_cdc::CdcRelay::new(&db.url, pool.clone(), publisher)
        .unwrap()
        .with_config(config)
        .unwrap();
    let (stop, task) = spawn_until(move |stop| async move { relay.run_until(stop).await });
    insert_each(&db, "w", 0..1);
    wait_for_all(&name, &[msg_id("w", 0)]);

    let taken = tokio::task::spawn_blocking(move || {
        (0..2).map(|_| pool.get().unwrap()).collect::<Vec<_>>()
    })
    .await
    .unwrap();
    // Retry polls are due every 100 ms: some now wait for a connection.
    tokio::time::sleep(Duration::from_millis(500)).await;
    insert_each(&db, "w", 1..6);
    let all: Vec<String> = (0..6).map(|n| msg_id("w", n)).collect();
    let deadline = std::time::Instant::now() + pool_timeout / 3;
    while !all.iter().all(|m| stream(&name).contains(m)) {
        assert!(
            std::time::Instant::now() < deadline,
            "the stream waited for a pool connection: {:?} on the stream",
            stream(&name)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(taken);
    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_socket_url_relays_through_the_unix_socket() {
    let db = Db::start(false);
    db.setup(&fast());
    // The relay's replication connection and its pool both through the socket, as libpq
    // reads the URL: `?host=<directory>`.
    let url = db.server.socket_url();
    let pool = diesel::r2d2::Pool::builder()
        .max_size(4)
        .build(diesel::r2d2::ConnectionManager::<diesel::PgConnection>::new(&url))
        .expect("pool");
    let (publisher, name) = publisher();
    let relay = outbox_cdc::CdcRelay::new(&url, pool, publisher)
        .expect("relay")
        .with_config(fast())
        .expect("config");
    let app = relay.application_name().to_owned();
    let (stop, task) = spawn_until(move |stop| async move { relay.run_until(stop).await });
    insert_each(&db, "k", 0..20);
    let all: Vec<String> = (0..20).map(|n| msg_id("k", n)).collect();
    assert_eq!(wait_for_all(&name, &all), all);
    // A WAL sender serving a socket has no client address.
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM pg_stat_replication \
             WHERE application_name = '{app}' AND client_addr IS NULL"
        )),
        1,
        "the replication connection is the socket's"
    );
    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");
}

#[tokio::test(flavor = "multi_thread")]
async fn names_go_into_sql_quoted_and_a_tampered_record_is_refused() {
    let db = Db::start(false);
    // A reserved word is a name PostgreSQL takes only quoted.
    let config = fast().with_publication("select");
    db.setup(&config);
    let (publisher, name) = publisher();
    let (stop, task) = spawn_relay(&db, publisher, config);
    insert_each(&db, "k", 0..3);
    let all: Vec<String> = (0..3).map(|n| msg_id("k", n)).collect();
    assert_eq!(wait_for_all(&name, &all), all);
    stop.send(()).unwrap();
    task.await.unwrap().expect("relay ends cleanly");

    // Purging in batches of none would never end: refused.
    assert!(matches!(
        outbox_cdc::purge_relayed(&mut db.conn(), Duration::from_secs(1), 0),
        Err(outbox_cdc::CdcError::Config(_))
    ));

    // A recorded name no config could have written is refused before any SQL runs it.
    db.conn()
        .batch_execute("UPDATE outbox_cdc SET publication = 'x; DROP TABLE outbox'")
        .unwrap();
    let err = outbox_cdc::switch_to_polling(&mut db.conn()).unwrap_err();
    assert!(
        matches!(&err, outbox_cdc::CdcError::Config(e) if e.field() == "outbox_cdc.publication"),
        "{err}"
    );
    assert_eq!(
        db.scalar("SELECT (to_regclass('outbox') IS NOT NULL)::int::bigint AS v"),
        1,
        "the outbox table is still there"
    );
}
