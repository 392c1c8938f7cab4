//! `--nats-cluster`: three private `nats-server -js` in one JetStream cluster, the
//! topic's stream with three replicas. Its "outage" is the stream's leader SIGKILLed
//! (or SIGTERMed) and started again after the outage's length: the other two elect a
//! new leader and serve on, and a publish the relay saw acknowledged must survive.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use crate::BoxError;
use crate::broker::BrokerServer;
use crate::nats_server::{NatsServer, free_port, sent_between};

pub(crate) struct NatsCluster {
    nodes: Vec<NatsServer>,
    /// The topic's stream, whose leader the outages kill.
    stream: String,
    /// The node killed, until it is started again.
    down: Option<usize>,
}

impl NatsCluster {
    /// Starts three nodes (`n1`…`n3`) routed to each other; waits until each serves.
    /// Its six free ports are picked before any node binds them: a node that lost one
    /// to another process exits at start, and the cluster is started again on new
    /// ports (three tries).
    pub(crate) fn start(dir: &Path, stream_prefix: &str, stream: &str) -> Result<Self, BoxError> {
        let mut tries = 0;
        loop {
            tries += 1;
            match Self::try_start(dir, stream_prefix, stream) {
                Err(e) if tries < 3 => {
                    eprintln!("chaos: the NATS cluster did not start ({e}); again")
                }
                result => return result,
            }
        }
    }

    fn try_start(dir: &Path, stream_prefix: &str, stream: &str) -> Result<Self, BoxError> {
        // A failed try's stores name other routes: each try starts empty.
        for i in 1..=3 {
            let _ = std::fs::remove_dir_all(dir.join(format!("jetstream-n{i}")));
        }
        let routes: Vec<u16> = (0..3).map(|_| free_port()).collect::<Result<_, _>>()?;
        let all = routes
            .iter()
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        let name = format!("chaos{}", std::process::id());
        let mut nodes = routes
            .iter()
            .enumerate()
            .map(|(i, &route)| {
                let cluster = Some((route, name.clone(), all.clone()));
                NatsServer::node(dir, stream_prefix, &format!("n{}", i + 1), cluster)
            })
            .collect::<Result<Vec<_>, _>>()?;
        // All at once: a node's JetStream waits for a quorum of the others.
        for node in &mut nodes {
            node.spawn()?;
        }
        for node in &mut nodes {
            node.wait_ready()?;
        }
        Ok(Self {
            nodes,
            stream: stream.to_owned(),
            down: None,
        })
    }

    /// A node that runs, for the JetStream API.
    fn running(&self) -> &NatsServer {
        let i = usize::from(self.down == Some(0));
        &self.nodes[i]
    }

    /// The index of the node that leads the topic's stream (the first node before the
    /// stream exists).
    fn leader(&self) -> Result<usize, BoxError> {
        let stream = self.stream.clone();
        let leader = self.running().with_js(async move |js| {
            let Ok(mut s) = js.get_stream(&stream).await else {
                return Ok(None);
            };
            Ok(s.info()
                .await?
                .cluster
                .as_ref()
                .and_then(|c| c.leader.clone()))
        })?;
        Ok(leader
            .and_then(|name| self.nodes.iter().position(|n| n.name == name))
            .unwrap_or(0))
    }
}

impl BrokerServer for NatsCluster {
    fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        format!("nats://{}", hosts.join(","))
    }
    /// The port of the node an outage takes down (the stream's leader, or the node
    /// down now): the run's end checks that it no longer answers once stopped. The
    /// other nodes stop when the cluster is dropped.
    fn port(&self) -> u16 {
        let i = match self.down {
            Some(i) => i,
            None => self.leader().unwrap_or(0),
        };
        self.nodes[i].port()
    }
    fn is_up(&self) -> bool {
        self.down.is_none()
    }
    fn up(&mut self) -> Result<(), BoxError> {
        if let Some(i) = self.down.take() {
            self.nodes[i].up()?;
        }
        Ok(())
    }
    fn down(&mut self, crash: bool) -> Result<(), BoxError> {
        if self.down.is_some() {
            return Ok(());
        }
        let i = self.leader()?;
        eprintln!(
            "chaos: {} of {}, the leader of {}",
            if crash { "SIGKILL" } else { "SIGTERM" },
            self.nodes[i].name,
            self.stream
        );
        self.nodes[i].down(crash)?;
        self.down = Some(i);
        Ok(())
    }
    fn kill_clients(&self) -> Result<u64, BoxError> {
        Err("nats-server 2.9 cannot drop its clients: no client_kill on NATS".into())
    }
    fn read_stream(&self, stream: &str) -> Result<Vec<(String, String)>, BoxError> {
        self.running().read_stream(stream)
    }
    fn readers(&self, window: Duration) -> Result<HashSet<String>, BoxError> {
        let up: Vec<&NatsServer> = (self.nodes.iter().enumerate())
            .filter(|(i, _)| self.down != Some(*i))
            .map(|(_, n)| n)
            .collect();
        let snapshot = || -> Result<HashMap<String, u64>, BoxError> {
            let mut all = HashMap::new();
            for n in &up {
                all.extend(n.connz()?);
            }
            Ok(all)
        };
        let first = snapshot()?;
        std::thread::sleep(window);
        Ok(sent_between(&first, snapshot()?))
    }
    fn len(&self, stream: &str) -> Result<u64, BoxError> {
        self.running().len(stream)
    }
}
