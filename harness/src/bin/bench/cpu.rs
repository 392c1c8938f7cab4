//! CPU time spent on the emit figures' transactions: the bench's own threads and the
//! PostgreSQL backends that serve their connections, from the kernel's per-task
//! `schedstat` (nanoseconds on a CPU; `/proc/<pid>/stat` counts 10 ms ticks).
//!
//! Throughput at one connection follows the disk's flush time, and at eight the 2 cores'
//! scheduling: both move by more than the library's cost from one second to the next.
//! The CPU time a transaction needs waits for neither, so the ratio of the two ways'
//! CPU per transaction narrows what the throughput ratio can only bracket (the rounds'
//! ranges mostly ±0.02 against ±0.05–0.15; BENCHMARKS.md).
//! Linux only, and only when PostgreSQL runs on this machine: otherwise no CPU figure.

use std::collections::HashMap;
use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{Integer, Nullable};

/// Time the task (a thread, or a one-thread process such as a PostgreSQL backend) at
/// `/proc/<task>` has run on a CPU.
fn on_cpu(task: &str) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{task}/schedstat")).ok()?;
    let ns = stat.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// Whose CPU time counts as the client's.
#[derive(Clone, Copy)]
pub(crate) enum Client {
    /// The calling thread.
    Thread,
    /// Every thread of this process (an async runtime's workers serve the tasks).
    Process,
}

/// CPU time on each side of the connections: the bench's and PostgreSQL's.
#[derive(Clone, Copy)]
pub(crate) struct Cpu {
    pub(crate) client: Duration,
    pub(crate) server: Duration,
}

impl Cpu {
    pub(crate) const ZERO: Self = Self {
        client: Duration::ZERO,
        server: Duration::ZERO,
    };

    pub(crate) fn total(self) -> Duration {
        self.client + self.server
    }

    /// Each side's time per one of `n` transactions.
    pub(crate) fn per(self, n: usize) -> Self {
        Self {
            client: self.client.div_f64(n as f64),
            server: self.server.div_f64(n as f64),
        }
    }
}

impl std::ops::Add for Cpu {
    type Output = Self;
    fn add(self, other: Self) -> Self {
        Self {
            client: self.client + other.client,
            server: self.server + other.server,
        }
    }
}

impl std::iter::Sum for Cpu {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::ZERO, |a, b| a + b)
    }
}

/// The CPU time of some tasks at one instant, by task: the backends', the client's.
pub(crate) struct Sample {
    server: HashMap<String, Duration>,
    client: HashMap<String, Duration>,
}

impl Sample {
    /// `backends`' and `client`'s CPU time now; `None` unless every backend is known.
    pub(crate) fn take(backends: &[Option<Backend>], client: Client) -> Option<Self> {
        let mut server = HashMap::new();
        for b in backends {
            let task = &b.as_ref()?.0;
            server.insert(task.clone(), on_cpu(task)?);
        }
        let mut threads = HashMap::new();
        match client {
            Client::Thread => {
                threads.insert("thread-self".to_owned(), on_cpu("thread-self")?);
            }
            Client::Process => {
                for thread in std::fs::read_dir("/proc/self/task").ok()? {
                    let task = format!("self/task/{}", thread.ok()?.file_name().to_str()?);
                    // A thread that ended between the listing and the read counts nothing.
                    if let Some(t) = on_cpu(&task) {
                        threads.insert(task, t);
                    }
                }
            }
        }
        Some(Self {
            server,
            client: threads,
        })
    }

    /// The CPU time spent since `before`: a thread that began since counts whole, one
    /// that ended counts nothing (a runtime's idle blocking threads come and go; a
    /// thread id reused in between would count too little). `None` where the kernel
    /// keeps no such time (schedstat reads zeros).
    pub(crate) fn since(&self, before: &Sample) -> Option<Cpu> {
        fn spent(now: &HashMap<String, Duration>, then: &HashMap<String, Duration>) -> Duration {
            now.iter()
                .map(|(task, t)| t.saturating_sub(then.get(task).copied().unwrap_or_default()))
                .sum()
        }
        let cpu = Cpu {
            client: spent(&self.client, &before.client),
            server: spent(&self.server, &before.server),
        };
        (!cpu.client.is_zero() && !cpu.server.is_zero()).then_some(cpu)
    }
}

/// A connection's backend as the server names it: its pid, and the port it sees the
/// bench's end of the connection on (none over a Unix socket).
#[derive(QueryableByName)]
struct Peer {
    #[diesel(sql_type = Integer)]
    pid: i32,
    #[diesel(sql_type = Nullable<Integer>)]
    port: Option<i32>,
}

/// The query that names a connection's backend.
fn peer_query() -> diesel::query_builder::SqlQuery {
    diesel::sql_query("SELECT pg_backend_pid() AS pid, inet_client_port() AS port")
}

/// The backend that serves a connection, if it runs on this machine.
pub(crate) struct Backend(String);

impl Backend {
    /// The backend serving `c`, if it can be read here (otherwise no CPU figure).
    pub(crate) fn of(c: &mut PgConnection) -> Option<Self> {
        Self::local(&peer_query().get_result(c).ok()?)
    }

    /// [`of`](Self::of) on diesel-async.
    pub(crate) async fn of_async(c: &mut diesel_async::AsyncPgConnection) -> Option<Self> {
        let peer = diesel_async::RunQueryDsl::get_result(peer_query(), c).await;
        Self::local(&peer.ok()?)
    }

    /// A pid of a server elsewhere could name an unrelated process here: the backend is
    /// taken only if its process title (`postgres: user db host(port) ...`) shows the
    /// connection's port.
    fn local(peer: &Peer) -> Option<Self> {
        let title = std::fs::read(format!("/proc/{}/cmdline", peer.pid)).ok()?;
        let title = String::from_utf8_lossy(&title);
        (title.starts_with("postgres") && title.contains(&format!("({})", peer.port?)))
            .then(|| Self(peer.pid.to_string()))
    }
}
