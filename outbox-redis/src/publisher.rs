use std::time::Duration;

use outbox_core::{PublishOutcomes, Publisher, Rejected, StoredMessage};
use redis::{Client, IntoConnectionInfo, RedisResult, Value};

use crate::conn::Connector;
use crate::entry::entry_fields;
use crate::error::is_outage;
use crate::{Error, Result};

/// The default prefix of stream names: the stream of topic `order.paid` is
/// `outbox:order.paid`.
pub const DEFAULT_STREAM_PREFIX: &str = "outbox:";

/// Publisher settings. `Default` gives the `outbox:` prefix, no trimming, a 2 s connect
/// timeout and a 5 s response timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublisherConfig {
    /// Prepended to the topic to name its stream (default [`DEFAULT_STREAM_PREFIX`]).
    /// Consumers must use the same prefix.
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
/// The connection is opened on the first publish and replaced after a connection
/// error, so building a publisher never fails because Redis is down.
#[derive(Debug)]
pub struct RedisPublisher {
    conn: Connector,
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
        if config.max_len == Some(0) {
            return Err(Error::Config("max_len must be at least 1".into()));
        }
        let client = Client::open(redis)?;
        Ok(Self {
            conn: Connector::new(client, config.connect_timeout, config.response_timeout),
            config,
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &PublisherConfig {
        &self.config
    }

    /// The stream that carries `topic`.
    pub fn stream_for(&self, topic: &str) -> String {
        format!("{}{topic}", self.config.stream_prefix)
    }

    fn pipeline(&self, batch: &[StoredMessage]) -> redis::Pipeline {
        let mut pipe = redis::Pipeline::with_capacity(batch.len());
        pipe.ignore_errors();
        for m in batch {
            let cmd = pipe.cmd("XADD").arg(self.stream_for(&m.envelope.topic));
            if let Some(n) = self.config.max_len {
                cmd.arg("MAXLEN").arg("~").arg(n);
            }
            cmd.arg("*");
            for (field, value) in entry_fields(&m.envelope) {
                cmd.arg(field).arg(value);
            }
        }
        pipe
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
        let pipe = self.pipeline(batch);
        let replies: Vec<RedisResult<Value>> = match self.conn.get().await {
            Ok(mut conn) => match pipe.query_async(&mut conn).await {
                Ok(replies) => replies,
                Err(e) => {
                    self.conn.check(&e).await;
                    return Err(outbox_core::Error::broker_unavailable(e));
                }
            },
            Err(e) => return Err(outbox_core::Error::broker_unavailable(e)),
        };
        if replies.len() != batch.len() {
            return Err(outbox_core::Error::broker_unavailable(format!(
                "redis returned {} replies for a batch of {}",
                replies.len(),
                batch.len()
            )));
        }
        let mut outcomes = Vec::with_capacity(batch.len());
        for (m, reply) in batch.iter().zip(replies) {
            match reply {
                Ok(_) => outcomes.push(Ok(())),
                // A server that refuses every write is an outage, not this message's fault.
                Err(e) if is_outage(&e) => return Err(outbox_core::Error::broker_unavailable(e)),
                Err(e) => {
                    tracing::debug!(msg_id = %m.envelope.msg_id, error = %e, "redis rejected an entry");
                    metrics::counter!("outbox_redis_publish_rejected_total").increment(1);
                    outcomes.push(Err(Rejected::new(e.to_string())));
                }
            }
        }
        Ok(outcomes)
    }
}
