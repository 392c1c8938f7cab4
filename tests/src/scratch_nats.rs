//! Private `nats-server`s with JetStream on free loopback ports, for what the shared
//! server must not be put through: an outage (killed and started again on the same
//! store), and a three-node cluster whose stream leader is killed.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::names::unique;
use crate::ports::{free_port, wait_for_port};

/// A private `nats-server -js` on a free port, with its store in a temporary directory
/// kept across [`restart`](Self::restart)s and removed on drop.
pub struct ScratchNats {
    port: u16,
    /// The cluster route port and the routes to the other nodes, for a cluster node.
    cluster: Option<(u16, String, String)>,
    child: Option<Child>,
    dir: PathBuf,
}

impl ScratchNats {
    /// Starts a server on a free loopback port and waits until it listens.
    pub fn start() -> Self {
        let mut nats = Self::unstarted(None);
        nats.restart();
        nats
    }

    fn unstarted(cluster: Option<(u16, String, String)>) -> Self {
        let dir = std::env::temp_dir().join(unique("scratch-nats"));
        std::fs::create_dir_all(&dir).expect("temp dir for the JetStream store");
        Self {
            port: free_port(),
            cluster,
            child: None,
            dir,
        }
    }

    /// Three servers in one JetStream cluster (`cluster name`, routes to each other),
    /// each started; a stream of three replicas spreads over all three.
    pub fn start_cluster() -> Vec<Self> {
        let name = unique("scratch");
        let routes: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let all = routes
            .iter()
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut nodes: Vec<Self> = routes
            .iter()
            .map(|&route| Self::unstarted(Some((route, name.clone(), all.clone()))))
            .collect();
        for node in &mut nodes {
            node.spawn();
        }
        for node in &nodes {
            wait_for_port(node.port, "a scratch nats-server", Duration::from_secs(20));
        }
        nodes
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kills the server with SIGKILL: clients now see a connection error.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether the server process runs.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Starts the server again on the same port and store, and waits until it listens.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
        wait_for_port(self.port, "a scratch nats-server", Duration::from_secs(20));
    }

    fn spawn(&mut self) {
        let port = self.port.to_string();
        let dir = self.dir.to_str().expect("temp dir is UTF-8").to_owned();
        let mut args = vec![
            "-js".to_owned(),
            "-a".to_owned(),
            "127.0.0.1".to_owned(),
            "-p".to_owned(),
            port.clone(),
            "-sd".to_owned(),
            dir,
        ];
        if let Some((route, name, routes)) = &self.cluster {
            args.extend([
                "--name".to_owned(),
                format!("n{port}"),
                "--cluster_name".to_owned(),
                name.clone(),
                "--cluster".to_owned(),
                format!("nats://127.0.0.1:{route}"),
                "--routes".to_owned(),
                routes.clone(),
            ]);
        }
        let child = Command::new("nats-server")
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server is installed (scripts/services.sh)");
        self.child = Some(child);
    }
}

impl Drop for ScratchNats {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
