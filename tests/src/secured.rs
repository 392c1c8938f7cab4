//! Private servers that require a password, for tests of wrong credentials: the shared
//! PostgreSQL trusts every local connection and the shared Redis has no password, so
//! neither can refuse one.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::unique;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

fn wait_for_port(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{what} did not start on port {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

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
            .arg("-c")
            .arg(format!("unix_socket_directories={}", dir.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("postgres starts");
        let server = Self { port, dir, child };
        wait_for_port(port, "the scratch PostgreSQL");
        server
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
        let _ = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A private `redis-server` on a free loopback port that requires the password
/// [`PASSWORD`](Self::PASSWORD) (`requirepass`). Stopped on drop.
pub struct PasswordRedis {
    port: u16,
    child: Child,
}

impl PasswordRedis {
    /// The right password.
    pub const PASSWORD: &'static str = "right-redis-pass";

    /// Starts the server and waits until it accepts connections.
    pub fn start() -> Self {
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--requirepass", Self::PASSWORD])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed");
        let server = Self { port, child };
        wait_for_port(port, "the password redis-server");
        server
    }

    /// `redis://:<password>@127.0.0.1:<port>`.
    pub fn url_with_password(&self, password: &str) -> String {
        format!("redis://:{password}@127.0.0.1:{}", self.port)
    }
}

impl Drop for PasswordRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
