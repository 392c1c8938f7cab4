//! Support for the `outbox` binary's tests: an isolated database per test on each
//! backend (a PostgreSQL schema, a MariaDB database, a SQLite file), events to emit, and
//! running the binary against it. Tests fail, never skip, when a service is down.

// Each test binary uses a part of this module.
#![allow(dead_code)]

use std::path::PathBuf;

use assert_cmd::Command;
use diesel::connection::SimpleConnection as _;
use diesel::{Connection as _, MysqlConnection, PgConnection, SqliteConnection};
use outbox_core::OutboxEvent;
use outbox_diesel::Emit as _;

/// The event the tests emit: msg_id `<n>:Ping`, topic `cli.ping`.
#[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "cli.ping")]
pub(crate) struct Ping {
    #[outbox(id)]
    pub(crate) n: u32,
}

/// `DATABASE_URL`, or the local PostgreSQL database `test`.
pub(crate) fn postgres_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// `MYSQL_URL`, or the local MariaDB database `test`.
pub(crate) fn mysql_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// `REDIS_URL`, or the local Redis.
pub(crate) fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A name unique to this process and call, safe in SQL identifiers and Redis keys.
pub(crate) fn unique(prefix: &str) -> String {
    format!("{prefix}_{}_{:08x}", std::process::id(), fastrand::u32(..))
}

/// The binary, with no database or Redis URL from the environment.
pub(crate) fn outbox() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox"));
    cmd.env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .env_remove("RUST_LOG");
    cmd
}

/// The backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Postgres,
    Mysql,
    Sqlite,
}

/// An isolated, empty database; removed on drop.
pub(crate) struct TestDb {
    pub(crate) kind: Kind,
    /// The URL to give `--database-url`.
    pub(crate) url: String,
    /// The schema (PostgreSQL), database (MariaDB) or file (SQLite).
    name: String,
}

/// A connection of the test's backend.
pub(crate) enum AnyConn {
    Pg(PgConnection),
    Mysql(MysqlConnection),
    Sqlite(SqliteConnection),
}

macro_rules! with_conn {
    ($conn:expr, $c:ident => $body:expr) => {
        match $conn {
            AnyConn::Pg($c) => $body,
            AnyConn::Mysql($c) => $body,
            AnyConn::Sqlite($c) => $body,
        }
    };
}

impl TestDb {
    /// A database of `kind`.
    pub(crate) fn new(kind: Kind) -> Self {
        match kind {
            Kind::Postgres => Self::postgres(),
            Kind::Mysql => Self::mysql(),
            Kind::Sqlite => Self::sqlite(),
        }
    }

    /// A fresh schema; every connection of `url` has it as its `search_path`.
    pub(crate) fn postgres() -> Self {
        let name = unique("cli");
        admin_pg()
            .batch_execute(&format!("CREATE SCHEMA {name}"))
            .expect("create schema");
        let base = postgres_url();
        let sep = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{sep}options=-c%20search_path%3D{name}");
        Self {
            kind: Kind::Postgres,
            url,
            name,
        }
    }

    /// A fresh database on the MariaDB server.
    pub(crate) fn mysql() -> Self {
        let name = unique("cli");
        admin_mysql()
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .expect("create database");
        let base = mysql_url();
        let server = base.rsplit_once('/').map_or(base.as_str(), |(s, _)| s);
        let url = format!("{server}/{name}");
        Self {
            kind: Kind::Mysql,
            url,
            name,
        }
    }

    /// A path for a new SQLite file (not created yet).
    pub(crate) fn sqlite() -> Self {
        let path = std::env::temp_dir().join(format!("{}.db", unique("outbox_cli")));
        let name = path.to_str().expect("utf-8 temp path").to_owned();
        Self {
            kind: Kind::Sqlite,
            url: format!("sqlite://{name}"),
            name,
        }
    }

    /// The SQLite file.
    pub(crate) fn sqlite_path(&self) -> PathBuf {
        assert_eq!(self.kind, Kind::Sqlite);
        PathBuf::from(&self.name)
    }

    /// The binary with `--database-url` set to this database.
    pub(crate) fn outbox(&self) -> Command {
        let mut cmd = outbox();
        cmd.args(["--database-url", &self.url]);
        cmd
    }

    /// `outbox migrate`, which must succeed.
    pub(crate) fn migrate(&self) {
        self.outbox().arg("migrate").assert().success();
    }

    /// A direct connection.
    pub(crate) fn conn(&self) -> AnyConn {
        match self.kind {
            Kind::Postgres => AnyConn::Pg(PgConnection::establish(&self.url).expect("connect")),
            Kind::Mysql => AnyConn::Mysql(MysqlConnection::establish(&self.url).expect("connect")),
            Kind::Sqlite => AnyConn::Sqlite(SqliteConnection::establish(&self.name).expect("open")),
        }
    }

    /// Runs SQL statements.
    pub(crate) fn exec(&self, sql: &str) {
        with_conn!(&mut self.conn(), c => c.batch_execute(sql))
            .unwrap_or_else(|e| panic!("`{sql}` failed: {e}"));
    }

    /// Emits `Ping { n }` for each `n`, in one transaction.
    pub(crate) fn emit(&self, ns: impl IntoIterator<Item = u32>) {
        let events: Vec<Ping> = ns.into_iter().map(|n| Ping { n }).collect();
        with_conn!(&mut self.conn(), c => c.transaction(|c| {
            c.emit_all(events)?;
            Ok::<_, diesel::result::Error>(())
        }))
        .expect("emit");
    }

    /// An SQL expression for the time `secs` seconds ago, in the backend's column format.
    pub(crate) fn ago(&self, secs: u64) -> String {
        match self.kind {
            Kind::Postgres => format!("now() - interval '{secs} seconds'"),
            Kind::Mysql => format!("UTC_TIMESTAMP(6) - INTERVAL {secs} SECOND"),
            Kind::Sqlite => format!("strftime('%Y-%m-%d %H:%M:%f', 'now', '-{secs} seconds')"),
        }
    }

    /// Marks these messages DEAD, as the relay would after the retry limit.
    pub(crate) fn kill(&self, ns: &[u32]) {
        for n in ns {
            self.exec(&format!(
                "UPDATE outbox SET status = 2, retries = 10, last_error = 'WRONGTYPE {n}' \
                 WHERE msg_id = '{n}:Ping'"
            ));
        }
    }

    /// `outbox status --json`, parsed.
    pub(crate) fn status(&self) -> serde_json::Value {
        self.json(&["status", "--json"])
    }

    /// Runs a command that must succeed and print JSON.
    pub(crate) fn json(&self, args: &[&str]) -> serde_json::Value {
        let out = self
            .outbox()
            .args(args)
            .assert()
            .success()
            .get_output()
            .stdout
            .clone();
        serde_json::from_slice(&out).unwrap_or_else(|e| {
            panic!(
                "{args:?} printed no JSON ({e}): {}",
                String::from_utf8_lossy(&out)
            )
        })
    }

    /// Runs a command that must succeed and returns its stdout.
    pub(crate) fn stdout(&self, args: &[&str]) -> String {
        let out = self
            .outbox()
            .args(args)
            .assert()
            .success()
            .get_output()
            .stdout
            .clone();
        String::from_utf8(out).expect("utf-8 output")
    }

    /// The row id of `<n>:Ping`.
    pub(crate) fn id_of(&self, n: u32) -> i64 {
        self.json(&["dead", "show", &format!("{n}:Ping"), "--json"])["id"]
            .as_i64()
            .expect("an id")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        match self.kind {
            Kind::Postgres => {
                let _ = admin_pg()
                    .batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name));
            }
            Kind::Mysql => {
                let _ =
                    admin_mysql().batch_execute(&format!("DROP DATABASE IF EXISTS {}", self.name));
            }
            Kind::Sqlite => {
                for suffix in ["", "-wal", "-shm", "-journal", ".outbox-relay.lock"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", self.name));
                }
            }
        }
    }
}

fn admin_pg() -> PgConnection {
    let url = postgres_url();
    PgConnection::establish(&url).unwrap_or_else(|e| panic!("PostgreSQL at {url} is needed: {e}"))
}

fn admin_mysql() -> MysqlConnection {
    let url = mysql_url();
    MysqlConnection::establish(&url).unwrap_or_else(|e| panic!("MariaDB at {url} is needed: {e}"))
}

/// Generates one `#[test]` per backend for each scenario `fn name(db: &TestDb)`.
macro_rules! on_every_backend {
    ($($scenario:ident),* $(,)?) => {
        mod postgres {
            $(#[test] fn $scenario() { super::$scenario(&super::common::TestDb::postgres()) })*
        }
        mod mariadb {
            $(#[test] fn $scenario() { super::$scenario(&super::common::TestDb::mysql()) })*
        }
        mod sqlite {
            $(#[test] fn $scenario() { super::$scenario(&super::common::TestDb::sqlite()) })*
        }
    };
}
pub(crate) use on_every_backend;
