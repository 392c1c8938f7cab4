//! The consumer runner: reads a consumer group's streams and applies each message
//! through the idempotency store. One file per role:
//!
//! - [`config`]: [`ConsumerConfig`] and [`StartFrom`]; [`builder`]: [`ConsumerBuilder`];
//!   [`stats`]: [`ConsumerStats`] and the metrics;
//! - [`groups`]: group creation; [`run`]: the loop of
//!   [`run_until`](Consumer::run_until), whose state [`health`] reports to probes;
//!   [`read`]: `XREADGROUP`; [`claim`]: `XAUTOCLAIM`;
//!   [`in_flight`]: the entries being processed, kept from looking idle;
//! - [`screen`]: the checks every entry meets before the store, in every mode;
//! - [`store`]: the idempotency store, blocking or async ([`ConsumerStore`]), whose kind
//!   decides where the work runs ([`executor`]);
//! - [`single`]: one transaction per message, on a blocking inbox run by the long-lived
//!   workers of [`work`]; [`batch`] and [`lanes`]: batch mode;
//! - [`failure`] and [`dead_letter`]: failed deliveries; [`ack`]: `XACK`;
//!   [`trim`]: the periodic trim;
//! - [`ordered`]: ordered mode, its own loop over leased streams and per-key queues.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::Dispatcher;
use redis::RedisResult;
use redis::streams::StreamId;

use crate::conn::Connector;
use crate::error::is_outage;

mod ack;
mod batch;
mod builder;
mod claim;
mod config;
mod dead_letter;
mod executor;
mod failure;
mod groups;
mod health;
mod in_flight;
mod lanes;
mod ordered;
mod read;
mod run;
mod screen;
mod single;
mod stats;
mod store;
mod trim;
mod work;

pub use builder::{ConsumerBuilder, NoInbox};
pub use config::{AfterDeadLetter, ConsumerConfig, OrderedConfig, StartFrom};
pub use health::ConsumerHealth;
pub use stats::ConsumerStats;
pub use store::{AsyncStore, ConsumerStore};

use ack::AckQueue;
pub(crate) use dead_letter::DEAD_LETTER_FIELDS;
use executor::Executor;
use read::Reader;
use stats::{Count, Counters};

#[doc = include_str!("../../docs/consumer.md")]
pub struct Consumer<I, C = <I as ConsumerStore>::Conn> {
    inner: Arc<Inner<I, C>>,
    /// Inside [`run_until`](Consumer::run_until): where finished work queues its acks.
    acks: Option<AckQueue>,
}

impl<I, C> Clone for Consumer<I, C> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            acks: self.acks.clone(),
        }
    }
}

impl<I, C> std::fmt::Debug for Consumer<I, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("group", &self.inner.group)
            .field("consumer_name", &self.inner.consumer_name)
            .field("streams", &self.inner.streams)
            .finish_non_exhaustive()
    }
}

struct Inner<I, C> {
    group: String,
    consumer_name: String,
    streams: Vec<Arc<str>>,
    /// On a Redis Cluster: hash-tagged streams, and commands grouped per slot.
    cluster: bool,
    dispatcher: Dispatcher<C>,
    inbox: I,
    /// Where the work on messages runs, as the store's kind has it.
    executor: Executor,
    config: ConsumerConfig,
    /// One reader for all streams; on a cluster one per hash slot.
    readers: Vec<Reader>,
    commands: Connector,
    counters: Counters,
    /// What [`Consumer::health`] reports, kept up by the run loop.
    health: health::HealthState,
}

/// One entry to process, read or claimed.
struct Job {
    stream: Arc<str>,
    entry: StreamId,
    delivery_count: u64,
}

/// How the work on one entry ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// Acknowledged (or queued for it): applied, a duplicate, ignored, or another
    /// group's redrive.
    Acked,
    /// Copied to the dead-letter stream and acknowledged.
    DeadLettered,
    /// Still pending: a handler failed (retried later), or Redis or the store failed as
    /// a whole (`outage`).
    Pending { outage: bool },
}

impl Outcome {
    /// Whether Redis or the store failed as a whole.
    fn outage(self) -> bool {
        matches!(self, Outcome::Pending { outage: true })
    }
}

/// How a job or a batch of jobs ended, reported to the run loop.
struct Done {
    /// The entries, no longer in flight.
    entries: Vec<(Arc<str>, String)>,
    /// Redis or the store failed as a whole: back off.
    outage: bool,
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.inner.group
    }

    /// This process's consumer name in the group.
    pub fn consumer_name(&self) -> &str {
        &self.inner.consumer_name
    }

    /// The streams read: the prefix plus each handled topic (`outbox:order.paid`), with
    /// the topic as hash tag on a cluster (`outbox:{order.paid}`).
    pub fn streams(&self) -> impl Iterator<Item = &str> {
        self.inner.streams.iter().map(|s| &**s)
    }

    /// Whether this consumer reads from a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.inner.cluster
    }

    /// The dead-letter stream of `stream`: `stream` plus the
    /// [`dead_letter_suffix`](ConsumerConfig::dead_letter_suffix), in the same hash slot
    /// on a cluster.
    pub fn dead_letter_stream(&self, stream: &str) -> String {
        format!("{stream}{}", self.inner.config.dead_letter_suffix)
    }

    /// The configuration in force.
    pub fn config(&self) -> &ConsumerConfig {
        &self.inner.config
    }

    /// After a Redis command: a failure checks the connection, is counted and logged.
    /// Returns whether it was an outage.
    async fn redis_done<T>(&self, result: RedisResult<T>, what: &str) -> bool {
        match result {
            Ok(_) => false,
            Err(e) => {
                self.inner.commands.check(&e).await;
                self.count(Count::RedisError, None);
                tracing::warn!(error = %e, "{what}");
                is_outage(&e)
            }
        }
    }
}

/// Whole milliseconds, at least 1, as Redis takes them (`BLOCK 0` would wait forever).
fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}
