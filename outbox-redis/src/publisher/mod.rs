use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use outbox_core::{
    InvalidConfig, Partitions, PublishOutcomes, Publisher, RejectKind, Rejected, StoredMessage,
};
use redis::{IntoConnectionInfo, RedisError, RedisResult, Value};

use self::catch_up::CatchUp;
use crate::conn::{
    Conn, Connector, Target, by_slot, check_prefix, partition_stream_name, partitions_key,
    query_all, stream_name,
};
use crate::entry::entry_fields;
use crate::error::is_outage;
use crate::{Error, Result};

mod catch_up;
mod config;

pub use config::{DEFAULT_MAX_PIPELINE_BYTES, DEFAULT_STREAM_PREFIX, Durability, PublisherConfig};

#[doc = include_str!("../../docs/publisher.md")]
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
    /// Whether the partition counts are recorded in `<prefix>partitions`.
    partitions_recorded: AtomicBool,
    /// The writes that wait until the replicas show they have caught up (see
    /// [`replicas_behind`](Self::replicas_behind)): all at the start and after an outage,
    /// and those to the streams of an unmet durability wait.
    catch_up: CatchUp,
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

    /// A publisher to the primary that Redis Sentinel names (feature `sentinel`), with
    /// the default [`PublisherConfig`]. It asks the sentinels for the primary at the
    /// first publish and again after a connection error, a `READONLY` reply or a
    /// failover announced on `+switch-master`; see [`SentinelConfig`](crate::SentinelConfig)
    /// for an example. Streams are named as on one server (`outbox:order.paid`).
    ///
    /// Replication is asynchronous: an entry Redis acknowledged can be lost when its
    /// primary dies before a replica that is then promoted received it. Choose
    /// [`Durability::Replicas`] to have a row marked SENT only once a replica has the
    /// entry (see "What SENT means" at [`PublisherConfig`]).
    #[cfg(feature = "sentinel")]
    pub fn sentinel(config: crate::SentinelConfig) -> Result<Self> {
        Self::on(Target::sentinel(config)?)
    }

    fn on(target: Target) -> Result<Self> {
        let config = PublisherConfig::default();
        Ok(Self {
            conn: target.connector(config.connect_timeout, config.response_timeout)?,
            cluster: target.is_cluster(),
            target,
            pipeline_bytes: AtomicUsize::new(config.max_pipeline_bytes),
            durability_checked: AtomicBool::new(false),
            partitions_recorded: AtomicBool::new(false),
            catch_up: CatchUp::default(),
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
        self.partitions_recorded = AtomicBool::new(false);
        self.catch_up = CatchUp::default();
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

    /// The stream that carries `topic` when it is not partitioned: `<prefix><topic>`, or
    /// `<prefix>{<topic>}` on a cluster. See [`stream_for_key`](Self::stream_for_key)
    /// for the stream a message actually goes to.
    pub fn stream_for(&self, topic: &str) -> String {
        stream_name(&self.config.stream_prefix, topic, self.cluster)
    }

    /// The stream that carries the messages of `topic` with ordering key `key`: that of
    /// the topic ([`stream_for`](Self::stream_for)), or, for a topic of
    /// [`PublisherConfig::partitions`], that of the key's partition `p`
    /// ([`outbox_core::partition_of`]): `<prefix><topic>:<p>`, or `<prefix>{<topic>:<p>}`
    /// on a cluster.
    pub fn stream_for_key(&self, topic: &str, key: &str) -> String {
        match self.partitions_of(topic) {
            p if p.is_partitioned() => {
                partition_stream_name(&self.config.stream_prefix, topic, p.of(key), self.cluster)
            }
            _ => self.stream_for(topic),
        }
    }

    /// The partition count of `topic`: as configured, or one.
    pub fn partitions_of(&self, topic: &str) -> Partitions {
        self.config
            .partitions
            .get(topic)
            .copied()
            .unwrap_or_default()
    }

    /// Connects and checks that the server supports the configured [`Durability`]: a
    /// server without `WAITAOF` (before Redis 7.2), or `Durability::Aof { local: true, .. }`
    /// on a server without `appendonly yes`, is [`Error::Config`]. The relay makes the
    /// same check before its first write; call this to fail at start-up instead. It also
    /// records the partition counts, as the first publish would.
    pub async fn check(&self) -> Result<()> {
        let mut conn = self.conn.get().await?;
        let checked = match self.check_durability(&mut conn).await {
            Ok(()) => self.record_partitions(&mut conn).await,
            Err(e) => Err(e),
        };
        checked.map_err(|e| match e {
            outbox_core::Error::Config(e) => Error::from(e),
            other => Error::Core(other),
        })
    }

    /// After an outage: the server may have come back without its data (a restart
    /// without persistence, a failover to an empty replica), so the partition counts are
    /// recorded again at the next publish (one `HSET`); and it may have come back
    /// without replicas, so they are checked before the next write.
    fn outage_seen(&self) {
        self.partitions_recorded.store(false, Ordering::Relaxed);
        self.catch_up.everywhere();
    }

    /// Before writing at the start, after an outage or after an unmet durability wait:
    /// the durability wait alone, on each part's node (the read of the part's first
    /// stream routes it there on a cluster). `WAIT` counts the replicas that have
    /// acknowledged the last write of its own client: on the connection that wrote
    /// before, it waits for those writes; on a new connection (no write yet) it counts
    /// the replicas in sync. Stops each part that must not be written now, saying why.
    ///
    /// Why before and not only after: an unmet wait after the `XADD`s leaves the entries
    /// on the stream while their rows stay NEW. Without this check every try of the
    /// relay (one per backoff) would append the same batch again for as long as the
    /// replicas stay away; with it, an unmet wait appends at most one batch, and the
    /// tries that follow write nothing until the replicas have caught up.
    async fn replicas_behind(&self, conn: &mut Conn, entries: &Entries<'_>, parts: &mut [Part]) {
        let Some((wait, _)) = self.config.durability.command() else {
            return;
        };
        let checked: Vec<usize> = (0..parts.len())
            .filter(|&p| self.catch_up.owed(parts[p].streams(entries)))
            .collect();
        if checked.is_empty() {
            return;
        }
        let pipes = (checked.iter())
            .map(|&p| {
                let mut pipe = redis::pipe();
                pipe.ignore_errors()
                    .cmd("XLEN")
                    .arg(entries.stream(parts[p].pipelines[0].messages[0]))
                    .add_command(wait.clone());
                pipe
            })
            .collect();
        let replies = query_all::<Vec<RedisResult<Value>>>(conn, pipes).await;
        for (&p, result) in checked.iter().zip(replies) {
            let unmet = match result.map(|mut replies| replies.pop()) {
                Ok(Some(Err(e))) if !is_outage(&e) => {
                    // The server took this wait when the publisher started: refusing it
                    // now, it changed under the connection. A primary demoted by hand
                    // answers a wait alone with an error, never `READONLY`, so without
                    // a new connection (through Sentinel, to the current primary) every
                    // try would ask the replica again.
                    self.conn.forget().await;
                    self.unmet(Err(e))
                }
                Ok(Some(waited)) => self.unmet(waited),
                Ok(None) => Some("no reply to the durability wait".to_owned()),
                Err(e) => {
                    self.outage_seen();
                    self.conn.check(&e).await;
                    Some(e.to_string())
                }
            };
            parts[p].stopped =
                unmet.map(|r| format!("the replicas lag behind earlier writes: {r}"));
        }
        let passed: Vec<&Part> = (checked.iter().map(|&p| &parts[p]))
            .filter(|part| part.stopped.is_none())
            .collect();
        let all = passed.len() == checked.len();
        self.catch_up
            .caught_up(passed.iter().flat_map(|part| part.streams(entries)), all);
        if !all {
            metrics::counter!("outbox_redis_durability_unmet_total").increment(1);
        }
    }

    /// Why the reply to a durability wait shows it unmet, if it does.
    fn unmet(&self, waited: RedisResult<Value>) -> Option<String> {
        match waited {
            Ok(reply) => self.config.durability.unmet(&reply),
            Err(e) if is_outage(&e) => Some(e.to_string()),
            Err(e) => Some(format!(
                "durability {}",
                unsupported(&self.config.durability, &e)
            )),
        }
    }

    /// Records the configured partition counts in `<prefix>partitions` (`HSET`), once in
    /// the publisher's life and again after each outage: consumers compare theirs with
    /// it. A key of another type there is a configuration error, found before any entry
    /// is written.
    async fn record_partitions(&self, conn: &mut Conn) -> Result<(), outbox_core::Error> {
        if self.config.partitions.is_empty() || self.partitions_recorded.load(Ordering::Relaxed) {
            return Ok(());
        }
        let key = partitions_key(&self.config.stream_prefix);
        let mut hset = redis::cmd("HSET");
        hset.arg(&key);
        for (topic, partitions) in &self.config.partitions {
            hset.arg(topic).arg(partitions.get());
        }
        match hset.query_async::<Value>(conn).await {
            Ok(_) => {
                self.partitions_recorded.store(true, Ordering::Relaxed);
                Ok(())
            }
            Err(e) if is_outage(&e) => {
                self.conn.check(&e).await;
                Err(outbox_core::Error::broker_unavailable(e))
            }
            Err(e) => Err(InvalidConfig::new(
                "partitions",
                format!("cannot be recorded in the hash `{key}`: {e}"),
            )
            .into()),
        }
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

    /// The commands of `pipeline` (one hash slot), then the durability wait. Each
    /// `XADD` is built in buffers of its exact size: grown an argument at a time, they
    /// cost the relay more than the rest of the publish.
    fn commands(&self, entries: &Entries<'_>, pipeline: &Pipeline) -> redis::Pipeline {
        let mut pipe = redis::Pipeline::with_capacity(pipeline.messages.len() + 1);
        pipe.ignore_errors();
        let max_len = self.config.max_len.map(|n| n.to_string());
        for &i in &pipeline.messages {
            let (stream, fields) = (entries.stream(i), &entries.fields[i]);
            let args = 3 + 2 * fields.len() + if max_len.is_some() { 3 } else { 0 };
            let bytes = "XADD*".len()
                + stream.len()
                + max_len.as_ref().map_or(0, |n| "MAXLEN~".len() + n.len())
                + fields.iter().map(|(f, v)| f.len() + v.len()).sum::<usize>();
            let mut cmd = redis::Cmd::with_capacity(args, bytes);
            cmd.arg("XADD").arg(stream);
            if let Some(n) = &max_len {
                cmd.arg("MAXLEN").arg("~").arg(n.as_str());
            }
            cmd.arg("*");
            for (field, value) in fields {
                cmd.arg(*field).arg(value.as_ref());
            }
            pipe.add_command(cmd);
        }
        if let Some((command, _)) = self.config.durability.command() {
            pipe.add_command(command);
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

/// A call's entries, each built once: every message's stream and fields. A stream is
/// named once per call (usually one per topic), not one `String` per message.
struct Entries<'a> {
    /// The call's distinct streams.
    streams: Vec<String>,
    /// Per message, its stream's index in `streams`.
    stream_of: Vec<usize>,
    fields: Vec<Fields<'a>>,
}

impl Entries<'_> {
    /// The stream of message `i`.
    fn stream(&self, i: usize) -> &str {
        &self.streams[self.stream_of[i]]
    }
}

/// What one entry weighs in a pipeline: its arguments and their framing, roughly.
fn entry_bytes(stream: &str, fields: &Fields<'_>) -> usize {
    const PER_ARG: usize = 16; // `$<len>\r\n...\r\n`
    let args: usize = fields.iter().map(|(f, v)| f.len() + v.len()).sum();
    "XADD".len() + stream.len() + args + PER_ARG * (fields.len() * 2 + 6)
}

/// The messages of one hash slot (all of a call's, unless on a cluster), in the
/// pipelines that carry them one after another.
struct Part {
    pipelines: Vec<Pipeline>,
    /// Why the rest of the part is not sent, once it stops: its replicas lag behind, or
    /// one of its pipelines failed.
    stopped: Option<String>,
}

impl Part {
    /// The streams its messages go to (a stream once per message).
    fn streams<'a>(&'a self, entries: &'a Entries<'_>) -> impl Iterator<Item = &'a str> {
        (self.pipelines.iter())
            .flat_map(|p| &p.messages)
            .map(|&i| entries.stream(i))
    }
}

/// The messages that one pipeline carries (indexes into the call's batch).
#[derive(Default)]
struct Pipeline {
    messages: Vec<usize>,
    /// What their entries weigh ([`entry_bytes`]).
    bytes: usize,
}

/// Splits `group` (indexes into the batch) into pipelines of at most `cap` bytes, a
/// message over the cap alone.
fn chunks(group: &[usize], sizes: &[usize], cap: usize) -> Vec<Pipeline> {
    let mut out = Vec::new();
    let mut current = Pipeline::default();
    for &i in group {
        if !current.messages.is_empty() && current.bytes.saturating_add(sizes[i]) > cap {
            out.push(std::mem::take(&mut current));
        }
        current.messages.push(i);
        current.bytes = current.bytes.saturating_add(sizes[i]);
    }
    if !current.messages.is_empty() {
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
        let entries = self.entries(batch);
        let mut parts = self.plan(&entries);
        let mut conn = self.ready_conn().await?;
        // A part whose replicas lag behind is not sent at all.
        self.replicas_behind(&mut conn, &entries, &mut parts).await;
        let mut answers = Answers::new(batch.len());
        self.send(&mut conn, batch, &entries, &mut parts, &mut answers)
            .await;
        settle(&parts, answers)
    }
}

/// Every message's outcome once the pipelines sent are answered: those of the pipelines
/// of a stopped part that were not sent are not taken. Nothing taken and nothing of the
/// messages' or topics' own: an outage of the whole call, as the relay has always been
/// told.
fn settle(parts: &[Part], mut answers: Answers) -> Result<PublishOutcomes, outbox_core::Error> {
    for part in parts {
        let Some(reason) = &part.stopped else {
            continue;
        };
        for &i in part.pipelines.iter().flat_map(|p| &p.messages) {
            answers.unanswered(i, || {
                Rejected::unavailable(format!("not sent after an earlier failure: {reason}"))
            });
        }
    }
    let outcomes = answers.into_outcomes();
    if let Some(Err(first)) = outcomes.first()
        && outcomes
            .iter()
            .all(|o| matches!(o, Err(r) if r.kind == RejectKind::Unavailable))
    {
        return Err(outbox_core::Error::broker_unavailable(first.reason.clone()));
    }
    Ok(outcomes)
}

/// The outcomes of one call's messages, as its pipelines are answered: each message's
/// is set by the reply of its pipeline, or, for a pipeline not sent after an earlier
/// one of its part failed, as not sent.
struct Answers {
    /// Per message of the call: `None` while its pipeline is unanswered.
    outcomes: Vec<Option<Result<(), Rejected>>>,
}

impl Answers {
    /// `n` messages, none answered.
    fn new(n: usize) -> Self {
        Self {
            outcomes: vec![None; n],
        }
    }

    /// Message `i`'s outcome, from its pipeline's reply.
    fn set(&mut self, i: usize, outcome: Result<(), Rejected>) {
        self.outcomes[i] = Some(outcome);
    }

    /// The outcomes of `messages`, from their pipeline's replies; returns the first reason
    /// the server could not take one of them (an outage): it stops their part.
    fn record(
        &mut self,
        messages: &[usize],
        outcomes: Vec<Result<(), Rejected>>,
    ) -> Option<String> {
        let mut halt = None;
        for (&i, outcome) in messages.iter().zip(outcomes) {
            if let Err(r) = &outcome
                && r.kind == RejectKind::Unavailable
            {
                halt.get_or_insert_with(|| r.reason.clone());
            }
            self.set(i, outcome);
        }
        halt
    }

    /// Message `i` rejected with `rejected()` unless its pipeline was answered.
    fn unanswered(&mut self, i: usize, rejected: impl FnOnce() -> Rejected) {
        self.outcomes[i].get_or_insert_with(|| Err(rejected()));
    }

    /// Every message's outcome, in the call's order.
    fn into_outcomes(self) -> PublishOutcomes {
        self.outcomes
            .into_iter()
            .map(|o| o.expect("every message is in one pipeline"))
            .collect()
    }
}

impl RedisPublisher {
    /// The call's pipelines per hash slot (one part unless on a cluster), in order, each
    /// of at most the pipeline cap in force.
    fn plan(&self, entries: &Entries<'_>) -> Vec<Part> {
        let n = entries.fields.len();
        let sizes: Vec<usize> = (0..n)
            .map(|i| entry_bytes(entries.stream(i), &entries.fields[i]))
            .collect();
        let cap = self.pipeline_bytes.load(Ordering::Relaxed);
        by_slot(
            self.cluster,
            (0..n).map(|i| (i, entries.stream(i))),
            |(_, s)| s,
        )
        .into_iter()
        .map(|group| {
            let group: Vec<usize> = group.into_iter().map(|(i, _)| i).collect();
            Part {
                pipelines: chunks(&group, &sizes, cap),
                stopped: None,
            }
        })
        .collect()
    }

    /// The connection for a call, once the durability probe has answered and the
    /// partition counts are recorded.
    async fn ready_conn(&self) -> Result<Conn, outbox_core::Error> {
        let mut conn = self.conn.get().await.map_err(|e| {
            self.outage_seen();
            outbox_core::Error::broker_unavailable(e)
        })?;
        self.check_durability(&mut conn).await?;
        self.record_partitions(&mut conn).await?;
        Ok(conn)
    }

    /// Sends the parts' pipelines in rounds (the next pipeline of every part still going,
    /// in one round trip) and records their replies in `answers`. A part stops at its
    /// first pipeline that fails: the rest of it is not sent. The pipeline cap grows back
    /// after a call without a timeout.
    async fn send(
        &self,
        conn: &mut Conn,
        batch: &[StoredMessage],
        entries: &Entries<'_>,
        parts: &mut [Part],
        answers: &mut Answers,
    ) {
        let mut timed_out = false;
        for round in 0.. {
            let live: Vec<usize> = (0..parts.len())
                .filter(|&p| parts[p].stopped.is_none() && round < parts[p].pipelines.len())
                .collect();
            if live.is_empty() {
                break;
            }
            let pipes = live
                .iter()
                .map(|&p| self.commands(entries, &parts[p].pipelines[round]))
                .collect();
            // Each pipeline goes whole, never in slices: a slice waiting for room in the
            // connection's queue could be overtaken by the next one, which would break key
            // order and let the durability wait go before writes it must cover.
            let results = query_all(conn, pipes).await;
            for (&p, result) in live.iter().zip(results) {
                let pipeline = &parts[p].pipelines[round];
                let stopped = match self
                    .replies(batch, entries, &pipeline.messages, result)
                    .await
                {
                    Ok(outcomes) => answers.record(&pipeline.messages, outcomes),
                    Err(e) => {
                        timed_out |= e.is_timeout();
                        Some(self.failed(pipeline, &e, answers).await)
                    }
                };
                parts[p].stopped = stopped;
            }
        }
        if !timed_out {
            self.grow();
        }
    }

    /// A pipeline that failed as a whole (connection, timeout): none of its messages is
    /// taken. Returns the reason, which stops its part.
    async fn failed(&self, pipeline: &Pipeline, e: &RedisError, answers: &mut Answers) -> String {
        if e.is_timeout() {
            self.shrink(pipeline.bytes);
        }
        self.outage_seen();
        self.conn.check(e).await;
        let reason = e.to_string();
        for &i in &pipeline.messages {
            answers.set(i, Err(Rejected::unavailable(reason.clone())));
        }
        reason
    }

    /// The stream ([`stream_for_key`](Self::stream_for_key)) and fields of each message
    /// of `batch`, each distinct stream named once.
    fn entries<'a>(&self, batch: &'a [StoredMessage]) -> Entries<'a> {
        let mut streams: Vec<String> = Vec::new();
        // The index of each (topic, partition or u32::MAX) in `streams`; a partitioned
        // topic can have up to 1024 streams, so a map rather than a search.
        let mut known: HashMap<(&str, u32), usize> = HashMap::new();
        let mut stream_of = Vec::with_capacity(batch.len());
        for m in batch {
            let topic = m.envelope.topic.as_str();
            let p = self.partitions_of(topic);
            let id = (
                topic,
                if p.is_partitioned() {
                    p.of(&m.envelope.key)
                } else {
                    u32::MAX
                },
            );
            let index = *known.entry(id).or_insert_with(|| {
                streams.push(self.stream_for_key(topic, &m.envelope.key));
                streams.len() - 1
            });
            stream_of.push(index);
        }
        let fields = batch.iter().map(|m| entry_fields(&m.envelope)).collect();
        Entries {
            streams,
            stream_of,
            fields,
        }
    }

    /// The outcomes of one pipeline's replies, for `messages`; `Err` when
    /// the pipeline failed as a whole (connection, timeout).
    async fn replies(
        &self,
        batch: &[StoredMessage],
        entries: &Entries<'_>,
        messages: &[usize],
        result: RedisResult<Vec<RedisResult<Value>>>,
    ) -> RedisResult<Vec<Result<(), Rejected>>> {
        let mut replies = result?;
        let wait = self.config.durability.command().is_some();
        if replies.len() != messages.len() + usize::from(wait) {
            return Ok(vec![
                Err(Rejected::unavailable(format!(
                    "redis returned {} replies for a pipeline of {}",
                    replies.len(),
                    messages.len() + usize::from(wait)
                )));
                messages.len()
            ]);
        }
        let waited = if wait { replies.pop() } else { None };
        let mut out = Vec::with_capacity(messages.len());
        for (&i, reply) in messages.iter().zip(replies) {
            out.push(match reply {
                Ok(_) => Ok(()),
                Err(e) => {
                    self.conn.check(&e).await;
                    let rejected = classify(&e);
                    if rejected.kind == RejectKind::Unavailable {
                        self.outage_seen();
                    }
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
        // An unmet wait: the entries are on the primary, but not as durable as asked;
        // nothing more is written until the replicas have caught up.
        if let Some(reason) = waited.and_then(|w| self.unmet(w)) {
            self.catch_up
                .owe(messages.iter().map(|&i| entries.stream(i)));
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
            .map(|p| p.messages)
            .collect();
        assert_eq!(got, vec![vec![0, 1], vec![2], vec![3, 4, 5], vec![6]]);
        assert_eq!(
            chunks(&group, &sizes, 1).len(),
            sizes.len(),
            "a cap below every message: one each"
        );
    }
}
