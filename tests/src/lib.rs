//! Support for the end-to-end tests in `tests/`: service URLs, isolated PostgreSQL
//! schemas, unique names, and a throwaway Redis server for outage tests.
//!
//! Service tests fail, never skip, when a service is unreachable.

mod secured;

pub use secured::{PasswordRedis, ScratchPostgres};

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `DATABASE_URL`, or the local PostgreSQL database `test`.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// `REDIS_URL`, or the local Redis.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A name unique to this process and call, safe in SQL identifiers and Redis keys.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}_{}_{:08x}", std::process::id(), fastrand::u32(..))
}

/// A fresh PostgreSQL schema: the returned URL puts every connection's `search_path` in
/// it, so tests that each use their own schema run in parallel. Dropped with the value.
pub struct PgSchema {
    /// The schema's name.
    pub name: String,
    /// A connection URL whose `search_path` is the schema.
    pub url: String,
}

impl PgSchema {
    /// Creates the schema (panics with the cause if PostgreSQL is unreachable).
    pub fn new() -> Self {
        let name = unique("e2e");
        psql(&format!("CREATE SCHEMA {name}"));
        let base = database_url();
        let sep = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{sep}options=-c%20search_path%3D{name}");
        Self { name, url }
    }
}

impl Default for PgSchema {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for PgSchema {
    fn drop(&mut self) {
        let _ = Command::new("psql")
            .args([
                &database_url(),
                "-qc",
                &format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Runs one SQL statement with `psql` against `DATABASE_URL`, panicking on failure.
pub fn psql(sql: &str) {
    let out = Command::new("psql")
        .args([&database_url(), "-v", "ON_ERROR_STOP=1", "-qc", sql])
        .output()
        .expect("psql runs");
    assert!(
        out.status.success(),
        "psql `{sql}` failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A private `redis-server` on a free port that a test can stop and start again, to
/// play a broker outage without touching the shared Redis.
pub struct ScratchRedis {
    port: u16,
    child: Option<Child>,
    /// With persistence: the AOF directory, kept across restarts, removed on drop.
    dir: Option<std::path::PathBuf>,
}

impl ScratchRedis {
    /// Starts a server on a free loopback port and waits until it answers.
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// Starts a server that keeps its data across [`restart`](Self::restart)s (AOF with
    /// `appendfsync always`), as a production Redis does: streams, groups and pending
    /// entries survive, so a restart is an outage and nothing else.
    pub fn start_persistent() -> Self {
        let dir = std::env::temp_dir().join(unique("scratch-redis"));
        std::fs::create_dir_all(&dir).expect("temp dir for the AOF");
        Self::start_with(Some(dir))
    }

    fn start_with(dir: Option<std::path::PathBuf>) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let mut redis = Self {
            port,
            child: None,
            dir,
        };
        redis.restart();
        redis
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server: clients now see connection errors.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port: empty, or with its data if it was
    /// started with [`start_persistent`](Self::start_persistent).
    pub fn restart(&mut self) {
        self.stop();
        let port = self.port.to_string();
        let mut args = vec!["--port", &port, "--bind", "127.0.0.1", "--save", ""];
        match &self.dir {
            Some(dir) => args.extend([
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--dir",
                dir.to_str().expect("temp dir is UTF-8"),
            ]),
            None => args.extend(["--appendonly", "no"]),
        }
        let child = Command::new("redis-server")
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "scratch redis-server did not start on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ScratchRedis {
    fn drop(&mut self) {
        self.stop();
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
