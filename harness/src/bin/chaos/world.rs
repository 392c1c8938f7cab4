//! The run's world: the servers and processes it started, its settings and what happened
//! to them ([`Tally`]); the phases of the run are its methods (`start` here, the faults in
//! `faults.rs`, the drain and the end below, the checks and the report in `report.rs`).

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use outbox_core::OutboxEvent as _;
use outbox_harness::chaos::{Tick, key_name};

use crate::broker::BrokerServer;
use crate::config::{Backend, Broker, Config};
use crate::db::Database;
use crate::db_server::DbServer;
use crate::nats_cluster::NatsCluster;
use crate::nats_server::NatsServer;
use crate::plan::Plan;
use crate::procs::{Proc, Role};
use crate::producer::{self, Producers};
use crate::redis_server::RedisServer;
use crate::tally::Tally;
use crate::{BoxError, GROUP, db, interrupted};

/// Everything the run started; dropping it (also on a panic or an error) kills the
/// processes, stops Redis and, unless kept, drops the database and the directory.
pub(crate) struct World<'c> {
    pub(crate) c: &'c Config,
    /// Names the run's database, stream prefix and directory.
    pub(crate) tag: String,
    pub(crate) procs: Vec<Proc>,
    /// The private broker: Redis, or NATS with `--broker nats` (the name stays).
    pub(crate) redis: Option<Box<dyn BrokerServer>>,
    pub(crate) db: Option<Database>,
    /// `--db-restart`: the private database server that holds `db`.
    pub(crate) server: Option<DbServer>,
    /// The streams of the topic.
    pub(crate) streams: Vec<String>,
    pub(crate) dir: PathBuf,
    pub(crate) keep: bool,
    /// `--partitioned` without `--db-restart` (a crash of the server would end it): a
    /// transaction held open across a retention boundary.
    pub(crate) hold_open: bool,
    pub(crate) tally: Tally,
}

impl Drop for World<'_> {
    fn drop(&mut self) {
        self.procs.clear();
        self.redis = None;
        if self.keep {
            // Stopped, its files kept.
            self.server = None;
            eprintln!(
                "chaos: kept the logs and the servers' files (Redis; with --db-restart \
                 the database's) in {}",
                self.dir.display()
            );
            if let Some(db) = &self.db {
                eprintln!("chaos: kept database {}", db.name);
            }
            return;
        }
        // A private server goes with its files.
        if self.server.is_none()
            && let Some(mut db) = self.db.take()
            && let Err(e) = db.drop_all()
        {
            eprintln!("chaos: could not drop database {}: {e}", db.name);
        }
        self.server = None;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl<'c> World<'c> {
    /// An empty world and its directory; says what the run will do.
    pub(crate) fn new(c: &'c Config, plan: &Plan) -> Result<Self, BoxError> {
        let tag = format!("chaos_{}_{}", c.seed, std::process::id());
        let dir = std::env::temp_dir().join(&tag);
        std::fs::create_dir_all(&dir)?;
        eprintln!(
            "chaos: seed {} on {}: {} events over {:?}, {} relays, {} consumers, {} faults of \
             each process kind, {} Redis outages, handler faults 1 in {}; files in {}",
            c.seed,
            c.backend.name(),
            c.events,
            c.duration,
            c.relays,
            c.consumers,
            c.faults_per_kind,
            plan.outages.len(),
            c.fault_one_in,
            dir.display()
        );
        if let Some((at, len)) = plan.db_restart {
            eprintln!(
                "chaos: db_restart at {:.1} s into the faults, the server down for {:.1} s",
                at.as_secs_f64(),
                len.as_secs_f64()
            );
        }
        Ok(Self {
            c,
            tag,
            procs: Vec::new(),
            redis: None,
            db: None,
            server: None,
            streams: Vec::new(),
            dir,
            keep: c.keep,
            hold_open: c.partitioned && c.db_restart.is_none(),
            tally: Tally::default(),
        })
    }

    pub(crate) fn db(&mut self) -> &mut Database {
        self.db.as_mut().expect("created")
    }

    pub(crate) fn redis(&mut self) -> &mut dyn BrokerServer {
        self.redis.as_deref_mut().expect("started")
    }

    /// Starts the servers (the database's with `--db-restart`, Redis), creates the
    /// run's database and starts the relays and the consumers.
    pub(crate) fn start(&mut self) -> Result<(), BoxError> {
        let c = self.c;
        // The shared servers do not keep the log the CDC relay reads (PostgreSQL's
        // wal_level is `replica`, MariaDB runs without log_bin): --cdc brings its own.
        let admin_url = if c.db_restart.is_some() || c.cdc {
            self.server
                .insert(DbServer::start(c.backend, &self.dir, c.cdc)?)
                .admin_url()
        } else {
            c.admin_url.clone()
        };
        // The held transaction's key comes after the producers' keys.
        self.db = Some(Database::create(
            c.backend,
            &admin_url,
            &self.tag,
            c.keys + usize::from(self.hold_open),
            c.partitioned,
        )?);
        if c.cdc {
            self.migrate_cdc()?;
        }
        let common = self.start_broker()?;
        let topic = Tick::TOPICS[0];
        // The streams `<prefix><topic>:<p>` when partitioned (docs/partitions.md); on
        // NATS one stream holds the topic's partition subjects.
        self.streams = if let Some(subjects) = &common.subject_prefix {
            let naming = outbox_nats::Naming::new(subjects.as_str(), common.prefix.as_str())?;
            vec![naming.stream(topic)]
        } else if c.partitions > 1 {
            (0..c.partitions)
                .map(|p| format!("{}{topic}:{p}", common.prefix))
                .collect()
        } else {
            vec![format!("{}{topic}", common.prefix)]
        };
        for i in 1..=c.relays {
            self.add_proc(format!("relay-{i}"), Role::Relay, &common)?;
        }
        for i in 1..=c.consumers {
            self.add_proc(format!("consumer-{i}"), Role::Consumer, &common)?;
        }
        for p in &mut self.procs {
            p.start()?;
        }
        Ok(())
    }

    /// Starts the private broker; what the relays and the consumers are told of it.
    fn start_broker(&mut self) -> Result<Common, BoxError> {
        let (server, prefix, subject_prefix): (Box<dyn BrokerServer>, _, _) = match self.c.broker {
            Broker::Redis => (
                Box::new(RedisServer::start(&self.dir)?),
                format!("{}:", self.tag),
                None,
            ),
            Broker::Nats => {
                let prefix = format!("{}_", self.tag.to_uppercase());
                let server: Box<dyn BrokerServer> = if self.c.nats_cluster {
                    let naming = outbox_nats::Naming::new(self.tag.as_str(), prefix.as_str())?;
                    let stream = naming.stream(Tick::TOPICS[0]);
                    Box::new(NatsCluster::start(&self.dir, &prefix, &stream)?)
                } else {
                    Box::new(NatsServer::start(&self.dir, &prefix)?)
                };
                (server, prefix, Some(self.tag.clone()))
            }
        };
        let broker_url = self.redis.insert(server).url();
        Ok(Common {
            broker_url,
            prefix,
            subject_prefix,
        })
    }

    /// `--cdc`: `outbox migrate --cdc` on the run's database (PostgreSQL: the
    /// publication and the slot; MariaDB: the `outbox_cdc` tables and the binlog
    /// position to start from), as an operator sets the CDC relay up.
    fn migrate_cdc(&mut self) -> Result<(), BoxError> {
        let url = self.db().harness_url("chaos-setup");
        let out = std::process::Command::new(&self.c.outbox_bin)
            .args(["--database-url", &url, "migrate", "--cdc"])
            .output()?;
        if !out.status.success() {
            return Err(format!(
                "outbox migrate --cdc failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        Ok(())
    }

    /// Adds (not yet started) a relay or a consumer process with a database user and a
    /// probe port of its own.
    fn add_proc(&mut self, name: String, role: Role, common: &Common) -> Result<(), BoxError> {
        let admin_port = free_port()?;
        let database_url = self.db().url_for(&name)?;
        if role == Role::Relay && self.c.cdc && self.c.backend == Backend::Mysql {
            self.db().grant_binlog_reader(&name)?;
        }
        let (program, args) = match role {
            Role::Relay => (
                self.c.outbox_bin.clone(),
                self.relay_args(database_url, common, admin_port),
            ),
            Role::Consumer => (
                self.c.consumer_bin.clone(),
                self.consumer_args(database_url, common, admin_port),
            ),
        };
        let log = self.dir.join(format!("{name}.log"));
        self.procs
            .push(Proc::new(name, role, program, args, log, admin_port));
        Ok(())
    }

    /// `outbox relay`'s command line.
    fn relay_args(&self, database_url: String, common: &Common, admin_port: u16) -> Vec<OsString> {
        let c = self.c;
        let mut args: Vec<OsString> = vec![
            "relay".into(),
            "--database-url".into(),
            database_url.into(),
            "--broker".into(),
            common.broker_url.clone().into(),
            "--stream-prefix".into(),
            common.prefix.clone().into(),
            "--admin-addr".into(),
            format!("127.0.0.1:{admin_port}").into(),
        ];
        if let Some(subjects) = &common.subject_prefix {
            args.extend(["--subject-prefix".into(), subjects.into()]);
        }
        if c.nats_cluster {
            args.extend(["--replicas".into(), "3".into()]);
        }
        if c.partitions > 1 {
            let partitions = format!("{}={}", Tick::TOPICS[0], c.partitions);
            args.extend(["--partitions".into(), partitions.into()]);
        }
        if c.cdc {
            args.push("--cdc".into());
        }
        args
    }

    /// `chaos_consumer`'s command line.
    fn consumer_args(
        &self,
        database_url: String,
        common: &Common,
        admin_port: u16,
    ) -> Vec<OsString> {
        let c = self.c;
        let mut args: Vec<OsString> = vec![
            "--admin-addr".into(),
            format!("127.0.0.1:{admin_port}").into(),
            "--backend".into(),
            c.backend.name().into(),
            "--database-url".into(),
            database_url.into(),
            match c.broker {
                Broker::Redis => "--redis-url".into(),
                Broker::Nats => "--nats-url".into(),
            },
            common.broker_url.clone().into(),
            "--stream-prefix".into(),
            common.prefix.clone().into(),
            "--group".into(),
            GROUP.into(),
            "--fault-one-in".into(),
            c.fault_one_in.to_string().into(),
            "--partitions".into(),
            c.partitions.to_string().into(),
        ];
        if let Some(subjects) = &common.subject_prefix {
            args.extend(["--subject-prefix".into(), subjects.into()]);
        }
        if c.nats_cluster {
            args.extend(["--replicas".into(), "3".into()]);
        }
        if c.ordered {
            args.push("--ordered".into());
        }
        if c.async_inbox {
            args.push("--async-inbox".into());
        }
        if let Some(n) = c.batch {
            args.extend(["--batch-size".into(), n.to_string().into()]);
        }
        args
    }

    /// Starts the producer threads and, with [`World::hold_open`], the transaction held
    /// open past its partition's end plus the retention, and a few maintenance runs
    /// after that.
    pub(crate) fn start_producers(&mut self) -> Producers {
        let c = self.c;
        let settings = producer::Settings {
            backend: c.backend,
            url: self.db().harness_url("chaos-producer"),
            seed: c.seed,
            events: c.events,
            keys: c.keys,
            within: c.duration,
        };
        let hold = self.hold_open.then(|| {
            let hold =
                db::PARTITION_RETENTION + 2 * db::PARTITION_INTERVAL + Duration::from_secs(5);
            (key_name(c.keys), hold)
        });
        Producers::start(&settings, c.producers, hold)
    }

    /// Polls every process once (restarting those due if `restart`), tallying what
    /// happened to them.
    pub(crate) fn poll_all(&mut self, now: Instant, restart: bool) -> Result<(), BoxError> {
        for p in &mut self.procs {
            if let Some(e) = p.poll(now, restart)? {
                self.tally.event(e);
            }
        }
        Ok(())
    }

    /// Waits until every committed message is applied and no outbox row is NEW; returns
    /// when, or `None` after `--drain-timeout`.
    pub(crate) fn drain(&mut self) -> Result<Option<Instant>, BoxError> {
        let started = Instant::now();
        let mut last_report = started;
        loop {
            interrupted()?;
            let now = Instant::now();
            self.poll_all(now, true)?;
            let partitioned = self.c.partitioned;
            let db = self.db();
            if partitioned {
                db.sample_partitions(false)?;
            }
            let (committed, applied, new) = db.progress()?;
            // The CDC relay leaves its rows NEW: every message applied is the end.
            let new = if self.c.cdc { 0 } else { new };
            if applied >= committed && new == 0 {
                return Ok(Some(now));
            }
            if now.duration_since(started) > self.c.drain_timeout {
                eprintln!(
                    "chaos: not drained after {:?}: {applied} of {committed} applied, {new} NEW",
                    self.c.drain_timeout
                );
                return Ok(None);
            }
            if now.duration_since(last_report) > Duration::from_secs(10) {
                eprintln!("chaos: draining: {applied} of {committed} applied, {new} NEW");
                last_report = now;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The consumer processes that do not read: each one's consumer (named
    /// `<host>-<pid>-<random>` by default) must issue an `XREADGROUP` within 10 s (its
    /// blocking read lasts 2 s).
    pub(crate) fn stuck_consumers(&self) -> Result<Vec<String>, BoxError> {
        let redis = self.redis.as_deref().expect("started");
        let readers = redis.readers(Duration::from_secs(10))?;
        Ok(self
            .procs
            .iter()
            .filter(|p| p.role == Role::Consumer)
            .filter_map(|p| {
                let pid = format!("-{}-", p.pid()?);
                (!readers.iter().any(|name| name.contains(&pid))).then(|| p.name.clone())
            })
            .collect())
    }

    /// Stops every process with SIGTERM (each must exit with 0); how many were running.
    pub(crate) fn terminate_all(&mut self) -> Result<u64, BoxError> {
        let mut terms = 0;
        for p in &mut self.procs {
            if let Some(e) = p.terminate_and_wait()? {
                terms += 1;
                self.tally.event(e);
            }
        }
        Ok(terms)
    }
}

/// What every relay and consumer of the run is given alike.
struct Common {
    broker_url: String,
    prefix: String,
    /// NATS: the subject prefix.
    subject_prefix: Option<String>,
}

/// A loopback port that was free a moment ago.
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
