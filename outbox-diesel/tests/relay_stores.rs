//! Relay-store behaviour that differs per backend: row locks between concurrent claimers
//! (PostgreSQL, MariaDB), the claim's index (EXPLAIN with many SENT rows), the SQLite
//! single-relay lock, and the PostgreSQL LISTEN/NOTIFY wake-up.

mod fixtures;

use std::time::{Duration, Instant};

use diesel::connection::{AnsiTransactionManager, SimpleConnection as _, TransactionManager as _};
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::{Connection, PgConnection, RunQueryDsl as _};
use fixtures::{Backend, Lite, My, Pg, exec, mariadb_plan, pg_plan, runtime};
use outbox_core::{ClaimedBatch, DeadRow, OutboxEvent, RelayBatchOutcome, RelayStore};
use outbox_diesel::{Emit, EmitOptions, Notify, SqliteRelayStore};
use outbox_tests::plans::{TableAccess, mariadb_table_accesses, pg_rows_removed_by_filter};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
struct Pinged {
    #[outbox(id)]
    n: u32,
}

fn ids(batch: &impl ClaimedBatch) -> Vec<i64> {
    batch.messages().iter().map(|m| m.id).collect()
}

async fn claim_skips_locked_rows<B: Backend>()
where
    B::Store: RelayStore,
{
    let db = B::create();
    let mut conn = B::connect(&db);
    conn.emit_all((1..=10).map(|n| Pinged { n })).unwrap();
    let all: Vec<i64> = outbox_diesel::list_messages(&mut conn, None, 0, 100)
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    let store = B::store(&db);

    // A row locked by someone else's transaction (a plain SELECT .. FOR UPDATE).
    let mut other = B::connect(&db);
    other
        .batch_execute(&format!(
            "BEGIN; SELECT id FROM outbox WHERE id = {} FOR UPDATE;",
            all[0]
        ))
        .unwrap();

    let a = store.claim(3).await.unwrap();
    assert_eq!(
        ids(&a),
        all[1..4],
        "skips the row locked by the other transaction"
    );
    let b = store.claim(3).await.unwrap();
    assert_eq!(
        ids(&b),
        all[4..7],
        "a second claimer skips the first one's rows"
    );
    other.batch_execute("ROLLBACK").unwrap();

    // Dropping a batch releases its rows untouched.
    drop(a);
    fixtures::released::<B>(&store, 1).await; // b is still in hand
    let c = store.claim(10).await.unwrap();
    let want: Vec<i64> = all[..4].iter().chain(&all[7..]).copied().collect();
    assert_eq!(ids(&c), want, "released rows and the rest, but not b's");

    b.complete(RelayBatchOutcome {
        sent: all[4..7].to_vec(),
        ..RelayBatchOutcome::default()
    })
    .await
    .unwrap();
    drop(c);
    fixtures::released::<B>(&store, 0).await;
    let d = store.claim(100).await.unwrap();
    assert_eq!(d.messages().len(), 7, "SENT rows are never claimed again");
    let backlog = store.backlog().await.unwrap();
    assert_eq!(backlog.due, 7);
}

#[test]
fn pg_claim_skips_rows_locked_by_a_concurrent_claimer() {
    runtime().block_on(claim_skips_locked_rows::<Pg>());
}

#[test]
fn mysql_claim_skips_rows_locked_by_a_concurrent_claimer() {
    runtime().block_on(claim_skips_locked_rows::<My>());
}

/// 20,000 SENT rows, a key each.
const SENT_ROWS_PG: &str =
    "INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, status, sent_at)
     SELECT 's-' || g || ':E', 't', 'E', 's-' || g, '{}'::jsonb, 1, now()
     FROM generate_series(1, 20000) g;";

#[test]
fn pg_claim_does_not_scan_sent_rows() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    exec(&mut c, SENT_ROWS_PG);
    c.emit_all((1..=50).map(|n| Pinged { n })).unwrap();
    exec(&mut c, "ANALYZE outbox;");
    let sql = outbox_diesel::__private::claim_sql::<PgConnection>(100);
    let plan = pg_plan(&mut c, &sql);
    let text = plan.join("\n");
    println!("{text}");
    assert!(
        text.contains("outbox_pending"),
        "the claim uses the NEW-only index:\n{text}"
    );
    assert!(!text.contains("Seq Scan"), "no table scan:\n{text}");
    for n in pg_rows_removed_by_filter(&plan) {
        assert!(n < 100, "filtered SENT rows:\n{text}");
    }
}

#[test]
fn mysql_claim_does_not_scan_sent_rows() {
    let db = My::create();
    let mut c = My::connect(&db);
    exec(
        &mut c,
        "SET SESSION max_recursive_iterations = 100000;
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, headers, status,
                             next_retry_at, created_at, sent_at)
         WITH RECURSIVE seq (n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM seq WHERE n < 20000)
         SELECT CONCAT('s-', n, ':E'), 't', 'E', CONCAT('s-', n), '{}', '{}', 1,
                UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) FROM seq;",
    );
    c.emit_all((1..=50).map(|n| Pinged { n })).unwrap();
    exec(&mut c, "ANALYZE TABLE outbox;");
    let sql = outbox_diesel::__private::claim_sql::<diesel::MysqlConnection>(100);
    let plan = mariadb_plan(&mut c, &sql);
    println!("{plan}");
    let accesses = mariadb_table_accesses(&plan);
    let TableAccess { key, rows } = accesses.first().expect("a table access in the plan");
    assert!(
        key == "outbox_claim" || key == "outbox_status_next_retry",
        "the claim uses a status-led index, not {key}:\n{plan}"
    );
    let examined = rows.expect("the rows the claim examined");
    assert!(
        examined <= 60.0,
        "examined {examined} rows: SENT rows were scanned\n{plan}"
    );
}

/// The unordered claim walks `outbox_claim` in id order whatever the table's statistics
/// say: here they were taken while every row was SENT, and a burst of NEW rows came after
/// (InnoDB's automatic recalculation, which would catch up within seconds, is off for the
/// table). Unforced, MariaDB 10.11 then walked the primary key through every SENT row, or
/// read and sorted the whole backlog on a never-analyzed table (670 ms at 150,000 NEW
/// rows): a claim must read about its LIMIT of rows.
#[test]
fn mysql_claim_walks_its_index_on_stale_statistics() {
    let db = My::create();
    let mut c = My::connect(&db);
    exec(
        &mut c,
        "ALTER TABLE outbox STATS_AUTO_RECALC = 0;
         SET SESSION max_recursive_iterations = 100000;
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, headers, status,
                             next_retry_at, created_at, sent_at)
         WITH RECURSIVE seq (n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM seq WHERE n < 20000)
         SELECT CONCAT('s-', n, ':E'), 't', 'E', CONCAT('s-', n), '{}', '{}', 1,
                UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) FROM seq;
         ANALYZE TABLE outbox;
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, headers, status,
                             next_retry_at, created_at)
         WITH RECURSIVE seq (n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM seq WHERE n < 20000)
         SELECT CONCAT('n-', n, ':E'), 't', 'E', CONCAT('k-', n % 100), '{}', '{}', 0,
                UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) FROM seq;",
    );
    let sql = outbox_diesel::__private::claim_sql::<diesel::MysqlConnection>(100);
    let plan = mariadb_plan(&mut c, &sql);
    println!("{plan}");
    let accesses = mariadb_table_accesses(&plan);
    let TableAccess { key, rows } = accesses.first().expect("a table access in the plan");
    assert_eq!(key, "outbox_claim", "{plan}");
    let examined = rows.expect("the rows the claim examined");
    assert!(
        examined <= 110.0,
        "examined {examined} rows for a LIMIT of 100\n{plan}"
    );
    assert!(!plan.contains("filesort"), "{plan}");
}

#[test]
fn sqlite_second_relay_gets_a_clear_error() {
    let db = Lite::create();
    let first = SqliteRelayStore::new(Lite::pool(&db, 2)).unwrap();
    let err = SqliteRelayStore::new(Lite::pool(&db, 2)).unwrap_err();
    assert!(err.is_relay_conflict(), "{err}");
    match &err {
        outbox_diesel::Error::RelayAlreadyRunning { owner, .. } => {
            assert_eq!(owner, first.owner())
        }
        other => panic!("expected RelayAlreadyRunning, got {other}"),
    }
    assert!(err.to_string().contains("one relay per database"), "{err}");
    // The holder keeps working; once it stops, another relay may start.
    runtime().block_on(async { first.claim(10).await.unwrap() });
    drop(first);
    SqliteRelayStore::new(Lite::pool(&db, 2)).unwrap();
}

/// A connection listening on the test's channel.
fn listener(db: &fixtures::TestDb) -> PgConnection {
    let mut l = Pg::connect(db);
    l.batch_execute(&format!("LISTEN \"{}\"", db.name)).unwrap();
    l
}

fn notifications(l: &mut PgConnection) -> usize {
    l.notifications_iter().map(Result::unwrap).count()
}

#[test]
fn pg_emit_notifies_only_while_a_relay_is_idle() {
    let db = Pg::create();
    let mut l = listener(&db);
    let mut c = Pg::connect(&db);
    let idle = EmitOptions::new().with_channel(db.name.clone());
    c.transaction(|c| c.emit_with(&idle, Pinged { n: 1 }).map(drop))
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(notifications(&mut l), 0, "no relay parked: no NOTIFY");

    // Another session parked as a relay (the emits' connection must not hold the lock
    // itself: a session's own exclusive lock does not stop its shared try).
    let mut relay = Pg::connect(&db);
    fixtures::park_as_a_relay(&mut relay, &db);
    // Nothing before commit, nothing after a rollback.
    c.transaction(|c| {
        c.emit_with(&idle, Pinged { n: 3 })?;
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(notifications(&mut l), 0, "NOTIFY is delivered at commit");
        Err::<(), _>(diesel::result::Error::RollbackTransaction)
    })
    .unwrap_err();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        notifications(&mut l),
        0,
        "a rolled-back emit notifies nobody"
    );
    c.transaction(|c| c.emit_with(&idle, Pinged { n: 2 }).map(drop))
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        notifications(&mut l),
        1,
        "exactly one NOTIFY, from the committed emit"
    );

    // Duplicates insert nothing, and a caller may go on and commit. An `emit_all` of
    // several duplicates only notifies nobody; a duplicate `emit` wakes the parked relay
    // (its check runs before the conflict is known: `Notify::WhenRelayIdle`; with the
    // check in a RETURNING list it would not, and this count would be 0).
    let rows = || -> Vec<(i64, String)> {
        use diesel::prelude::*;
        use outbox_diesel::schema::pg::outbox;
        outbox::table
            .select((outbox::id, outbox::msg_id))
            .order(outbox::id)
            .load(&mut Pg::connect(&db))
            .unwrap()
    };
    let before = rows();
    c.transaction(|c| {
        let all = c.emit_all_with(&idle, [Pinged { n: 1 }, Pinged { n: 2 }]);
        assert!(all.unwrap_err().is_duplicate());
        diesel::QueryResult::Ok(())
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(notifications(&mut l), 0, "emit_all of duplicates");
    c.transaction(|c| {
        assert!(
            c.emit_with(&idle, Pinged { n: 2 })
                .unwrap_err()
                .is_duplicate()
        );
        diesel::QueryResult::Ok(())
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(notifications(&mut l), 1, "a duplicate emit, committed");
    assert_eq!(rows(), before, "duplicates changed nothing");

    let never = idle.clone().with_notify(Notify::Never);
    c.emit_with(&never, Pinged { n: 4 }).unwrap();
    let always = idle.clone().with_notify(Notify::Always);
    fixtures::unpark(&mut relay);
    c.emit_all_with(&always, (5..8).map(|n| Pinged { n }))
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        notifications(&mut l),
        1,
        "Never sends none; Always one per transaction"
    );
}

async fn timed_wait(db: &fixtures::TestDb, notify: Notify) -> Duration {
    let store = Pg::store(db);
    let waiter = tokio::spawn(async move {
        let started = Instant::now();
        store.wait_for_work(Duration::from_secs(3)).await;
        started.elapsed()
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut c = Pg::connect(db);
    let opts = EmitOptions::new()
        .with_channel(db.name.clone())
        .with_notify(notify);
    c.transaction(|c| {
        c.emit_with(
            &opts,
            Pinged {
                n: fastrand::u32(..),
            },
        )
        .map(drop)
    })
    .unwrap();
    waiter.await.unwrap()
}

#[test]
fn pg_idle_relay_wakes_at_commit() {
    let db = Pg::create();
    runtime().block_on(async {
        let woke = timed_wait(&db, Notify::WhenRelayIdle).await;
        assert!(woke < Duration::from_millis(1500), "woke after {woke:?}");
        let mut c = Pg::connect(&db);
        // The release of the lock goes on in the background while the relay claims.
        let cleared = Instant::now() + Duration::from_secs(5);
        while fixtures::parked_relays(&db) != 0 {
            assert!(
                Instant::now() < cleared,
                "a woken relay is busy: emitters stop notifying"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        // With work already due, waiting returns at once.
        let store = Pg::store(&db);
        let started = Instant::now();
        store.wait_for_work(Duration::from_secs(3)).await;
        assert!(started.elapsed() < Duration::from_secs(1));
        exec(&mut c, "UPDATE outbox SET status = 1");

        // Without NOTIFY the relay sleeps out its poll interval.
        let slept = timed_wait(&db, Notify::Never).await;
        assert!(slept >= Duration::from_millis(2900), "woke after {slept:?}");
    });
}

#[test]
fn pg_wait_without_listener_or_with_a_dead_one_polls() {
    let db = Pg::create();
    runtime().block_on(async {
        let store = outbox_diesel::PgRelayStore::new(Pg::pool(&db, 1));
        let started = Instant::now();
        store.wait_for_work(Duration::from_millis(300)).await;
        assert!(started.elapsed() >= Duration::from_millis(290));

        // Unreachable, and TLS required (the LISTEN connection has none): both poll.
        for url in [
            "postgres://nobody@127.0.0.1:1/none".to_owned(),
            format!("{}&sslmode=require", db.url),
        ] {
            let broken = outbox_diesel::PgRelayStore::new(Pg::pool(&db, 1)).with_listener(url);
            let started = Instant::now();
            broken.wait_for_work(Duration::from_millis(300)).await;
            let waited = started.elapsed();
            assert!(
                waited >= Duration::from_millis(290) && waited < Duration::from_secs(2),
                "{waited:?}"
            );
        }
    });
}

/// A `created_at` that PostgreSQL takes but chrono cannot hold (written around this
/// library) dead-letters its own row, in both claim orders, instead of failing every
/// claim of the relay.
#[test]
fn pg_a_created_at_out_of_range_is_dead_lettered_not_a_stuck_relay() {
    for order in [
        outbox_diesel::ClaimOrder::PerKey,
        outbox_diesel::ClaimOrder::Unordered,
    ] {
        let db = Pg::create();
        let mut c = Pg::connect(&db);
        c.emit_all((1..=3).map(|n| Pinged { n })).unwrap();
        exec(
            &mut c,
            "UPDATE outbox SET created_at = '270000-01-01 00:00:00+00' WHERE msg_id = '1:Pinged';
             UPDATE outbox SET created_at = 'infinity' WHERE msg_id = '2:Pinged';",
        );
        runtime().block_on(async {
            let store = Pg::store(&db).with_order(order);
            let batch = store.claim(10).await.unwrap();
            let ids: Vec<String> = batch
                .messages()
                .iter()
                .map(|m| m.envelope.msg_id.to_string())
                .collect();
            assert_eq!(ids, ["3:Pinged"], "{order:?}");
            // The dead letters are written in the claim's transaction, with its outcome.
            let sent = batch.messages().iter().map(|m| m.id).collect();
            batch
                .complete(RelayBatchOutcome {
                    sent,
                    ..Default::default()
                })
                .await
                .unwrap();
        });
        assert_eq!(
            Pg::scalar(
                &mut c,
                "SELECT COUNT(*) AS n FROM outbox WHERE status = 2 \
                 AND last_error LIKE '%created_at is out of range%'"
            ),
            2,
            "{order:?}"
        );
    }
}

/// Whole-table scans of `outbox` counted by the server once the sessions named `app`
/// have ended: a session reports its counts as it ends (an idle one only now and then),
/// and leaves `pg_stat_activity` after that.
fn pg_table_scans(c: &mut PgConnection, app: &str) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Pg::scalar(
        c,
        &format!("SELECT COUNT(*) AS n FROM pg_stat_activity WHERE application_name = '{app}'"),
    ) != 0
    {
        assert!(Instant::now() < deadline, "other sessions still open");
        std::thread::sleep(Duration::from_millis(50));
    }
    exec(c, "SELECT pg_stat_clear_snapshot()");
    Pg::scalar(
        c,
        "SELECT seq_scan AS n FROM pg_stat_all_tables WHERE relid = 'outbox'::regclass",
    )
}

/// One relay turn as `run_until` takes it at a low rate: two rows emitted, claimed and
/// recorded, then the due check of a short wait. Both sent (`mixed` false): marked with
/// the COMMIT in one string; one sent and one dead letter: the prepared `MarkSent`.
async fn pg_relay_turn(store: &outbox_diesel::PgRelayStore, c: &mut PgConnection, mixed: bool) {
    c.emit_all([0, 1].map(|_| Pinged {
        n: fastrand::u32(..),
    }))
    .unwrap();
    let batch = store.claim(10).await.unwrap();
    let mut sent = ids(&batch);
    assert_eq!(sent.len(), 2);
    let dead = match mixed {
        true => vec![DeadRow {
            id: sent.pop().unwrap(),
            error: "poison".to_owned(),
        }],
        false => Vec::new(),
    };
    batch
        .complete(RelayBatchOutcome {
            sent,
            dead,
            ..Default::default()
        })
        .await
        .unwrap();
    store.claim(10).await.unwrap(); // empty: the relay is idle
    store.wait_for_work(Duration::from_millis(1)).await;
}

#[test]
fn pg_relay_statements_keep_to_indexes_on_a_table_grown_since_its_statistics() {
    // A new table: statistics of an empty one (and no autovacuum to renew them), the
    // relay's statements (the SENT marks on its pool, the due check on its LISTEN
    // session) planned while it was small (the prepared ones a generic plan after five
    // runs), then the table grew with nothing analyzed since.
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    exec(
        &mut c,
        "ALTER TABLE outbox SET (autovacuum_enabled = off); ANALYZE outbox",
    );
    // The relay's sessions by a name of their own, to wait for their end.
    let relay_url = format!("{}&application_name={}", db.url, db.name);
    let before = pg_table_scans(&mut c, &db.name);
    let rt = runtime();
    rt.block_on(async {
        let pool = Pool::builder()
            .max_size(1)
            .build(ConnectionManager::<PgConnection>::new(relay_url.clone()))
            .unwrap();
        let store = outbox_diesel::PgRelayStore::new(pool)
            .with_listener(relay_url.clone())
            .with_channel(db.name.clone());
        // The first wait opens the LISTEN session; every later one runs its due check.
        store.wait_for_work(Duration::from_millis(500)).await;
        // Six runs of `MarkSent` and of the due check: their generic plans.
        for turn in 0..12 {
            pg_relay_turn(&store, &mut c, turn % 2 == 1).await;
        }
        exec(&mut c, SENT_ROWS_PG);
        for turn in 0..6 {
            pg_relay_turn(&store, &mut c, turn % 2 == 1).await;
        }
    });
    drop(rt); // and the store with it: the relay's sessions end
    assert_eq!(
        pg_table_scans(&mut c, &db.name) - before,
        0,
        "the relay's statements scanned the whole table"
    );
}

#[derive(diesel::QueryableByName)]
struct Setting {
    #[diesel(sql_type = diesel::sql_types::Text)]
    value: String,
}

fn pg_setting(c: &mut PgConnection, name: &str) -> String {
    diesel::sql_query(format!("SELECT current_setting('{name}') AS value"))
        .get_result::<Setting>(c)
        .unwrap()
        .value
}

#[test]
fn pg_claim_commits_without_the_flush_and_leaves_the_session_as_it_was() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    let session = ["synchronous_commit", "enable_seqscan"].map(|s| pg_setting(&mut c, s));
    outbox_diesel::__private::begin_claim(&mut c, Duration::from_secs(30)).unwrap();
    assert_eq!(pg_setting(&mut c, "synchronous_commit"), "off");
    assert_eq!(pg_setting(&mut c, "enable_seqscan"), "off");
    AnsiTransactionManager::commit_transaction(&mut c).unwrap();
    // `SET LOCAL`: a pooled connection goes back as it came.
    assert_eq!(
        ["synchronous_commit", "enable_seqscan"].map(|s| pg_setting(&mut c, s)),
        session
    );
}

#[test]
fn pg_a_batch_with_dead_letters_commits_durably() {
    // A DEAD mark frees its key for the next message: lost in a crash, the dead message
    // would come back behind it. SENT and retry marks may be lost (republished).
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    c.emit_all((1..=3).map(|n| Pinged { n })).unwrap();
    let id = |c: &mut PgConnection, n: u32| {
        Pg::scalar(
            c,
            &format!("SELECT id AS n FROM outbox WHERE msg_id = '{n}:Pinged'"),
        )
    };
    let (one, two, three) = (id(&mut c, 1), id(&mut c, 2), id(&mut c, 3));
    outbox_diesel::__private::begin_claim(&mut c, Duration::ZERO).unwrap();
    let outcome = RelayBatchOutcome {
        sent: vec![one],
        retry: vec![outbox_core::RetryRow {
            id: two,
            next_retry_at: chrono::Utc::now(),
            error: "try again".into(),
        }],
        ..Default::default()
    };
    outbox_diesel::__private::complete(&mut c, &outcome).unwrap();
    assert_eq!(pg_setting(&mut c, "synchronous_commit"), "off");
    let outcome = RelayBatchOutcome {
        dead: vec![DeadRow {
            id: three,
            error: "poison".into(),
        }],
        ..Default::default()
    };
    outbox_diesel::__private::complete(&mut c, &outcome).unwrap();
    assert_eq!(pg_setting(&mut c, "synchronous_commit"), "on");
    AnsiTransactionManager::commit_transaction(&mut c).unwrap();
    assert_eq!(
        Pg::scalar(&mut c, "SELECT COUNT(*) AS n FROM outbox WHERE status = 2"),
        1
    );
}

#[test]
fn pg_a_failed_mark_or_commit_leaves_the_batch_new_and_the_connection_usable() {
    // A batch sent in full is marked and committed by one string: whether its UPDATE
    // fails (and the COMMIT does not run) or its COMMIT does, the rows stay NEW and the
    // pool gets its one connection back outside any transaction, the same session
    // (r2d2 does not test it on check-out here, so a broken one would fail the claim
    // after it instead of being replaced unseen).
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    c.emit_all((1..=2).map(|n| Pinged { n })).unwrap();
    // A transaction left open holding the batch's row locks would block the DDL below.
    exec(
        &mut c,
        "SET lock_timeout = '5s';
         CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'refused by a trigger'; END $$;",
    );
    let pool = Pool::builder()
        .max_size(1)
        .test_on_check_out(false)
        .build(ConnectionManager::<PgConnection>::new(db.url.clone()))
        .unwrap();
    let session = |pool: &Pool<ConnectionManager<PgConnection>>| {
        Pg::scalar(
            &mut pool.get().unwrap(),
            "SELECT pg_backend_pid()::int8 AS n",
        )
    };
    let first = session(&pool);
    let store = outbox_diesel::PgRelayStore::new(pool);
    let rt = runtime();
    let complete_all = || {
        rt.block_on(async {
            let batch = store.claim(10).await.unwrap();
            let sent = ids(&batch);
            assert_eq!(sent.len(), 2);
            batch
                .complete(RelayBatchOutcome {
                    sent,
                    ..Default::default()
                })
                .await
        })
    };
    let new =
        |c: &mut PgConnection| Pg::scalar(c, "SELECT COUNT(*) AS n FROM outbox WHERE status = 0");
    for trigger in [
        "CREATE TRIGGER refuse BEFORE UPDATE ON outbox \
         FOR EACH ROW EXECUTE FUNCTION refuse()",
        "CREATE CONSTRAINT TRIGGER refuse AFTER UPDATE ON outbox \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse()",
    ] {
        exec(&mut c, trigger);
        let failed = complete_all().unwrap_err();
        let failed = outbox_core::error_chain(&failed).to_string();
        assert!(
            failed.contains("refused by a trigger"),
            "{trigger}: {failed}"
        );
        assert_eq!(new(&mut c), 2, "{trigger}");
        exec(&mut c, "DROP TRIGGER refuse ON outbox");
        assert_eq!(session(store.pool()), first, "{trigger}");
        assert_eq!(
            Pg::scalar(
                &mut c,
                &format!(
                    "SELECT COUNT(*) AS n FROM pg_stat_activity \
                     WHERE pid = {first} AND state <> 'idle'"
                )
            ),
            0,
            "{trigger}: the pool's session is not idle"
        );
    }
    complete_all().unwrap();
    assert_eq!(new(&mut c), 0);
    assert_eq!(session(store.pool()), first);
}
