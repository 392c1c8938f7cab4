//! The run's private database server (`--db-restart`): a PostgreSQL cluster of its own
//! (`initdb`) or a MariaDB of its own (`mariadb-install-db`), on a free loopback port,
//! which the run crashes and starts again on the same files and port.
//!
//! The server is the harness's child under `setpriv --pdeathsig KILL`, like every other
//! process of the run: PostgreSQL is started as `postgres -D <data>` (what `pg_ctl start`
//! runs, without detaching it from the harness) and crashed with
//! `pg_ctl -m immediate stop` (SIGQUIT: every backend exits at once, no checkpoint, crash
//! recovery at the next start); MariaDB is crashed with SIGKILL.
//!
//! With `--cdc` the server is the run's even without `--db-restart`, for the log the CDC
//! relay reads, which the shared servers do not keep as it needs: PostgreSQL with
//! `wal_level = logical`, MariaDB with the binlog in row format ([`MARIADB_BINLOG`]).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use diesel::{Connection as _, MysqlConnection, PgConnection};

use crate::BoxError;
use crate::config::Backend;
use crate::procs::signal;

/// `--cdc` on MariaDB: the binlog as the binlog CDC relay needs it (`outbox_cdc::mysql::
/// check_server`; `outbox_tests::ScratchMariadb::BINLOG`, the relay's tests). Like the
/// InnoDB log (`innodb_flush_log_at_trx_commit = 2`) it is written to the OS at each
/// commit and survives a crash of the server process; `sync_binlog = 0` leaves its fsync
/// to the OS.
const MARIADB_BINLOG: [&str; 6] = [
    "--log-bin=binlog",
    "--binlog-format=ROW",
    "--binlog-row-image=FULL",
    "--binlog-row-metadata=FULL",
    "--server-id=1",
    "--sync-binlog=0",
];

/// How long a start (crash recovery included) may take.
const START_TIMEOUT: Duration = Duration::from_secs(120);

pub(crate) struct DbServer {
    backend: Backend,
    port: u16,
    /// The server's files (data directory, socket, log).
    dir: PathBuf,
    /// `--cdc`: PostgreSQL with logical decoding on, MariaDB with the binlog in row
    /// format.
    cdc: bool,
    child: Option<Child>,
}

/// The PostgreSQL server binaries: `pg_config --bindir` if `initdb` is there, else
/// Debian's `/usr/lib/postgresql/<version>/bin` (libpq-dev's `pg_config` may name
/// `/usr/bin`, which holds only the clients).
fn pg_bindir() -> PathBuf {
    let given = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| PathBuf::from(s.trim()));
    let debian = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.path().join("bin"));
    given
        .into_iter()
        .chain(debian)
        .find(|dir| dir.join("initdb").is_file())
        .unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin"))
}

/// `program` run as the `postgres` OS user (the server refuses root), killed with the
/// harness.
fn as_postgres(program: &Path) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        "--reuid=postgres",
        "--regid=postgres",
        "--init-groups",
        "--pdeathsig=KILL",
        "--",
    ])
    .arg(program);
    c
}

/// Runs `cmd` to the end; its output goes to `log`.
fn run_logged(mut cmd: Command, log: &Path, what: &str) -> Result<(), BoxError> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    let status = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .status()?;
    if !status.success() {
        return Err(format!("{what} failed ({status}); see {}", log.display()).into());
    }
    Ok(())
}

impl DbServer {
    /// Creates the server's files under `dir` and starts it; `cdc`: the log the CDC relay
    /// reads (PostgreSQL `wal_level = logical` with room for its slot and WAL senders,
    /// MariaDB the binlog as [`MARIADB_BINLOG`] sets it).
    pub(crate) fn start(backend: Backend, dir: &Path, cdc: bool) -> Result<Self, BoxError> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let dir = dir.join(match backend {
            Backend::Postgres => "postgres",
            Backend::Mysql => "mariadb",
        });
        std::fs::create_dir_all(&dir)?;
        let server = Self {
            backend,
            port,
            dir,
            cdc,
            child: None,
        };
        let log = server.log();
        match backend {
            Backend::Postgres => {
                let owner = Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(&server.dir)
                    .status()?;
                if !owner.success() {
                    return Err(format!("chown postgres {}", server.dir.display()).into());
                }
                let mut init = as_postgres(&pg_bindir().join("initdb"));
                init.arg("-D")
                    .arg(server.data())
                    .args(["-U", "postgres", "--auth=trust", "-N"]);
                run_logged(init, &log, "initdb")?;
            }
            Backend::Mysql => {
                std::fs::create_dir_all(server.tmp())?;
                let mut init = Command::new("mariadb-install-db");
                // A server starting removes the temporary files in its tmpdir, those of
                // another server's bootstrap included (tests start servers of their own).
                init.env("TMPDIR", server.tmp())
                    .arg("--no-defaults")
                    .arg(format!("--datadir={}", server.data().display()))
                    // root with an empty password over TCP, as on the shared server.
                    .args([
                        "--auth-root-authentication-method=normal",
                        "--user=root",
                        "--skip-test-db",
                    ]);
                run_logged(init, &log, "mariadb-install-db")?;
            }
        }
        let mut server = server;
        server.up()?;
        Ok(server)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// MariaDB's temporary directory, its own.
    fn tmp(&self) -> PathBuf {
        self.dir.join("tmp")
    }

    fn log(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// The URL to create the run's database with.
    pub(crate) fn admin_url(&self) -> String {
        match self.backend {
            Backend::Postgres => format!("postgres://postgres@127.0.0.1:{}/postgres", self.port),
            Backend::Mysql => format!("mysql://root@127.0.0.1:{}/mysql", self.port),
        }
    }

    /// Starts the server on its files and port and waits until it takes sessions (after
    /// a crash, once its recovery is over).
    pub(crate) fn up(&mut self) -> Result<(), BoxError> {
        if self.child.is_some() {
            return Ok(());
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())?;
        let mut cmd = self.command();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if self.answers() {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut()
                && let Some(status) = c.try_wait()?
            {
                self.child = None;
                return Err(format!(
                    "the database server exited at start ({status}); see {}",
                    self.log().display()
                )
                .into());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the database server did not start in {START_TIMEOUT:?}; see {}",
                    self.log().display()
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The server's command line: its files, its port, settings for a crash test.
    fn command(&self) -> Command {
        match self.backend {
            Backend::Postgres => {
                let mut c = as_postgres(&pg_bindir().join("postgres"));
                c.arg("-D").arg(self.data()).args([
                    "-p",
                    &self.port.to_string(),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    // A crash of the server process, not of the machine: what it wrote
                    // is in the page cache either way, so fsync only slows the run.
                    "-c",
                    "fsync=off",
                    "-c",
                    "max_connections=200",
                ]);
                if self.cdc {
                    c.args([
                        "-c",
                        "wal_level=logical",
                        "-c",
                        "max_replication_slots=10",
                        "-c",
                        "max_wal_senders=10",
                    ]);
                }
                c.arg("-c")
                    .arg(format!("unix_socket_directories={}", self.dir.display()));
                c
            }
            Backend::Mysql => {
                let mut c = crate::procs::with_parent_death("mariadbd");
                c.arg("--no-defaults")
                    .arg(format!("--datadir={}", self.data().display()))
                    .arg(format!(
                        "--socket={}",
                        self.dir.join("mysqld.sock").display()
                    ))
                    .arg(format!(
                        "--pid-file={}",
                        self.dir.join("mysqld.pid").display()
                    ))
                    .arg(format!("--tmpdir={}", self.tmp().display()))
                    .args([
                        "--user=root",
                        "--bind-address=127.0.0.1",
                        &format!("--port={}", self.port),
                        "--max-connections=200",
                        // Written to the OS at each commit (survives the server's
                        // crash), flushed to disk once a second.
                        "--innodb-flush-log-at-trx-commit=2",
                        "--innodb-buffer-pool-size=64M",
                    ]);
                if self.cdc {
                    c.args(MARIADB_BINLOG);
                }
                c
            }
        }
    }

    /// Whether the server takes a session (the port opens before recovery ends).
    pub(crate) fn answers(&self) -> bool {
        match self.backend {
            Backend::Postgres => PgConnection::establish(&self.admin_url()).is_ok(),
            Backend::Mysql => MysqlConnection::establish(&self.admin_url()).is_ok(),
        }
    }

    /// Crashes the server: PostgreSQL `pg_ctl -m immediate stop`, MariaDB SIGKILL.
    pub(crate) fn crash(&mut self) -> Result<(), BoxError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        match self.backend {
            Backend::Postgres => {
                let mut stop = as_postgres(&pg_bindir().join("pg_ctl"));
                stop.arg("-D")
                    .arg(self.data())
                    .args(["-m", "immediate", "stop"]);
                if let Err(e) = run_logged(stop, &self.log(), "pg_ctl -m immediate stop") {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(e);
                }
            }
            Backend::Mysql => signal(&child, "KILL")?,
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                child.kill()?;
                child.wait()?;
                return Err("the database server did not stop within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
}

impl DbServer {
    /// Stops the server cleanly (SIGINT: PostgreSQL's fast shutdown, which also removes
    /// its shared memory; MariaDB takes SIGTERM), SIGKILL if it does not stop in 20 s.
    /// Returns its port, which must then be closed.
    pub(crate) fn stop(&mut self) -> u16 {
        if let Some(mut child) = self.child.take() {
            let sig = match self.backend {
                Backend::Postgres => "INT",
                Backend::Mysql => "TERM",
            };
            let _ = signal(&child, sig);
            let deadline = Instant::now() + Duration::from_secs(20);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        self.port
    }
}

impl Drop for DbServer {
    fn drop(&mut self) {
        self.stop();
    }
}
