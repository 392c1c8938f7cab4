//! Test support: an isolated database per test (a PostgreSQL schema, a MariaDB database,
//! a SQLite temp file), for PostgreSQL at `DATABASE_URL` and MariaDB at `MYSQL_URL` (local
//! defaults). A service that is down fails the test; nothing is skipped.
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use diesel::sql_types::BigInt;
use diesel::{
    Connection, MysqlConnection, PgConnection, QueryableByName, RunQueryDsl, SqliteConnection,
};
use outbox_core::RelayStore;
use outbox_diesel::{MysqlRelayStore, OutboxConnection, PgRelayStore, SqliteRelayStore};

pub fn pg_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

pub fn mysql_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

fn unique(prefix: &str) -> String {
    format!("{prefix}_{:016x}", fastrand::u64(..))
}

/// An isolated database; dropped (schema, database or file) when this is dropped.
pub struct TestDb {
    /// Connects to the isolated database.
    pub url: String,
    /// The schema / database / file name: unique, usable as a NOTIFY channel.
    pub name: String,
    cleanup: Option<Box<dyn FnOnce() + Send>>,
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Some(f) = self.cleanup.take() {
            f();
        }
    }
}

#[derive(QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// One backend under test.
pub trait Backend: 'static {
    type Conn: OutboxConnection + R2D2Connection;
    type Store: RelayStore + 'static;
    const NAME: &'static str;

    /// A fresh isolated database with the outbox migrated and an `accounts` table holding
    /// alice (1000) and bob (0).
    fn create() -> TestDb;

    fn connect(db: &TestDb) -> Self::Conn {
        Self::Conn::establish(&db.url)
            .unwrap_or_else(|e| panic!("{} unreachable at {}: {e}", Self::NAME, db.url))
    }

    fn pool(db: &TestDb, size: u32) -> Pool<ConnectionManager<Self::Conn>> {
        Pool::builder()
            .max_size(size)
            .connection_timeout(Duration::from_secs(10))
            .build(ConnectionManager::new(db.url.clone()))
            .unwrap()
    }

    fn store(db: &TestDb) -> Self::Store;

    /// A single number: `sql` must select one BIGINT-compatible column named `n`.
    fn scalar(c: &mut Self::Conn, sql: &str) -> i64;
}

pub fn exec<C: SimpleConnection>(c: &mut C, sql: &str) {
    c.batch_execute(sql)
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

fn prepare<C: OutboxConnection>(c: &mut C) {
    outbox_diesel::migrate(c).unwrap();
    exec(
        c,
        "CREATE TABLE accounts (id VARCHAR(64) PRIMARY KEY, balance BIGINT NOT NULL);
         INSERT INTO accounts (id, balance) VALUES ('alice', 1000), ('bob', 0);",
    );
}

pub struct Pg;
pub struct My;
pub struct Lite;

impl Backend for Pg {
    type Conn = PgConnection;
    type Store = PgRelayStore;
    const NAME: &'static str = "PostgreSQL";

    fn create() -> TestDb {
        let base = pg_url();
        let mut admin = PgConnection::establish(&base)
            .unwrap_or_else(|e| panic!("PostgreSQL unreachable at {base}: {e}"));
        let name = unique("t");
        exec(&mut admin, &format!("CREATE SCHEMA {name}"));
        let sep = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{sep}options=-csearch_path%3D{name}");
        let drop_name = name.clone();
        let db = TestDb {
            url,
            name,
            cleanup: Some(Box::new(move || {
                if let Ok(mut admin) = PgConnection::establish(&base) {
                    let _ = admin.batch_execute(&format!("DROP SCHEMA {drop_name} CASCADE"));
                }
            })),
        };
        prepare(&mut Self::connect(&db));
        db
    }

    fn store(db: &TestDb) -> PgRelayStore {
        PgRelayStore::new(Self::pool(db, 4))
            .with_listener(db.url.clone())
            .with_channel(db.name.clone())
    }

    fn scalar(c: &mut PgConnection, sql: &str) -> i64 {
        diesel::sql_query(sql)
            .get_result::<N>(c)
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .n
    }
}

impl Backend for My {
    type Conn = MysqlConnection;
    type Store = MysqlRelayStore;
    const NAME: &'static str = "MariaDB";

    fn create() -> TestDb {
        let base = mysql_url();
        let mut admin = MysqlConnection::establish(&base)
            .unwrap_or_else(|e| panic!("MariaDB unreachable at {base}: {e}"));
        let name = unique("t");
        exec(&mut admin, &format!("CREATE DATABASE {name}"));
        let (server, _) = base.rsplit_once('/').expect("MYSQL_URL names a database");
        let url = format!("{server}/{name}");
        let drop_name = name.clone();
        let db = TestDb {
            url,
            name,
            cleanup: Some(Box::new(move || {
                if let Ok(mut admin) = MysqlConnection::establish(&base) {
                    let _ = admin.batch_execute(&format!("DROP DATABASE {drop_name}"));
                }
            })),
        };
        prepare(&mut Self::connect(&db));
        db
    }

    fn store(db: &TestDb) -> MysqlRelayStore {
        MysqlRelayStore::new(Self::pool(db, 4))
    }

    fn scalar(c: &mut MysqlConnection, sql: &str) -> i64 {
        diesel::sql_query(sql)
            .get_result::<N>(c)
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .n
    }
}

impl Backend for Lite {
    type Conn = SqliteConnection;
    type Store = SqliteRelayStore;
    const NAME: &'static str = "SQLite";

    fn create() -> TestDb {
        let name = unique("outbox_diesel_test");
        let path = std::env::temp_dir().join(format!("{name}.db"));
        let url = path.to_str().unwrap().to_owned();
        let db = TestDb {
            url: url.clone(),
            name,
            cleanup: Some(Box::new(move || {
                for suffix in ["", "-wal", "-shm", ".outbox-relay.lock"] {
                    let _ = std::fs::remove_file(format!("{url}{suffix}"));
                }
            })),
        };
        let mut c = Self::connect(&db);
        exec(&mut c, "PRAGMA journal_mode = WAL;");
        prepare(&mut c);
        db
    }

    fn pool(db: &TestDb, size: u32) -> Pool<ConnectionManager<SqliteConnection>> {
        outbox_diesel::sqlite_pool(&db.url, size).unwrap()
    }

    fn connect(db: &TestDb) -> SqliteConnection {
        let mut c = SqliteConnection::establish(&db.url).unwrap();
        exec(&mut c, "PRAGMA busy_timeout = 5000;");
        c
    }

    fn store(db: &TestDb) -> SqliteRelayStore {
        SqliteRelayStore::new(Self::pool(db, 2)).unwrap()
    }

    fn scalar(c: &mut SqliteConnection, sql: &str) -> i64 {
        diesel::sql_query(sql)
            .get_result::<N>(c)
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .n
    }
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}
