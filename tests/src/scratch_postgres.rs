//! A private PostgreSQL server that requires a password, for tests of wrong credentials:
//! the shared PostgreSQL trusts every local connection, so it cannot refuse one.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::names::unique;
use crate::ports::{free_port, wait_for_port};
use crate::process::stop_child;
use crate::wait::wait_until_within;

/// The directory of the PostgreSQL server binaries (`pg_config --bindir`).
fn pg_bindir() -> PathBuf {
    let out = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .expect("pg_config is installed");
    PathBuf::from(String::from_utf8(out.stdout).expect("utf-8").trim())
}

/// A private PostgreSQL server on a free loopback port whose user `postgres` needs the
/// password [`PASSWORD`](Self::PASSWORD) (SCRAM). It runs as the `postgres` OS user
/// (the server refuses root) and is removed with its data on drop.
pub struct ScratchPostgres {
    port: u16,
    dir: PathBuf,
    child: Child,
}

impl ScratchPostgres {
    /// The right password.
    pub const PASSWORD: &'static str = "right-pg-pass";

    /// `initdb`, then starts the server and waits until it accepts connections.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// [`start`](Self::start) with logical decoding on: `wal_level = logical`, 10
    /// replication slots and WAL senders, for the CDC relay's tests.
    pub fn start_logical() -> Self {
        Self::start_with(&[
            ("wal_level", "logical"),
            ("max_replication_slots", "10"),
            ("max_wal_senders", "10"),
        ])
    }

    /// [`start`](Self::start) with server settings (`-c name=value`) added.
    pub fn start_with(settings: &[(&str, &str)]) -> Self {
        let dir = std::env::temp_dir().join(unique("scratch-pg"));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let pwfile = dir.join("pw");
        std::fs::write(&pwfile, Self::PASSWORD).expect("password file");
        let chown = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&dir)
            .status()
            .expect("chown");
        assert!(chown.success(), "chown of {}", dir.display());
        let bin = pg_bindir();
        let as_postgres = |program: &str| {
            let mut cmd = Command::new("setpriv");
            cmd.args([
                "--reuid=postgres",
                "--regid=postgres",
                "--init-groups",
                // Never outlive the test process, even when it is killed.
                "--pdeathsig=KILL",
            ])
            .arg(bin.join(program));
            cmd
        };
        let data = dir.join("data");
        let init = as_postgres("initdb")
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=scram-sha-256", "-N"])
            .arg(format!("--pwfile={}", pwfile.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .expect("initdb runs");
        assert!(
            init.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&init.stderr)
        );
        let port = free_port();
        let child = as_postgres("postgres")
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .args(
                settings
                    .iter()
                    .flat_map(|(k, v)| ["-c".to_owned(), format!("{k}={v}")]),
            )
            .arg("-c")
            .arg(format!("unix_socket_directories={}", dir.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("postgres starts");
        let server = Self { port, dir, child };
        wait_for_port(port, "the scratch PostgreSQL", Duration::from_secs(30));
        // The port opens before recovery ends ("the database system is starting up"):
        // wait until the server accepts sessions.
        wait_until_within(
            "the scratch PostgreSQL to accept connections",
            Duration::from_secs(30),
            || {
                Command::new(bin.join("pg_isready"))
                    .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()])
                    .status()
                    .is_ok_and(|s| s.success())
            },
        );
        server
    }

    /// `postgres://postgres:<right password>@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        self.url_with_password(Self::PASSWORD)
    }

    /// The same server through its Unix-domain socket, in libpq's form:
    /// `postgres://postgres:<right password>@/postgres?host=<socket directory>&port=<port>`.
    pub fn socket_url(&self) -> String {
        format!(
            "postgres://postgres:{}@/postgres?host={}&port={}",
            Self::PASSWORD,
            self.dir.display(),
            self.port
        )
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres:<password>@127.0.0.1:<port>/postgres`.
    pub fn url_with_password(&self, password: &str) -> String {
        format!(
            "postgres://postgres:{password}@127.0.0.1:{}/postgres",
            self.port
        )
    }
}

impl Drop for ScratchPostgres {
    fn drop(&mut self) {
        // A fast shutdown (SIGINT) lets the server remove its shared memory; SIGKILL
        // only if it does not stop.
        stop_child(&mut self.child, "-INT");
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
