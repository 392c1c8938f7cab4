//! A private MariaDB server with the binary log on in row format, for the binlog CDC
//! relay's tests: the shared MariaDB runs without `log_bin`, and a test must be able to
//! purge its binlogs.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::names::unique;
use crate::ports::{free_port, wait_for_port};
use crate::process::stop_child;
use crate::wait::wait_until_within;

/// A private `mariadbd` on a free loopback port, `root` without a password, a database
/// `test`, and the binlog as the CDC relay needs it (`--log-bin --binlog-format=ROW
/// --binlog-row-image=FULL --binlog-row-metadata=FULL`, plus any settings given). It is
/// killed with the test process and removed with its files on drop.
pub struct ScratchMariadb {
    port: u16,
    dir: PathBuf,
    child: Child,
}

impl ScratchMariadb {
    /// The binlog settings the CDC relay needs.
    pub const BINLOG: [&'static str; 5] = [
        "--log-bin=binlog",
        "--binlog-format=ROW",
        "--binlog-row-image=FULL",
        "--binlog-row-metadata=FULL",
        "--server-id=1",
    ];

    /// `mariadb-install-db`, then the server with [`BINLOG`](Self::BINLOG).
    pub fn start() -> Self {
        Self::start_with(&Self::BINLOG)
    }

    /// The server with exactly these settings (`--name=value`) beyond its files and port.
    pub fn start_with(settings: &[&str]) -> Self {
        let dir = std::env::temp_dir().join(unique("scratch-mariadb"));
        let data = dir.join("data");
        std::fs::create_dir_all(&data).expect("temp dir");
        // A temporary directory of its own: a server starting removes the temporary
        // files it finds in its tmpdir, those of another server's bootstrap included
        // (tests start several at once).
        let tmp = dir.join("tmp");
        std::fs::create_dir_all(&tmp).expect("temp dir");
        let init = Command::new("mariadb-install-db")
            .env("TMPDIR", &tmp)
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .args([
                "--auth-root-authentication-method=normal",
                "--user=root",
                "--skip-test-db",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .expect("mariadb-install-db runs");
        assert!(
            init.status.success(),
            "mariadb-install-db failed: {}",
            String::from_utf8_lossy(&init.stderr)
        );
        let port = free_port();
        let log = std::fs::File::create(dir.join("server.log")).expect("log file");
        let child = Command::new("setpriv")
            // Never outlive the test process, even when it is killed.
            .args(["--pdeathsig=KILL", "--", "mariadbd", "--no-defaults"])
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--socket={}", dir.join("mysqld.sock").display()))
            .arg(format!("--pid-file={}", dir.join("mysqld.pid").display()))
            .arg(format!("--tmpdir={}", tmp.display()))
            .args([
                "--user=root",
                "--bind-address=127.0.0.1",
                &format!("--port={port}"),
                "--innodb-buffer-pool-size=32M",
                "--innodb-flush-log-at-trx-commit=2",
                "--sync-binlog=0",
            ])
            .args(settings)
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .spawn()
            .expect("mariadbd starts");
        let server = Self { port, dir, child };
        wait_for_port(port, "the scratch MariaDB", Duration::from_secs(60));
        wait_until_within(
            "the scratch MariaDB to accept sessions",
            Duration::from_secs(60),
            || server.sql("CREATE DATABASE IF NOT EXISTS test").is_ok(),
        );
        server
    }

    /// `mysql://root@127.0.0.1:<port>/test`.
    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.port)
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Runs `sql` with the `mariadb` client as root in database `test` (created at
    /// start); its output (tab-separated, no column names), or the client's error.
    pub fn sql(&self, sql: &str) -> Result<String, String> {
        let out = Command::new("mariadb")
            .args(["--no-defaults", "-h", "127.0.0.1", "-u", "root", "-N", "-B"])
            .arg(format!("--port={}", self.port))
            .args(["-e", sql])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// [`sql`](Self::sql) in database `test`, panicking on an error.
    pub fn exec(&self, sql: &str) -> String {
        self.sql(&format!("USE test; {sql}"))
            .unwrap_or_else(|e| panic!("`{sql}` failed: {e}"))
    }
}

impl Drop for ScratchMariadb {
    fn drop(&mut self) {
        stop_child(&mut self.child, "-TERM");
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
