use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use outbox_core::{InvalidConfig, PublishOutcomes, Publisher, RejectKind, Rejected, StoredMessage};
use redis::{IntoConnectionInfo, RedisError, RedisResult, Value};

use crate::conn::{Conn, Connector, Target, by_slot, check_prefix, query_all, stream_name};
use crate::entry::entry_fields;
use crate::error::is_outage;
use crate::{Error, Result};

/// The default prefix of stream names: the stream of topic `order.paid` is
/// `outbox:order.paid` (`outbox:{order.paid}` on a Redis Cluster).
pub const DEFAULT_STREAM_PREFIX: &str = "outbox:";

/// The default cap on the bytes of one pipeline: 8 MiB (see
/// [`PublisherConfig::max_pipeline_bytes`]).
pub const DEFAULT_MAX_PIPELINE_BYTES: usize = 8 << 20;

/// When the relay may count a message as published, and so mark it SENT: what a
/// [`RedisPublisher`] waits for after its `XADD`s. See [`PublisherConfig::durability`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Durability {
    /// The `XADD` reply: the entry is in the primary's memory (default). It can be lost
    /// if the primary dies before its AOF is fsynced (`appendfsync everysec`, the usual
    /// setting, loses up to a second; no AOF loses everything since the last snapshot) or
    /// before an asynchronous replica that is then promoted has received it.
    #[default]
    Reply,
    /// After each pipeline, `WAIT replicas timeout`: the entries count as published only
    /// once `replicas` replicas have acknowledged them. Fewer within `timeout` is an
    /// outage: the messages stay NEW, spend no retry, and are published again later (a
    /// duplicate on the stream for each, which consumers skip by `msg_id`). This narrows,
    /// but does not close, the window of a failover losing an entry: Redis replication
    /// stays asynchronous, and an acknowledging replica may itself not have fsynced.
    Replicas {
        /// How many replicas must acknowledge (`WAIT`'s `numreplicas`).
        replicas: u32,
        /// How long to wait for them; more than zero and less than
        /// [`PublisherConfig::response_timeout`].
        timeout: Duration,
    },
    /// After each pipeline, `WAITAOF numlocal numreplicas timeout` (Redis 7.2 or later):
    /// the entries count as published only once they are fsynced to the primary's AOF
    /// (`local`) and to the AOF of `replicas` replicas. Not reached within `timeout` is an
    /// outage, as for [`Replicas`](Self::Replicas). A server without `WAITAOF` (before
    /// 7.2), or `local` on a server without `appendonly yes`, stops the relay with
    /// [`outbox_core::Error::Config`] before anything is written.
    Aof {
        /// Whether the primary must have fsynced its own AOF (`numlocal` 1).
        local: bool,
        /// How many replicas must have fsynced theirs (`numreplicas`).
        replicas: u32,
        /// How long to wait; more than zero and less than
        /// [`PublisherConfig::response_timeout`].
        timeout: Duration,
    },
}

impl Durability {
    /// The wait to append to a pipeline, and its timeout, unless this is [`Reply`](Self::Reply).
    fn command(&self) -> Option<(redis::Cmd, Duration)> {
        match *self {
            Self::Reply => None,
            Self::Replicas { replicas, timeout } => {
                let mut cmd = redis::cmd("WAIT");
                cmd.arg(replicas).arg(millis(timeout));
                Some((cmd, timeout))
            }
            Self::Aof {
                local,
                replicas,
                timeout,
            } => {
                let mut cmd = redis::cmd("WAITAOF");
                cmd.arg(u8::from(local)).arg(replicas).arg(millis(timeout));
                Some((cmd, timeout))
            }
        }
    }

    /// The same wait with nothing to wait for, answered at once: it checks that the
    /// server has the command and accepts its arguments, before anything is written.
    fn probe(&self) -> Option<redis::Cmd> {
        match *self {
            Self::Reply => None,
            Self::Replicas { .. } => {
                let mut cmd = redis::cmd("WAIT");
                cmd.arg(0).arg(1);
                Some(cmd)
            }
            Self::Aof { local, .. } => {
                let mut cmd = redis::cmd("WAITAOF");
                cmd.arg(u8::from(local)).arg(0).arg(1);
                Some(cmd)
            }
        }
    }

    /// `None` if `reply` (to [`command`](Self::command)) shows the wait was met, else why not.
    fn unmet(&self, reply: &Value) -> Option<String> {
        let int = |v: &Value| match v {
            Value::Int(n) => Some(*n),
            _ => None,
        };
        match *self {
            Self::Reply => None,
            Self::Replicas { replicas, timeout } => match int(reply) {
                Some(n) if n >= i64::from(replicas) => None,
                Some(n) => Some(format!(
                    "WAIT: {n} of {replicas} replicas acknowledged within {timeout:?}"
                )),
                None => Some(format!("WAIT: unexpected reply {reply:?}")),
            },
            Self::Aof {
                local,
                replicas,
                timeout,
            } => {
                let counts = match reply {
                    Value::Array(items) if items.len() == 2 => int(&items[0]).zip(int(&items[1])),
                    _ => None,
                };
                match counts {
                    Some((l, r)) if l >= i64::from(local) && r >= i64::from(replicas) => None,
                    Some((l, r)) => Some(format!(
                        "WAITAOF: fsynced locally {l} of {}, on {r} of {replicas} replicas \
                         within {timeout:?}",
                        u8::from(local)
                    )),
                    None => Some(format!("WAITAOF: unexpected reply {reply:?}")),
                }
            }
        }
    }

    fn timeout(&self) -> Option<Duration> {
        match *self {
            Self::Reply => None,
            Self::Replicas { timeout, .. } | Self::Aof { timeout, .. } => Some(timeout),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Self::Reply => "Reply",
            Self::Replicas { .. } => "WAIT",
            Self::Aof { .. } => "WAITAOF",
        }
    }
}

/// Whole milliseconds, at least 1 (`WAIT ... 0` would block without end).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// Publisher settings. `Default` gives the `outbox:` prefix, no trimming, a 2 s connect
/// timeout, a 5 s response timeout, pipelines of at most 8 MiB and
/// [`Durability::Reply`]. Each `with_*` setter changes one field and keeps the others;
/// [`RedisPublisher::with_config`] validates the whole.
///
/// ```
/// use outbox_redis::{PublisherConfig, RedisPublisher};
///
/// let publisher = RedisPublisher::new("redis://127.0.0.1:6379")?
///     .with_config(PublisherConfig::default().with_stream_prefix("app:").with_max_len(1_000_000))?;
/// assert_eq!(publisher.stream_for("order.paid"), "app:order.paid");
/// # Ok::<_, outbox_redis::Error>(())
/// ```
///
/// # What SENT means
///
/// With the default [`Durability::Reply`] a row is marked SENT when Redis has replied to
/// its `XADD`: the entry is in the primary's memory, not necessarily on disk or on a
/// replica. A Redis without `appendfsync always` (the default is `everysec`), or one
/// whose replicas are asynchronous (they always are) and one of which is promoted in a
/// failover, can lose an entry it acknowledged, and the row stays SENT: the message is
/// never published again. Choose [`Durability::Aof`] (Redis 7.2 or later, AOF on) or
/// [`Durability::Replicas`] to have the relay wait for the AOF fsync or for replicas
/// before it marks a row SENT, at the cost of that wait on every pipeline.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PublisherConfig {
    /// Prepended to the topic to name its stream (default [`DEFAULT_STREAM_PREFIX`]).
    /// Consumers must use the same prefix. On a cluster the topic is then wrapped in
    /// braces, as a hash tag (`outbox:{order.paid}`), and the prefix must not contain
    /// `{` or `}`.
    pub stream_prefix: String,
    /// Approximate cap on each stream's length, applied by every XADD as
    /// `MAXLEN ~ n` (default `None`: no trimming on publish).
    ///
    /// MAXLEN trims by count whether or not consumers have read the entries; prefer
    /// [`trim_acknowledged`](crate::trim_acknowledged), which never removes pending work,
    /// and keep this only as a safety bound well above any expected backlog. From 1 to
    /// `i64::MAX` (Redis's limit).
    pub max_len: Option<usize>,
    /// How long opening a connection may take (default 2 s).
    pub connect_timeout: Duration,
    /// How long one pipeline may wait for its replies (default 5 s), sending included.
    /// A timeout is an outage: what earlier pipelines of the batch published is
    /// recorded, the rest is published again later, and the next pipelines are made
    /// smaller (see [`max_pipeline_bytes`](Self::max_pipeline_bytes)). Set it above the
    /// time one of your largest messages takes to reach Redis: a message that cannot
    /// make it alone within the timeout stays an outage (logged, never dead-lettered).
    pub response_timeout: Duration,
    /// The most bytes of entries one pipeline carries (default
    /// [`DEFAULT_MAX_PIPELINE_BYTES`], 8 MiB); a larger batch is sent as several
    /// pipelines, one after the other, in order. A message larger than this still goes,
    /// in a pipeline of its own.
    ///
    /// This keeps a round trip well within [`response_timeout`](Self::response_timeout)
    /// (500 messages of 1 MiB in one pipeline would not be) and bounds the memory of a
    /// batch in flight. After a timeout the publisher halves its pipelines (down to one
    /// message each) and grows them back, up to this cap, after calls without one, so a
    /// slow link cannot make a batch time out on every attempt.
    pub max_pipeline_bytes: usize,
    /// What a row waits for before it is SENT (default [`Durability::Reply`]; see
    /// "What SENT means" above).
    pub durability: Durability,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            stream_prefix: DEFAULT_STREAM_PREFIX.to_owned(),
            max_len: None,
            connect_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(5),
            max_pipeline_bytes: DEFAULT_MAX_PIPELINE_BYTES,
            durability: Durability::Reply,
        }
    }
}

impl PublisherConfig {
    /// Sets [`stream_prefix`](Self::stream_prefix).
    #[must_use]
    pub fn with_stream_prefix(mut self, stream_prefix: impl Into<String>) -> Self {
        self.stream_prefix = stream_prefix.into();
        self
    }

    /// Sets [`max_len`](Self::max_len): a number, or `None` for no trimming on publish.
    #[must_use]
    pub fn with_max_len(mut self, max_len: impl Into<Option<usize>>) -> Self {
        self.max_len = max_len.into();
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout).
    #[must_use]
    pub fn with_connect_timeout(mut self, connect_timeout: Duration) -> Self {
        self.connect_timeout = connect_timeout;
        self
    }

    /// Sets [`response_timeout`](Self::response_timeout).
    #[must_use]
    pub fn with_response_timeout(mut self, response_timeout: Duration) -> Self {
        self.response_timeout = response_timeout;
        self
    }

    /// Sets [`max_pipeline_bytes`](Self::max_pipeline_bytes).
    #[must_use]
    pub fn with_max_pipeline_bytes(mut self, max_pipeline_bytes: usize) -> Self {
        self.max_pipeline_bytes = max_pipeline_bytes;
        self
    }

    /// Sets [`durability`](Self::durability).
    #[must_use]
    pub fn with_durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// Checks every field: `max_len` from 1 to `i64::MAX`, `max_pipeline_bytes` at
    /// least 1, a durability timeout more than zero and less than `response_timeout`.
    /// [`RedisPublisher::with_config`] calls it (and checks the prefix against the
    /// deployment: no braces on a cluster).
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        if self.max_len == Some(0) {
            return Err(InvalidConfig::new("max_len", "must be at least 1"));
        }
        // Redis reads MAXLEN as a signed 64-bit number: a larger one is refused by every
        // XADD, which would count against each message.
        if self.max_len.is_some_and(|n| i64::try_from(n).is_err()) {
            return Err(InvalidConfig::new(
                "max_len",
                format!("must be at most {}", i64::MAX),
            ));
        }
        if self.max_pipeline_bytes == 0 {
            return Err(InvalidConfig::new(
                "max_pipeline_bytes",
                "must be at least 1",
            ));
        }
        if let Some(timeout) = self.durability.timeout() {
            // Zero would make the server wait without end, and a wait as long as the
            // response timeout would turn every unmet wait into a broken connection.
            if timeout.is_zero() || timeout >= self.response_timeout {
                return Err(InvalidConfig::new(
                    "durability",
                    format!(
                        "timeout ({timeout:?}) must be more than zero and less than \
                         response_timeout ({:?})",
                        self.response_timeout
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Publishes outbox batches to Redis Streams: one stream per topic, pipelined `XADD`s.
/// Implements [`outbox_core::Publisher`], so it plugs into [`outbox_core::Relay`].
///
/// Each message becomes one entry (`XADD <prefix><topic> * ...`) with the fields listed
/// at [`ENTRY_FIELDS`](crate::ENTRY_FIELDS). A batch goes in one pipeline, or in several
/// in order when it holds more than
/// [`max_pipeline_bytes`](PublisherConfig::max_pipeline_bytes). A pipeline is not a
/// transaction: every command succeeds or fails on its own, and the relay gets one
/// result per message:
///
/// - taken: `Ok`, the row becomes SENT (after the [`Durability`] wait, if any);
/// - the server cannot take writes right now (`OOM`, `LOADING`, `READONLY`, `BUSY`,
///   `MASTERDOWN`, ..., a timeout, a lost connection, a durability wait not met):
///   [`Rejected::unavailable`] for that message and every later one of the batch, which
///   are not sent. They stay NEW without spending a retry, what was taken before is
///   SENT, and the relay backs off. A call in which nothing was taken fails as a whole,
///   as [`BrokerUnavailable`](outbox_core::Error::BrokerUnavailable);
/// - the stream itself refuses entries (`WRONGTYPE`: its key holds another type; or
///   its last possible id is used up): [`Rejected::topic`]; its messages wait, spending
///   no retry, while the relay logs an error and backs off until an operator fixes the
///   key;
/// - any other error reply: [`Rejected::new`], the message's own failure, which spends
///   a retry.
///
/// On a Redis Cluster (`RedisPublisher::cluster`, feature `cluster`) the streams are
/// hash-tagged (`<prefix>{<topic>}`), the batch is split per hash slot (per topic, in
/// practice) and each part goes in its own pipelines, the parts side by side: a batch
/// costs one round trip to each node it touches, concurrently. A part that fails leaves
/// its messages NEW as above while the other parts' are recorded.
///
/// The connection is opened on the first publish and replaced after a connection
/// error, so building a publisher never fails because Redis is down.
#[derive(Debug)]
pub struct RedisPublisher {
    /// Kept to open the connection again when [`with_config`](Self::with_config) changes
    /// its timeouts.
    target: Target,
    conn: Connector,
    cluster: bool,
    config: PublisherConfig,
    /// The pipeline cap in force: `max_pipeline_bytes`, halved after each timeout.
    pipeline_bytes: AtomicUsize,
    /// Whether the server has answered the durability probe.
    durability_checked: AtomicBool,
}

impl RedisPublisher {
    /// A publisher with the default [`PublisherConfig`]. `redis` is a URL such as
    /// `redis://127.0.0.1:6379` or anything else the redis crate accepts; only its syntax
    /// is checked here.
    pub fn new(redis: impl IntoConnectionInfo) -> Result<Self> {
        Self::on(Target::single(redis)?)
    }

    /// A publisher to the Redis Cluster reachable through any of `nodes` (URLs such as
    /// `redis://127.0.0.1:7000`; the cluster's other nodes are discovered), with the
    /// default [`PublisherConfig`]. Its streams are hash-tagged: the stream of topic
    /// `order.paid` is `outbox:{order.paid}`. Consumers must be built with
    /// [`Consumer::builder_cluster`](crate::Consumer::builder_cluster), which names
    /// streams the same way.
    ///
    /// Only the addresses' syntax is checked here (and that there is at least one). On a
    /// cluster the stream prefix must not contain `{` or `}`.
    #[cfg(feature = "cluster")]
    pub fn cluster<T: IntoConnectionInfo>(nodes: impl IntoIterator<Item = T>) -> Result<Self> {
        Self::on(Target::cluster(nodes)?)
    }

    fn on(target: Target) -> Result<Self> {
        let config = PublisherConfig::default();
        Ok(Self {
            conn: target.connector(config.connect_timeout, config.response_timeout)?,
            cluster: target.is_cluster(),
            target,
            pipeline_bytes: AtomicUsize::new(config.max_pipeline_bytes),
            durability_checked: AtomicBool::new(false),
            config,
        })
    }

    /// Replaces the configuration, after [`PublisherConfig::validate`] and a check of
    /// the prefix against the deployment (no `{` or `}` on a cluster): a value out of
    /// range is [`Error::Config`]. Call it before the first publish: the connection is
    /// opened anew, with the config's timeouts.
    pub fn with_config(mut self, config: PublisherConfig) -> Result<Self> {
        config.validate()?;
        check_prefix(&config.stream_prefix, self.cluster)?;
        self.conn = self
            .target
            .connector(config.connect_timeout, config.response_timeout)?;
        self.pipeline_bytes = AtomicUsize::new(config.max_pipeline_bytes);
        self.durability_checked = AtomicBool::new(false);
        self.config = config;
        Ok(self)
    }

    /// The configuration in force.
    pub fn config(&self) -> &PublisherConfig {
        &self.config
    }

    /// Whether this publisher writes to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// The stream that carries `topic`: `<prefix><topic>`, or `<prefix>{<topic>}` on a
    /// cluster.
    pub fn stream_for(&self, topic: &str) -> String {
        stream_name(&self.config.stream_prefix, topic, self.cluster)
    }

    /// Connects and checks that the server supports the configured [`Durability`]: a
    /// server without `WAITAOF` (before Redis 7.2), or `Durability::Aof { local: true, .. }`
    /// on a server without `appendonly yes`, is [`Error::Config`]. The relay makes the
    /// same check before its first write; call this to fail at start-up instead.
    pub async fn check(&self) -> Result<()> {
        let mut conn = self.conn.get().await?;
        self.check_durability(&mut conn).await.map_err(|e| match e {
            outbox_core::Error::Config(e) => Error::from(e),
            other => Error::Core(other),
        })
    }

    /// Sends the durability probe once (until it succeeds): a server that lacks the
    /// command is a configuration error, found before any entry is written.
    async fn check_durability(&self, conn: &mut Conn) -> Result<(), outbox_core::Error> {
        let Some(probe) = self.config.durability.probe() else {
            return Ok(());
        };
        if self.durability_checked.load(Ordering::Relaxed) {
            return Ok(());
        }
        match probe.query_async::<Value>(conn).await {
            Ok(_) => {
                self.durability_checked.store(true, Ordering::Relaxed);
                Ok(())
            }
            Err(e) if is_outage(&e) => {
                self.conn.check(&e).await;
                Err(outbox_core::Error::broker_unavailable(e))
            }
            Err(e) => Err(InvalidConfig::new(
                "durability",
                unsupported(&self.config.durability, &e),
            )
            .into()),
        }
    }

    /// The commands of `batch[range]` (one hash slot), then the durability wait.
    fn pipeline(
        &self,
        streams: &[String],
        fields: &[Fields<'_>],
        part: &[usize],
    ) -> redis::Pipeline {
        let mut pipe = redis::Pipeline::with_capacity(part.len() + 1);
        pipe.ignore_errors();
        for &i in part {
            let cmd = pipe.cmd("XADD").arg(&streams[i]);
            if let Some(n) = self.config.max_len {
                cmd.arg("MAXLEN").arg("~").arg(n);
            }
            cmd.arg("*");
            for (field, value) in &fields[i] {
                cmd.arg(*field).arg(value.as_ref());
            }
        }
        if let Some((wait, _)) = self.config.durability.command() {
            pipe.add_command(wait);
        }
        pipe
    }

    /// Halves the pipeline cap after a pipeline of `bytes` timed out.
    fn shrink(&self, bytes: usize) {
        let before = self.pipeline_bytes.load(Ordering::Relaxed);
        let after = (bytes.min(before) / 2).max(1);
        self.pipeline_bytes.store(after, Ordering::Relaxed);
        tracing::warn!(
            pipeline_bytes = bytes,
            next_cap = after,
            "a redis pipeline timed out; the next pipelines are smaller"
        );
        metrics::counter!("outbox_redis_publish_timeouts_total").increment(1);
    }

    /// Grows the pipeline cap back towards the configured one after a call without a
    /// timeout.
    fn grow(&self) {
        let now = self.pipeline_bytes.load(Ordering::Relaxed);
        if now < self.config.max_pipeline_bytes {
            let next = now.saturating_mul(2).min(self.config.max_pipeline_bytes);
            self.pipeline_bytes.store(next, Ordering::Relaxed);
        }
    }
}

/// The field/value pairs of one entry.
type Fields<'a> = [(&'static str, Cow<'a, str>); 8];

/// What one entry weighs in a pipeline: its arguments and their framing, roughly.
fn entry_bytes(stream: &str, fields: &Fields<'_>) -> usize {
    const PER_ARG: usize = 16; // `$<len>\r\n...\r\n`
    let args: usize = fields.iter().map(|(f, v)| f.len() + v.len()).sum();
    "XADD".len() + stream.len() + args + PER_ARG * (fields.len() * 2 + 6)
}

/// Splits `group` (indexes into the batch) into runs of at most `cap` bytes, a message
/// over the cap alone; returns each run and its bytes.
fn chunks(group: &[usize], sizes: &[usize], cap: usize) -> Vec<(Vec<usize>, usize)> {
    let mut out: Vec<(Vec<usize>, usize)> = Vec::new();
    let mut current: (Vec<usize>, usize) = (Vec::new(), 0);
    for &i in group {
        if !current.0.is_empty() && current.1.saturating_add(sizes[i]) > cap {
            out.push(std::mem::take(&mut current));
        }
        current.0.push(i);
        current.1 = current.1.saturating_add(sizes[i]);
    }
    if !current.0.is_empty() {
        out.push(current);
    }
    out
}

/// The configuration error for a server that refuses the durability command.
fn unsupported(durability: &Durability, e: &RedisError) -> String {
    let needs = match durability {
        Durability::Aof { local: true, .. } => {
            "`Aof` needs WAITAOF (Redis 7.2 or later) and, with `local`, `appendonly yes`"
        }
        Durability::Aof { .. } => "`Aof` needs WAITAOF (Redis 7.2 or later)",
        _ => "`Replicas` needs WAIT on the primary",
    };
    format!("{needs}; the server refused `{}`: {e}", durability.name())
}

/// Whether an error reply to an `XADD` is about the stream rather than the entry: every
/// later entry of the stream would fail the same way until an operator fixes the key.
fn is_stream_fault(e: &RedisError) -> bool {
    match e.code() {
        Some("WRONGTYPE") => true,
        Some("ERR") => e
            .detail()
            .is_some_and(|d| d.contains("exhausted the last possible ID")),
        _ => false,
    }
}

/// The outcome of one `XADD` error reply.
fn classify(e: &RedisError) -> Rejected {
    if is_outage(e) {
        Rejected::unavailable(e.to_string())
    } else if is_stream_fault(e) {
        Rejected::topic(e.to_string())
    } else {
        Rejected::new(e.to_string())
    }
}

impl Publisher for RedisPublisher {
    async fn publish(
        &self,
        batch: &[StoredMessage],
    ) -> Result<PublishOutcomes, outbox_core::Error> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let streams: Vec<String> = batch
            .iter()
            .map(|m| self.stream_for(&m.envelope.topic))
            .collect();
        let fields: Vec<Fields<'_>> = batch.iter().map(|m| entry_fields(&m.envelope)).collect();
        let sizes: Vec<usize> = streams
            .iter()
            .zip(&fields)
            .map(|(s, f)| entry_bytes(s, f))
            .collect();
        let cap = self.pipeline_bytes.load(Ordering::Relaxed);
        // Per hash slot (a single group unless on a cluster), its pipelines in order.
        let parts: Vec<Vec<(Vec<usize>, usize)>> =
            by_slot(self.cluster, streams.iter().enumerate(), |(_, s)| {
                s.as_str()
            })
            .into_iter()
            .map(|group| {
                let group: Vec<usize> = group.into_iter().map(|(i, _)| i).collect();
                chunks(&group, &sizes, cap)
            })
            .collect();

        let mut conn = match self.conn.get().await {
            Ok(conn) => conn,
            Err(e) => return Err(outbox_core::Error::broker_unavailable(e)),
        };
        self.check_durability(&mut conn).await?;

        let mut outcomes: Vec<Option<Result<(), Rejected>>> = vec![None; batch.len()];
        // A part stops at its first pipeline that fails; the rest of it is not sent.
        let mut stopped: Vec<Option<String>> = vec![None; parts.len()];
        let mut timed_out = false;
        let rounds = parts.iter().map(Vec::len).max().unwrap_or(0);
        for round in 0..rounds {
            let live: Vec<usize> = (0..parts.len())
                .filter(|&p| stopped[p].is_none() && round < parts[p].len())
                .collect();
            if live.is_empty() {
                break;
            }
            let pipes = live
                .iter()
                .map(|&p| self.pipeline(&streams, &fields, &parts[p][round].0))
                .collect();
            let results: Vec<RedisResult<Vec<RedisResult<Value>>>> =
                query_all(&mut conn, pipes).await;
            for (&p, result) in live.iter().zip(results) {
                let (part, bytes) = &parts[p][round];
                match self.replies(batch, part, result).await {
                    Ok(part_outcomes) => {
                        let mut halt = None;
                        for (&i, outcome) in part.iter().zip(part_outcomes) {
                            if let Err(r) = &outcome
                                && r.kind == RejectKind::Unavailable
                            {
                                halt.get_or_insert_with(|| r.reason.clone());
                            }
                            outcomes[i] = Some(outcome);
                        }
                        stopped[p] = halt;
                    }
                    Err(e) => {
                        if e.is_timeout() {
                            timed_out = true;
                            self.shrink(*bytes);
                        }
                        self.conn.check(&e).await;
                        let reason = e.to_string();
                        for &i in part {
                            outcomes[i] = Some(Err(Rejected::unavailable(reason.clone())));
                        }
                        stopped[p] = Some(reason);
                    }
                }
            }
        }
        if !timed_out {
            self.grow();
        }
        // The pipelines after a failed one were not sent.
        for (p, reason) in stopped.iter().enumerate() {
            let Some(reason) = reason else { continue };
            for (part, _) in &parts[p] {
                for &i in part {
                    outcomes[i].get_or_insert_with(|| {
                        Err(Rejected::unavailable(format!(
                            "not sent: an earlier pipeline failed: {reason}"
                        )))
                    });
                }
            }
        }
        let outcomes: PublishOutcomes = outcomes
            .into_iter()
            .map(|o| o.expect("every message is in one pipeline"))
            .collect();
        // Nothing taken and nothing of the messages' or topics' own: an outage of the
        // whole call, as the relay has always been told.
        if let Some(Err(first)) = outcomes.first()
            && outcomes
                .iter()
                .all(|o| matches!(o, Err(r) if r.kind == RejectKind::Unavailable))
        {
            return Err(outbox_core::Error::broker_unavailable(first.reason.clone()));
        }
        Ok(outcomes)
    }
}

impl RedisPublisher {
    /// The outcomes of one pipeline's replies, for the messages of `part`; `Err` when
    /// the pipeline failed as a whole (connection, timeout).
    async fn replies(
        &self,
        batch: &[StoredMessage],
        part: &[usize],
        result: RedisResult<Vec<RedisResult<Value>>>,
    ) -> RedisResult<Vec<Result<(), Rejected>>> {
        let mut replies = result?;
        let wait = self.config.durability.command().is_some();
        if replies.len() != part.len() + usize::from(wait) {
            return Ok(vec![
                Err(Rejected::unavailable(format!(
                    "redis returned {} replies for a pipeline of {}",
                    replies.len(),
                    part.len() + usize::from(wait)
                )));
                part.len()
            ]);
        }
        let waited = if wait { replies.pop() } else { None };
        let mut out = Vec::with_capacity(part.len());
        for (&i, reply) in part.iter().zip(replies) {
            out.push(match reply {
                Ok(_) => Ok(()),
                Err(e) => {
                    self.conn.check(&e).await;
                    let rejected = classify(&e);
                    let m = &batch[i];
                    match rejected.kind {
                        RejectKind::Message => {
                            tracing::debug!(msg_id = %m.envelope.msg_id, error = %e, "redis rejected an entry");
                            metrics::counter!("outbox_redis_publish_rejected_total").increment(1);
                        }
                        _ => {
                            tracing::debug!(msg_id = %m.envelope.msg_id, error = %e, "redis could not take an entry");
                        }
                    }
                    Err(rejected)
                }
            });
        }
        // An unmet wait: the entries are on the primary, but not as durable as asked.
        let unmet = match waited {
            None => None,
            Some(Ok(reply)) => self.config.durability.unmet(&reply),
            Some(Err(e)) if is_outage(&e) => Some(e.to_string()),
            Some(Err(e)) => Some(format!(
                "durability {}",
                unsupported(&self.config.durability, &e)
            )),
        };
        if let Some(reason) = unmet {
            metrics::counter!("outbox_redis_durability_unmet_total").increment(1);
            for o in &mut out {
                if o.is_ok() {
                    *o = Err(Rejected::unavailable(reason.clone()));
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_keep_order_and_send_an_oversized_message_alone() {
        let sizes = [3, 3, 10, 1, 1, 1, 4];
        let group: Vec<usize> = (0..sizes.len()).collect();
        let got: Vec<Vec<usize>> = chunks(&group, &sizes, 6)
            .into_iter()
            .map(|(c, _)| c)
            .collect();
        assert_eq!(got, vec![vec![0, 1], vec![2], vec![3, 4, 5], vec![6]]);
        let one: Vec<Vec<usize>> = chunks(&group, &sizes, 1)
            .into_iter()
            .map(|(c, _)| c)
            .collect();
        assert_eq!(
            one.len(),
            sizes.len(),
            "a cap below every message: one each"
        );
    }

    #[test]
    fn config_is_validated() {
        let ok = PublisherConfig::default();
        assert!(ok.validate().is_ok());
        let bad = [
            PublisherConfig {
                max_pipeline_bytes: 0,
                ..ok.clone()
            },
            PublisherConfig {
                durability: Durability::Replicas {
                    replicas: 1,
                    timeout: Duration::ZERO,
                },
                ..ok.clone()
            },
            PublisherConfig {
                durability: Durability::Aof {
                    local: true,
                    replicas: 0,
                    timeout: ok.response_timeout,
                },
                ..ok.clone()
            },
        ];
        for config in bad {
            let err = Error::from(config.validate().unwrap_err());
            assert!(err.is_config(), "{config:?}: {err}");
        }
    }

    #[test]
    fn waits_are_met_or_not() {
        let t = Duration::from_millis(100);
        let replicas = Durability::Replicas {
            replicas: 2,
            timeout: t,
        };
        assert_eq!(replicas.unmet(&Value::Int(2)), None);
        assert!(replicas.unmet(&Value::Int(1)).unwrap().contains("1 of 2"));
        let aof = Durability::Aof {
            local: true,
            replicas: 1,
            timeout: t,
        };
        let reply = |l, r| Value::Array(vec![Value::Int(l), Value::Int(r)]);
        assert_eq!(aof.unmet(&reply(1, 1)), None);
        assert!(aof.unmet(&reply(0, 1)).is_some());
        assert!(aof.unmet(&reply(1, 0)).is_some());
        assert!(aof.unmet(&Value::Nil).is_some());
    }
}
