//! The command line (`Args`) and the settings it comes to after `--ci` and the defaults
//! (`Config`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::BoxError;

/// The chaos run (see the file's documentation).
#[derive(Debug, Parser)]
#[command(name = "chaos")]
pub(crate) struct Args {
    /// Seeds every random choice: fault times, kinds, targets, durations, the
    /// producers' transactions.
    #[arg(long)]
    seed: u64,
    /// The short CI version: 2000 events, 60 s, 5 faults of each process kind, 2 Redis
    /// outages (options given explicitly still win).
    #[arg(long)]
    ci: bool,
    /// Events to commit (default 5000).
    #[arg(long)]
    events: Option<u64>,
    /// How long faults are injected (default 120s); the producers spread the events over
    /// it.
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// The database.
    #[arg(long, value_enum, default_value_t = Backend::Postgres)]
    backend: Backend,
    /// Faults of each process kind: SIGKILL, SIGTERM, SIGSTOP, CLIENT KILL, session
    /// kill (default 10).
    #[arg(long)]
    faults_per_kind: Option<usize>,
    /// Redis outages of 1–20 s (default: as many as fit in 60% of the duration, at most
    /// `--faults-per-kind`).
    #[arg(long)]
    redis_outages: Option<usize>,
    /// About one message in N fails, and another one in N panics, on its first delivery
    /// (default: events / (1.5 × faults per kind)).
    #[arg(long)]
    handler_fault_one_in: Option<u64>,
    /// Relay processes.
    #[arg(long, default_value_t = 2)]
    relays: usize,
    /// Consumer processes.
    #[arg(long, default_value_t = 3)]
    consumers: usize,
    /// Producer threads.
    #[arg(long, default_value_t = 2)]
    producers: usize,
    /// Ordering keys.
    #[arg(long, default_value_t = 32)]
    keys: usize,
    /// Partitions of the topic: the relays publish to this many streams and the
    /// consumers read them all.
    #[arg(long, default_value_t = 1)]
    partitions: u32,
    /// Ordered consumers: each partition read by one consumer at a time, each key's
    /// messages applied in order; the run then also fails on any application out of
    /// sequence at the handler (`handler_order_breaks`).
    #[arg(long)]
    ordered: bool,
    /// Consumers on the async inbox (`AsyncPgInbox`, diesel-async) with an async handler,
    /// instead of the blocking inbox (PostgreSQL only).
    #[arg(long)]
    async_inbox: bool,
    /// The outbox tables on PostgreSQL partitioned by time (`migrate_partitioned`), with
    /// partitions of 5 s so that the relays make new ones all through the run, and drop
    /// them 90 s after their range ends; adds the `maint_kill` fault.
    #[arg(long)]
    partitioned: bool,
    /// Consumers in batch mode: up to N messages per transaction.
    #[arg(long)]
    batch: Option<usize>,
    /// Longest wait, after the last fault, for every committed message to be applied
    /// (default 300s; 100s with --ci).
    #[arg(long, value_parser = humantime::parse_duration)]
    drain_timeout: Option<Duration>,
    /// PostgreSQL server to create the run's database on.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    /// MariaDB / MySQL server to create the run's database on (`--backend mysql`).
    #[arg(
        long,
        env = "MYSQL_URL",
        default_value = "mysql://root@127.0.0.1:3306/test"
    )]
    mysql_url: String,
    /// The `outbox` binary (default: next to this one).
    #[arg(long)]
    outbox_bin: Option<PathBuf>,
    /// The `chaos_consumer` binary (default: next to this one); e.g. one built from an
    /// older commit, to see the run catch a defect.
    #[arg(long)]
    consumer_bin: Option<PathBuf>,
    /// Keep the database and the logs even when every check passes.
    #[arg(long)]
    keep: bool,
    /// The `db_restart` fault: the run's database on a private server of its own
    /// (PostgreSQL: `initdb`; MariaDB: `mariadb-install-db`), crashed once in the middle
    /// of the run (`pg_ctl -m immediate stop`; MariaDB SIGKILL) while producers, relays
    /// and consumers work, kept down for `--db-down`, then started again on the same
    /// files and port.
    #[arg(long)]
    db_restart: bool,
    /// How long the crashed server stays down (default 45s with --ci, else 45–60 s).
    #[arg(long, value_parser = humantime::parse_duration, requires = "db_restart")]
    db_down: Option<Duration>,
    /// The relays run `outbox relay --cdc` (outbox-cdc) on a private server of the
    /// run's own, set up with `outbox migrate --cdc`: on PostgreSQL logical decoding
    /// (`wal_level = logical`), one relay reads the slot, the others wait and take it
    /// over; on MariaDB (`--backend mysql`) the binlog in row format, one relay holds
    /// the readers' named lock (`GET_LOCK`) and reads the binlog, the others wait and
    /// take the lock over. A SIGSTOPped holder is taken over after 10 s.
    #[arg(long)]
    cdc: bool,
    /// The broker: `redis` (a private `redis-server`) or `nats` (a private
    /// `nats-server -js`: `outbox relay --broker nats://…`, the NATS consumer; its
    /// outages are the server SIGKILLed or SIGTERMed and started again on its store;
    /// no `client_kill`, which nats-server 2.9 cannot do; `--ordered` is the NATS
    /// consumer's ordered mode).
    #[arg(long, value_enum, default_value_t = Broker::Redis)]
    broker: Broker,
    /// With `--broker nats`: three private servers in one JetStream cluster, the stream
    /// with three replicas (`outbox relay --replicas 3`); each broker outage is the
    /// stream's leader SIGKILLed or SIGTERMed, started again after the outage.
    #[arg(long)]
    nats_cluster: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Broker {
    Redis,
    Nats,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Backend {
    Postgres,
    Mysql,
}

impl Backend {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::Mysql => "mysql",
        }
    }
}

/// The settings after `--ci` and the defaults.
pub(crate) struct Config {
    pub(crate) seed: u64,
    pub(crate) events: u64,
    pub(crate) duration: Duration,
    pub(crate) backend: Backend,
    pub(crate) faults_per_kind: usize,
    pub(crate) redis_outages: usize,
    pub(crate) fault_one_in: u64,
    pub(crate) relays: usize,
    pub(crate) consumers: usize,
    pub(crate) producers: usize,
    pub(crate) keys: usize,
    pub(crate) partitions: u32,
    pub(crate) ordered: bool,
    pub(crate) async_inbox: bool,
    pub(crate) partitioned: bool,
    pub(crate) batch: Option<usize>,
    pub(crate) drain_timeout: Duration,
    pub(crate) admin_url: String,
    pub(crate) outbox_bin: PathBuf,
    pub(crate) consumer_bin: PathBuf,
    pub(crate) keep: bool,
    /// `--db-restart`: how long the server stays down (`None`: random, 45–60 s).
    pub(crate) db_restart: Option<Option<Duration>>,
    /// `--cdc`: the CDC relay, on a private server with the log it reads.
    pub(crate) cdc: bool,
    /// `--broker`.
    pub(crate) broker: Broker,
    /// `--nats-cluster`.
    pub(crate) nats_cluster: bool,
}

impl Config {
    pub(crate) fn from_args(mut a: Args) -> Result<Self, BoxError> {
        let events = a.events.unwrap_or(if a.ci { 2000 } else { 5000 });
        let duration = a
            .duration
            // Partitions are dropped 90 s after they end: at CI size the partitioned run
            // lasts 150 s, so that the relays drop them under the faults.
            .unwrap_or(Duration::from_secs(match (a.ci, a.partitioned) {
                (true, false) => 60,
                (true, true) => 150,
                (false, _) => 120,
            }));
        let faults_per_kind = a.faults_per_kind.unwrap_or(if a.ci { 5 } else { 10 });
        // An outage lasts 10.5 s on average; keep Redis up 40% of the time.
        let fit = (duration.as_secs_f64() * 0.6 / 10.5) as usize;
        let redis_outages = a
            .redis_outages
            .unwrap_or(if a.ci { 2 } else { faults_per_kind.min(fit) })
            .max(1);
        let fault_one_in = a
            .handler_fault_one_in
            .unwrap_or_else(|| (events * 2 / (3 * faults_per_kind.max(1) as u64)).max(2));
        let (outbox_bin, consumer_bin) = binaries(a.outbox_bin.take(), a.consumer_bin.take())?;
        validate(&a, events)?;
        Ok(Self {
            seed: a.seed,
            events,
            duration,
            backend: a.backend,
            faults_per_kind,
            redis_outages,
            fault_one_in,
            relays: a.relays,
            consumers: a.consumers,
            producers: a.producers,
            keys: a.keys,
            partitions: a.partitions,
            ordered: a.ordered,
            async_inbox: a.async_inbox,
            partitioned: a.partitioned,
            batch: a.batch,
            drain_timeout: a.drain_timeout.unwrap_or(Duration::from_secs(if a.ci {
                100
            } else {
                300
            })),
            admin_url: match a.backend {
                Backend::Postgres => a.database_url,
                Backend::Mysql => a.mysql_url,
            },
            outbox_bin,
            consumer_bin,
            keep: a.keep,
            // The longest timeout or backoff in the code that a database outage meets is
            // the consumer's 40 s stall limit of its liveness (`ConsumerConfig`'s 30 s
            // `min_idle` plus 10 s): its `/healthz` must stay 200 through an outage
            // longer than that. Then come the relay's 30 s stall timeout, the r2d2 pool's
            // 30 s connection timeout of the consumer (10 s for the relay), the 10 s
            // connect timeout of the relay's LISTEN connection and the 5 s outage
            // backoff. 45 s at CI size is past all of them, as issue 28 asks.
            db_restart: a
                .db_restart
                .then_some(a.db_down.or(a.ci.then_some(Duration::from_secs(45)))),
            cdc: a.cdc,
            broker: a.broker,
            nats_cluster: a.nats_cluster,
        })
    }
}

/// The `outbox` and `chaos_consumer` binaries: those given, else the ones next to this
/// one; an error if one is missing.
fn binaries(
    outbox_bin: Option<PathBuf>,
    consumer_bin: Option<PathBuf>,
) -> Result<(PathBuf, PathBuf), BoxError> {
    let here = std::env::current_exe()?
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let outbox_bin = outbox_bin.unwrap_or_else(|| here.join("outbox"));
    let consumer_bin = consumer_bin.unwrap_or_else(|| here.join("chaos_consumer"));
    for bin in [&outbox_bin, &consumer_bin] {
        if !bin.is_file() {
            return Err(format!(
                "{} not found: build it with the same profile, e.g. \
                     `cargo build --release -p typed-outbox-cli -p outbox-harness --bins`",
                bin.display()
            )
            .into());
        }
    }
    Ok((outbox_bin, consumer_bin))
}

/// The combinations and counts the run cannot take.
fn validate(a: &Args, events: u64) -> Result<(), BoxError> {
    outbox_core::Partitions::new(a.partitions)?;
    if a.async_inbox && a.backend != Backend::Postgres {
        return Err("--async-inbox runs on PostgreSQL only (--backend postgres)".into());
    }
    if a.nats_cluster && a.broker != Broker::Nats {
        return Err("--nats-cluster needs --broker nats".into());
    }
    if a.partitioned && a.backend != Backend::Postgres {
        return Err("--partitioned runs on PostgreSQL only (--backend postgres)".into());
    }
    if a.batch == Some(0) || a.relays == 0 || a.consumers == 0 || a.keys == 0 || events == 0 {
        return Err(
            "--batch, --relays, --consumers, --keys and --events must be at least 1".into(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn validated(args: &[&str]) -> Result<(), BoxError> {
        let a = Args::try_parse_from([&["chaos", "--seed", "1"], args].concat())?;
        validate(&a, 1)
    }

    #[test]
    fn cdc_runs_on_both_backends() {
        validated(&["--cdc"]).expect("PostgreSQL");
        validated(&["--cdc", "--backend", "mysql"]).expect("MariaDB, the binlog relay");
        validated(&["--cdc", "--backend", "mysql", "--db-restart"]).expect("crashed");
    }

    #[test]
    fn postgres_only_options_stay_refused_on_mariadb() {
        for refused in [["--partitioned"], ["--async-inbox"]] {
            let args = [&["--cdc", "--backend", "mysql"][..], &refused[..]].concat();
            assert!(validated(&args).is_err(), "{args:?}");
        }
    }
}
