use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox_core::{
    Delivery, Dispatcher, Handler, Inbox, InboxBatchOutcomes, OutageBackoff, OutboxEvent, Prepared,
    Processed,
};
use redis::streams::{StreamAutoClaimReply, StreamId, StreamPendingCountReply, StreamReadReply};
use redis::{IntoConnectionInfo, RedisResult};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::Instrument as _;

use crate::conn::{
    Conn, Connector, Target, by_slot, check_prefix, query_all, stream_name, topic_of,
};
use crate::entry::{envelope_from_fields, value_bytes};
use crate::error::is_outage;
use crate::publisher::DEFAULT_STREAM_PREFIX;
use crate::trim::{TrimReport, trim_acknowledged};
use crate::{Error, Result};

/// Where a newly created consumer group starts reading.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StartFrom {
    /// From the first entry still in the stream (`0`): nothing published before the
    /// group's first start is lost. The default.
    #[default]
    Beginning,
    /// From entries added after the group is created (`$`).
    End,
}

/// Consumer settings; `Default` gives the values documented on each field.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsumerConfig {
    /// Prepended to each topic to name its stream (default `outbox:`, as the publisher's).
    /// On a cluster the topic is then wrapped in braces (`outbox:{order.paid}`), and the
    /// prefix must not contain `{` or `}`.
    pub stream_prefix: String,
    /// This process's consumer name within the group (default `None`: a name unique per
    /// process, `<hostname>-<pid>-<random>`). Set it only to something unique per process.
    pub consumer_name: Option<String>,
    /// Where a group that does not exist yet starts (default [`StartFrom::Beginning`]).
    pub start_from: StartFrom,
    /// How long one `XREADGROUP ... BLOCK` waits for new entries (default 2 s). The read
    /// connection's response timeout is this plus [`response_timeout`](Self::response_timeout),
    /// so blocking reads are never cut short by the client.
    pub block: Duration,
    /// Most entries read per stream and call (default 64). In batch mode a read takes up
    /// to [`batch_size`](Self::batch_size) entries per free batch instead.
    pub read_count: usize,
    /// Most messages processed at once (default 16); with a database inbox, at most the
    /// pool's size is useful. In batch mode: most batches (transactions) at once. Up to
    /// as many entries again (batches in batch mode) are read ahead and wait for a free
    /// slot, so that the next message is at hand when one finishes.
    pub max_in_flight: usize,
    /// Opt-in batch mode (default `None`: one transaction per message). With `Some(n)`,
    /// the entries of one read are split into batches of at most `n` messages, and each
    /// batch is one transaction of the idempotency store with a savepoint per message
    /// ([`Inbox::process_batch`]); the applied and duplicate entries are acknowledged
    /// after the commit, with one `XACK` per stream. Batches are formed per key (the
    /// entry's `key` field): the keys are hashed into `max_in_flight` lanes, one
    /// transaction runs per lane at a time, so that the batches running side by side
    /// share no key; within a batch the keys come in byte order, so that consumers
    /// whose batches share keys lock their rows in the same order and do not deadlock
    /// (see [`Consumer`]). A failing or panicking handler rolls
    /// back only its own message, which stays pending and is retried and dead-lettered
    /// as in single mode. A store failure fails the whole batch as an outage (nothing
    /// committed; delivery counts are set back). `Some(100)` is a good start; a larger
    /// batch holds its transaction's locks longer.
    pub batch_size: Option<usize>,
    /// How long an entry stays unacknowledged before it is claimed again and retried
    /// (default 30 s). This is also how long a crashed consumer's entries wait. Keep it
    /// well above the slowest handler.
    pub min_idle: Duration,
    /// How often pending entries are looked for with `XAUTOCLAIM` (default 5 s); at
    /// most once per read, so a long [`block`](Self::block) spaces claims out too.
    pub claim_interval: Duration,
    /// Deliveries after which a failing message is dead-lettered (default 5). The handler
    /// runs at most this many times; its error on the last one is the recorded reason.
    /// An entry claimed with a higher delivery count (its consumers crashed or stalled
    /// while handling it) is dead-lettered without running the handler again.
    pub max_deliveries: u64,
    /// Appended to a stream's name to name its dead-letter stream (default `:dead`).
    pub dead_letter_suffix: String,
    /// Most entries a dead-letter stream keeps (default `Some(100_000)`): each
    /// dead-letter `XADD` carries `MAXLEN n`, so the oldest dead letters are removed
    /// once there are `n`. The bound is exact, not `~`: dead letters are rare, so the
    /// cost of exact trimming does not matter, and the stream never holds more than `n`.
    /// `None` keeps every dead letter (the stream then grows until someone deletes
    /// from it). Must be at least 1.
    pub dead_letter_max_len: Option<usize>,
    /// Acknowledge and count entries whose event type has no handler, instead of
    /// dead-lettering them (default `false`). Useful when several consumer groups share
    /// a topic and each handles only some of its types.
    pub ignore_unknown_types: bool,
    /// How long opening a connection may take (default 2 s).
    pub connect_timeout: Duration,
    /// Response timeout of every command except the blocking read (default 5 s).
    pub response_timeout: Duration,
    /// Opt-in periodic trimming (default `None`): with `Some(interval)`,
    /// [`run_until`](Consumer::run_until) calls
    /// [`trim_acknowledged`](Consumer::trim_acknowledged) on this consumer's streams
    /// about every `interval` (at most once per read, like claims), removing the entries
    /// every group has acknowledged. A failed trim is logged and counted as a Redis
    /// error and never stops the consumer. Running `outbox trim` periodically, or
    /// [`trim_acknowledged`](crate::trim_acknowledged) from a task of your own, does
    /// the same from outside. Dead-letter streams are bounded by
    /// [`dead_letter_max_len`](Self::dead_letter_max_len) instead.
    pub trim_interval: Option<Duration>,
    /// Pauses after Redis or the idempotency store fails as a whole.
    pub outage_backoff: OutageBackoff,
    /// How long [`run_until`](Consumer::run_until) waits, after its shutdown signal, for
    /// the messages in flight to finish (default 20 s, inside Kubernetes's default 30 s
    /// grace period). Those still running then are abandoned: they stay pending and
    /// another consumer claims them after [`min_idle`](Self::min_idle); a transaction
    /// that commits anyway makes that redelivery a duplicate.
    pub shutdown_timeout: Duration,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            stream_prefix: DEFAULT_STREAM_PREFIX.to_owned(),
            consumer_name: None,
            start_from: StartFrom::Beginning,
            block: Duration::from_secs(2),
            read_count: 64,
            max_in_flight: 16,
            batch_size: None,
            min_idle: Duration::from_secs(30),
            claim_interval: Duration::from_secs(5),
            max_deliveries: 5,
            dead_letter_suffix: ":dead".to_owned(),
            dead_letter_max_len: Some(100_000),
            ignore_unknown_types: false,
            connect_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(5),
            trim_interval: None,
            outage_backoff: OutageBackoff::default(),
            shutdown_timeout: Duration::from_secs(20),
        }
    }
}

impl ConsumerConfig {
    fn validate(&self) -> Result<()> {
        let fail = |m: &str| Err(Error::Config(m.to_owned()));
        if self.block < Duration::from_millis(1) {
            // BLOCK 0 would wait forever and never see a shutdown.
            return fail("block must be at least 1 ms");
        }
        if self.read_count == 0 {
            return fail("read_count must be at least 1");
        }
        if self.max_in_flight == 0 {
            return fail("max_in_flight must be at least 1");
        }
        if self.batch_size == Some(0) {
            return fail("batch_size must be at least 1");
        }
        if self.max_deliveries == 0 {
            return fail("max_deliveries must be at least 1");
        }
        if self.min_idle < Duration::from_millis(1) {
            return fail("min_idle must be at least 1 ms");
        }
        if self.claim_interval.is_zero() {
            return fail("claim_interval must not be zero");
        }
        if self.dead_letter_suffix.is_empty() {
            return fail("dead_letter_suffix must not be empty");
        }
        if self.dead_letter_max_len == Some(0) {
            return fail("dead_letter_max_len must be at least 1 (None keeps every dead letter)");
        }
        if self.trim_interval.is_some_and(|i| i.is_zero()) {
            return fail("trim_interval must not be zero");
        }
        if self.consumer_name.as_deref() == Some("") {
            return fail("consumer_name must not be empty");
        }
        // Deadlines are computed from these; a day is far beyond any sensible value and
        // keeps `Instant` arithmetic (and Redis's millisecond arguments) in range.
        let day = Duration::from_secs(24 * 3600);
        let longest = [
            self.block,
            self.min_idle,
            self.claim_interval,
            self.response_timeout,
            self.shutdown_timeout,
        ]
        .into_iter()
        .chain(self.trim_interval)
        .max()
        .unwrap_or_default();
        if longest > day {
            return fail(
                "block, min_idle, claim_interval, response_timeout, shutdown_timeout and trim_interval must be at most a day",
            );
        }
        Ok(())
    }
}

/// Counts of what a [`Consumer`] did since it was built. Each count is also a metric.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Messages whose handler ran and committed (`outbox_consumer_consumed_total`).
    pub consumed: u64,
    /// Messages recognised as already applied and acked without running the handler
    /// (`outbox_consumer_duplicates_total`).
    pub duplicates: u64,
    /// Failed attempts: handler errors and panics, and store outages
    /// (`outbox_consumer_failures_total`).
    pub failures: u64,
    /// Entries copied to a dead-letter stream (`outbox_consumer_dead_lettered_total`).
    pub dead_lettered: u64,
    /// Entries of unhandled types acked without processing, when
    /// [`ignore_unknown_types`](ConsumerConfig::ignore_unknown_types) is set
    /// (`outbox_consumer_ignored_total`).
    pub ignored: u64,
    /// Entries taken over with `XAUTOCLAIM` (`outbox_consumer_reclaimed_total`).
    pub reclaimed: u64,
    /// Transactions that met a transient conflict (deadlock, serialization failure,
    /// lock wait timeout) and ran again (`outbox_consumer_conflicts_total`). A few
    /// immediate runs again do not count as deliveries; a conflict that persists
    /// through them is a failed delivery.
    pub conflicts: u64,
    /// Failed reads, claims and acks: Redis errors the runner backed off from
    /// (`outbox_consumer_redis_errors_total`).
    pub redis_errors: u64,
}

#[derive(Default)]
struct Counters {
    consumed: AtomicU64,
    duplicates: AtomicU64,
    failures: AtomicU64,
    dead_lettered: AtomicU64,
    ignored: AtomicU64,
    reclaimed: AtomicU64,
    conflicts: AtomicU64,
    redis_errors: AtomicU64,
}

#[derive(Clone, Copy)]
enum Count {
    Consumed,
    Duplicate,
    Failure,
    DeadLettered,
    Ignored,
    Reclaimed,
    Conflict,
    RedisError,
}

/// Marks a [`ConsumerBuilder`] that has no idempotency store yet; see
/// [`ConsumerBuilder::idempotency`].
#[derive(Debug, Clone, Copy, Default)]
pub struct NoInbox;

/// Builds a [`Consumer`]: register handlers, give the idempotency store, then
/// [`build`](Self::build). `C` is the handlers' connection type, which must be the
/// store's [`Inbox::Conn`].
pub struct ConsumerBuilder<C, I = NoInbox> {
    target: RedisResult<Target>,
    group: String,
    dispatcher: Dispatcher<C>,
    error: Option<outbox_core::Error>,
    inbox: I,
    config: ConsumerConfig,
}

impl<C, I> std::fmt::Debug for ConsumerBuilder<C, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("group", &self.group)
            .field("dispatcher", &self.dispatcher)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<C: 'static, I> ConsumerBuilder<C, I> {
    /// Routes the event types of `E` to `handler`. Registering one event type twice is
    /// reported by [`build`](Self::build).
    pub fn handle<E, H>(mut self, handler: H) -> Self
    where
        E: OutboxEvent,
        H: Handler<E, Conn = C>,
    {
        if let Err(e) = self.dispatcher.register::<E, H>(handler) {
            self.error.get_or_insert(e);
        }
        self
    }

    /// Routes the event types of `E` to an [`AsyncHandler`](outbox_core::AsyncHandler):
    /// an effect outside the database, awaited inside the dedup transaction, whose
    /// guarantee is at-least-once (see the trait). A type handled twice is reported by
    /// [`build`](ConsumerBuilder::build).
    pub fn handle_async<E, H>(mut self, handler: H) -> Self
    where
        E: OutboxEvent,
        H: outbox_core::AsyncHandler<E>,
    {
        if let Err(e) = self.dispatcher.register_async::<E, H>(handler) {
            self.error.get_or_insert(e);
        }
        self
    }

    /// Registers the step that upgrades a payload of `E`'s schema version `from` to
    /// `from + 1`, so that `E`'s handler receives messages from producers still at an
    /// older version; see [`Dispatcher::upgrade`]. A payload newer than `E` is
    /// dead-lettered at once ("produced by a newer service (v4 > v3)"), as is one a step
    /// refuses. A step out of `E`'s versions, or registered twice, is reported by
    /// [`build`](ConsumerBuilder::build).
    pub fn upgrade<E: OutboxEvent>(
        mut self,
        from: u32,
        step: impl Fn(
            serde_json::Value,
        ) -> std::result::Result<serde_json::Value, outbox_core::BoxError>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        if let Err(e) = self.dispatcher.upgrade::<E>(from, step) {
            self.error.get_or_insert(e);
        }
        self
    }

    /// The idempotency store: records `(group, msg_id)` in the handler's transaction.
    /// Any [`Inbox`] whose connection is the handlers' (an `outbox-diesel` store over a
    /// pool, or [`outbox_core::MemoryDb`] in tests).
    pub fn idempotency<J: Inbox<Conn = C>>(self, store: J) -> ConsumerBuilder<C, J> {
        ConsumerBuilder {
            target: self.target,
            group: self.group,
            dispatcher: self.dispatcher,
            error: self.error,
            inbox: store,
            config: self.config,
        }
    }

    /// Replaces the whole configuration.
    pub fn config(mut self, config: ConsumerConfig) -> Self {
        self.config = config;
        self
    }

    /// Sets the consumer name (default: unique per process).
    pub fn consumer_name(mut self, name: impl Into<String>) -> Self {
        self.config.consumer_name = Some(name.into());
        self
    }

    /// Sets the stream prefix (default `outbox:`); it must match the publisher's.
    pub fn stream_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.stream_prefix = prefix.into();
        self
    }

    /// Turns on batch mode with at most `max_messages` messages per transaction; see
    /// [`ConsumerConfig::batch_size`].
    pub fn batch_size(mut self, max_messages: usize) -> Self {
        self.config.batch_size = Some(max_messages);
        self
    }
}

impl<C: 'static, I: Inbox<Conn = C>> ConsumerBuilder<C, I> {
    /// Checks the configuration and the Redis address (without connecting) and builds
    /// the consumer. Fails on an invalid setting, a handler registered twice, or no
    /// handler at all (and, on a cluster, on a stream prefix with a `{` or `}`).
    pub fn build(self) -> Result<Consumer<I, C>> {
        if let Some(e) = self.error {
            return Err(e.into());
        }
        self.config.validate()?;
        if self.group.is_empty() || self.group.len() > outbox_core::MAX_CONSUMER_GROUP_LEN {
            return Err(Error::Config(format!(
                "the consumer group name must be 1 to {} bytes long (it is recorded in \
                 `consumed_msg`); got {:?}",
                outbox_core::MAX_CONSUMER_GROUP_LEN,
                self.group
            )));
        }
        if self.dispatcher.topics().is_empty() {
            return Err(Error::Config("register at least one handler".into()));
        }
        let target = self.target?;
        let config = self.config;
        let cluster = target.is_cluster();
        check_prefix(&config.stream_prefix, cluster)?;
        let streams: Vec<Arc<str>> = self
            .dispatcher
            .topics()
            .iter()
            .map(|t| Arc::<str>::from(stream_name(&config.stream_prefix, t, cluster)))
            .collect();
        let consumer_name = config.consumer_name.clone().unwrap_or_else(default_name);
        // One blocking reader for all streams; on a cluster one per hash slot, each on its
        // own connection (a blocked read holds up its connection to that node).
        let readers = by_slot(cluster, streams.iter().cloned(), |s| s)
            .into_iter()
            .map(|streams| {
                Ok(Reader {
                    streams,
                    conn: target.connector(
                        config.connect_timeout,
                        config.block + config.response_timeout,
                    )?,
                })
            })
            .collect::<RedisResult<Vec<_>>>()?;
        let commands = target.connector(config.connect_timeout, config.response_timeout)?;
        Ok(Consumer {
            inner: Arc::new(Inner {
                group: self.group,
                consumer_name,
                streams,
                cluster,
                dispatcher: self.dispatcher,
                inbox: Arc::new(self.inbox),
                config,
                readers,
                commands,
                counters: Counters::default(),
            }),
            acks: None,
        })
    }
}

fn default_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_owned());
    format!("{host}-{}-{:08x}", std::process::id(), fastrand::u32(..))
}

/// Reads a consumer group's streams and applies each message exactly once in effect
/// through typed [`Handler`]s.
///
/// Per entry: the event type picks the handler and the payload is decoded into its type;
/// then, on a blocking thread, the idempotency store opens a transaction, records
/// `(group, msg_id)` and runs the handler with the transaction's connection; after the
/// commit the entry is acknowledged (`XACK`). A message already recorded is acknowledged
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
/// inbox without savepoints (the default [`Inbox::process_batch`]) it behaves like
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
pub struct Consumer<I, C = <I as Inbox>::Conn> {
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

impl Consumer<NoInbox, ()> {
    /// Starts building a consumer of group `group` on the Redis at `redis` (a URL such as
    /// `redis://127.0.0.1:6379`; it is checked by [`build`](ConsumerBuilder::build)).
    pub fn builder<C: 'static>(
        redis: impl IntoConnectionInfo,
        group: impl Into<String>,
    ) -> ConsumerBuilder<C, NoInbox> {
        Self::builder_on(Target::single(redis), group.into())
    }

    /// Starts building a consumer of group `group` on the Redis Cluster reachable through
    /// any of `nodes` (URLs such as `redis://127.0.0.1:7000`; the other nodes are
    /// discovered). It reads the hash-tagged streams a
    /// [`RedisPublisher::cluster`](crate::RedisPublisher::cluster) writes
    /// (`outbox:{order.paid}`), and its dead-letter streams share their slot
    /// (`outbox:{order.paid}:dead`). See [Redis Cluster](crate#redis-cluster).
    ///
    /// ```no_run
    /// use outbox_core::{Delivery, Handler, HandlerError, MemoryDb, MemoryTx, OutboxEvent, Relay};
    /// use outbox_redis::{Consumer, RedisPublisher};
    ///
    /// #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
    /// struct OrderPaid { #[outbox(id)] order_id: String, amount_cents: i64 }
    ///
    /// struct AwardPoints;
    /// impl Handler<OrderPaid> for AwardPoints {
    ///     type Conn = MemoryTx<i64>;
    ///     fn handle(&self, e: OrderPaid, tx: &mut Self::Conn, _: &Delivery) -> Result<(), HandlerError> {
    ///         *tx.data() += e.amount_cents / 100;
    ///         Ok(())
    ///     }
    /// }
    ///
    /// # tokio::runtime::Runtime::new()?.block_on(async {
    /// // Any of the cluster's nodes; the others are discovered.
    /// let nodes = ["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"];
    ///
    /// // Writes `outbox:{order.paid}`.
    /// let relay = Relay::new(MemoryDb::new(()), RedisPublisher::cluster(nodes)?);
    /// relay.run_once().await?;
    ///
    /// // Reads `outbox:{order.paid}`; dead letters go to `outbox:{order.paid}:dead`.
    /// let consumer = Consumer::builder_cluster(nodes, "points")
    ///     .handle::<OrderPaid, _>(AwardPoints)
    ///     .idempotency(MemoryDb::new(0_i64))
    ///     .build()?;
    /// consumer.run_until(std::future::pending()).await?;
    /// # Ok::<_, Box<dyn std::error::Error>>(()) })?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    #[cfg(feature = "cluster")]
    pub fn builder_cluster<C: 'static, T: IntoConnectionInfo>(
        nodes: impl IntoIterator<Item = T>,
        group: impl Into<String>,
    ) -> ConsumerBuilder<C, NoInbox> {
        Self::builder_on(Target::cluster(nodes), group.into())
    }

    fn builder_on<C: 'static>(
        target: RedisResult<Target>,
        group: String,
    ) -> ConsumerBuilder<C, NoInbox> {
        ConsumerBuilder {
            target,
            group,
            dispatcher: Dispatcher::new(),
            error: None,
            inbox: NoInbox,
            config: ConsumerConfig::default(),
        }
    }
}

struct Inner<I, C> {
    group: String,
    consumer_name: String,
    streams: Vec<Arc<str>>,
    /// On a Redis Cluster: hash-tagged streams, and commands grouped per slot.
    cluster: bool,
    dispatcher: Dispatcher<C>,
    inbox: Arc<I>,
    config: ConsumerConfig,
    /// One reader for all streams; on a cluster one per hash slot.
    readers: Vec<Reader>,
    commands: Connector,
    counters: Counters,
}

/// Reads some streams with one `XREADGROUP ... BLOCK`, on a connection of its own: a
/// blocked connection holds up every command queued behind it, and its response timeout
/// must exceed the block time.
struct Reader {
    streams: Vec<Arc<str>>,
    conn: Connector,
}

/// The reads in progress when a consumer has several readers (a cluster with streams in
/// several slots): each reader's read runs on, across rounds of the run loop, until it
/// returns, so that entries of one stream are processed while the others still block.
#[derive(Default)]
struct Reads {
    tasks: JoinSet<(usize, RedisResult<Vec<Job>>)>,
    /// Each reader's read in progress, if any.
    running: Vec<Option<tokio::task::Id>>,
    /// Entries read in a round that also failed: handed out by the next round.
    held: Vec<Job>,
}

/// One entry to process, read or claimed.
struct Job {
    stream: Arc<str>,
    entry: StreamId,
    delivery_count: u64,
}

/// The entries this consumer is processing, with when each started; shared by the run
/// loop and the task that keeps them from looking idle.
#[derive(Clone, Default)]
struct InFlight(Arc<std::sync::Mutex<Started>>);

/// When each entry in flight, by stream and id, started.
type Started = HashMap<(Arc<str>, String), Instant>;

impl InFlight {
    fn entries(&self) -> std::sync::MutexGuard<'_, Started> {
        // The map holds no invariant a panic could break.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds `job`'s entry; false if it is in flight already.
    fn insert(&self, job: &Job) -> bool {
        let key = (Arc::clone(&job.stream), job.entry.id.clone());
        match self.entries().entry(key) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Instant::now());
                true
            }
        }
    }

    fn contains(&self, stream: &Arc<str>, id: &str) -> bool {
        self.entries()
            .contains_key(&(Arc::clone(stream), id.to_owned()))
    }

    fn remove(&self, entries: &[(Arc<str>, String)]) {
        let mut map = self.entries();
        for entry in entries {
            map.remove(entry);
        }
    }

    /// The ids of entries in flight for longer than `age`, per stream.
    fn older_than(&self, age: Duration) -> Vec<(Arc<str>, Vec<String>)> {
        let mut by_stream: Vec<(Arc<str>, Vec<String>)> = Vec::new();
        for ((stream, id), started) in self.entries().iter() {
            if started.elapsed() < age {
                continue;
            }
            match by_stream.iter_mut().find(|(s, _)| s == stream) {
                Some((_, ids)) => ids.push(id.clone()),
                None => by_stream.push((Arc::clone(stream), vec![id.clone()])),
            }
        }
        by_stream
    }
}

/// The acknowledgements of one [`run_until`](Consumer::run_until): work whose
/// transaction committed queues its entries here and is done; a task sends what has
/// queued meanwhile as one `XACK` per stream ([`Consumer::flush_acks`]). An ack
/// still follows its commit, but no longer holds up the next message: at one message in
/// flight the `XACK` round trip overlaps the next transaction, and under load many
/// entries share one `XACK`.
#[derive(Clone)]
struct AckQueue {
    queue: tokio::sync::mpsc::UnboundedSender<(Arc<str>, String)>,
    /// An `XACK` failed since the run loop last looked (it then backs off).
    failed: Arc<std::sync::atomic::AtomicBool>,
}

/// Most entries one `XACK` round of the ack queue sends.
const ACK_BATCH: usize = 1024;

/// Consecutive whole failures, by where they happened. Each kind is reset by its own
/// success, so a success of one kind (a claim that works) can never hide that the other
/// recovered, nor keep the loop pausing after Redis answers again.
#[derive(Default)]
struct Health {
    /// Failed reads and claims.
    redis: u32,
    /// Messages or batches that ended in a store outage (or a failed ack).
    work: u32,
}

impl Health {
    fn pause(&self, backoff: &OutageBackoff) -> Option<Duration> {
        let failures = self.redis.max(self.work);
        (failures > 0).then(|| backoff.pause(failures))
    }
}

/// How a job or a batch of jobs ended, reported to the run loop.
struct Done {
    /// The entries, no longer in flight.
    entries: Vec<(Arc<str>, String)>,
    /// Redis or the store failed as a whole: back off.
    outage: bool,
}

enum Attempt {
    Processed(Processed),
    Failed {
        reason: String,
        outage: bool,
        /// A deadlock or serialization failure: nothing committed, run it again soon.
        conflict: bool,
    },
}

/// A batch whose store transaction failed as a whole.
struct BatchFailed {
    reason: String,
    outage: bool,
    /// A deadlock or serialization failure rolled the whole batch back.
    conflict: bool,
}

/// Immediate runs again of a message whose transaction met a transient conflict
/// (deadlock, serialization failure, lock wait timeout), before the conflict counts as
/// a failed delivery. A conflict is nobody's fault and usually gone at once; running
/// it again from the loop would wait `min_idle` for nothing.
const CONFLICT_RETRIES: u32 = 3;

/// The pause before the `n`-th run again after a conflict: 10, 20, 40 ms plus up to as
/// much again at random, so that the two sides of a deadlock do not meet again.
fn conflict_pause(n: u32) -> Duration {
    let base = Duration::from_millis(10) * (1 << n.min(6));
    base + base.mul_f64(fastrand::f64())
}

/// What the checks before the store decided for an entry in batch mode.
enum Screened {
    Deliver(Delivery),
    Ignore,
    DeadLetter(String),
    /// Delivered past the limit without an outcome: see `Consumer::over_limit`.
    OverLimit,
}

impl<I, C> Consumer<I, C>
where
    I: Inbox<Conn = C>,
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

    /// What this consumer has done so far.
    pub fn stats(&self) -> ConsumerStats {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerStats {
            consumed: get(&c.consumed),
            duplicates: get(&c.duplicates),
            failures: get(&c.failures),
            dead_lettered: get(&c.dead_lettered),
            ignored: get(&c.ignored),
            reclaimed: get(&c.reclaimed),
            conflicts: get(&c.conflicts),
            redis_errors: get(&c.redis_errors),
        }
    }

    /// Creates the group on each stream (and the stream, `MKSTREAM`) if it does not
    /// exist, and registers this consumer in it (`XGROUP CREATECONSUMER`). Idempotent;
    /// [`run_until`](Self::run_until) calls it first.
    pub async fn ensure_groups(&self) -> Result<()> {
        let inner = &self.inner;
        let start = match inner.config.start_from {
            StartFrom::Beginning => "0",
            StartFrom::End => "$",
        };
        let mut conn = inner.commands.get().await?;
        for stream in &inner.streams {
            let created: RedisResult<()> = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&**stream)
                .arg(&inner.group)
                .arg(start)
                .arg("MKSTREAM")
                .query_async(&mut conn)
                .await;
            match created {
                Ok(()) => {
                    tracing::info!(stream = &**stream, group = %inner.group, start, "consumer group created")
                }
                Err(e) if e.code() == Some("BUSYGROUP") => {}
                Err(e) => {
                    inner.commands.check(&e).await;
                    return Err(e.into());
                }
            }
            // Registers the consumer at once, so that `XINFO CONSUMERS` lists it before
            // its first delivery.
            let registered: RedisResult<redis::Value> = redis::cmd("XGROUP")
                .arg("CREATECONSUMER")
                .arg(&**stream)
                .arg(&inner.group)
                .arg(&inner.consumer_name)
                .query_async(&mut conn)
                .await;
            if let Err(e) = registered {
                inner.commands.check(&e).await;
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// Trims each of this consumer's streams to what some group still needs; see
    /// [`trim_acknowledged`].
    pub async fn trim_acknowledged(&self) -> Result<Vec<TrimReport>> {
        let mut conn = self.inner.commands.get().await?;
        let mut reports = Vec::with_capacity(self.inner.streams.len());
        for stream in &self.inner.streams {
            reports.push(trim_acknowledged(&mut conn, stream).await?);
        }
        Ok(reports)
    }

    /// Runs until `shutdown` completes: creates the groups, then reads, claims and
    /// processes entries.
    ///
    /// Fails only if the groups cannot be created for a reason other than an outage (a
    /// wrong type at a stream's key, missing permissions). A Redis unreachable at start
    /// is waited for with the outage backoff, as later outages of Redis or the store are:
    /// logged, counted and backed off from, never ending the run.
    ///
    /// Whatever the timings of an outage, the loop gets back to reading as soon as Redis
    /// answers again: every failure kind (reads and claims, store outages) has its own
    /// consecutive count that its next success resets, and a claim is always followed
    /// by a read.
    ///
    /// On shutdown it stops reading, lets the messages in flight (and those read ahead
    /// for them, see [`max_in_flight`](ConsumerConfig::max_in_flight)) finish, sends their
    /// acknowledgements, then returns, within [`shutdown_timeout`](ConsumerConfig::shutdown_timeout):
    /// messages still in flight then stay pending. Entries handed to a read that the shutdown cut short stay
    /// pending and are claimed again after `min_idle`. Dropping the future instead
    /// abandons the messages in flight the same way: nothing is lost, and their
    /// transactions decide whether a redelivery is a duplicate.
    pub async fn run_until(&self, shutdown: impl Future<Output = ()>) -> Result<()> {
        let mut shutdown = std::pin::pin!(shutdown);
        if !self.wait_for_groups(&mut shutdown).await? {
            return Ok(());
        }
        let inner = &self.inner;
        let span = tracing::info_span!("outbox.consumer", group = %inner.group, consumer = %inner.consumer_name);
        // No more transactions at once than the store can run: a task waiting for a
        // pooled connection would time out and look like a store outage.
        let permits = Arc::new(Semaphore::new(
            inner
                .config
                .max_in_flight
                .min(inner.inbox.capacity().unwrap_or(usize::MAX))
                .max(1),
        ));
        let mut tasks: JoinSet<Done> = JoinSet::new();
        let in_flight = InFlight::default();
        let keep_alive = tokio::spawn(
            self.clone()
                .keep_in_flight_alive(in_flight.clone())
                .instrument(span.clone()),
        );
        // Work spawned by this run acks through `acks`; the flusher ends once every
        // copy of its sender is gone (this run's `this` and its tasks), after sending
        // what they queued.
        let (queue, queued) = tokio::sync::mpsc::unbounded_channel();
        let acks = AckQueue {
            queue,
            failed: Arc::default(),
        };
        let flusher = tokio::spawn(
            self.clone()
                .flush_acks(queued, Arc::clone(&acks.failed))
                .instrument(span.clone()),
        );
        let this = Consumer {
            inner: Arc::clone(&self.inner),
            acks: Some(acks.clone()),
        };
        // Entries read beyond the free slots wait for a slot (a permit) in their task, so
        // that the next message is at hand when one finishes instead of a read away.
        let task_limit = inner.config.max_in_flight.saturating_mul(2);
        // Batch mode: one task at a time per lane of keys (see `lanes`). (Twice as many
        // lanes as transactions measured slower: 1.6 instead of 1.9 times single mode
        // at 8 in flight, 1.3 instead of 1.5 under contention.)
        let lane_locks: Arc<[tokio::sync::Mutex<()>]> = (0..inner.config.max_in_flight)
            .map(|_| tokio::sync::Mutex::new(()))
            .collect();
        let mut next_claim = Instant::now();
        let mut next_trim = inner.config.trim_interval.map(|i| Instant::now() + i);
        let mut health = Health::default();
        let mut claimed_last = false;
        let mut reads = Reads::default();
        tracing::info!(parent: &span, streams = ?inner.streams, "consumer started");
        loop {
            while let Some(done) = tasks.try_join_next() {
                self.finished(done, &in_flight, &mut health);
            }
            if acks.failed.swap(false, Ordering::Relaxed) {
                health.work = health.work.saturating_add(1);
            }
            if let Some(pause) = health.pause(&inner.config.outage_backoff) {
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    () = tokio::time::sleep(pause) => {}
                }
            }
            let free = task_limit.saturating_sub(tasks.len());
            if free == 0 {
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    Some(done) = tasks.join_next() => self.finished(done, &in_flight, &mut health),
                }
                continue;
            }
            if let (Some(at), Some(interval)) = (next_trim, inner.config.trim_interval)
                && Instant::now() >= at
            {
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    () = self.periodic_trim().instrument(span.clone()) => {}
                }
                next_trim = Some(Instant::now() + interval);
            }
            // A claim is always followed by a read, whatever the timings: a loop that
            // only claimed (pauses longer than the claim interval) would never see a new
            // entry again.
            let claiming = !claimed_last && Instant::now() >= next_claim;
            claimed_last = claiming;
            // Entries that fit: one per free slot, or a batch per free slot.
            let room = match inner.config.batch_size {
                None => free.min(inner.config.read_count),
                Some(size) => free.saturating_mul(size),
            };
            let step = async {
                if claiming {
                    self.claim(room, &in_flight).await
                } else {
                    self.read(room, &mut reads).await
                }
            };
            let jobs = tokio::select! {
                biased;
                () = &mut shutdown => break,
                jobs = step.instrument(span.clone()) => jobs,
            };
            if claiming {
                next_claim = Instant::now() + inner.config.claim_interval;
            }
            match jobs {
                Ok(jobs) => {
                    // Redis answered: whatever failed before, it is back.
                    health.redis = 0;
                    let fresh: Vec<Job> = jobs
                        .into_iter()
                        // Skips entries claimed back while this consumer still works on them.
                        .filter(|job| in_flight.insert(job))
                        .collect();
                    this.spawn_work(fresh, &lane_locks, &mut tasks, &permits, &span);
                }
                Err(e) => {
                    self.count(Count::RedisError, None);
                    if e.code() == Some("NOGROUP") {
                        // The stream or group was deleted under us: recreate it.
                        tracing::warn!(parent: &span, error = %e, "consumer group missing; recreating it");
                        if let Err(e) = self.ensure_groups().await {
                            tracing::warn!(parent: &span, error = %outbox_core::error_chain(&e), "cannot recreate consumer groups");
                            health.redis = health.redis.saturating_add(1);
                        }
                    } else {
                        tracing::warn!(parent: &span, error = %e, "redis read failed; backing off");
                        health.redis = health.redis.saturating_add(1);
                    }
                }
            }
        }
        // Reads still blocking (on a cluster) stop here; what they may have read stays
        // pending, as with a read the shutdown cut short.
        drop(reads);
        tracing::info!(parent: &span, in_flight = tasks.len(), "consumer stopping");
        let grace = tokio::time::sleep(inner.config.shutdown_timeout);
        tokio::pin!(grace);
        loop {
            tokio::select! {
                done = tasks.join_next() => match done {
                    Some(done) => self.finished(done, &in_flight, &mut health),
                    None => break,
                },
                () = &mut grace => {
                    tracing::warn!(parent: &span, abandoned = tasks.len(), "shutdown timeout reached; the messages still in flight stay pending for other consumers");
                    // Their store transactions roll back when their connections close
                    // (or commit, and a redelivery is then a duplicate).
                    tasks.abort_all();
                    break;
                }
            }
        }
        keep_alive.abort();
        // Acks of what finished go out before the run returns.
        drop((this, acks));
        if let Err(e) = flusher.await {
            tracing::error!(parent: &span, error = %e, "ack task failed");
        }
        tracing::info!(parent: &span, "consumer stopped");
        Ok(())
    }

    /// Creates the groups, waiting out an outage of Redis (a consumer started before
    /// Redis, or during a restart, must not need a restart of its own). Returns false
    /// if `shutdown` came first.
    async fn wait_for_groups(
        &self,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Result<bool> {
        let mut outages = 0;
        loop {
            match self.ensure_groups().await {
                Ok(()) => return Ok(true),
                Err(e) if e.is_outage() => {
                    outages += 1;
                    self.count(Count::RedisError, None);
                    tracing::warn!(error = %outbox_core::error_chain(&e), "redis unavailable at start; waiting for it");
                    tokio::select! {
                        biased;
                        () = &mut *shutdown => return Ok(false),
                        () = tokio::time::sleep(self.inner.config.outage_backoff.pause(outages)) => {}
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Starts processing `jobs`: one task per entry; in batch mode one task per lane (see
    /// [`lanes`]), which waits for the lane's previous task, then runs its batches one
    /// after another.
    fn spawn_work(
        &self,
        jobs: Vec<Job>,
        lane_locks: &Arc<[tokio::sync::Mutex<()>]>,
        tasks: &mut JoinSet<Done>,
        permits: &Arc<Semaphore>,
        span: &tracing::Span,
    ) {
        let Some(size) = self.inner.config.batch_size else {
            for job in jobs {
                let this = self.clone();
                let permits = Arc::clone(permits);
                tasks.spawn(
                    async move {
                        let _permit = permits.acquire_owned().await;
                        this.process(job).await
                    }
                    .instrument(span.clone()),
                );
            }
            return;
        };
        for (n, lane) in lanes(jobs, size, lane_locks.len()) {
            let this = self.clone();
            let permits = Arc::clone(permits);
            let lane_locks = Arc::clone(lane_locks);
            tasks.spawn(
                async move {
                    // The lane first: a task waiting for its lane holds no connection.
                    let _lane = lane_locks[n].lock().await;
                    let _permit = permits.acquire_owned().await;
                    let mut done = Done {
                        entries: Vec::new(),
                        outage: false,
                    };
                    for batch in lane {
                        let batch_done = this.clone().process_batch(batch).await;
                        done.entries.extend(batch_done.entries);
                        done.outage |= batch_done.outage;
                    }
                    done
                }
                .instrument(span.clone()),
            );
        }
    }

    /// Keeps the entries this consumer works on from looking idle: every third of
    /// `min_idle`, an `XCLAIM ... JUSTID` to itself resets the idle time of those in
    /// flight for longer than that, without counting a delivery. So neither another
    /// consumer nor this one's own `XAUTOCLAIM` takes over a slow handler's entry and
    /// runs it a second time concurrently; if this process stalls or dies, the refreshes
    /// stop and the entries are claimed after `min_idle`, as before.
    async fn keep_in_flight_alive(self, in_flight: InFlight) {
        let every = self.inner.config.min_idle / 3;
        loop {
            tokio::time::sleep(every).await;
            let stale = in_flight.older_than(every);
            for (stream, ids) in stale {
                let refreshed: RedisResult<redis::Value> = async {
                    let mut conn = self.inner.commands.get().await?;
                    redis::cmd("XCLAIM")
                        .arg(&*stream)
                        .arg(&self.inner.group)
                        .arg(&self.inner.consumer_name)
                        .arg(0)
                        .arg(&ids)
                        .arg("JUSTID")
                        .query_async(&mut conn)
                        .await
                }
                .await;
                self.redis_done(refreshed, "cannot refresh the entries in flight")
                    .await;
            }
        }
    }

    /// One round of [`ConsumerConfig::trim_interval`]: trims, logs, never fails.
    async fn periodic_trim(&self) {
        match self.trim_acknowledged().await {
            Ok(reports) => {
                for r in reports.iter().filter(|r| r.removed > 0) {
                    tracing::debug!(stream = %r.stream, removed = r.removed, min_id = ?r.min_id, "trimmed acknowledged entries");
                }
            }
            Err(e) => {
                if let Error::Redis(e) = &e {
                    self.inner.commands.check(e).await;
                }
                self.count(Count::RedisError, None);
                tracing::warn!(error = %outbox_core::error_chain(&e), "trimming acknowledged entries failed; trying again next interval");
            }
        }
    }

    fn finished(
        &self,
        done: Result<Done, tokio::task::JoinError>,
        in_flight: &InFlight,
        health: &mut Health,
    ) {
        match done {
            Ok(done) => {
                in_flight.remove(&done.entries);
                health.work = if done.outage {
                    health.work.saturating_add(1)
                } else {
                    0
                };
            }
            // `process` catches handler panics; this is a bug in the runner itself, or
            // a task aborted at the shutdown timeout. The entry stays pending and is
            // claimed again.
            Err(e) => tracing::error!(error = %e, "consumer task failed"),
        }
    }

    fn count(&self, what: Count, stream: Option<&str>) {
        let c = &self.inner.counters;
        let (atomic, name) = match what {
            Count::Consumed => (&c.consumed, "outbox_consumer_consumed_total"),
            Count::Duplicate => (&c.duplicates, "outbox_consumer_duplicates_total"),
            Count::Failure => (&c.failures, "outbox_consumer_failures_total"),
            Count::DeadLettered => (&c.dead_lettered, "outbox_consumer_dead_lettered_total"),
            Count::Ignored => (&c.ignored, "outbox_consumer_ignored_total"),
            Count::Reclaimed => (&c.reclaimed, "outbox_consumer_reclaimed_total"),
            Count::Conflict => (&c.conflicts, "outbox_consumer_conflicts_total"),
            Count::RedisError => (&c.redis_errors, "outbox_consumer_redis_errors_total"),
        };
        atomic.fetch_add(1, Ordering::Relaxed);
        let group = self.inner.group.clone();
        match stream {
            Some(stream) => {
                metrics::counter!(name, "group" => group, "stream" => stream.to_owned())
                    .increment(1);
            }
            None => metrics::counter!(name, "group" => group).increment(1),
        }
    }

    /// New entries. With one reader (always on a single server), its read. With several
    /// (a cluster), starts a read for each reader that has none in progress, waits for
    /// the first to return and takes whatever else has returned meanwhile; the others go
    /// on blocking into the next rounds.
    async fn read(&self, count: usize, reads: &mut Reads) -> RedisResult<Vec<Job>> {
        let readers = self.inner.readers.len();
        if readers == 1 {
            return self.read_from(0, count).await;
        }
        if !reads.held.is_empty() {
            return Ok(std::mem::take(&mut reads.held));
        }
        reads.running.resize(readers, None);
        for (i, running) in reads.running.iter_mut().enumerate() {
            if running.is_none() {
                let this = self.clone();
                let task = reads
                    .tasks
                    .spawn(async move { (i, this.read_from(i, count).await) });
                *running = Some(task.id());
            }
        }
        let mut jobs = Vec::new();
        let mut error = None;
        let mut next = reads.tasks.join_next().await;
        while let Some(joined) = next {
            match joined {
                Ok((i, result)) => {
                    reads.running[i] = None;
                    match result {
                        Ok(read) => jobs.extend(read),
                        Err(e) => {
                            error.get_or_insert(e);
                        }
                    }
                }
                // A bug in the runner: the reader reads again next round, and entries
                // the failed read took stay pending and are claimed again.
                Err(e) => {
                    tracing::error!(error = %e, "read task failed");
                    for running in &mut reads.running {
                        if *running == Some(e.id()) {
                            *running = None;
                        }
                    }
                }
            }
            next = reads.tasks.try_join_next();
        }
        match error {
            Some(e) => {
                reads.held = jobs;
                Err(e)
            }
            None => Ok(jobs),
        }
    }

    /// New entries of reader `i`'s streams:
    /// `XREADGROUP GROUP g c COUNT n BLOCK ms STREAMS s... > ...`.
    async fn read_from(&self, i: usize, count: usize) -> RedisResult<Vec<Job>> {
        let inner = &self.inner;
        let reader = &inner.readers[i];
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&inner.group)
            .arg(&inner.consumer_name)
            .arg("COUNT")
            .arg(count)
            .arg("BLOCK")
            .arg(duration_ms(inner.config.block))
            .arg("STREAMS");
        for stream in &reader.streams {
            cmd.arg(&**stream);
        }
        for _ in &reader.streams {
            cmd.arg(">");
        }
        let mut conn = reader.conn.get().await?;
        let reply: Option<StreamReadReply> = match cmd.query_async(&mut conn).await {
            Ok(reply) => reply,
            Err(e) => {
                reader.conn.check(&e).await;
                return Err(e);
            }
        };
        let mut jobs = Vec::new();
        for key in reply.map(|r| r.keys).unwrap_or_default() {
            let Some(stream) = reader.streams.iter().find(|s| ***s == *key.key) else {
                continue;
            };
            jobs.extend(key.ids.into_iter().map(|entry| Job {
                stream: Arc::clone(stream),
                entry,
                delivery_count: 1,
            }));
        }
        Ok(jobs)
    }

    /// Entries idle longer than `min_idle` in the group, whoever held them:
    /// `XAUTOCLAIM`, then their delivery counts from `XPENDING`.
    async fn claim(&self, free: usize, in_flight: &InFlight) -> RedisResult<Vec<Job>> {
        let inner = &self.inner;
        let mut conn = inner.commands.get().await?;
        let result = self.claim_on(&mut conn, free, in_flight).await;
        if let Err(e) = &result {
            inner.commands.check(e).await;
        }
        result
    }

    async fn claim_on(
        &self,
        conn: &mut Conn,
        free: usize,
        in_flight: &InFlight,
    ) -> RedisResult<Vec<Job>> {
        let inner = &self.inner;
        let mut jobs: Vec<Job> = Vec::new();
        for stream in &inner.streams {
            let mut cursor = "0-0".to_owned();
            // Each call scans a bounded part of the pending list; a few calls per round
            // keep one round short while a long list is still covered over time.
            for _ in 0..8 {
                let budget = free.saturating_sub(jobs.len());
                if budget == 0 {
                    return Ok(jobs);
                }
                let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
                    .arg(&**stream)
                    .arg(&inner.group)
                    .arg(&inner.consumer_name)
                    .arg(duration_ms(inner.config.min_idle))
                    .arg(&cursor)
                    .arg("COUNT")
                    .arg(budget)
                    .query_async(&mut *conn)
                    .await?;
                if !reply.deleted_ids.is_empty() {
                    tracing::warn!(stream = &**stream, deleted = ?reply.deleted_ids, "pending entries were deleted from the stream before being processed");
                }
                if !reply.claimed.is_empty() {
                    let counts =
                        delivery_counts(conn, stream, &inner.group, &reply.claimed).await?;
                    for (entry, count) in reply.claimed.into_iter().zip(counts) {
                        let mine = in_flight.contains(stream, &entry.id);
                        if !mine {
                            self.count(Count::Reclaimed, Some(stream));
                            tracing::info!(stream = &**stream, entry_id = %entry.id, delivery_count = count, "pending entry claimed");
                        }
                        jobs.push(Job {
                            stream: Arc::clone(stream),
                            entry,
                            delivery_count: count,
                        });
                    }
                }
                if reply.next_stream_id == "0-0" {
                    break;
                }
                cursor = reply.next_stream_id;
            }
        }
        Ok(jobs)
    }

    /// Processes one entry to the end: dead-letter, ack, or leave pending.
    async fn process(self, job: Job) -> Done {
        let span = tracing::info_span!(
            "outbox.consume",
            stream = &*job.stream,
            entry_id = %job.entry.id,
            delivery_count = job.delivery_count,
            msg_id = tracing::field::Empty,
            event_type = tracing::field::Empty,
            traceparent = tracing::field::Empty,
        );
        let outage = self.process_inner(&job).instrument(span).await;
        Done {
            entries: vec![(job.stream, job.entry.id)],
            outage,
        }
    }

    /// Returns whether Redis or the store failed as a whole.
    async fn process_inner(&self, job: &Job) -> bool {
        let inner = &self.inner;
        let topic = topic_of(&job.stream, &inner.config.stream_prefix, inner.cluster);
        if job.delivery_count > inner.config.max_deliveries {
            return self.over_limit(job).await;
        }
        let envelope = match envelope_from_fields(&job.entry.map, topic) {
            Ok(envelope) => envelope,
            Err(e) => {
                return self
                    .dead_letter(job, &outbox_core::error_chain(&e).to_string())
                    .await;
            }
        };
        let span = tracing::Span::current();
        span.record("msg_id", envelope.msg_id.as_str());
        span.record("event_type", envelope.event_type.as_str());
        // Trace context captured at emit time, for subscribers that link the spans.
        // A W3C traceparent is 55 bytes; a foreign producer's huge header stays out of
        // every log line.
        if let Some(parent) = envelope.headers.get(outbox_core::TRACEPARENT)
            && parent.len() <= MAX_TRACEPARENT_LEN
        {
            span.record("traceparent", parent.as_str());
        }
        let mut prepared = match inner.dispatcher.prepare(&envelope) {
            Ok(prepared) => prepared,
            Err(outbox_core::Error::UnknownEventType(t)) if inner.config.ignore_unknown_types => {
                tracing::debug!(event_type = %t, "no handler for this event type; acknowledged");
                self.count(Count::Ignored, Some(&job.stream));
                return self.ack(job).await;
            }
            Err(e) => {
                return self
                    .dead_letter(job, &outbox_core::error_chain(&e).to_string())
                    .await;
            }
        };
        let delivery = Delivery {
            envelope,
            delivery_count: job.delivery_count,
            entry_id: Some(job.entry.id.clone()),
        };
        let mut conflicts = 0;
        let attempt = loop {
            match self.attempt(prepared, delivery.clone()).await {
                Attempt::Failed {
                    reason,
                    conflict: true,
                    ..
                } if conflicts < CONFLICT_RETRIES => {
                    conflicts += 1;
                    self.count(Count::Conflict, Some(&job.stream));
                    tracing::debug!(%reason, conflicts, "transient database conflict; running the message again");
                    tokio::time::sleep(conflict_pause(conflicts)).await;
                    // Decoded before, so it decodes again.
                    prepared = match inner.dispatcher.prepare(&delivery.envelope) {
                        Ok(prepared) => prepared,
                        Err(e) => {
                            return self
                                .dead_letter(job, &outbox_core::error_chain(&e).to_string())
                                .await;
                        }
                    };
                }
                attempt => break attempt,
            }
        };
        match attempt {
            Attempt::Processed(Processed::Applied) => {
                self.count(Count::Consumed, Some(&job.stream));
                self.ack(job).await
            }
            Attempt::Processed(Processed::Duplicate) => {
                tracing::debug!("duplicate message acknowledged without running the handler");
                self.count(Count::Duplicate, Some(&job.stream));
                self.ack(job).await
            }
            Attempt::Failed { reason, outage, .. } => self.failed(job, &reason, outage).await,
        }
    }

    /// An entry delivered past the limit without an outcome: its consumers crashed or
    /// stalled past `min_idle` each time, and running it again could crash this one too.
    /// It is dead-lettered without running its handler, unless the inbox shows it was
    /// applied and only its `XACK` got lost: then it is acknowledged as a duplicate (asked
    /// by a `process` whose closure refuses, so nothing is written either way). Returns
    /// whether Redis or the store failed as a whole.
    async fn over_limit(&self, job: &Job) -> bool {
        let inner = &self.inner;
        let reason = format!(
            "delivery limit exceeded: delivered {} times (limit {}) without being processed",
            job.delivery_count, inner.config.max_deliveries
        );
        let topic = topic_of(&job.stream, &inner.config.stream_prefix, inner.cluster);
        let Ok(envelope) = envelope_from_fields(&job.entry.map, topic) else {
            return self.dead_letter(job, &reason).await;
        };
        let (inbox, group, refusal) = (
            Arc::clone(&inner.inbox),
            inner.group.clone(),
            reason.clone(),
        );
        let applied = tokio::task::spawn_blocking(move || {
            inbox.process(&group, &envelope.msg_id, |_| {
                Err(outbox_core::HandlerError::msg(refusal))
            })
        })
        .await;
        match applied {
            Ok(Ok(Processed::Duplicate)) => {
                tracing::debug!("applied before; only its acknowledgement was lost");
                self.count(Count::Duplicate, Some(&job.stream));
                self.ack(job).await
            }
            Ok(Err(e)) if e.is_outage() => {
                self.failed(job, &outbox_core::error_chain(&e).to_string(), true)
                    .await
            }
            // Asking met a conflict: nothing is known yet; ask again at the next claim.
            Ok(Err(e)) if e.is_transient() => {
                self.count(Count::Conflict, Some(&job.stream));
                false
            }
            _ => self.dead_letter(job, &reason).await,
        }
    }

    /// A failed attempt: after a store outage the delivery is not counted; a handler
    /// failure on the last delivery is dead-lettered, earlier ones stay pending.
    /// Returns whether Redis or the store failed as a whole.
    async fn failed(&self, job: &Job, reason: &str, outage: bool) -> bool {
        self.count(Count::Failure, Some(&job.stream));
        if outage {
            tracing::warn!(entry_id = %job.entry.id, %reason, "idempotency store unavailable; the message will be retried");
            self.uncount_delivery(job).await;
            true
        } else if job.delivery_count >= self.inner.config.max_deliveries {
            tracing::warn!(entry_id = %job.entry.id, %reason, "handler failed on its last delivery");
            self.dead_letter(job, reason).await
        } else {
            tracing::warn!(entry_id = %job.entry.id, %reason, "handler failed; the message will be retried");
            false
        }
    }

    /// Processes a batch of entries to the end: the checks of single mode per entry,
    /// then one store transaction for the rest, then one `XACK` per stream.
    async fn process_batch(self, jobs: Vec<Job>) -> Done {
        let span = tracing::info_span!("outbox.consume_batch", messages = jobs.len());
        let outage = self.process_batch_inner(&jobs).instrument(span).await;
        Done {
            entries: jobs
                .into_iter()
                .map(|job| (job.stream, job.entry.id))
                .collect(),
            outage,
        }
    }

    /// Returns whether Redis or the store failed as a whole.
    async fn process_batch_inner(&self, jobs: &[Job]) -> bool {
        let mut outage = false;
        let mut acks: Vec<&Job> = Vec::new();
        let mut runs: Vec<&Job> = Vec::new();
        let mut deliveries: Vec<Delivery> = Vec::new();
        for job in jobs {
            match self.screen(job) {
                Screened::Deliver(delivery) => {
                    runs.push(job);
                    deliveries.push(delivery);
                }
                Screened::Ignore => {
                    self.count(Count::Ignored, Some(&job.stream));
                    acks.push(job);
                }
                Screened::DeadLetter(reason) => outage |= self.dead_letter(job, &reason).await,
                Screened::OverLimit => outage |= self.over_limit(job).await,
            }
        }
        if !deliveries.is_empty() {
            match self.attempt_batch(deliveries).await {
                Ok(outcomes) => {
                    for (job, outcome) in runs.into_iter().zip(outcomes) {
                        match outcome {
                            Ok(Processed::Applied) => {
                                self.count(Count::Consumed, Some(&job.stream));
                                acks.push(job);
                            }
                            Ok(Processed::Duplicate) => {
                                self.count(Count::Duplicate, Some(&job.stream));
                                acks.push(job);
                            }
                            Err(e) if e.is_poison() => {
                                outage |= self
                                    .dead_letter(job, &outbox_core::error_chain(&e).to_string())
                                    .await;
                            }
                            Err(e) if e.is_transient() => {
                                // Only its savepoint rolled back: it runs again on its own.
                                tracing::debug!(error = %outbox_core::error_chain(&e), "transient database conflict; running the message again on its own");
                                self.count(Count::Conflict, Some(&job.stream));
                                outage |= self.process_inner(job).await;
                            }
                            Err(e) => {
                                outage |= self
                                    .failed(
                                        job,
                                        &outbox_core::error_chain(&e).to_string(),
                                        e.is_outage(),
                                    )
                                    .await;
                            }
                        }
                    }
                }
                Err(BatchFailed {
                    conflict: true,
                    reason,
                    ..
                }) => {
                    // The database rolled the whole batch back (MySQL ends the
                    // transaction on a deadlock, savepoints included): nobody's fault.
                    // Each message runs again on its own, so a conflict costs its own
                    // message at most.
                    tracing::debug!(%reason, "transient database conflict rolled the batch back; running its messages one by one");
                    for job in &runs {
                        self.count(Count::Conflict, Some(&job.stream));
                    }
                    for job in runs {
                        outage |= self.process_inner(job).await;
                    }
                }
                Err(BatchFailed {
                    reason,
                    outage: store_down,
                    ..
                }) => {
                    for job in runs {
                        outage |= self.failed(job, &reason, store_down).await;
                    }
                }
            }
        }
        outage | self.ack_all(&acks).await
    }

    /// The checks before the store, as in single mode: the delivery limit, the entry's
    /// fields, a handler for its type. Decoding is left to the dispatcher.
    fn screen(&self, job: &Job) -> Screened {
        let inner = &self.inner;
        if job.delivery_count > inner.config.max_deliveries {
            return Screened::OverLimit;
        }
        let topic = topic_of(&job.stream, &inner.config.stream_prefix, inner.cluster);
        let envelope = match envelope_from_fields(&job.entry.map, topic) {
            Ok(envelope) => envelope,
            Err(e) => return Screened::DeadLetter(outbox_core::error_chain(&e).to_string()),
        };
        if !inner.dispatcher.handles(&envelope.event_type) {
            if inner.config.ignore_unknown_types {
                tracing::debug!(event_type = %envelope.event_type, "no handler for this event type; acknowledged");
                return Screened::Ignore;
            }
            let e = outbox_core::Error::UnknownEventType(envelope.event_type);
            return Screened::DeadLetter(e.to_string());
        }
        Screened::Deliver(Delivery {
            envelope,
            delivery_count: job.delivery_count,
            entry_id: Some(job.entry.id.clone()),
        })
    }

    /// Runs the batch's store transaction on a blocking thread. `Err`: the whole batch
    /// failed and nothing committed.
    async fn attempt_batch(
        &self,
        deliveries: Vec<Delivery>,
    ) -> Result<InboxBatchOutcomes, BatchFailed> {
        let inner = Arc::clone(&self.inner);
        let joined = tokio::task::spawn_blocking(move || {
            inner
                .dispatcher
                .consume_batch(&*inner.inbox, &inner.group, &deliveries)
        })
        .await;
        match joined {
            Ok(Ok(outcomes)) => Ok(outcomes),
            Ok(Err(e)) => Err(BatchFailed {
                outage: e.is_outage(),
                conflict: e.is_transient(),
                reason: outbox_core::error_chain(&e).to_string(),
            }),
            // Handler panics are caught per message; this is the store's own panic.
            Err(e) => Err(BatchFailed {
                conflict: false,
                reason: match e.try_into_panic() {
                    Ok(panic) => format!("batch panicked: {}", outbox_core::panic_message(&*panic)),
                    Err(e) => format!("batch task failed: {e}"),
                },
                outage: false,
            }),
        }
    }

    /// Acknowledges entries whose work committed: through this run's ack queue, or (outside
    /// [`run_until`](Self::run_until)) at once. Returns whether Redis failed; a queued ack
    /// reports its failure to the run loop instead.
    async fn ack_all(&self, jobs: &[&Job]) -> bool {
        if jobs.is_empty() {
            return false;
        }
        if let Some(acks) = &self.acks {
            let queued = jobs.iter().all(|job| {
                acks.queue
                    .send((Arc::clone(&job.stream), job.entry.id.clone()))
                    .is_ok()
            });
            if queued {
                return false;
            }
        }
        let entries: Vec<(Arc<str>, String)> = jobs
            .iter()
            .map(|job| (Arc::clone(&job.stream), job.entry.id.clone()))
            .collect();
        self.xack(&entries).await
    }

    /// Sends the queued acks of a run until every sender is gone: each round takes what
    /// has queued (up to [`ACK_BATCH`]) and sends it as one `XACK` per stream.
    async fn flush_acks(
        self,
        mut queued: tokio::sync::mpsc::UnboundedReceiver<(Arc<str>, String)>,
        failed: Arc<std::sync::atomic::AtomicBool>,
    ) {
        let mut entries = Vec::new();
        while queued.recv_many(&mut entries, ACK_BATCH).await > 0 {
            if self.xack(&entries).await {
                failed.store(true, Ordering::Relaxed);
            }
            entries.clear();
        }
    }

    /// `XACK` of many entries, one command per stream in one pipeline (on a cluster, one
    /// pipeline per hash slot, sent concurrently); returns whether Redis failed.
    async fn xack(&self, entries: &[(Arc<str>, String)]) -> bool {
        let inner = &self.inner;
        let mut streams: Vec<&Arc<str>> = Vec::new();
        for (stream, _) in entries {
            if !streams.contains(&stream) {
                streams.push(stream);
            }
        }
        let pipes = by_slot(inner.cluster, streams, |s| s)
            .into_iter()
            .map(|streams| {
                let mut pipe = redis::pipe();
                for stream in streams {
                    let cmd = pipe.cmd("XACK").arg(&**stream).arg(&inner.group);
                    for (_, id) in entries.iter().filter(|(s, _)| s == stream) {
                        cmd.arg(id);
                    }
                    cmd.ignore();
                }
                pipe
            })
            .collect();
        let acked: RedisResult<()> = async {
            let mut conn = inner.commands.get().await?;
            query_all(&mut conn, pipes).await.into_iter().collect()
        }
        .await;
        self.redis_done(
            acked,
            "ack failed; the entries stay pending and are claimed again",
        )
        .await
    }

    /// Runs the dedup transaction on a blocking thread; a panic is a failure.
    async fn attempt(&self, prepared: Prepared<C>, delivery: Delivery) -> Attempt {
        let inbox = Arc::clone(&self.inner.inbox);
        let group = self.inner.group.clone();
        let joined = tokio::task::spawn_blocking(move || {
            inbox.process(&group, &delivery.envelope.msg_id, |conn| {
                prepared.run(conn, &delivery)
            })
        })
        .await;
        match joined {
            Ok(Ok(processed)) => Attempt::Processed(processed),
            Ok(Err(e)) => Attempt::Failed {
                outage: e.is_outage(),
                conflict: e.is_transient(),
                reason: outbox_core::error_chain(&e).to_string(),
            },
            Err(e) => Attempt::Failed {
                conflict: false,
                reason: match e.try_into_panic() {
                    Ok(panic) => {
                        format!("handler panicked: {}", outbox_core::panic_message(&*panic))
                    }
                    Err(e) => format!("handler task failed: {e}"),
                },
                outage: false,
            },
        }
    }

    /// `XACK` of one entry, through the ack queue; returns whether Redis failed.
    async fn ack(&self, job: &Job) -> bool {
        self.ack_all(&[job]).await
    }

    /// Copies the entry to the dead-letter stream and acks it, in one transaction (on a
    /// cluster the dead-letter stream shares the stream's hash slot, which `MULTI` needs).
    /// Returns whether Redis failed.
    async fn dead_letter(&self, job: &Job, reason: &str) -> bool {
        let inner = &self.inner;
        let dead = self.dead_letter_stream(&job.stream);
        let mut pipe = redis::pipe();
        pipe.atomic();
        let xadd = pipe.cmd("XADD").arg(&dead);
        if let Some(max_len) = inner.config.dead_letter_max_len {
            xadd.arg("MAXLEN").arg(max_len);
        }
        xadd.arg("*")
            .arg("reason")
            .arg(reason)
            .arg("delivery_count")
            .arg(job.delivery_count)
            .arg("group")
            .arg(&inner.group)
            .arg("stream")
            .arg(&*job.stream)
            .arg("entry_id")
            .arg(&job.entry.id);
        let mut fields: Vec<_> = job
            .entry
            .map
            .iter()
            .filter(|(k, _)| !DEAD_LETTER_FIELDS.contains(&k.as_str()))
            .collect();
        fields.sort_by(|a, b| a.0.cmp(b.0));
        for (field, value) in fields {
            xadd.arg(field).arg(value_bytes(value));
        }
        xadd.ignore();
        pipe.cmd("XACK")
            .arg(&*job.stream)
            .arg(&inner.group)
            .arg(&job.entry.id)
            .ignore();
        let written: RedisResult<()> = async {
            let mut conn = inner.commands.get().await?;
            pipe.query_async(&mut conn).await
        }
        .await;
        let failed = self
            .redis_done(written, "dead-lettering failed; the entry stays pending")
            .await;
        if !failed {
            tracing::warn!(dead_letter_stream = %dead, %reason, "entry dead-lettered");
            self.count(Count::DeadLettered, Some(&job.stream));
        }
        failed
    }

    /// After a store outage: sets the entry's delivery count back, so that outages never
    /// bring a message closer to the dead-letter stream. Best effort.
    async fn uncount_delivery(&self, job: &Job) {
        let inner = &self.inner;
        let reset: RedisResult<redis::Value> = async {
            let mut conn = inner.commands.get().await?;
            redis::cmd("XCLAIM")
                .arg(&*job.stream)
                .arg(&inner.group)
                .arg(&inner.consumer_name)
                .arg(0)
                .arg(&job.entry.id)
                .arg("RETRYCOUNT")
                .arg(job.delivery_count.saturating_sub(1))
                .arg("JUSTID")
                .query_async(&mut conn)
                .await
        }
        .await;
        self.redis_done(reset, "cannot reset the delivery count")
            .await;
    }

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

/// The ordering key of an entry, as the relay wrote it (the `key` field; an entry of
/// another producer without one falls back to its `msg_id`).
fn entry_key(entry: &StreamId) -> Vec<u8> {
    entry
        .map
        .get("key")
        .or_else(|| entry.map.get("msg_id"))
        .map(value_bytes)
        .unwrap_or_default()
}

/// The lane of `key` among `lanes`: FNV-1a, so that every consumer process (whatever its
/// Rust version) puts a key in the same lane.
fn lane_of(key: &[u8], lanes: usize) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in key {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % lanes.max(1) as u64) as usize
}

/// Splits the entries of one read in batch mode into lanes: `(lane, batches)`, each a
/// list of batches of at most `size` entries that one task runs one after another.
///
/// - A key's lane is a hash of the key modulo `lanes` (the consumer's `max_in_flight`),
///   so all entries of a key go to one lane, and in every read and every consumer
///   process to the lane of the same number. The run loop runs one task per lane
///   number at a time: the transactions running side by side in this consumer never
///   write the rows of the same key (a handler that updates its key's row would
///   otherwise wait for, or deadlock with, a sibling batch), and a key's entries run in
///   stream order. Two consumer processes collide only lane against lane of the same
///   number, never one lane against many.
/// - Within a lane, keys come in byte order, so that batches of different consumers lock
///   the rows of shared keys in the same order: they wait for each other, but do not
///   deadlock.
fn lanes(jobs: Vec<Job>, size: usize, lanes: usize) -> Vec<(usize, Vec<Vec<Job>>)> {
    let size = size.max(1);
    let mut keys: Vec<(Vec<u8>, Vec<Job>)> = Vec::new();
    let mut index: HashMap<Vec<u8>, usize> = HashMap::new();
    for job in jobs {
        let key = entry_key(&job.entry);
        match index.get(&key) {
            Some(&i) => keys[i].1.push(job),
            None => {
                index.insert(key.clone(), keys.len());
                keys.push((key, vec![job]));
            }
        }
    }
    let count = lanes.max(1);
    let mut lanes: Vec<Vec<(Vec<u8>, Vec<Job>)>> = (0..count).map(|_| Vec::new()).collect();
    for key in keys {
        lanes[lane_of(&key.0, count)].push(key);
    }
    lanes
        .into_iter()
        .enumerate()
        .filter(|(_, lane)| !lane.is_empty())
        .map(|(n, mut lane)| {
            lane.sort_by(|a, b| a.0.cmp(&b.0));
            let jobs: Vec<Job> = lane.into_iter().flat_map(|(_, jobs)| jobs).collect();
            let mut batches = Vec::with_capacity(jobs.len().div_ceil(size));
            let mut jobs = jobs.into_iter().peekable();
            while jobs.peek().is_some() {
                batches.push(jobs.by_ref().take(size).collect());
            }
            (n, batches)
        })
        .collect()
}

/// Longest `traceparent` header recorded on a span (W3C's is 55 bytes; room for a
/// version with more fields).
const MAX_TRACEPARENT_LEN: usize = 256;

/// Fields a dead-letter entry sets before the original entry's fields.
const DEAD_LETTER_FIELDS: [&str; 5] = ["reason", "delivery_count", "group", "stream", "entry_id"];

/// The delivery count of each of `entries` (pending in `group`), in order, with one
/// pipelined `XPENDING <stream> <group> <id> <id> 1` per entry.
async fn delivery_counts(
    conn: &mut Conn,
    stream: &str,
    group: &str,
    entries: &[StreamId],
) -> RedisResult<Vec<u64>> {
    let mut pipe = redis::pipe();
    for entry in entries {
        pipe.cmd("XPENDING")
            .arg(stream)
            .arg(group)
            .arg(&entry.id)
            .arg(&entry.id)
            .arg(1);
    }
    let replies: Vec<StreamPendingCountReply> = pipe.query_async(conn).await?;
    Ok(replies
        .into_iter()
        .map(|r| r.ids.first().map_or(1, |p| p.times_delivered as u64))
        .collect())
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: usize, key: &str) -> Job {
        let mut map = HashMap::new();
        map.insert(
            "key".to_owned(),
            redis::Value::BulkString(key.as_bytes().to_vec()),
        );
        Job {
            stream: Arc::from("s"),
            entry: StreamId {
                id: format!("{id}-0"),
                map,
                ..StreamId::default()
            },
            delivery_count: 1,
        }
    }

    fn ids(batch: &[Job]) -> Vec<&str> {
        batch.iter().map(|j| j.entry.id.as_str()).collect()
    }

    #[test]
    fn lanes_keep_each_key_in_one_lane_in_stream_order_with_keys_sorted() {
        // 24 entries over 6 keys; batches of 2, 3 lanes.
        let keys = ["c", "a", "b", "d", "f", "e"];
        let jobs = (0..24).map(|i| job(i, keys[i % keys.len()])).collect();
        let lanes = lanes(jobs, 2, 3);
        assert!(lanes.len() <= 3);
        let mut seen = Vec::new();
        for (n, lane) in &lanes {
            assert!(*n < 3);
            assert!(
                lane.iter()
                    .all(|batch| !batch.is_empty() && batch.len() <= 2)
            );
            let flat: Vec<&Job> = lane.iter().flatten().collect();
            let lane_keys: Vec<Vec<u8>> = flat.iter().map(|j| entry_key(&j.entry)).collect();
            let mut sorted = lane_keys.clone();
            sorted.sort();
            assert_eq!(lane_keys, sorted, "keys in byte order within a lane");
            for j in flat {
                assert_eq!(lane_of(&entry_key(&j.entry), 3), *n);
                seen.push((entry_key(&j.entry), j.entry.id.clone()));
            }
        }
        // Each key in exactly one lane, its entries in stream order.
        for key in keys {
            let holders = lanes
                .iter()
                .filter(|(_, lane)| {
                    lane.iter()
                        .flatten()
                        .any(|j| entry_key(&j.entry) == key.as_bytes())
                })
                .count();
            assert_eq!(holders, 1, "key {key} in one lane");
            let order: Vec<usize> = seen
                .iter()
                .filter(|(k, _)| k == key.as_bytes())
                .map(|(_, id)| id.trim_end_matches("-0").parse().unwrap())
                .collect();
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(order, sorted, "key {key} in stream order");
        }
        assert_eq!(seen.len(), 24);
    }

    #[test]
    fn a_key_has_the_same_lane_in_every_read() {
        let read = |keys: &[&str]| {
            let jobs = keys.iter().enumerate().map(|(i, k)| job(i, k)).collect();
            lanes(jobs, 10, 8)
                .into_iter()
                .flat_map(|(n, lane)| {
                    lane.into_iter()
                        .flatten()
                        .map(move |j| (String::from_utf8(entry_key(&j.entry)).unwrap(), n))
                })
                .collect::<HashMap<String, usize>>()
        };
        let first = read(&["acct-1", "acct-2", "acct-3", "acct-4"]);
        let second = read(&["acct-4", "acct-9", "acct-1"]);
        assert_eq!(first["acct-1"], second["acct-1"]);
        assert_eq!(first["acct-4"], second["acct-4"]);
        // The hash is fixed (FNV-1a): other consumer processes agree.
        assert_eq!(lane_of(b"", 8), (0xcbf2_9ce4_8422_2325u64 % 8) as usize);
    }

    #[test]
    fn a_hot_key_is_one_lane_of_batches() {
        let one_key = (0..7).map(|i| job(i, "hot")).collect();
        let hot = lanes(one_key, 3, 4);
        assert_eq!(hot.len(), 1, "a single key is one lane");
        let sizes: Vec<usize> = hot[0].1.iter().map(Vec::len).collect();
        assert_eq!(sizes, [3, 3, 1]);
        assert_eq!(ids(&hot[0].1[0]), ["0-0", "1-0", "2-0"]);
    }
}
