//! The reference scenario on real services, checked end to end: the same code the
//! `transfer` example prints, on its default SQLite + Redis and on PostgreSQL + Redis
//! (`-- --postgres`). `examples/tests/transfer.rs` runs the example itself.

use diesel::PgConnection;
use diesel::connection::SimpleConnection as _;
use diesel::r2d2::{ConnectionManager, Pool};
use outbox_core::Status;
use outbox_diesel::{PgRelayStore, SqliteRelayStore};
use outbox_examples::scenario::{self, Outcome};
use outbox_examples::sql::SETUP_SQL;
use outbox_tests::{Isolated, redis_url, unique, unique_prefix};

fn expected() -> Outcome {
    Outcome {
        balances: (900, 100),
        message: (Status::Sent, 2),
        messages: 1,
        applied: 1,
        duplicates: 1,
        notes: vec!["alice→bob 100".into()],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_and_redis() {
    let schema = Isolated::postgres("e2e");
    let pool = Pool::builder()
        .max_size(4)
        .build(ConnectionManager::<PgConnection>::new(&schema.url))
        .unwrap();
    let mut conn = pool.get().unwrap();
    outbox_diesel::migrate(&mut *conn).unwrap();
    conn.batch_execute(SETUP_SQL).unwrap();
    drop(conn);
    let store = PgRelayStore::new(pool.clone()).with_listener(schema.url.clone());
    let prefix = unique_prefix("ref");
    let outcome = scenario::run(pool, store, &redis_url(), &prefix, drop)
        .await
        .unwrap();
    assert_eq!(outcome, expected());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_and_redis() {
    let dir = std::env::temp_dir().join(unique("ref"));
    std::fs::create_dir_all(&dir).unwrap();
    let pool = outbox_diesel::sqlite_pool(&dir.join("bank.db").to_string_lossy(), 4).unwrap();
    let mut conn = pool.get().unwrap();
    outbox_diesel::migrate(&mut *conn).unwrap();
    conn.batch_execute(SETUP_SQL).unwrap();
    drop(conn);
    let store = SqliteRelayStore::new(pool.clone()).unwrap();
    let prefix = unique_prefix("ref");
    let outcome = scenario::run(pool, store, &redis_url(), &prefix, drop)
        .await
        .unwrap();
    assert_eq!(outcome, expected());
    let _ = std::fs::remove_dir_all(dir);
}
