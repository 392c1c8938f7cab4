use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use outbox_core::{
    InvalidConfig, Partitions, PublishOutcomes, Publisher, RejectKind, Rejected, StoredMessage,
};
use redis::{IntoConnectionInfo, RedisError, RedisResult, Value};

use crate::conn::{
    Conn, Connector, Target, by_slot, check_prefix, partition_stream_name, partitions_key,
    query_all, stream_name,
};
use crate::entry::entry_fields;
use crate::error::is_outage;
use crate::{Error, Result};

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
    /// Whether the replicas must show they have caught up before the next write (see
    /// [`replicas_behind`](Self::replicas_behind)): true at the start, after an outage
    /// and after an unmet durability wait.
    catch_up_first: AtomicBool,
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
            catch_up_first: AtomicBool::new(true),
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
        self.catch_up_first = AtomicBool::new(true);
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
        self.catch_up_first.store(true, Ordering::Relaxed);
    }

    /// Before writing at the start, after an outage or after an unmet durability wait:
    /// the durability wait alone, on each part's node (the read of the part's first
    /// stream routes it there on a cluster). `WAIT` counts the replicas that have
    /// acknowledged the last write of its own client: on the connection that wrote
    /// before, it waits for those writes; on a new connection (no write yet) it counts
    /// the replicas in sync. Returns, per part, why it must not be written now.
    ///
    /// Why before and not only after: an unmet wait after the `XADD`s leaves the entries
    /// on the stream while their rows stay NEW. Without this check every try of the
    /// relay (one per backoff) would append the same batch again for as long as the
    /// replicas stay away; with it, an unmet wait appends at most one batch, and the
    /// tries that follow write nothing until the replicas have caught up.
    async fn replicas_behind(
        &self,
        conn: &mut Conn,
        streams: &Streams,
        parts: &[Vec<(Vec<usize>, usize)>],
    ) -> Vec<Option<String>> {
        let Some((wait, _)) = self.config.durability.command() else {
            return vec![None; parts.len()];
        };
        if !self.catch_up_first.load(Ordering::Relaxed) {
            return vec![None; parts.len()];
        }
        let pipes = (parts.iter())
            .map(|part| {
                let mut pipe = redis::pipe();
                pipe.ignore_errors()
                    .cmd("XLEN")
                    .arg(streams.of(part[0].0[0]))
                    .add_command(wait.clone());
                pipe
            })
            .collect();
        let mut behind = Vec::with_capacity(parts.len());
        for result in query_all::<Vec<RedisResult<Value>>>(conn, pipes).await {
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
            behind.push(unmet.map(|r| format!("the replicas lag behind earlier writes: {r}")));
        }
        if behind.iter().all(Option::is_none) {
            self.catch_up_first.store(false, Ordering::Relaxed);
        } else {
            metrics::counter!("outbox_redis_durability_unmet_total").increment(1);
        }
        behind
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

    /// The commands of `batch[range]` (one hash slot), then the durability wait. Each
    /// `XADD` is built in buffers of its exact size: grown an argument at a time, they
    /// cost the relay more than the rest of the publish.
    fn pipeline(
        &self,
        streams: &Streams,
        fields: &[Fields<'_>],
        part: &[usize],
    ) -> redis::Pipeline {
        let mut pipe = redis::Pipeline::with_capacity(part.len() + 1);
        pipe.ignore_errors();
        let max_len = self.config.max_len.map(|n| n.to_string());
        for &i in part {
            let stream = streams.of(i);
            let args = 3 + 2 * fields[i].len() + if max_len.is_some() { 3 } else { 0 };
            let bytes = "XADD*".len()
                + stream.len()
                + max_len.as_ref().map_or(0, |n| "MAXLEN~".len() + n.len())
                + fields[i]
                    .iter()
                    .map(|(f, v)| f.len() + v.len())
                    .sum::<usize>();
            let mut cmd = redis::Cmd::with_capacity(args, bytes);
            cmd.arg("XADD").arg(stream);
            if let Some(n) = &max_len {
                cmd.arg("MAXLEN").arg("~").arg(n.as_str());
            }
            cmd.arg("*");
            for (field, value) in &fields[i] {
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

/// The stream of each message of a batch: one name per distinct stream (usually one per
/// topic), not one `String` per message.
struct Streams {
    names: Vec<String>,
    /// Per message, its stream's index in `names`.
    of: Vec<usize>,
}

impl Streams {
    fn of(&self, i: usize) -> &str {
        &self.names[self.of[i]]
    }
}

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
        let streams = self.streams(batch);
        let fields: Vec<Fields<'_>> = batch.iter().map(|m| entry_fields(&m.envelope)).collect();
        let sizes: Vec<usize> = (0..batch.len())
            .map(|i| entry_bytes(streams.of(i), &fields[i]))
            .collect();
        let cap = self.pipeline_bytes.load(Ordering::Relaxed);
        // Per hash slot (a single group unless on a cluster), its pipelines in order.
        let parts: Vec<Vec<(Vec<usize>, usize)>> = by_slot(
            self.cluster,
            (0..batch.len()).map(|i| (i, streams.of(i))),
            |(_, s)| s,
        )
        .into_iter()
        .map(|group| {
            let group: Vec<usize> = group.into_iter().map(|(i, _)| i).collect();
            chunks(&group, &sizes, cap)
        })
        .collect();

        let mut conn = match self.conn.get().await {
            Ok(conn) => conn,
            Err(e) => {
                self.outage_seen();
                return Err(outbox_core::Error::broker_unavailable(e));
            }
        };
        self.check_durability(&mut conn).await?;
        self.record_partitions(&mut conn).await?;

        let mut outcomes = Answers::new(batch.len());
        // A part stops at its first pipeline that fails; the rest of it is not sent. A
        // part whose replicas lag behind is not sent at all.
        let mut stopped = self.replicas_behind(&mut conn, &streams, &parts).await;
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
            // Each pipeline goes whole, never in slices: a slice waiting for room in the
            // connection's queue could be overtaken by the next one, which would break key
            // order and let the durability wait go before writes it must cover.
            let results = query_all(&mut conn, pipes).await;
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
                            outcomes.set(i, outcome);
                        }
                        stopped[p] = halt;
                    }
                    Err(e) => {
                        if e.is_timeout() {
                            timed_out = true;
                            self.shrink(*bytes);
                        }
                        self.outage_seen();
                        self.conn.check(&e).await;
                        let reason = e.to_string();
                        for &i in part {
                            outcomes.set(i, Err(Rejected::unavailable(reason.clone())));
                        }
                        stopped[p] = Some(reason);
                    }
                }
            }
        }
        if !timed_out {
            self.grow();
        }
        // The pipelines after a failed one (or after replicas found behind) were not sent.
        for (p, reason) in stopped.iter().enumerate() {
            let Some(reason) = reason else { continue };
            for (part, _) in &parts[p] {
                for &i in part {
                    outcomes.unanswered(i, || {
                        Rejected::unavailable(format!(
                            "not sent after an earlier failure: {reason}"
                        ))
                    });
                }
            }
        }
        let outcomes = outcomes.into_outcomes();
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
    /// The stream of each message of `batch` ([`stream_for_key`](Self::stream_for_key)),
    /// each distinct name built once.
    fn streams(&self, batch: &[StoredMessage]) -> Streams {
        let mut names: Vec<String> = Vec::new();
        // The index of each (topic, partition or u32::MAX) in `names`; a partitioned
        // topic can have up to 1024 streams, so a map rather than a search.
        let mut known: HashMap<(&str, u32), usize> = HashMap::new();
        let mut of = Vec::with_capacity(batch.len());
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
                names.push(self.stream_for_key(topic, &m.envelope.key));
                names.len() - 1
            });
            of.push(index);
        }
        Streams { names, of }
    }

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
            self.catch_up_first.store(true, Ordering::Relaxed);
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
}
