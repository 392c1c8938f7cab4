//! The consumer runner: reads a consumer group's streams and applies each message
//! through the idempotency store. One file per role:
//!
//! - [`config`]: [`ConsumerConfig`] and [`StartFrom`]; [`builder`]: [`ConsumerBuilder`];
//!   [`stats`]: [`ConsumerStats`] and the metrics;
//! - [`groups`]: group creation; [`run`]: the loop of
//!   [`run_until`](Consumer::run_until), whose state [`health`] reports to probes;
//!   [`read`]: `XREADGROUP`; [`claim`]: `XAUTOCLAIM`;
//!   [`in_flight`]: the entries being processed, kept from looking idle;
//! - [`store`]: the idempotency store, blocking or async ([`ConsumerStore`]);
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
mod failure;
mod groups;
mod health;
mod in_flight;
mod lanes;
mod ordered;
mod read;
mod run;
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
use read::Reader;
use stats::{Count, Counters};

/// Reads a consumer group's streams and applies each message exactly once in effect
/// through typed [`Handler`](outbox_core::Handler)s.
///
/// Per entry: the event type picks the handler and the payload is decoded into its type;
/// then the idempotency store opens a transaction, records `(group, msg_id)` and runs the
/// handler with the transaction's connection — a blocking [`Inbox`](outbox_core::Inbox)
/// on a blocking thread (in single mode one long-lived worker thread per transaction
/// in flight, which takes the next entry from a queue), an
/// [`AsyncInbox`](outbox_core::AsyncInbox)
/// ([`idempotency_async`](ConsumerBuilder::idempotency_async)) awaited, with no blocking
/// thread per message; after the commit the entry is acknowledged (`XACK`). A message already recorded is acknowledged
/// without running the handler, and counted as a duplicate.
///
/// - A handler error or panic rolls the transaction back and leaves the entry pending.
///   After [`min_idle`](ConsumerConfig::min_idle) it is claimed again (`XAUTOCLAIM`, by
///   this consumer or another one of the group; this also takes over the entries of
///   consumers that crashed) and retried. When it fails on its
///   [`max_deliveries`](ConsumerConfig::max_deliveries)-th delivery it is copied to the
///   dead-letter stream with the reason and then acknowledged.
/// - An entry that cannot be decoded, or whose type has no handler, goes to the
///   dead-letter stream at once (or is acknowledged and counted, with
///   [`ignore_unknown_types`](ConsumerConfig::ignore_unknown_types)).
/// - An outage of the idempotency store does not count as a delivery: the entry's
///   delivery count is set back, so a long database outage dead-letters nothing.
///
/// # Batch mode
///
/// With [`batch_size`](ConsumerConfig::batch_size) set, the messages of one read are
/// applied in batches: one store transaction per batch with a savepoint per message
/// ([`Dispatcher::consume_batch`]), then one `XACK` per stream for the applied and
/// duplicate entries. The rules above hold per message: a handler error or panic rolls
/// back only its message, which stays pending, is retried and eventually dead-lettered;
/// poison is dead-lettered at once; a store outage fails the batch as a whole and
/// spends no delivery. Fewer commits make it faster where the commit dominates; with an
/// inbox without savepoints (the default [`Inbox::process_batch`](outbox_core::Inbox::process_batch)) it behaves like
/// single mode.
///
/// Batches are formed per key: each key is hashed into one of `max_in_flight` lanes,
/// the same in every consumer process, and one task per lane runs its entries in stream
/// order, in batches one after another; the batches running side by side in a consumer
/// share no key, so handlers that update their key's row (an account, an order) never
/// wait for a sibling batch. Within a batch the keys come in byte order: batches of two
/// consumer processes that share keys (lane against lane of the same number) lock those
/// rows in the same order, and wait for each other instead of deadlocking. A few hot
/// keys use as few lanes.
///
/// # Partitioned topics and ordered mode
///
/// A topic whose event type declares `#[outbox(partitions = N)]` (or that
/// [`ConsumerConfig::with_partitions`] names) is read as its `N` partition streams
/// (`<prefix><topic>:<p>`); everything above holds per stream.
///
/// With [`ordered`](ConsumerConfig::ordered), each stream is read by one consumer of the
/// group at a time, the holder of its lease in Redis, and the entries of one key are
/// handled one after another in stream order: a failed entry runs again in this process
/// (after the outage backoff's pause for its delivery count), holding its key back,
/// until it is applied or dead-lettered; other keys go on, up to `max_in_flight` at
/// once. A stream whose holder died is taken over after the lease TTL, its pending
/// entries first and in order. See [`OrderedConfig`] and docs/partitions.md ("Ordered consumers").
///
/// # Acknowledgements
///
/// An entry is acknowledged only after its transaction committed (or after it was
/// dead-lettered). The acks of entries finished around the same time share one `XACK`
/// per stream, sent by a task of the run while the next messages are processed; on
/// shutdown the run sends the queued acks before it returns. A failed `XACK` leaves
/// its entries pending: they are claimed again and found to be duplicates.
///
/// Dead-letter entries (`<stream>:dead` by default) carry `reason`, `delivery_count`,
/// `group`, `stream` and `entry_id`, followed by the original entry's fields.
///
/// On a Redis Cluster (`Consumer::builder_cluster`, feature `cluster`) each hash slot's
/// streams are read by their own blocking `XREADGROUP`, side by side; see
/// [Redis Cluster](crate#redis-cluster).
///
/// Effects outside the database (an HTTP call, an e-mail) go in an
/// [`AsyncHandler`](outbox_core::AsyncHandler), registered with
/// [`handle_async`](ConsumerBuilder::handle_async). Such an effect is only as idempotent
/// as its own target: a crash after the call and before the commit repeats it.
pub struct Consumer<I, C = <I as ConsumerStore>::Conn> {
    inner: Arc<Inner<I, C>>,
    /// Inside [`run_until`](Consumer::run_until): where finished work queues its acks.
    acks: Option<AckQueue>,
    /// On a worker of single mode ([`work`]): a blocking store's transactions run on the
    /// calling thread.
    on_worker: bool,
}

impl<I, C> Clone for Consumer<I, C> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            acks: self.acks.clone(),
            on_worker: self.on_worker,
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
    /// Shared with the store's blocking tasks in batch mode.
    dispatcher: Arc<Dispatcher<C>>,
    inbox: Arc<I>,
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
    /// Acknowledged (or queued for it): applied, a duplicate, or ignored.
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
