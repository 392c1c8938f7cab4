//! An isolated database per test, so tests run in parallel against the shared servers:
//! a PostgreSQL schema, a MariaDB database or a SQLite file, removed when the value is
//! dropped. The servers are administered with the `psql` and `mariadb` (or `mysql`)
//! command-line clients, so this crate needs no database driver. A server that is down fails the test; nothing skips.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use crate::names::unique;
use crate::services::{database_url, mysql_url};

/// The database engines a test can isolate itself on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// A schema on the PostgreSQL server at [`database_url`].
    Postgres,
    /// A database on the MariaDB server at [`mysql_url`].
    Mariadb,
    /// A file in the temp directory.
    Sqlite,
}

/// An isolated, empty database; dropped (schema, database or files) with the value.
#[derive(Debug)]
pub struct Isolated {
    /// Which engine.
    pub engine: Engine,
    /// The schema or database name, or the SQLite file's stem: unique, a valid SQL
    /// identifier (and PostgreSQL `NOTIFY` channel).
    pub name: String,
    /// Connects to the isolated database. PostgreSQL: [`database_url`] with every
    /// connection's `search_path` set to the schema
    /// (`options=-c%20search_path%3D<name>`); MariaDB: the server of [`mysql_url`] with
    /// the database; SQLite: the file's path (not created yet).
    pub url: String,
}

impl Isolated {
    /// An isolated database on `engine`, its name starting with `prefix`.
    pub fn new(engine: Engine, prefix: &str) -> Self {
        match engine {
            Engine::Postgres => Self::postgres(prefix),
            Engine::Mariadb => Self::mariadb(prefix),
            Engine::Sqlite => Self::sqlite(prefix),
        }
    }

    /// A fresh PostgreSQL schema.
    pub fn postgres(prefix: &str) -> Self {
        let name = unique(prefix);
        psql(&format!("CREATE SCHEMA {name}"));
        let url = with_search_path(&database_url(), &name);
        Self {
            engine: Engine::Postgres,
            name,
            url,
        }
    }

    /// A fresh MariaDB database.
    pub fn mariadb(prefix: &str) -> Self {
        let name = unique(prefix);
        mariadb(&format!("CREATE DATABASE {name}"));
        let base = mysql_url();
        let (server, _) = base.rsplit_once('/').expect("MYSQL_URL names a database");
        let url = format!("{server}/{name}");
        Self {
            engine: Engine::Mariadb,
            name,
            url,
        }
    }

    /// A path for a new SQLite file in the temp directory (not created yet).
    pub fn sqlite(prefix: &str) -> Self {
        let name = unique(prefix);
        let path = std::env::temp_dir().join(format!("{name}.db"));
        let url = path.to_str().expect("utf-8 temp path").to_owned();
        Self {
            engine: Engine::Sqlite,
            name,
            url,
        }
    }

    /// The SQLite file (panics for the other engines).
    pub fn sqlite_path(&self) -> PathBuf {
        assert_eq!(self.engine, Engine::Sqlite, "only SQLite has a file");
        PathBuf::from(&self.url)
    }
}

impl Drop for Isolated {
    fn drop(&mut self) {
        // Best effort: a test that already failed must not panic again here.
        match self.engine {
            Engine::Postgres => {
                let _ = run_psql(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name));
            }
            Engine::Mariadb => {
                let _ = run_mariadb(&format!("DROP DATABASE IF EXISTS {}", self.name));
            }
            Engine::Sqlite => {
                for suffix in ["", "-wal", "-shm", "-journal", ".outbox-relay.lock"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", self.url));
                }
            }
        }
    }
}

/// A MariaDB user with a password, allowed everything on its own [`Isolated`]
/// database, for tests of wrong credentials (the shared `root` has no password). The
/// user and the database are dropped with the value.
#[derive(Debug)]
pub struct MariadbUser {
    /// The user's name.
    pub name: String,
    /// Its database.
    pub db: Isolated,
}

impl MariadbUser {
    /// The right password.
    pub const PASSWORD: &'static str = "right-maria-pass";

    /// Creates the user and its database, both named after `prefix`.
    pub fn new(prefix: &str) -> Self {
        let db = Isolated::mariadb(prefix);
        let name = unique(prefix);
        mariadb(&format!(
            "CREATE USER '{name}'@'%' IDENTIFIED BY '{}'; GRANT ALL ON {}.* TO '{name}'@'%'",
            Self::PASSWORD,
            db.name
        ));
        Self { name, db }
    }

    /// `mysql://<user>:<password>@<server of MYSQL_URL>/<its database>`.
    pub fn url_with_password(&self, password: &str) -> String {
        let server = MysqlServer::parse(&mysql_url());
        format!(
            "mysql://{}:{password}@{}:{}/{}",
            self.name, server.host, server.port, self.db.name
        )
    }
}

impl Drop for MariadbUser {
    fn drop(&mut self) {
        let _ = run_mariadb(&format!("DROP USER IF EXISTS '{}'@'%'", self.name));
    }
}

/// `base` with every connection's `search_path` set to `schema` (libpq `options`).
pub fn with_search_path(base: &str, schema: &str) -> String {
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}options=-c%20search_path%3D{schema}")
}

/// Runs SQL with `psql` against [`database_url`], panicking with its stderr on failure.
pub fn psql(sql: &str) {
    check("psql", sql, run_psql(sql));
}

/// Runs SQL with the `mariadb` client against the server of [`mysql_url`], panicking
/// with its stderr on failure.
pub fn mariadb(sql: &str) {
    check("mariadb", sql, run_mariadb(sql));
}

fn check(client: &str, sql: &str, out: Output) {
    assert!(
        out.status.success(),
        "{client} `{sql}` failed (is the server up?): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn run_psql(sql: &str) -> Output {
    Command::new("psql")
        .args([&database_url(), "-v", "ON_ERROR_STOP=1", "-qc", sql])
        .stdin(Stdio::null())
        .output()
        .expect("psql is installed")
}

/// Runs SQL with the `mariadb` client, or `mysql` where only that one is installed
/// (e.g. Homebrew's `mysql-client`).
fn run_mariadb(sql: &str) -> Output {
    let server = MysqlServer::parse(&mysql_url());
    let run = |client: &str| {
        let mut cmd = Command::new(client);
        cmd.args(["--protocol=TCP", "-h", &server.host, "-P", &server.port])
            .args(["-u", &server.user]);
        if let Some(password) = &server.password {
            cmd.arg(format!("-p{password}"));
        }
        cmd.args(["-e", sql]).stdin(Stdio::null()).output()
    };
    match run("mariadb") {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => run("mysql"),
        other => other,
    }
    .expect("the mariadb (or mysql) client is installed")
}

/// The parts of `mysql://user[:password]@host[:port]/db` the `mariadb` client takes.
struct MysqlServer {
    user: String,
    password: Option<String>,
    host: String,
    port: String,
}

impl MysqlServer {
    fn parse(url: &str) -> Self {
        let rest = url
            .strip_prefix("mysql://")
            .unwrap_or_else(|| panic!("MYSQL_URL `{url}` is not mysql://"));
        let rest = rest.split(['/', '?']).next().unwrap_or(rest);
        let (credentials, address) = rest.rsplit_once('@').unwrap_or(("root", rest));
        let (user, password) = match credentials.split_once(':') {
            Some((user, password)) => (user, Some(password.to_owned())),
            None => (credentials, None),
        };
        let (host, port) = address.split_once(':').unwrap_or((address, "3306"));
        Self {
            user: user.to_owned(),
            password,
            host: host.to_owned(),
            port: port.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mysql_urls_are_split_for_the_client() {
        let s = MysqlServer::parse("mysql://app:secret@db.local:3307/test?ssl_mode=DISABLED");
        assert_eq!(
            (
                s.user.as_str(),
                s.password.as_deref(),
                s.host.as_str(),
                s.port.as_str()
            ),
            ("app", Some("secret"), "db.local", "3307")
        );
        let s = MysqlServer::parse("mysql://root@127.0.0.1/test");
        assert_eq!(
            (
                s.user.as_str(),
                s.password,
                s.host.as_str(),
                s.port.as_str()
            ),
            ("root", None, "127.0.0.1", "3306")
        );
    }

    #[test]
    fn the_search_path_is_added_as_a_libpq_option() {
        assert_eq!(
            with_search_path("postgres://h/db", "s1"),
            "postgres://h/db?options=-c%20search_path%3Ds1"
        );
        assert_eq!(
            with_search_path("postgres://h/db?sslmode=disable", "s1"),
            "postgres://h/db?sslmode=disable&options=-c%20search_path%3Ds1"
        );
    }
}
