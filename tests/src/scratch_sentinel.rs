//! A private Redis Sentinel deployment for failover tests: a primary, a replica and
//! three sentinels, each a `redis-server` on a free loopback port.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use redis::Value;

use crate::names::unique;
use crate::ports::free_port;
use crate::wait::wait_until_explained;

const MASTER: &str = ScratchSentinel::MASTER;
const REPL_USER: &str = "repl";
const REPL_PASS: &str = "repl-pass";

/// How long one step of [`ScratchSentinel`] may take: generous, for a busy machine.
const STEP: Duration = Duration::from_secs(30);

/// One primary, one replica and three sentinels (`redis-server --sentinel`, quorum 2,
/// `down-after-milliseconds` 1000, `failover-timeout` 3000) on free loopback ports in a
/// temporary directory, monitoring the primary as [`MASTER`](Self::MASTER). No
/// persistence; the replicas authenticate as their own ACL user, so that the primary
/// can cut them off ([`cut_replication`](Self::cut_replication)). Dropping it kills every
/// server and removes the directory.
pub struct ScratchSentinel {
    dir: PathBuf,
    /// Data servers by port: the primary first, then the replica.
    data_ports: [u16; 2],
    data: [Option<Child>; 2],
    sentinel_ports: Vec<u16>,
    sentinels: Vec<Child>,
}

impl ScratchSentinel {
    /// The name the sentinels monitor the primary under.
    pub const MASTER: &'static str = "mymaster";

    /// The data servers' ports: the first primary, then the first replica (their roles
    /// swap at a failover; [`primary_port`](Self::primary_port) says which is which).
    pub fn data_ports(&self) -> [u16; 2] {
        self.data_ports
    }

    /// The port of sentinel `i` (0 to 2).
    pub fn sentinel_port(&self, i: usize) -> u16 {
        self.sentinel_ports[i]
    }

    /// Starts the servers and waits until the replica streams from the primary and each
    /// sentinel knows the replica and its two peers.
    pub fn start() -> Self {
        Self::start_with("")
    }

    /// [`start`](Self::start), with `primary_conf` added to the first primary's
    /// configuration.
    pub fn start_with(primary_conf: &str) -> Self {
        let dir = std::env::temp_dir().join(unique("outbox-redis-sentinel"));
        std::fs::create_dir_all(&dir).unwrap();
        let ports = [free_port(), free_port()];
        let mut d = Self {
            dir,
            data_ports: ports,
            data: [None, None],
            sentinel_ports: Vec::new(),
            sentinels: Vec::new(),
        };
        d.start_data(0, None, primary_conf);
        d.start_data(1, Some(ports[0]), "");
        d.wait_replica_synced(ports[1], ports[0]);
        // Each sentinel is told its peers and the replica up front (with fixed ids), as a
        // deployment's saved sentinel configs do, instead of discovering them through
        // hello messages every 2 s and INFO every 10 s: the test starts at once.
        let sentinel_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let id = |i: usize| format!("{:040x}", i + 1);
        for (i, &port) in sentinel_ports.iter().enumerate() {
            let conf = d.dir.join(format!("sentinel-{port}.conf"));
            let mut text = format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile {dir}/sentinel-{port}.log\n\
                 sentinel myid {myid}\n\
                 sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n\
                 sentinel down-after-milliseconds {MASTER} 1000\n\
                 sentinel failover-timeout {MASTER} 3000\n\
                 sentinel parallel-syncs {MASTER} 1\n\
                 sentinel known-replica {MASTER} 127.0.0.1 {replica}\n",
                dir = d.dir.display(),
                myid = id(i),
                primary = ports[0],
                replica = ports[1],
            );
            for (j, &peer) in sentinel_ports.iter().enumerate() {
                if j != i {
                    text.push_str(&format!(
                        "sentinel known-sentinel {MASTER} 127.0.0.1 {peer} {}\n",
                        id(j)
                    ));
                }
            }
            std::fs::write(&conf, text).unwrap();
            let child = Command::new("redis-server")
                .arg(&conf)
                .arg("--sentinel")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server must be installed to run the sentinel tests");
            d.sentinel_ports.push(port);
            d.sentinels.push(child);
        }
        // Failover needs each sentinel to know the replica and the two other sentinels
        // (a majority elects the leader); they learn both within a few seconds.
        for &port in &d.sentinel_ports.clone() {
            d.wait(
                &format!("sentinel {port} to know the replica and its peers"),
                || {
                    let master = sync_query(port, redis::cmd("SENTINEL").arg("MASTER").arg(MASTER));
                    let Ok(fields) = master.map(|v: Vec<String>| v) else {
                        return false;
                    };
                    let get = |name: &str| {
                        fields
                            .chunks(2)
                            .find(|kv| kv[0] == name)
                            .map(|kv| kv[1].clone())
                    };
                    get("num-slaves").as_deref() == Some("1")
                        && get("num-other-sentinels").as_deref() == Some("2")
                },
            );
        }
        d
    }

    /// Starts data server `i` (0 or 1) on its port: empty, a replica of `primary` if
    /// given. Both know the user the replicas authenticate as, so either can be the
    /// primary of the other. `extra` is added to the configuration.
    pub fn start_data(&mut self, i: usize, primary: Option<u16>, extra: &str) {
        let port = self.data_ports[i];
        let dir = self.dir.display();
        let mut conf = format!(
            "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile {dir}/redis-{port}.log\n\
             dbfilename dump-{port}.rdb\nsave \"\"\nappendonly no\n\
             user default on nopass ~* &* +@all\n\
             user {REPL_USER} on >{REPL_PASS} ~* &* +@all\n\
             masteruser {REPL_USER}\nmasterauth {REPL_PASS}\n\
             repl-diskless-sync-delay 0\n{extra}\n"
        );
        if let Some(primary) = primary {
            conf.push_str(&format!("replicaof 127.0.0.1 {primary}\n"));
        }
        let path = self.dir.join(format!("redis-{port}.conf"));
        std::fs::write(&path, conf).unwrap();
        let child = Command::new("redis-server")
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed to run the sentinel tests");
        self.data[i] = Some(child);
        self.wait(&format!("redis-server {port} to answer"), || {
            sync_query::<String>(port, &redis::cmd("PING")).is_ok()
        });
    }

    /// SIGKILL of data server `i` (0: the first primary, 1: the first replica).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.data[i].take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// Cuts the replication link: the primary refuses the replica's user and drops its
    /// connection, so the replica stays behind while the primary takes writes (a
    /// network partition between the two, as far as replication goes).
    pub fn cut_replication(&self) {
        let primary = self.data_ports[0];
        sync_query::<()>(
            primary,
            redis::cmd("ACL").arg("SETUSER").arg(REPL_USER).arg("off"),
        )
        .unwrap();
        sync_query::<Value>(
            primary,
            redis::cmd("CLIENT").arg("KILL").arg("USER").arg(REPL_USER),
        )
        .unwrap();
    }

    /// Waits until the server at `replica` replicates `primary` and a write on the
    /// primary has reached it.
    pub fn wait_replica_synced(&self, replica: u16, primary: u16) {
        self.wait(&format!("{replica} to replicate {primary}"), || {
            let Ok(info) = sync_query::<String>(replica, redis::cmd("INFO").arg("replication"))
            else {
                return false;
            };
            info.contains("role:slave")
                && info.contains(&format!("master_port:{primary}"))
                && info.contains("master_link_status:up")
        });
        // A replica just synced gets the command stream only after its first REPLCONF
        // ACK (up to a second later): until then the primary buffers for it, and a kill
        // loses what it took meanwhile. Wait for a write to come through.
        let marker = unique("outbox-test:synced");
        self.wait(&format!("a write on {primary} to reach {replica}"), || {
            sync_query::<()>(primary, redis::cmd("SET").arg(&marker).arg(1)).is_ok()
                && sync_query::<bool>(replica, redis::cmd("EXISTS").arg(&marker)).unwrap_or(false)
        });
    }

    /// The primary's port as the first sentinel reports it.
    pub fn primary_port(&self) -> Option<u16> {
        let (_, port): (String, u16) = sync_query(
            self.sentinel_ports[0],
            redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(MASTER),
        )
        .ok()?;
        Some(port)
    }

    /// `redis://127.0.0.1:PORT` of each sentinel.
    pub fn sentinel_urls(&self) -> Vec<String> {
        (self.sentinel_ports.iter())
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// Polls `cond` until it holds; fails after 30 s with the servers' logs.
    pub fn wait(&self, what: &str, cond: impl FnMut() -> bool) {
        wait_until_explained(STEP, cond, || {
            format!("waiting for {what}\n{}", self.logs())
        });
    }

    /// The last lines of every server's log.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for entry in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "log") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                out.push_str(&format!("--- {}\n", path.display()));
                for line in tail.into_iter().rev() {
                    out.push_str(line);
                    out.push('\n');
                }
            }
        }
        out
    }
}

impl Drop for ScratchSentinel {
    fn drop(&mut self) {
        for child in self
            .data
            .iter_mut()
            .flatten()
            .chain(self.sentinels.iter_mut())
        {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One command on a fresh connection to `127.0.0.1:port`, with short timeouts.
pub fn sync_query<T: redis::FromRedisValue>(port: u16, cmd: &redis::Cmd) -> redis::RedisResult<T> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    let mut conn = client.get_connection_with_timeout(Duration::from_secs(1))?;
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    cmd.query(&mut conn)
}
