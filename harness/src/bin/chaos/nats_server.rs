//! The run's private `nats-server -js` (`--broker nats`): its store in the run's
//! directory, so that stopping it (even with SIGKILL) and starting it again on the same
//! port is an outage of the relays and the consumers.

use std::collections::{HashMap, HashSet};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use outbox_nats::async_nats::{self, jetstream};

use crate::BoxError;
use crate::probe;
use crate::procs::{signal, with_parent_death};

pub(crate) struct NatsServer {
    port: u16,
    /// The HTTP monitoring port (`/healthz`, `/connz`).
    monitor: u16,
    dir: PathBuf,
    /// The consumers' dead-letter stream (`<stream prefix>DEAD`).
    dead_stream: String,
    child: Option<Child>,
    /// The server's name (`chaos`, or `n1`… in a cluster): its log and store are named
    /// after it.
    pub(crate) name: String,
    /// In a cluster: its route port, the cluster's name and the routes to every node.
    cluster: Option<(u16, String, String)>,
}

impl NatsServer {
    /// Starts a server on free loopback ports, its store in `dir`; the relays use
    /// `stream_prefix`.
    pub(crate) fn start(dir: &Path, stream_prefix: &str) -> Result<Self, BoxError> {
        let mut server = Self::node(dir, stream_prefix, "chaos", None)?;
        server.up()?;
        Ok(server)
    }

    /// A server not started yet, on free ports; `cluster`: its route port, the
    /// cluster's name and the routes.
    pub(crate) fn node(
        dir: &Path,
        stream_prefix: &str,
        name: &str,
        cluster: Option<(u16, String, String)>,
    ) -> Result<Self, BoxError> {
        Ok(Self {
            port: free_port()?,
            monitor: free_port()?,
            dir: dir.to_owned(),
            dead_stream: format!("{stream_prefix}DEAD"),
            child: None,
            name: name.to_owned(),
            cluster,
        })
    }

    pub(crate) fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    pub(crate) fn is_up(&self) -> bool {
        self.child.is_some()
    }

    /// Starts the server (same ports, same store) and waits until JetStream serves
    /// (`/healthz`: 200 once the streams are recovered).
    pub(crate) fn up(&mut self) -> Result<(), BoxError> {
        if self.child.is_some() {
            return Ok(());
        }
        self.spawn()?;
        self.wait_ready()
    }

    /// Starts the process (the nodes of a cluster all start before any is ready).
    pub(crate) fn spawn(&mut self) -> Result<(), BoxError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("nats-{}.log", self.name)))?;
        let mut command = with_parent_death("nats-server");
        command
            .args(["-js", "-a", "127.0.0.1", "--server_name", &self.name])
            .args(["-p", &self.port.to_string()])
            .args(["-m", &self.monitor.to_string()])
            .arg("-sd")
            .arg(self.dir.join(format!("jetstream-{}", self.name)));
        if let Some((route, name, routes)) = &self.cluster {
            command
                .args(["--cluster_name", name, "--routes", routes])
                .arg("--cluster")
                .arg(format!("nats://127.0.0.1:{route}"));
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    /// Waits until the server's JetStream serves.
    pub(crate) fn wait_ready(&mut self) -> Result<(), BoxError> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if probe::status(self.monitor, "/healthz") == Some(200) {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut()
                && let Some(status) = c.try_wait()?
            {
                self.child = None;
                return Err(format!(
                    "nats-server on port {} exited at start ({status}); see {}",
                    self.port,
                    self.dir.join(format!("nats-{}.log", self.name)).display()
                )
                .into());
            }
            if Instant::now() > deadline {
                return Err(format!("nats-server on port {} did not start", self.port).into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
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
                    return Err("nats-server ignored SIGTERM for 30 s".into());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// Runs `f` on a JetStream context of a new connection, on a runtime of its own.
    pub(crate) fn with_js<T>(
        &self,
        f: impl AsyncFnOnce(jetstream::Context) -> Result<T, BoxError>,
    ) -> Result<T, BoxError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let client = async_nats::ConnectOptions::new()
                .connection_timeout(Duration::from_secs(5))
                .connect(self.url())
                .await?;
            f(jetstream::new(client)).await
        })
    }

    /// Every message of `stream`: `(sequence, Nats-Msg-Id)`, in sequence order.
    pub(crate) fn read_stream(&self, stream: &str) -> Result<Vec<(String, String)>, BoxError> {
        self.with_js(async |js| {
            let Ok(mut s) = js.get_stream(stream).await else {
                return Ok(Vec::new());
            };
            let state = s.info().await?.state.clone();
            let mut out = Vec::new();
            for seq in state.first_sequence..=state.last_sequence {
                // A sequence with no message (none here: nothing is deleted) is skipped.
                let Ok(m) = s.get_raw_message(seq).await else {
                    continue;
                };
                let msg_id = m
                    .headers
                    .get("Nats-Msg-Id")
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default();
                out.push((seq.to_string(), msg_id));
            }
            Ok(out)
        })
    }

    /// Messages in `stream`; `<stream>:dead` counts the dead-letter stream.
    pub(crate) fn len(&self, stream: &str) -> Result<u64, BoxError> {
        let name = if stream.ends_with(":dead") {
            self.dead_stream.as_str()
        } else {
            stream
        };
        self.with_js(async |js| match js.get_stream(name).await {
            Ok(mut s) => Ok(s.info().await?.state.messages),
            Err(_) => Ok(0),
        })
    }

    /// The names of the connections that sent messages (a pull is a request message)
    /// within `window`: `/connz` read twice, `window` apart.
    pub(crate) fn readers(&self, window: Duration) -> Result<HashSet<String>, BoxError> {
        let first = self.connz()?;
        std::thread::sleep(window);
        Ok(sent_between(&first, self.connz()?))
    }

    /// Named connections and the messages each has sent (`in_msgs`).
    pub(crate) fn connz(&self) -> Result<HashMap<String, u64>, BoxError> {
        use std::io::{Read as _, Write as _};
        // HTTP/1.0: the answer comes whole, not chunked.
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.monitor))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(b"GET /connz?limit=1024 HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b)
            .ok_or("/connz: no body")?;
        let connz: serde_json::Value = serde_json::from_str(body)?;
        let conns = connz["connections"].as_array().cloned().unwrap_or_default();
        Ok(conns
            .iter()
            .filter_map(|c| Some((c["name"].as_str()?.to_owned(), c["in_msgs"].as_u64()?)))
            .collect())
    }
}

/// The connections of `second` that sent messages since `first`: those whose count
/// grew, and those that connected in between (a consumer reconnecting after the
/// window's first look, as after a broker outage that ends the run) and sent any.
pub(crate) fn sent_between(
    first: &HashMap<String, u64>,
    second: HashMap<String, u64>,
) -> HashSet<String> {
    second
        .into_iter()
        .filter(|(name, n)| *n > first.get(name).copied().unwrap_or(0))
        .map(|(name, _)| name)
        .collect()
}

/// A loopback port that was free a moment ago.
pub(crate) fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
