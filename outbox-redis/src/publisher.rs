use std::time::Duration;

use outbox_core::{PublishOutcomes, Publisher, Rejected, StoredMessage};
use redis::{IntoConnectionInfo, RedisResult, Value};

use crate::conn::{Connector, Target, by_slot, check_prefix, query_all, stream_name};
use crate::entry::entry_fields;
use crate::error::is_outage;
use crate::{Error, Result};

/// The default prefix of stream names: the stream of topic `order.paid` is
/// `outbox:order.paid` (`outbox:{order.paid}` on a Redis Cluster).
pub const DEFAULT_STREAM_PREFIX: &str = "outbox:";

/// Publisher settings. `Default` gives the `outbox:` prefix, no trimming, a 2 s connect
/// timeout and a 5 s response timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// and keep this only as a safety bound well above any expected backlog.
    pub max_len: Option<usize>,
    /// How long opening a connection may take (default 2 s).
    pub connect_timeout: Duration,
    /// How long a batch may wait for its replies (default 5 s). A timeout is reported as
    /// an outage.
    pub response_timeout: Duration,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            stream_prefix: DEFAULT_STREAM_PREFIX.to_owned(),
            max_len: None,
            connect_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(5),
        }
    }
}

/// Publishes outbox batches to Redis Streams: one stream per topic, one pipelined round
/// trip per batch. Implements [`outbox_core::Publisher`], so it plugs into
/// [`outbox_core::Relay`].
///
/// Each message becomes one entry (`XADD <prefix><topic> * ...`) with the fields listed
/// at [`ENTRY_FIELDS`](crate::ENTRY_FIELDS). The pipeline is not a transaction: every
/// command succeeds or fails on its own, and the relay gets one result per message.
/// A connection error, a timeout or a server that refuses all writes (`OOM`, `LOADING`,
/// `READONLY`, ...) fails the whole batch as
/// [`BrokerUnavailable`](outbox_core::Error::BrokerUnavailable), which backs the relay off
/// without spending any message's retries; any other error reply (such as `WRONGTYPE`
/// when the stream's key holds another type) rejects just that message.
///
/// On a Redis Cluster (`RedisPublisher::cluster`, feature `cluster`) the streams are
/// hash-tagged (`<prefix>{<topic>}`), the batch is split per hash slot (per topic, in
/// practice) and each part is one pipeline, all sent at once: a batch costs one round
/// trip to each node it touches, concurrently. If one part fails as a whole, the batch
/// is an outage even though the other parts were written; the relay publishes them
/// again, and consumers recognise the duplicates by `msg_id`.
///
/// The connection is opened on the first publish and replaced after a connection
/// error, so building a publisher never fails because Redis is down.
#[derive(Debug)]
pub struct RedisPublisher {
    conn: Connector,
    cluster: bool,
    config: PublisherConfig,
}

impl RedisPublisher {
    /// A publisher with the default [`PublisherConfig`]. `redis` is a URL such as
    /// `redis://127.0.0.1:6379` or anything else the redis crate accepts; only its syntax
    /// is checked here.
    pub fn new(redis: impl IntoConnectionInfo) -> Result<Self> {
        Self::with_config(redis, PublisherConfig::default())
    }

    /// A publisher with `config`.
    pub fn with_config(redis: impl IntoConnectionInfo, config: PublisherConfig) -> Result<Self> {
        Self::on(Target::single(redis)?, config)
    }

    /// A publisher to the Redis Cluster reachable through any of `nodes` (URLs such as
    /// `redis://127.0.0.1:7000`; the cluster's other nodes are discovered), with the
    /// default [`PublisherConfig`]. Its streams are hash-tagged: the stream of topic
    /// `order.paid` is `outbox:{order.paid}`. Consumers must be built with
    /// [`Consumer::builder_cluster`](crate::Consumer::builder_cluster), which names
    /// streams the same way.
    ///
    /// Only the addresses' syntax is checked here (and that there is at least one).
    #[cfg(feature = "cluster")]
    pub fn cluster<T: IntoConnectionInfo>(nodes: impl IntoIterator<Item = T>) -> Result<Self> {
        Self::cluster_with_config(nodes, PublisherConfig::default())
    }

    /// A publisher to the Redis Cluster reachable through any of `nodes`, with `config`;
    /// see [`cluster`](Self::cluster). The stream prefix must not contain `{` or `}`.
    #[cfg(feature = "cluster")]
    pub fn cluster_with_config<T: IntoConnectionInfo>(
        nodes: impl IntoIterator<Item = T>,
        config: PublisherConfig,
    ) -> Result<Self> {
        Self::on(Target::cluster(nodes)?, config)
    }

    fn on(target: Target, config: PublisherConfig) -> Result<Self> {
        if config.max_len == Some(0) {
            return Err(Error::Config("max_len must be at least 1".into()));
        }
        let cluster = target.is_cluster();
        check_prefix(&config.stream_prefix, cluster)?;
        Ok(Self {
            conn: target.connector(config.connect_timeout, config.response_timeout)?,
            cluster,
            config,
        })
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

    /// The batch's positions split per pipeline (a single one unless on a cluster), and
    /// each pipeline.
    fn pipelines(&self, batch: &[StoredMessage]) -> (Vec<Vec<usize>>, Vec<redis::Pipeline>) {
        let streams: Vec<String> = batch
            .iter()
            .map(|m| self.stream_for(&m.envelope.topic))
            .collect();
        let groups: Vec<Vec<usize>> =
            by_slot(self.cluster, streams.iter().enumerate(), |(_, s)| {
                s.as_str()
            })
            .into_iter()
            .map(|group| group.into_iter().map(|(i, _)| i).collect())
            .collect();
        let pipes = groups
            .iter()
            .map(|group| {
                let mut pipe = redis::Pipeline::with_capacity(group.len());
                pipe.ignore_errors();
                for &i in group {
                    let cmd = pipe.cmd("XADD").arg(&streams[i]);
                    if let Some(n) = self.config.max_len {
                        cmd.arg("MAXLEN").arg("~").arg(n);
                    }
                    cmd.arg("*");
                    for (field, value) in entry_fields(&batch[i].envelope) {
                        cmd.arg(field).arg(value.as_ref());
                    }
                }
                pipe
            })
            .collect();
        (groups, pipes)
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
        let (groups, pipes) = self.pipelines(batch);
        let mut conn = match self.conn.get().await {
            Ok(conn) => conn,
            Err(e) => return Err(outbox_core::Error::broker_unavailable(e)),
        };
        let results: Vec<RedisResult<Vec<RedisResult<Value>>>> = query_all(&mut conn, pipes).await;
        let mut outcomes: Vec<Option<Result<(), Rejected>>> = vec![None; batch.len()];
        for (group, result) in groups.iter().zip(results) {
            let replies = match result {
                Ok(replies) => replies,
                Err(e) => {
                    self.conn.check(&e).await;
                    return Err(outbox_core::Error::broker_unavailable(e));
                }
            };
            if replies.len() != group.len() {
                return Err(outbox_core::Error::broker_unavailable(format!(
                    "redis returned {} replies for a pipeline of {}",
                    replies.len(),
                    group.len()
                )));
            }
            for (&i, reply) in group.iter().zip(replies) {
                outcomes[i] = Some(match reply {
                    Ok(_) => Ok(()),
                    // A server that refuses every write (or a slot that moved) is an
                    // outage, not this message's fault.
                    Err(e) if is_outage(&e) => {
                        self.conn.check(&e).await;
                        return Err(outbox_core::Error::broker_unavailable(e));
                    }
                    Err(e) => {
                        let m = &batch[i];
                        tracing::debug!(msg_id = %m.envelope.msg_id, error = %e, "redis rejected an entry");
                        metrics::counter!("outbox_redis_publish_rejected_total").increment(1);
                        Err(Rejected::new(e.to_string()))
                    }
                });
            }
        }
        Ok(outcomes
            .into_iter()
            .map(|o| o.expect("every message is in one pipeline"))
            .collect())
    }
}
