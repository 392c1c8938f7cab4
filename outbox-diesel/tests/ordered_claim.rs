//! The per-key claim (`ClaimOrder::PerKey`, the default) on PostgreSQL, MariaDB and
//! SQLite: a key's later rows are held back behind an older row that another claimer
//! holds or that waits for its retry, other keys go on, a hot key is not capped, and the
//! statements use the NEW-only indexes (EXPLAIN with many SENT rows).

mod fixtures;

use diesel::connection::SimpleConnection as _;
use diesel::sql_types::Text;
use diesel::{MysqlConnection, PgConnection, QueryableByName, RunQueryDsl, SqliteConnection};
use fixtures::{Backend, Lite, My, Pg, exec, mariadb_plan, pg_plan, runtime};
use outbox_core::{ClaimedBatch, OutboxEvent, RelayStore};
use outbox_diesel::{
    ClaimOrder, Emit, MysqlRelayStore, OutboxConnection, PgRelayStore, SqliteRelayStore,
};
use outbox_tests::plans::{TableAccess, mariadb_table_accesses, pg_rows_removed_by_filter};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(key = account)]
struct Moved {
    #[outbox(id)]
    n: u32,
    account: String,
}

/// Emits one message per `(n, key)`, in this order (ids follow it).
fn emit<C: OutboxConnection>(c: &mut C, rows: &[(u32, &str)]) {
    c.emit_all(rows.iter().map(|&(n, account)| Moved {
        n,
        account: account.into(),
    }))
    .unwrap();
}

fn names(batch: &impl ClaimedBatch) -> Vec<String> {
    batch
        .messages()
        .iter()
        .map(|m| {
            m.envelope
                .msg_id
                .as_str()
                .trim_end_matches(":Moved")
                .to_owned()
        })
        .collect()
}

trait Ordered: Backend {
    /// An hour from now, as the backend's SQL.
    const LATER: &'static str;
    fn store_with(db: &fixtures::TestDb, order: ClaimOrder) -> Self::Store;
}

impl Ordered for Pg {
    const LATER: &'static str = "now() + interval '1 hour'";
    fn store_with(db: &fixtures::TestDb, order: ClaimOrder) -> PgRelayStore {
        Pg::store(db).with_order(order)
    }
}

impl Ordered for My {
    const LATER: &'static str = "UTC_TIMESTAMP(6) + INTERVAL 1 HOUR";
    fn store_with(db: &fixtures::TestDb, order: ClaimOrder) -> MysqlRelayStore {
        My::store(db).with_order(order)
    }
}

impl Ordered for Lite {
    const LATER: &'static str = "strftime('%Y-%m-%d %H:%M:%f', 'now', '+1 hour')";
    fn store_with(db: &fixtures::TestDb, order: ClaimOrder) -> SqliteRelayStore {
        Lite::store(db).with_order(order)
    }
}

/// Rows held by another claimer hold back the later rows of their key, and only those.
async fn locked_row_holds_back_its_key<B: Ordered>() {
    let db = B::create();
    let mut c = B::connect(&db);
    emit(
        &mut c,
        &[(1, "a"), (2, "b"), (3, "a"), (4, "c"), (5, "a"), (6, "b")],
    );
    let store = B::store_with(&db, ClaimOrder::PerKey);
    assert_eq!(store.claim(100).await.unwrap().messages().len(), 6);
    fixtures::released::<B>(&store, 0).await;

    // Another relay holds rows 1 and 2 (its batch, limit 2).
    let other = store.claim(2).await.unwrap();
    assert_eq!(names(&other), ["1", "2"]);
    let mine = store.claim(100).await.unwrap();
    assert_eq!(
        names(&mine),
        ["4"],
        "a's and b's later rows wait for the other relay; c goes on"
    );
    drop(mine);
    fixtures::released::<B>(&store, 1).await; // the other relay's batch is in hand

    // The unordered claim would overtake them.
    let unordered = B::store_with(&db, ClaimOrder::Unordered);
    assert_eq!(
        names(&unordered.claim(100).await.unwrap()),
        ["3", "4", "5", "6"]
    );
    fixtures::released::<B>(&unordered, 0).await;

    // Once the other relay has published its rows, the rest follows in order.
    let ids: Vec<i64> = other.messages().iter().map(|m| m.id).collect();
    other
        .complete(outbox_core::RelayBatchOutcome {
            sent: ids,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        names(&store.claim(100).await.unwrap()),
        ["3", "4", "5", "6"]
    );
}

#[test]
fn pg_locked_row_holds_back_its_key() {
    runtime().block_on(locked_row_holds_back_its_key::<Pg>());
}

#[test]
fn mysql_locked_row_holds_back_its_key() {
    runtime().block_on(locked_row_holds_back_its_key::<My>());
}

/// A row waiting for its retry holds back its key without crowding other keys out of
/// the batch; a hot key is not capped at one row per batch.
async fn retry_holds_back_its_key<B: Ordered>() {
    let db = B::create();
    let mut c = B::connect(&db);
    emit(
        &mut c,
        &[(1, "a"), (2, "a"), (3, "a"), (4, "a"), (5, "b"), (6, "b")],
    );
    exec(
        &mut c,
        &format!(
            "UPDATE outbox SET retries = 1, next_retry_at = {} WHERE msg_id = '1:Moved'",
            B::LATER
        ),
    );
    // (One store at a time: SQLite allows one relay per database.)
    let store = B::store_with(&db, ClaimOrder::PerKey);
    let batch = store.claim(2).await.unwrap();
    assert_eq!(
        names(&batch),
        ["5", "6"],
        "a waits for its retry, and its rows do not fill the batch"
    );
    // Each store is dropped only once its batches are rolled back, so that their rows
    // are free for the next claim (PostgreSQL, MySQL; a SQLite batch holds no
    // connection, and its store's relay lock goes with the store).
    drop(batch);
    fixtures::released::<B>(&store, 0).await;
    drop(store);
    let unordered = B::store_with(&db, ClaimOrder::Unordered);
    assert_eq!(names(&unordered.claim(2).await.unwrap()), ["2", "3"]);
    fixtures::released::<B>(&unordered, 0).await;
    drop(unordered);
    let store = B::store_with(&db, ClaimOrder::PerKey);

    exec(
        &mut c,
        "UPDATE outbox SET next_retry_at = created_at WHERE msg_id = '1:Moved'",
    );
    assert_eq!(
        names(&store.claim(5).await.unwrap()),
        ["1", "2", "3", "4", "5"],
        "all of a hot key's rows in one batch"
    );
}

#[test]
fn pg_retry_holds_back_its_key() {
    runtime().block_on(retry_holds_back_its_key::<Pg>());
}

#[test]
fn mysql_retry_holds_back_its_key() {
    runtime().block_on(retry_holds_back_its_key::<My>());
}

#[test]
fn sqlite_retry_holds_back_its_key() {
    runtime().block_on(retry_holds_back_its_key::<Lite>());
}

/// A key whose older row is claimable but outside the LIMIT is not a problem: `L` is a
/// prefix of the due rows, so a key's rows in it are its oldest due ones.
#[test]
fn pg_a_redriven_row_in_the_middle_holds_back_the_rows_after_it() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    emit(&mut c, &[(1, "a"), (2, "a"), (3, "a")]);
    // Row 2 waits for a retry while 1 and 3 are due (e.g. 1 was re-driven after 2 failed).
    exec(
        &mut c,
        &format!(
            "UPDATE outbox SET next_retry_at = {} WHERE msg_id = '2:Moved'",
            Pg::LATER
        ),
    );
    runtime().block_on(async {
        let store = Pg::store_with(&db, ClaimOrder::PerKey);
        assert_eq!(names(&store.claim(10).await.unwrap()), ["1"]);
    });
}

const SENT_ROWS_PG: &str =
    "INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, status, sent_at)
     SELECT 's-' || g || ':E', 't', 'E', 'k-' || (g % 100), '{}'::jsonb, 1, now()
     FROM generate_series(1, 20000) g;";

#[test]
fn pg_per_key_claim_uses_the_new_only_indexes() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    exec(&mut c, SENT_ROWS_PG);
    let rows: Vec<(u32, String)> = (0..500).map(|n| (n, format!("k-{}", n % 100))).collect();
    let rows: Vec<(u32, &str)> = rows.iter().map(|(n, k)| (*n, k.as_str())).collect();
    emit(&mut c, &rows);
    exec(&mut c, "ANALYZE outbox;");
    let sql = outbox_diesel::__private::claim_per_key_sql::<PgConnection>(100);
    println!("{sql}");
    let plan = pg_plan(&mut c, &sql);
    let text = plan.join("\n");
    println!("{text}");
    assert!(
        text.contains("outbox_pending on outbox"),
        "the lock walks the NEW-only id index:\n{text}"
    );
    assert!(
        text.contains("outbox_retrying"),
        "the keys waiting for a retry come from the index of NEW rows that failed:\n{text}"
    );
    assert!(
        !text.contains("Seq Scan on outbox"),
        "no table scan:\n{text}"
    );
    for n in pg_rows_removed_by_filter(&plan) {
        assert!(n <= 500, "filtered SENT rows:\n{text}");
    }
}

/// MariaDB's analyzed plan of `sql` and its table accesses.
fn mysql_plan(c: &mut MysqlConnection, sql: &str) -> (String, Vec<TableAccess>) {
    let plan = mariadb_plan(c, sql);
    let found = mariadb_table_accesses(&plan);
    (plan, found)
}

#[test]
fn mysql_per_key_claim_uses_the_new_only_indexes() {
    let db = My::create();
    let mut c = My::connect(&db);
    exec(
        &mut c,
        "SET SESSION max_recursive_iterations = 100000;
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, headers, status,
                             next_retry_at, created_at, sent_at)
         WITH RECURSIVE seq (n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM seq WHERE n < 20000)
         SELECT CONCAT('s-', n, ':E'), 't', 'E', CONCAT('k-', n % 100), '{}', '{}', 1,
                UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) FROM seq;",
    );
    let rows: Vec<(u32, String)> = (0..500).map(|n| (n, format!("k-{}", n % 100))).collect();
    let rows: Vec<(u32, &str)> = rows.iter().map(|(n, k)| (*n, k.as_str())).collect();
    emit(&mut c, &rows);
    exec(&mut c, "ANALYZE TABLE outbox;");

    let lock = outbox_diesel::__private::claim_per_key_sql::<MysqlConnection>(100);
    println!("{lock}");
    let (plan, found) = mysql_plan(&mut c, &lock);
    println!("{plan}");
    let TableAccess { key, rows } = &found[0];
    let examined = rows.unwrap_or(0.0);
    assert!(
        key == "outbox_claim" || key == "outbox_status_next_retry",
        "the lock walks a status-led index, not {key}:\n{plan}"
    );
    assert!(examined <= 200.0, "examined {examined} rows:\n{plan}");
    assert!(
        found[1..].iter().all(|a| a.key == "outbox_pending_key"),
        "the head probe uses (status, msg_key, id):\n{plan}"
    );

    let ids: Vec<i64> =
        outbox_diesel::list_messages(&mut c, Some(outbox_core::Status::New), 0, 100)
            .unwrap()
            .iter()
            .map(|r| r.id)
            .collect();
    let probe = outbox_diesel::__private::key_probe_sql::<MysqlConnection>(&ids);
    let (plan, found) = mysql_plan(&mut c, &probe);
    println!("{plan}");
    assert!(
        found.iter().any(|a| a.key == "PRIMARY")
            && found.iter().any(|a| a.key == "outbox_pending_key"),
        "the keys of L by primary key, the probe by (status, msg_key, id):\n{plan}"
    );
    for TableAccess { key, rows } in &found {
        let examined = rows.unwrap_or(0.0);
        assert!(examined <= 200.0, "{key} examined {examined} rows:\n{plan}");
    }
}

#[test]
fn sqlite_per_key_claim_uses_the_new_only_indexes() {
    let db = Lite::create();
    let mut c: SqliteConnection = Lite::connect(&db);
    emit(&mut c, &[(1, "a"), (2, "b")]);
    let sql = outbox_diesel::__private::claim_per_key_sql::<SqliteConnection>(100);
    #[derive(QueryableByName)]
    struct Detail {
        #[diesel(sql_type = Text)]
        detail: String,
    }
    let plan: Vec<String> = diesel::sql_query(format!("EXPLAIN QUERY PLAN {sql}"))
        .load::<Detail>(&mut c)
        .unwrap()
        .into_iter()
        .map(|d| d.detail)
        .collect();
    let text = plan.join("\n");
    println!("{text}");
    assert!(
        plan.iter()
            .any(|l| l.ends_with("USING INDEX outbox_pending")),
        "{text}"
    );
    assert!(text.contains("outbox_pending_key"), "{text}");
    assert!(!text.contains("SCAN outbox"), "no table scan:\n{text}");
    c.batch_execute("SELECT 1").unwrap();
}
