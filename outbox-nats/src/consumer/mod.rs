//! The consumer runner: durable pull consumers, one per group and stream, that apply
//! each message exactly once in effect through the idempotency store. One file per
//! role:
//!
//! - [`config`]: [`ConsumerConfig`]; [`builder`]: [`ConsumerBuilder`]; [`health`]:
//!   [`ConsumerHealth`] and [`ConsumerStats`];
//! - [`run`]: [`run_until`](Consumer::run_until), the streams and durable consumers it
//!   sets up and the pulls of its readers; [`lanes`]: the durable consumer each reader
//!   pulls from, in ordered mode one per partition;
//! - [`screen`]: the checks every message meets before the store;
//! - [`process`]: a message or a batch through the store, then its ack, nak or dead
//!   letter.
//!
//! The idempotency store ([`ConsumerStore`], [`AsyncStore`]) and where the work runs
//! ([`Executor`]) are outbox-core's, shared with outbox-redis.

use std::sync::Arc;

use async_nats::jetstream;
use outbox_core::__private::consumer::Executor;
use outbox_core::{ConsumerStore, Dispatcher, Partitions};

mod builder;
mod config;
mod health;
mod lanes;
mod process;
mod run;
pub(crate) mod screen;

pub use builder::{ConsumerBuilder, NoInbox};
pub use config::{ConsumerConfig, StartFrom};
pub use health::{ConsumerHealth, ConsumerStats};

use health::{Count, Counters, HealthState};

/// A consumer group's runner on NATS JetStream.
///
/// Build it with [`Consumer::builder`]: its handlers (by event type), the idempotency
/// store (`idempotency` or `idempotency_async`, as on outbox-redis) and a
/// [`ConsumerConfig`]; then [`run_until`](Self::run_until) a shutdown signal.
///
/// For each handled topic it reads the topic's stream through a durable pull consumer
/// named after the group (every process of the group shares it; the server hands each
/// message to one of them). A message is decoded by event type, applied in the store's
/// transaction together with its `(group, msg_id)` row, and acknowledged after the
/// commit; a duplicate is acknowledged and counted. A failed handler's message is
/// negatively acknowledged with a delay that doubles with each failure, and moved to
/// the dead-letter stream with its reason after
/// [`max_deliveries`](ConsumerConfig::max_deliveries); a message that cannot be decoded
/// goes there at once. An outage of the store costs no delivery.
///
/// Messages are handled concurrently (up to
/// [`max_in_flight`](ConsumerConfig::max_in_flight)), so messages of one key may be
/// applied out of order across redeliveries; ordered mode keeps their order.
///
/// # Ordered mode
///
/// With [`ConsumerConfig::ordered`], each partition subject of a partitioned topic (an
/// unpartitioned topic's subject counts as one partition) is read through a durable
/// consumer of its own, `<group>~p<partition>`, that the server lets have one message
/// in hand at a time across every process of the group: a partition's next message is
/// delivered once the one before is acknowledged, after its transaction committed (or
/// after it was dead-lettered). The messages of a key, which the publisher keeps in
/// order on their partition's subject, reach the handler in that order.
///
/// - A failing message holds its partition alone: it is delivered again after its
///   delay, before the partition's later messages, until it is applied or
///   dead-lettered after [`max_deliveries`](ConsumerConfig::max_deliveries); the
///   partition then moves on. A redriven dead letter comes after the messages of its
///   key published meanwhile.
/// - Every process pulls from every partition, so nothing is handed over: a process
///   that shuts down finishes its message in hand and stops pulling, and the next
///   message goes to another process at once. The message in hand of a process killed
///   or frozen is delivered to another after [`ack_wait`](ConsumerConfig::ack_wait):
///   the longest a partition waits for a reader that is gone.
/// - Throughput: one message in hand per partition (no concurrency or batching inside
///   one), so ordered throughput grows with the partition count.
///
/// The group's durable consumers of the unordered mode (named after the group) and of
/// ordered mode are different: a group switched from one to the other starts the new
/// ones from [`start_from`](ConsumerConfig::start_from), and the inbox skips what was
/// already applied.
pub struct Consumer<I, C = <I as ConsumerStore>::Conn> {
    inner: Arc<Inner<I, C>>,
}

impl<I, C> Clone for Consumer<I, C> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<I, C> std::fmt::Debug for Consumer<I, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("group", &self.inner.group)
            .field("topics", &self.inner.topics)
            .finish_non_exhaustive()
    }
}

/// A topic the consumer reads: its stream and the subjects the stream holds.
#[derive(Debug, Clone)]
pub(crate) struct Topic {
    pub(crate) name: Arc<str>,
    pub(crate) stream: Arc<str>,
    pub(crate) partitions: Partitions,
}

pub(crate) struct Inner<I, C> {
    group: String,
    client: async_nats::Client,
    js: jetstream::Context,
    topics: Vec<Topic>,
    dispatcher: Dispatcher<C>,
    inbox: I,
    /// Where the work on messages runs, as the store's kind has it.
    executor: Executor,
    config: ConsumerConfig,
    counters: Counters,
    health: HealthState,
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// The consumer group: also the durable consumer's name on every stream.
    pub fn group(&self) -> &str {
        &self.inner.group
    }

    /// The streams read, one per handled topic.
    pub fn streams(&self) -> impl Iterator<Item = &str> {
        self.inner.topics.iter().map(|t| &*t.stream)
    }

    /// The configuration in force.
    pub fn config(&self) -> &ConsumerConfig {
        &self.inner.config
    }

    /// What the consumer did since it was built.
    pub fn stats(&self) -> ConsumerStats {
        self.inner.counters.snapshot()
    }

    /// The consumer's state for probes. The stall limit is the longest a healthy round
    /// takes: a pull's wait, the shutdown timeout for the messages in hand, and slack.
    pub fn health(&self) -> ConsumerHealth {
        let c = &self.inner.config;
        let stall = c.fetch_wait + c.ack_wait + std::time::Duration::from_secs(10);
        self.inner.health.snapshot(stall)
    }

    fn count(&self, what: Count, n: u64) {
        self.inner.counters.add(what, &self.inner.group, n);
    }
}
