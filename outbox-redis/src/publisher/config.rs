//! [`PublisherConfig`] and the [`Durability`] it asks for.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_core::{InvalidConfig, OutboxEvent, Partitions};
use redis::Value;

/// The default prefix of stream names: the stream of topic `order.paid` is
/// `outbox:order.paid` (`outbox:{order.paid}` on a Redis Cluster).
pub const DEFAULT_STREAM_PREFIX: &str = "outbox:";

/// The default cap on the bytes of one pipeline: 8 MiB (see
/// [`PublisherConfig::max_pipeline_bytes`]).
pub const DEFAULT_MAX_PIPELINE_BYTES: usize = 8 << 20;

/// When the relay may count a message as published, and so mark it SENT: what a
/// [`RedisPublisher`](crate::RedisPublisher) waits for after its `XADD`s. See [`PublisherConfig::durability`].
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
    /// duplicate on the stream for each, which consumers skip by `msg_id`). Until the
    /// replicas have acknowledged what it wrote, the publisher writes nothing more: its
    /// next tries repeat the wait alone (on a new connection, at the start or after an
    /// outage, that counts the replicas in sync; on a cluster, per shard), so a primary
    /// left without replicas gets one copy of a batch per relay, not one per try. This
    /// narrows, but does not close, the window of a failover losing an entry: Redis
    /// replication stays asynchronous, and an acknowledging replica may itself not have
    /// fsynced.
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
    /// outage, as for [`Replicas`](Self::Replicas), and the same wait, alone, comes
    /// before the next write. A server without `WAITAOF` (before 7.2), or `local` on a
    /// server without `appendonly yes`, stops the relay with
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
    pub(super) fn command(&self) -> Option<(redis::Cmd, Duration)> {
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
    pub(super) fn probe(&self) -> Option<redis::Cmd> {
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
    pub(super) fn unmet(&self, reply: &Value) -> Option<String> {
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

    pub(super) fn timeout(&self) -> Option<Duration> {
        match *self {
            Self::Reply => None,
            Self::Replicas { timeout, .. } | Self::Aof { timeout, .. } => Some(timeout),
        }
    }

    pub(super) fn name(&self) -> &'static str {
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
/// timeout, a 5 s response timeout, pipelines of at most 8 MiB,
/// [`Durability::Reply`] and no partitioned topic. Each `with_*` setter changes one field and keeps the others;
/// [`RedisPublisher::with_config`](crate::RedisPublisher::with_config) validates the whole.
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
///
/// # Pipelines
///
/// A batch goes to Redis as pipelines of at most
/// [`max_pipeline_bytes`](Self::max_pipeline_bytes), one after the other, in order (a
/// larger message goes alone). A pipeline that misses its
/// [`response_timeout`](Self::response_timeout) is an outage: what earlier pipelines of
/// the batch published is recorded, the rest is published again later, and the
/// publisher halves its pipelines (down to one message each), growing them back after
/// calls without a timeout, so a slow link cannot make a batch time out on every
/// attempt. A message that cannot reach Redis alone within the timeout stays an outage
/// (logged, never dead-lettered): set the timeout above what your largest message takes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PublisherConfig {
    /// Prepended to the topic to name its stream (default [`DEFAULT_STREAM_PREFIX`]);
    /// consumers must use the same. Without `{` or `}` on a cluster, where the topic is
    /// a hash tag ([Redis Cluster](crate#redis-cluster)).
    pub stream_prefix: String,
    /// `MAXLEN ~ n` on every XADD (default `None`), which trims read or not: a safety
    /// bound well above any backlog; [`trim_acknowledged`](crate::trim_acknowledged)
    /// never removes pending work. From 1 to `i64::MAX`.
    pub max_len: Option<usize>,
    /// How long opening a connection may take (default 2 s).
    pub connect_timeout: Duration,
    /// How long one pipeline may wait for its replies, sending included (default 5 s);
    /// see [pipelines](Self#pipelines).
    pub response_timeout: Duration,
    /// The most bytes of entries one pipeline carries (default
    /// [`DEFAULT_MAX_PIPELINE_BYTES`], 8 MiB), which bounds a round trip and the memory
    /// of a batch in flight; see [pipelines](Self#pipelines).
    pub max_pipeline_bytes: usize,
    /// What a row waits for before it is SENT (default [`Durability::Reply`]; see
    /// "What SENT means" above).
    pub durability: Durability,
    /// Topics spread over partition streams `<prefix><topic>:<p>` by
    /// [`outbox_core::partition_of`] their ordering key (default none); every relay must
    /// be given the same counts. See [`with_partitions`](Self::with_partitions).
    pub partitions: BTreeMap<String, Partitions>,
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
            partitions: BTreeMap::new(),
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

    /// Sets the partition count of `topic` in [`partitions`](Self::partitions), keeping
    /// the other topics'. Its messages go to `<prefix><topic>:<p>` (`<prefix>{<topic>:<p>}`
    /// on a cluster); a topic with [`Partitions::ONE`], or not listed, keeps its one
    /// stream. The publisher records each count in the hash `<prefix>partitions`, where
    /// consumers check theirs; docs/partitions.md says how to change one on a live system.
    ///
    /// ```
    /// use outbox_core::Partitions;
    /// use outbox_redis::{PublisherConfig, RedisPublisher};
    ///
    /// let config = PublisherConfig::default().with_partitions("order.paid", Partitions::new(8)?);
    /// let publisher = RedisPublisher::new("redis://127.0.0.1:6379")?.with_config(config)?;
    /// assert_eq!(publisher.stream_for_key("order.paid", "order-42"), "outbox:order.paid:4");
    /// assert_eq!(publisher.stream_for_key("order.shipped", "order-42"), "outbox:order.shipped");
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn with_partitions(mut self, topic: impl Into<String>, partitions: Partitions) -> Self {
        self.partitions.insert(topic.into(), partitions);
        self
    }

    /// Sets the partition count of each of `E`'s topics to
    /// [`E::PARTITIONS`](OutboxEvent::PARTITIONS) (`#[outbox(partitions = N)]`), keeping
    /// the other topics': the relay then publishes where the event type says.
    #[must_use]
    pub fn with_partitions_of<E: OutboxEvent>(mut self) -> Self {
        let partitions = Partitions::of_event::<E>();
        for topic in E::TOPICS {
            self.partitions.insert((*topic).to_owned(), partitions);
        }
        self
    }

    /// Checks every field: `max_len` from 1 to `i64::MAX`, `max_pipeline_bytes` at
    /// least 1, a durability timeout more than zero and less than `response_timeout`,
    /// topics in `partitions` made of `[A-Za-z0-9._-]` (1 to 128 bytes, as the derive
    /// requires; in particular no `:`, which separates the partition in a stream name).
    /// [`RedisPublisher::with_config`](crate::RedisPublisher::with_config) calls it (and checks the prefix against the
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
        for topic in self.partitions.keys() {
            if let Some(rule) = topic_rule(topic) {
                return Err(InvalidConfig::new(
                    "partitions",
                    format!("topic {topic:?} {rule}"),
                ));
            }
        }
        Ok(())
    }
}

/// The longest topic: the width of the outbox table's `topic` column.
const MAX_TOPIC_LEN: usize = 128;

/// What is wrong with `topic` as a topic name, if anything.
fn topic_rule(topic: &str) -> Option<&'static str> {
    if topic.is_empty() || topic.len() > MAX_TOPIC_LEN {
        Some("must be 1 to 128 bytes long")
    } else if !topic
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        Some("must contain only ASCII letters, digits, `.`, `_` and `-`")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

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
    fn partitioned_topics_must_be_topic_names() {
        let eight = Partitions::new(8).unwrap();
        let ok = PublisherConfig::default()
            .with_partitions("order.paid", eight)
            .with_partitions("a-b_c.9", Partitions::ONE);
        assert!(ok.validate().is_ok());
        assert_eq!(ok.partitions.len(), 2, "a setter keeps the other topics");
        for topic in [
            "",
            "order:paid",
            "{order}",
            "order paid",
            "ключ",
            &"x".repeat(129),
        ] {
            let err = ok
                .clone()
                .with_partitions(topic, eight)
                .validate()
                .unwrap_err();
            assert_eq!(err.field(), "partitions", "{topic:?}");
            assert!(err.rule().contains(&format!("{topic:?}")), "{err}");
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
