//! Private `redis-server`s on free loopback ports, for what the shared Redis must not
//! be put through: an outage (stop and restart, optionally keeping the data), and a
//! server that requires a password.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::names::unique;
use crate::ports::{free_port, wait_for_port};

/// A private `redis-server` on a free port that a test can stop and start again, to
/// play a broker outage without touching the shared Redis.
pub struct ScratchRedis {
    port: u16,
    child: Option<Child>,
    /// With persistence: the AOF directory, kept across restarts, removed on drop.
    dir: Option<PathBuf>,
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

    fn start_with(dir: Option<PathBuf>) -> Self {
        let port = free_port();
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
        wait_for_port(
            self.port,
            "the scratch redis-server",
            Duration::from_secs(20),
        );
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
        wait_for_port(port, "the password redis-server", Duration::from_secs(30));
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
