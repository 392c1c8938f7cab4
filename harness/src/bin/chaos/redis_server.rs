//! The run's private `redis-server`: AOF with `appendfsync always`, so that stopping it
//! (even with SIGKILL) and starting it again is an outage and nothing else.

use std::collections::HashSet;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use redis::streams::StreamRangeReply;

use crate::BoxError;
use crate::procs::{signal, with_parent_death};

pub(crate) struct RedisServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a server on a free loopback port, its files in `dir`.
    pub(crate) fn start(dir: &Path) -> Result<Self, BoxError> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let mut server = Self {
            port,
            dir: dir.to_owned(),
            child: None,
        };
        server.up()?;
        Ok(server)
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    pub(crate) fn is_up(&self) -> bool {
        self.child.is_some()
    }

    /// Starts the server (on the same port and files) and waits until it answers.
    pub(crate) fn up(&mut self) -> Result<(), BoxError> {
        if self.child.is_some() {
            return Ok(());
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("redis.log"))?;
        let child = with_parent_death("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        // While it loads the AOF, Redis answers `LOADING`: wait for a PONG.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if self.ping() {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut()
                && let Some(status) = c.try_wait()?
            {
                self.child = None;
                return Err(format!(
                    "redis-server on port {} exited at start ({status}); see {}",
                    self.port,
                    self.dir.join("redis.log").display()
                )
                .into());
            }
            if Instant::now() > deadline {
                return Err(format!("redis-server on port {} did not start", self.port).into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn ping(&self) -> bool {
        let Ok(mut c) = self.connection() else {
            return false;
        };
        redis::cmd("PING")
            .query::<String>(&mut c)
            .is_ok_and(|p| p == "PONG")
    }

    fn connection(&self) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(2))
    }

    /// Stops the server: with SIGKILL (`crash`) or SIGTERM (a clean shutdown).
    pub(crate) fn down(&mut self, crash: bool) -> Result<(), BoxError> {
        if let Some(mut child) = self.child.take() {
            signal(&child, if crash { "KILL" } else { "TERM" })?;
            let deadline = Instant::now() + Duration::from_secs(30);
            while child.try_wait()?.is_none() {
                if Instant::now() > deadline {
                    child.kill()?;
                    child.wait()?;
                    return Err("redis-server ignored SIGTERM for 30 s".into());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// `CLIENT KILL TYPE normal`: drops every client connection (not the caller's own).
    pub(crate) fn kill_clients(&self) -> Result<u64, BoxError> {
        let mut c = self.connection()?;
        Ok(redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .query(&mut c)?)
    }

    /// Every entry of `stream`: `(entry id, msg_id)`.
    pub(crate) fn read_stream(&self, stream: &str) -> Result<Vec<(String, String)>, BoxError> {
        let mut c = self.connection()?;
        let mut out = Vec::new();
        let mut start = "-".to_owned();
        loop {
            let reply: StreamRangeReply = redis::cmd("XRANGE")
                .arg(stream)
                .arg(&start)
                .arg("+")
                .arg("COUNT")
                .arg(10_000)
                .query(&mut c)?;
            let Some(last) = reply.ids.last() else {
                return Ok(out);
            };
            start = format!("({}", last.id);
            for entry in &reply.ids {
                let msg_id: String = entry.get("msg_id").unwrap_or_default();
                out.push((entry.id.clone(), msg_id));
            }
        }
    }

    /// The consumer names that issue `XREADGROUP`, or renew their membership (ordered
    /// consumers), within `window`, seen with `MONITOR`.
    /// (`XINFO CONSUMERS` cannot tell: Redis 7.0 does not count a read that returns
    /// nothing as activity.)
    pub(crate) fn readers(&self, window: Duration) -> Result<HashSet<String>, BoxError> {
        use std::io::{BufRead as _, BufReader, Write as _};
        // A plain socket: the redis crate's connection gives up after a read timeout.
        let mut socket = std::net::TcpStream::connect(("127.0.0.1", self.port))?;
        socket.write_all(b"MONITOR\r\n")?;
        socket.set_read_timeout(Some(Duration::from_millis(200)))?;
        let mut lines = BufReader::new(socket);
        let deadline = Instant::now() + window;
        let mut names = HashSet::new();
        let mut line = Vec::new();
        while Instant::now() < deadline {
            match lines.read_until(b'\n', &mut line) {
                Ok(0) => return Err("MONITOR connection closed".into()),
                Ok(_) if line.ends_with(b"\n") => {}
                Ok(_) => continue,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
            // +1796058611.609978 [0 127.0.0.1:41332] "XREADGROUP" "GROUP" "chaos" "NAME" ...
            // An ordered consumer holding no partition (more consumers than a fair share
            // needs) reads nothing; it takes part by renewing its membership:
            // +1796058611.6 [0 lua] "ZADD" "<prefix>members:chaos" "1796058621600" "NAME"
            let text = String::from_utf8_lossy(&line);
            let mut quoted = text.split('"').skip(1).step_by(2);
            match quoted.next() {
                Some("XREADGROUP") => {
                    if let (Some(_), Some(_), Some(name)) =
                        (quoted.next(), quoted.next(), quoted.next())
                    {
                        names.insert(name.to_owned());
                    }
                }
                Some("ZADD") => {
                    if let (Some(key), Some(_), Some(name)) =
                        (quoted.next(), quoted.next(), quoted.next())
                        && key.ends_with(&format!("members:{}", crate::GROUP))
                    {
                        names.insert(name.to_owned());
                    }
                }
                _ => {}
            }
            line.clear();
        }
        Ok(names)
    }

    /// The consumers holding an ordered-mode lease of `group` on one of `streams`: the
    /// holder's name in each lease (`<stream>:lease:<group>`, whose value is
    /// `<epoch>:<holder>`).
    pub(crate) fn lease_holders(
        &self,
        streams: &[String],
        group: &str,
    ) -> Result<HashSet<String>, BoxError> {
        let mut c = self.connection()?;
        let mut holders = HashSet::new();
        for stream in streams {
            let value: Option<String> = redis::cmd("GET")
                .arg(format!("{stream}:lease:{group}"))
                .query(&mut c)?;
            if let Some((_, holder)) = value.as_deref().and_then(|v| v.split_once(':')) {
                holders.insert(holder.to_owned());
            }
        }
        Ok(holders)
    }

    /// `XLEN stream`.
    pub(crate) fn len(&self, stream: &str) -> Result<u64, BoxError> {
        let mut c = self.connection()?;
        Ok(redis::cmd("XLEN").arg(stream).query(&mut c)?)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
