//! The command line, as clap parses it.

use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use outbox_core::{InvalidConfig, Partitions};
use outbox_redis::PublisherConfig;

use crate::backend::BackendKind;

const AFTER_HELP: &str = "\
The database is chosen by the URL scheme: postgres:// or postgresql:// (PostgreSQL),
mysql:// (MySQL / MariaDB), sqlite://PATH, sqlite:PATH or a file path ending in .db or
.sqlite (SQLite). Durations are written like 30s, 5m, 7d or \"1h 30m\".

Logs go to stderr; set RUST_LOG (e.g. RUST_LOG=outbox_core=debug) to change the level.
Exit codes: 0 success, 1 failure, 2 usage error.";

const RELAY_HELP: &str = "\
SIGINT or SIGTERM stops the relay after the batch in hand; it then exits with 0. Any
number of relays may run on PostgreSQL and MySQL; SQLite allows one per database file.
Broker and database outages pause the relay without spending any message's attempts.

A topic given --partitions TOPIC=N is published to N streams, <PREFIX><TOPIC>:<p>, each
message to the partition of its ordering key; give every relay the same counts. The
relay records them in <PREFIX>partitions: consumers compare their own counts with them
and warn when they differ, and `outbox streams` shows them.

The broker URL names the topology: redis:// or rediss:// one server,
redis+cluster://HOST:PORT,HOST:PORT a Redis Cluster (streams are hash-tagged:
<PREFIX>{<TOPIC>}), redis+sentinel://HOST:PORT,HOST:PORT/MASTER the primary that Redis
Sentinel names, followed through failovers. --durability replicas=1 keeps a row NEW
until a replica has its entry, so that a failover loses nothing the relay marked SENT.
nats://HOST:PORT[,HOST:PORT] is NATS JetStream: a stream per topic (<PREFIX><TOPIC>,
created with --replicas, --duplicate-window and --max-age, or checked), each message with
Nats-Msg-Id = its msg_id; a row is marked SENT once the server acknowledged it.

Examples:
  outbox relay --broker redis://127.0.0.1:6379 --admin-addr 127.0.0.1:9464
  outbox relay --broker redis://127.0.0.1:6379 --partitions order.paid=8
  outbox relay --broker redis+cluster://10.0.0.1:7000,10.0.0.2:7000
  outbox relay --broker redis+sentinel://:PASS@10.0.0.1:26379,10.0.0.2:26379/mymaster \\
      --durability replicas=1,timeout=500ms
  outbox relay --broker nats://10.0.0.1:4222,10.0.0.2:4222 --replicas 3";

const TRIM_HELP: &str = "\
Only entries every consumer group has acknowledged are removed: an entry still pending
for some group, or not yet read by some group, stays. Streams without a consumer group
are left alone, and dead-letter streams are skipped (the consumer bounds those). Safe to
run at any time, e.g. from cron; does not need --database-url.

On a Redis Cluster (--broker redis+cluster://…) every primary's streams are trimmed.
On NATS (nats://…) trim is refused: JetStream removes messages itself by the stream's
retention (max_age, `outbox relay --max-age`); see docs/nats.md.

Example:
  outbox trim --broker redis://127.0.0.1:6379 --stream-prefix outbox:";

const STREAMS_HELP: &str = "\
For each topic under the prefix: the partition count publishers recorded, then each of
its streams (one, or one per partition) with its length and dead letters, and per
consumer group the entries pending and not yet delivered (lag, Redis 7+) and, on
partition streams, the consumer holding the partition's lease and for how long. Keys
that are not streams (leases, the hash of partition counts) are never listed.

On a Redis Cluster (--broker redis+cluster://…) the streams of every primary are listed.
On NATS (--broker nats://…) each JetStream stream under the prefix is a topic (all its
partitions' subjects in one stream): its messages, and per durable consumer (a group)
the messages delivered and not acknowledged (pending) and not delivered yet (lag); the
dead letters are the stream <PREFIX>DEAD.

Example:
  outbox streams --broker redis+cluster://10.0.0.1:7000,10.0.0.2:7000 --json";

const PARTITIONS_HELP: &str = "\
Relays keep the partitions by themselves; `maintain` is for cron or for a setup whose
relays are stopped. Expired partitions are detached and dropped whole, never emptied by
DELETE; one that still holds NEW or DEAD rows is kept and reported until they are sent,
re-driven or purged. Exits 1 when a step failed (tried again at the next run).

Examples:
  outbox migrate --partitioned --partition-interval 1d --retention 7d
  outbox partitions maintain
  outbox partitions list --json";

const DEAD_HELP: &str = "\
Examples:
  outbox dead list --limit 20
  outbox dead show order-42:OrderPaid
  outbox dead redrive 17 order-43:OrderPaid
  outbox dead purge --all";

/// Most connections `outbox relay --pool-size` takes: a relay works one batch at a time
/// (claims on one connection, completes on it), so a few are plenty.
const MAX_POOL_SIZE: i64 = 64;

/// Operate a transactional outbox: create its tables, run the relay that publishes
/// committed messages to Redis Streams, watch the backlog, handle dead letters and purge
/// old rows.
#[derive(Debug, Parser)]
#[command(name = "outbox", version, about, long_about = None, after_help = AFTER_HELP)]
pub(crate) struct Cli {
    /// Database URL: postgres://…, mysql://…, sqlite://PATH or a .db/.sqlite file.
    #[arg(
        long,
        env = "DATABASE_URL",
        global = true,
        hide_env_values = true,
        value_name = "URL"
    )]
    pub(crate) database_url: Option<String>,

    /// What to do.
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Create the outbox tables and indexes if they are missing (safe to run again).
    Migrate(MigrateArgs),
    /// Show the backlog: due NEW messages, the age of the oldest one, DEAD messages.
    Status(StatusArgs),
    /// Publish committed messages to Redis Streams or NATS JetStream until SIGINT or
    /// SIGTERM.
    #[command(after_help = RELAY_HELP)]
    Relay(Box<RelayArgs>),
    /// List, inspect, re-drive and purge dead letters (DEAD messages).
    #[command(subcommand, after_help = DEAD_HELP)]
    Dead(DeadCommand),
    /// Delete published messages and consumer dedup records past their retention.
    #[command(subcommand)]
    Purge(PurgeCommand),
    /// PostgreSQL's partitioned layout (`migrate --partitioned`): keep and list partitions.
    #[command(subcommand, after_help = PARTITIONS_HELP)]
    Partitions(PartitionsCommand),
    /// Remove the Redis stream entries every consumer group has acknowledged.
    #[command(after_help = TRIM_HELP)]
    Trim(TrimArgs),
    /// List the topics' streams and partitions: length, consumer groups, lease holders.
    #[command(after_help = STREAMS_HELP)]
    Streams(StreamsArgs),
    /// Serve the operator's web page and its JSON API: backlog, dead letters, consumer
    /// groups.
    #[cfg(feature = "serve")]
    #[command(after_help = SERVE_HELP)]
    Serve(ServeArgs),
}

#[cfg(feature = "serve")]
const SERVE_HELP: &str = "\
Binds 127.0.0.1:8080 by default. With a token (--token or OUTBOX_SERVE_TOKEN), every read
needs it too: the page asks for it once in a login form (then a session cookie), the API
takes `Authorization: Bearer <token>`; --public-reads opens the reads. Redrive and purge
(every POST) always need the token. Without one the page is read-only and open, and a
non-loopback --addr is refused. /healthz is open. The token is never logged.

With --broker, the consumers' dead letters and groups are shown too: on Redis its
dead-letter streams (<PREFIX>…:dead) and consumer groups, on NATS (nats://…) the
dead-letter stream <PREFIX>DEAD and each stream's durable consumers (lag: messages not yet
delivered; pending: delivered, not acknowledged).

Example:
  OUTBOX_SERVE_TOKEN=$(openssl rand -hex 16) outbox serve --broker redis://127.0.0.1:6379";

/// `outbox serve`.
#[cfg(feature = "serve")]
#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on. Anything but a loopback address needs --token.
    #[arg(long, default_value = "127.0.0.1:8080", value_name = "ADDR")]
    pub(crate) addr: std::net::SocketAddr,
    /// The secret every request must carry: reads (unless --public-reads) and the
    /// state-changing ones (redrive, purge). Without it the page is read-only.
    #[arg(
        long,
        env = "OUTBOX_SERVE_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub(crate) token: Option<String>,
    /// Serve the pages and the API's reads without the token, to anyone who reaches
    /// --addr: every dead letter's payload and headers, the topics and the groups.
    /// Redrive and purge still need the token.
    #[arg(long)]
    pub(crate) public_reads: bool,
    /// The broker, for the consumer groups and their dead-letter streams (left out
    /// without it).
    #[command(flatten)]
    pub(crate) broker: BrokerArg,
    /// Prefix of the outbox's stream names (as `outbox relay --stream-prefix`; default
    /// `outbox:` on Redis, `OUTBOX_` on NATS, whose dead letters are in the stream
    /// `<PREFIX>DEAD`).
    #[arg(long, value_name = "PREFIX")]
    pub(crate) stream_prefix: Option<String>,
    /// Redis: streams whose name ends with SUFFIX are consumer dead-letter streams.
    #[arg(long, default_value = ":dead", value_parser = clap::builder::NonEmptyStringValueParser::new(), value_name = "SUFFIX")]
    pub(crate) dead_letter_suffix: String,
    /// A host name the page may be reached by, besides the address it listens on and
    /// `localhost` (the name of a proxy in front of it, or its DNS name); repeatable.
    /// Requests naming any other host are refused (421), which keeps pages on other
    /// sites from reading it by DNS rebinding.
    #[arg(long = "allowed-host", value_name = "NAME")]
    pub(crate) allowed_hosts: Vec<String>,
}

impl Command {
    /// The relay and the server run until stopped; the other commands run once.
    pub(crate) fn is_long_running(&self) -> bool {
        match self {
            Self::Relay(_) => true,
            #[cfg(feature = "serve")]
            Self::Serve(_) => true,
            _ => false,
        }
    }
}

/// `outbox migrate`.
#[derive(Debug, Args)]
pub(crate) struct MigrateArgs {
    /// Print the SQL instead of running it (for review, or to copy into your own migrations).
    #[arg(long)]
    pub(crate) print: bool,
    /// With --print: the backend whose SQL to print, instead of the database URL's.
    #[arg(long, value_enum, requires = "print")]
    pub(crate) backend: Option<BackendKind>,
    /// With --print: print the SQL that drops the tables instead.
    #[arg(long, requires = "print")]
    pub(crate) down: bool,
    /// PostgreSQL: partition `outbox` and `consumed_msg` by time, converting existing
    /// tables (their rows become the first partition), and keep partitions ahead.
    #[arg(long)]
    pub(crate) partitioned: bool,
    /// With --partitioned: the time one partition covers.
    #[arg(long, default_value = "1d", value_parser = humantime::parse_duration, requires = "partitioned", value_name = "DURATION")]
    pub(crate) partition_interval: Duration,
    /// With --partitioned: partitions kept ready after the current one.
    #[arg(long, default_value_t = 7, requires = "partitioned", value_name = "N")]
    pub(crate) premake: u32,
    /// With --partitioned: how long a partition is kept after its range ends (the
    /// msg_id dedup window).
    #[arg(long, default_value = "7d", value_parser = humantime::parse_duration, requires = "partitioned", value_name = "DURATION")]
    pub(crate) retention: Duration,
    /// Also set up the CDC relay (`outbox relay --cdc`, docs/cdc.md). PostgreSQL: the
    /// publication of the outbox's inserts and the logical replication slot; needs
    /// `wal_level = logical` and a role with REPLICATION. MariaDB (mysql://): the
    /// `outbox_cdc` tables and the binlog position the relay starts from; needs MariaDB
    /// 10.5+ with log_bin, binlog_format = ROW, binlog_row_image = FULL,
    /// binlog_row_metadata = FULL and a user with REPLICATION SLAVE, BINLOG MONITOR and
    /// PROCESS (MySQL 8 is refused: its binlog is not read yet). SQLite: refused.
    /// Idempotent.
    #[arg(long)]
    pub(crate) cdc: bool,
    /// With --cdc, after the relay lost its place in the log (stop the CDC relays
    /// first). PostgreSQL: recreate a slot the server invalidated or lost. MariaDB: move
    /// the stored position, which a purge of the binlog removed (PositionLost), to the
    /// binlog's position now. Either way the messages committed since the old position
    /// are published from the table (some again: the consumers' inbox absorbs them).
    #[arg(long, requires = "cdc")]
    pub(crate) recover_slot: bool,
    /// Leave CDC mode for the polling relay (stop the CDC relays first): marks SENT what
    /// the CDC relay published and ends CDC mode (PostgreSQL: drops the slot and the
    /// publication; MariaDB: forgets the binlog position); the polling relays then
    /// publish the rest (docs/cdc.md, "Switching back").
    #[arg(long, conflicts_with_all = ["cdc", "print"])]
    pub(crate) to_polling: bool,
}

/// `outbox partitions`.
#[derive(Debug, Subcommand)]
pub(crate) enum PartitionsCommand {
    /// Create the partitions ahead and drop expired ones (what the relay does by itself).
    Maintain,
    /// List the partitions of `outbox` and `consumed_msg` with their ranges.
    List(PartitionsListArgs),
}

/// `outbox partitions list`.
#[derive(Debug, Args)]
pub(crate) struct PartitionsListArgs {
    /// Print JSON: [{"table": .., "name": .., "from": .. or null, "to": .. or null}].
    #[arg(long)]
    pub(crate) json: bool,
}

/// `outbox status`.
#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// Print JSON: {"due": N, "oldest_due_age_seconds": S or null, "dead": N}.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `outbox relay`.
#[derive(Debug, Args)]
pub(crate) struct RelayArgs {
    /// The broker.
    #[command(flatten)]
    pub(crate) broker: BrokerArg,
    /// Messages claimed and published per round trip.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..), value_name = "N")]
    pub(crate) batch_size: u32,
    /// Longest wait for new messages while idle (PostgreSQL wakes the relay at commit).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub(crate) poll_interval: Duration,
    /// How long the batch in hand may take to finish after SIGINT or SIGTERM; past it
    /// the batch is released (its rows stay NEW for the next relay) and the relay exits
    /// 0. The default fits inside Kubernetes's 30 s grace period.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub(crate) shutdown_timeout: Duration,
    /// How long a relay that stops answering (paused, cut off) may hold its claimed rows
    /// before the database ends its transaction and another relay takes them over
    /// (PostgreSQL and MariaDB; `0s` leaves the server's settings).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub(crate) stall_timeout: Duration,
    /// Failed attempts after which a message is dead-lettered (outages never count).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..), value_name = "N")]
    pub(crate) max_attempts: u32,
    /// Prefix of stream names: topic `order.paid` goes to `<PREFIX>order.paid` on Redis
    /// (default `outbox:`), to the stream `<PREFIX>order_paid` on NATS (default
    /// `OUTBOX_`).
    #[arg(long, value_name = "PREFIX")]
    pub(crate) stream_prefix: Option<String>,
    /// NATS: prefix of the subjects: topic `order.paid` is published on
    /// `<PREFIX>.order.paid` (`<PREFIX>.order.paid.p<n>` when partitioned). Default
    /// `outbox`.
    #[arg(long, value_name = "PREFIX")]
    pub(crate) subject_prefix: Option<String>,
    /// NATS: copies of each message in the streams the relay creates, 1 to 5 (3 on a
    /// cluster: a publish is acknowledged once a majority stored it). An existing stream
    /// with another count is refused, not changed. Default 1.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=5), value_name = "N")]
    pub(crate) replicas: Option<u8>,
    /// NATS: how long the server remembers a msg_id, dropping a copy the relay
    /// publishes again within it (after a crash before the SENT mark). Cover the
    /// relay's longest stop between a publish and its mark. Default 2m.
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub(crate) duplicate_window: Option<Duration>,
    /// NATS: how long a stream the relay creates keeps a message (`0s`: for ever); the
    /// stream's own retention is what removes messages on NATS (`outbox trim` does not
    /// apply). An existing stream with another age is refused, not changed. Default 7d.
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub(crate) max_age: Option<Duration>,
    /// Spread TOPIC over N partition streams `<PREFIX><TOPIC>:<p>` by ordering key, N from
    /// 1 to 1024. Repeat for each partitioned topic; every relay needs the same counts.
    #[arg(long = "partitions", value_parser = parse_partitions, value_name = "TOPIC=N")]
    pub(crate) partitions: Vec<TopicPartitions>,
    /// Approximate cap on each stream's length (XADD MAXLEN ~ N); a safety bound only.
    /// From 1 (0 would trim every message away before consumers read it) to 2^63 - 1
    /// (Redis's limit: a larger one made every XADD fail).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=i64::MAX as u64), value_name = "N")]
    pub(crate) max_stream_len: Option<u64>,
    /// What a message must reach before its row is marked SENT: `reply` (the primary
    /// answered the XADD), `replicas=N[,timeout=T]` (WAIT: N replicas have it) or
    /// `aof=local|N|local+N[,timeout=T]` (WAITAOF, Redis 7.2+: fsynced to the primary's
    /// AOF, to N replicas' AOF, or both). T defaults to 1s and must stay under 5s. A wait
    /// not met in time is an outage: the rows stay NEW and spend no attempt.
    #[arg(long, default_value = "reply", value_parser = crate::broker::parse_durability, value_name = "DURABILITY")]
    pub(crate) durability: outbox_redis::Durability,
    /// Claim order: `per-key` publishes the messages of one ordering key in id order, also
    /// across retries and with several relays; `unordered` claims with plain SKIP LOCKED,
    /// faster, for consumers that do not need order.
    #[arg(long, value_enum, default_value_t = Order::PerKey, value_name = "ORDER")]
    pub(crate) order: Order,
    /// Database connections in the relay's pool, 1 to 64 (the pool opens them all at
    /// start).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=MAX_POOL_SIZE), value_name = "N")]
    pub(crate) pool_size: u32,
    /// Run `outbox migrate` before starting.
    #[arg(long)]
    pub(crate) migrate: bool,
    /// Relay from the database's log instead of polling the table: commit order, no
    /// UPDATE per message. PostgreSQL: logical decoding through a slot; MariaDB
    /// (mysql://): the binlog, as a replica (MySQL 8 is refused); SQLite: refused. Set
    /// it up first with `outbox migrate --cdc`, or with --migrate (docs/cdc.md). Relays
    /// of one database share its slot (MariaDB: a named lock), one reading at a time;
    /// the others wait and take over. --order and --poll-interval do
    /// not apply (the log is in commit order and pushes new commits).
    #[arg(long)]
    pub(crate) cdc: bool,
    /// Serve, at http://ADDR: /metrics (Prometheus: backlog, published, failures, batch
    /// timings), /healthz (200 when the database and Redis answer, else 503 naming the
    /// one down) and /readyz (200 while the oldest due message is younger than
    /// --ready-max-age, else 503).
    #[cfg(feature = "admin")]
    #[arg(long, value_name = "ADDR")]
    pub(crate) admin_addr: Option<std::net::SocketAddr>,
    /// /readyz answers 503 once the oldest due message is older than this: the relay is
    /// not keeping up (or cannot publish).
    #[cfg(feature = "admin")]
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub(crate) ready_max_age: std::time::Duration,
}

/// `--broker` (alias `--redis-url`), shared by every command that reaches the broker.
#[derive(Debug, Args)]
pub(crate) struct BrokerArg {
    /// Broker URL: redis://HOST:PORT[/DB] or rediss://… (one Redis),
    /// redis+cluster://HOST:PORT,HOST:PORT… (a Redis Cluster, through these seed nodes),
    /// redis+sentinel://HOST:PORT,HOST:PORT…/MASTER[/DB] (the primary these sentinels
    /// monitor as MASTER), nats://HOST:PORT,HOST:PORT… or nats+tls://… (NATS JetStream:
    /// `outbox relay` and `outbox streams`). Credentials go before the hosts
    /// (`redis://:PASS@HOST`, `nats://USER:PASS@HOST`); they are the data nodes'.
    /// `--redis-url` is the old name; without either, OUTBOX_BROKER, else REDIS_URL.
    #[arg(
        long = "broker",
        alias = "redis-url",
        env = "OUTBOX_BROKER",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub(crate) url: Option<String>,
}

impl BrokerArg {
    /// The URL given: `--broker` or `--redis-url`, else `OUTBOX_BROKER`, else
    /// `REDIS_URL` (read here, not by clap, so that `REDIS_URL` left in an environment
    /// never conflicts with a `--broker` given on the command line).
    pub(crate) fn given(&self) -> Option<String> {
        self.url.clone().or_else(|| {
            std::env::var("REDIS_URL")
                .ok()
                .filter(|url| !url.is_empty())
        })
    }
}

/// `outbox trim`.
#[derive(Debug, Args)]
pub(crate) struct TrimArgs {
    /// The broker.
    #[command(flatten)]
    pub(crate) broker: BrokerArg,
    /// Trim every stream whose name starts with PREFIX (as `outbox relay --stream-prefix`).
    #[arg(long, default_value = outbox_redis::DEFAULT_STREAM_PREFIX, value_name = "PREFIX")]
    pub(crate) stream_prefix: String,
    /// Streams whose name ends with SUFFIX are dead-letter streams, and are skipped.
    #[arg(long, default_value = ":dead", value_parser = clap::builder::NonEmptyStringValueParser::new(), value_name = "SUFFIX")]
    pub(crate) dead_letter_suffix: String,
    /// Print a JSON array: [{"stream": S, "removed": N, "min_id": ID or null}, …].
    #[arg(long)]
    pub(crate) json: bool,
}

/// `outbox streams`.
#[derive(Debug, Args)]
pub(crate) struct StreamsArgs {
    /// The broker.
    #[command(flatten)]
    pub(crate) broker: BrokerArg,
    /// List the streams whose name starts with PREFIX (as `outbox relay --stream-prefix`;
    /// default `outbox:` on Redis, `OUTBOX_` on NATS).
    #[arg(long, value_name = "PREFIX")]
    pub(crate) stream_prefix: Option<String>,
    /// Streams whose name ends with SUFFIX are dead-letter streams, counted with the
    /// stream they came from.
    #[arg(long, default_value = ":dead", value_parser = clap::builder::NonEmptyStringValueParser::new(), value_name = "SUFFIX")]
    pub(crate) dead_letter_suffix: String,
    /// Print a JSON array of topics: [{"topic": T, "recorded_partitions": N or null,
    /// "streams": [{"stream": S, "partition": P or null, "length": N, "dead_letters": N,
    /// "groups": [{"group": G, "pending": N, "lag": N or null, "consumers": N,
    /// "lease": {"holder": C, "epoch": E or null, "ttl_ms": MS or null} or null}]}]}].
    #[arg(long)]
    pub(crate) json: bool,
}

/// One `--partitions TOPIC=N` of `outbox relay`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TopicPartitions {
    /// The topic.
    pub(crate) topic: String,
    /// Its partition count.
    pub(crate) partitions: Partitions,
}

/// Why a `--partitions` value is refused (clap prints it after the value).
#[derive(Debug, thiserror::Error)]
pub(crate) enum PartitionsArgError {
    /// No `=` between the topic and the count.
    #[error("expected TOPIC=N, e.g. order.paid=8")]
    MissingEquals,
    /// The count is not a whole number.
    #[error("`{0}` is not a partition count: expected a whole number from 1 to 1024")]
    NotANumber(String),
    /// The count is out of range, or the topic is not a topic name.
    #[error(transparent)]
    Invalid(#[from] InvalidConfig),
}

/// Parses `TOPIC=N`: N from 1 to 1024, TOPIC a topic name as the publisher checks it.
fn parse_partitions(value: &str) -> Result<TopicPartitions, PartitionsArgError> {
    let (topic, count) = value
        .split_once('=')
        .ok_or(PartitionsArgError::MissingEquals)?;
    let count: u32 = count
        .trim()
        .parse()
        .map_err(|_| PartitionsArgError::NotANumber(count.to_owned()))?;
    let partitions = Partitions::new(count)?;
    PublisherConfig::default()
        .with_partitions(topic, partitions)
        .validate()?;
    Ok(TopicPartitions {
        topic: topic.to_owned(),
        partitions,
    })
}

/// The relay's claim order (`outbox relay --order`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Order {
    /// Messages that share an ordering key are published in id order.
    PerKey,
    /// No order between messages; faster claims.
    Unordered,
}

impl From<Order> for outbox_diesel::ClaimOrder {
    fn from(order: Order) -> Self {
        match order {
            Order::PerKey => Self::PerKey,
            Order::Unordered => Self::Unordered,
        }
    }
}

/// `outbox dead …`.
#[derive(Debug, Subcommand)]
pub(crate) enum DeadCommand {
    /// List DEAD messages in id order.
    List(DeadListArgs),
    /// Show one message (any status) with its error, headers and payload.
    Show(DeadShowArgs),
    /// Put DEAD messages back to NEW with their retries reset, due now.
    Redrive(Selection),
    /// Delete DEAD messages.
    Purge(Selection),
}

/// `outbox dead list`.
#[derive(Debug, Args)]
pub(crate) struct DeadListArgs {
    /// At most this many messages.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..), value_name = "N")]
    pub(crate) limit: u32,
    /// Only messages with a row id above this one (to page: the last id shown).
    #[arg(long, default_value_t = 0, value_name = "ID")]
    pub(crate) after: i64,
    /// Print a JSON array of messages.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `outbox dead show`.
#[derive(Debug, Args)]
pub(crate) struct DeadShowArgs {
    /// The message's row id or msg_id.
    #[arg(value_name = "ID|MSG_ID")]
    pub(crate) target: String,
    /// Print JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

/// Which DEAD messages a re-drive or purge acts on: listed ones, or all.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub(crate) struct Selection {
    /// Row ids or msg_ids. Messages that are not DEAD are left alone (with a warning).
    #[arg(value_name = "ID|MSG_ID")]
    pub(crate) targets: Vec<String>,
    /// Every DEAD message.
    #[arg(long)]
    pub(crate) all: bool,
}

/// `outbox purge …`.
#[derive(Debug, Subcommand)]
pub(crate) enum PurgeCommand {
    /// Delete SENT messages published longer ago than --older-than (NEW and DEAD are kept).
    Sent(PurgeArgs),
    /// Delete consumer dedup records (consumed_msg) older than --older-than. Choose it
    /// well beyond the broker's redelivery horizon.
    Consumed(PurgeArgs),
}

/// Retention and batch size of a purge.
#[derive(Debug, Args)]
pub(crate) struct PurgeArgs {
    /// Retention, e.g. 7d or 36h.
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub(crate) older_than: Duration,
    /// Rows deleted per statement; each batch commits on its own, so locks stay short.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..), value_name = "N")]
    pub(crate) batch_size: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn selection_needs_ids_or_all_but_not_both() {
        let parse =
            |args: &[&str]| Cli::try_parse_from(["outbox", "dead", "redrive"].iter().chain(args));
        assert!(parse(&[]).is_err());
        assert!(parse(&["1", "--all"]).is_err());
        assert!(parse(&["1", "a:B"]).is_ok());
        assert!(parse(&["--all"]).is_ok());
    }

    #[test]
    fn trim_defaults_the_prefix_and_the_dead_letter_suffix() {
        let cli = Cli::try_parse_from(["outbox", "trim", "--redis-url", "redis://h"]).unwrap();
        let Command::Trim(args) = cli.command else {
            panic!("parsed as {:?}", cli.command);
        };
        assert_eq!(args.stream_prefix, "outbox:");
        assert_eq!(args.dead_letter_suffix, ":dead");
        assert!(!args.json);
    }

    #[test]
    fn partitions_are_topic_equals_count() {
        let parsed = parse_partitions("order.paid=8").unwrap();
        assert_eq!(parsed.topic, "order.paid");
        assert_eq!(parsed.partitions.get(), 8);
        let refused = |value: &str| parse_partitions(value).unwrap_err().to_string();
        assert_eq!(refused("order.paid"), "expected TOPIC=N, e.g. order.paid=8");
        assert!(refused("order.paid=abc").starts_with("`abc` is not a partition count"));
        assert!(refused("order.paid=-1").starts_with("`-1` is not a partition count"));
        assert!(refused("order.paid=0").contains("partitions must be between 1 and 1024; got 0"));
        assert!(refused("order.paid=1025").contains("got 1025"));
        assert!(refused("=8").contains("topic \"\""));
        assert!(refused("order:paid=8").contains("topic \"order:paid\""));
        let cli = Cli::try_parse_from([
            "outbox",
            "relay",
            "--redis-url",
            "redis://h",
            "--partitions",
            "a=2",
            "--partitions",
            "b=4",
        ])
        .unwrap();
        let Command::Relay(args) = cli.command else {
            panic!("parsed as {:?}", cli.command);
        };
        let topics: Vec<_> = args.partitions.iter().map(|p| p.topic.as_str()).collect();
        assert_eq!(topics, ["a", "b"]);
    }

    #[test]
    fn durations_are_human() {
        let cli = Cli::try_parse_from(["outbox", "purge", "sent", "--older-than", "7d"]).unwrap();
        let Command::Purge(PurgeCommand::Sent(args)) = cli.command else {
            panic!("parsed as {:?}", cli.command);
        };
        assert_eq!(args.older_than, Duration::from_secs(7 * 86_400));
        assert!(Cli::try_parse_from(["outbox", "purge", "sent", "--older-than", "7x"]).is_err());
    }
}
