//! Building a consumer: handlers, the idempotency store, the configuration.

use std::sync::Arc;

use outbox_core::__private::builder::{Routed, Routes};
use outbox_core::{AsyncInbox, AsyncTxHandler, Handler, Inbox, InvalidConfig, OutboxEvent};
use redis::{IntoConnectionInfo, RedisResult};

use super::health::HealthState;
use super::read::Reader;
use super::stats::Counters;
use super::{AsyncStore, Consumer, ConsumerConfig, ConsumerStore, Inner};
use crate::conn::{Target, by_slot, check_prefix, partition_stream_name, stream_name};
use crate::{Error, Result};

/// Marks a [`ConsumerBuilder`] that has no idempotency store yet; see
/// [`ConsumerBuilder::idempotency`].
#[derive(Debug, Clone, Copy, Default)]
pub struct NoInbox;

/// Builds a [`Consumer`]: register handlers, give the idempotency store and, unless the
/// defaults do, the configuration ([`with_config`](Self::with_config)), then
/// [`build`](Self::build), which checks it all. `C` is the handlers' connection type,
/// which must be the store's [`Inbox::Conn`] (or [`AsyncInbox::Conn`]).
pub struct ConsumerBuilder<C, I = NoInbox> {
    target: Result<Target>,
    group: String,
    /// The handlers, the partition counts their event types declare
    /// ([`OutboxEvent::PARTITIONS`], which [`ConsumerConfig::partitions`] overrides) and
    /// the first registration's error, reported by [`build`](Self::build).
    routes: Routes<C>,
    inbox: I,
    config: ConsumerConfig,
}

impl<C, I> std::fmt::Debug for ConsumerBuilder<C, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("group", &self.group)
            .field("dispatcher", self.routes.dispatcher())
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
        self.routes.handle::<E, H>(handler);
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
        self.routes.handle_async::<E, H>(handler);
        self
    }

    /// Routes the event types of `E` to an [`AsyncTxHandler`]: awaited inside the dedup
    /// transaction with its connection, for a consumer on an [`AsyncInbox`]
    /// ([`idempotency_async`](Self::idempotency_async)). A type handled twice is reported
    /// by [`build`](ConsumerBuilder::build).
    pub fn handle_tx<E, H>(mut self, handler: H) -> Self
    where
        E: OutboxEvent,
        H: AsyncTxHandler<E, Conn = C>,
        C: Send,
    {
        self.routes.handle_tx::<E, H>(handler);
        self
    }

    /// Registers the step that upgrades a payload of `E`'s schema version `from` to
    /// `from + 1`, so that `E`'s handler receives messages from producers still at an
    /// older version; see [`Dispatcher::upgrade`](outbox_core::Dispatcher::upgrade). A
    /// payload newer than `E` is dead-lettered at once ("produced by a newer service
    /// (v4 > v3)"), as is one a step refuses. A step out of `E`'s versions, or
    /// registered twice, is reported by [`build`](ConsumerBuilder::build).
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
        self.routes.upgrade::<E>(from, step);
        self
    }

    /// The idempotency store: records `(group, msg_id)` in the handler's transaction.
    /// Any [`Inbox`] whose connection is the handlers' (an `outbox-diesel` store over a
    /// pool, or [`outbox_core::MemoryDb`] in tests).
    pub fn idempotency<J: Inbox<Conn = C>>(self, store: J) -> ConsumerBuilder<C, J> {
        self.with_store(store)
    }

    /// The idempotency store, async: an [`AsyncInbox`] (`outbox-diesel`'s
    /// `AsyncPgInbox` over diesel-async), whose transactions the consumer awaits on the
    /// runtime instead of running them on blocking threads. Its handlers are
    /// [`AsyncTxHandler`]s ([`handle_tx`](Self::handle_tx)) and [`AsyncHandler`](outbox_core::AsyncHandler)s;
    /// everything else (retries, dead letters, batch mode, acks) is as with
    /// [`idempotency`](Self::idempotency). The consumer's type is then
    /// `Consumer<AsyncStore<J>>`.
    pub fn idempotency_async<J>(self, store: J) -> ConsumerBuilder<C, AsyncStore<J>>
    where
        J: AsyncInbox<Conn = C>,
    {
        self.with_store(AsyncStore(store))
    }

    fn with_store<J>(self, store: J) -> ConsumerBuilder<C, J> {
        ConsumerBuilder {
            target: self.target,
            group: self.group,
            routes: self.routes,
            inbox: store,
            config: self.config,
        }
    }

    /// The configuration, whole: build it with [`ConsumerConfig`]'s `with_*` setters.
    /// It is checked by [`build`](Self::build). The builder has no setter of its own for
    /// any of its fields, so nothing given here is overwritten later, nor overwrites
    /// an earlier setting:
    ///
    /// ```
    /// use outbox_core::{Delivery, Handler, HandlerError, MemoryDb, MemoryTx, OutboxEvent};
    /// use outbox_redis::{Consumer, ConsumerConfig};
    ///
    /// #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
    /// struct OrderPaid { #[outbox(id)] order_id: String }
    ///
    /// struct Count;
    /// impl Handler<OrderPaid> for Count {
    ///     type Conn = MemoryTx<u64>;
    ///     fn handle(&self, _: OrderPaid, tx: &mut Self::Conn, _: &Delivery) -> Result<(), HandlerError> {
    ///         *tx.data() += 1;
    ///         Ok(())
    ///     }
    /// }
    ///
    /// let config = ConsumerConfig::default()
    ///     .with_consumer_name("orders-1")
    ///     .with_batch_size(100);
    /// let consumer = Consumer::builder("redis://127.0.0.1:6379", "orders")
    ///     .handle::<OrderPaid, _>(Count)
    ///     .idempotency(MemoryDb::new(0_u64))
    ///     .with_config(config)
    ///     .build()?;
    /// assert_eq!(consumer.consumer_name(), "orders-1");
    /// assert_eq!(consumer.config().batch_size, Some(100));
    /// # Ok::<_, outbox_redis::Error>(())
    /// ```
    ///
    /// A shortcut such as `.batch_size(100)` on the builder does not exist:
    ///
    /// ```compile_fail,E0599
    /// # use outbox_redis::Consumer;
    /// let builder = Consumer::builder::<()>("redis://127.0.0.1:6379", "orders").batch_size(100);
    /// ```
    pub fn with_config(mut self, config: ConsumerConfig) -> Self {
        self.config = config;
        self
    }
}

impl<C: 'static, I: ConsumerStore<Conn = C>> ConsumerBuilder<C, I> {
    /// Checks the configuration ([`ConsumerConfig::validate`]) and the Redis address
    /// (without connecting) and builds the consumer. Fails on an invalid setting
    /// ([`Error::Config`]), a handler registered twice, or no handler at all
    /// ([`Error::NoHandler`]); on a cluster also on a stream prefix with a `{` or `}`.
    /// Handled event types of one topic that declare different partition counts
    /// (`#[outbox(partitions = N)]`) are an [`Error::Config`] too.
    pub fn build(self) -> Result<Consumer<I, C>> {
        let routed = self.routes.finish::<Error>()?;
        check(&self.group, &self.config, routed.dispatcher.topics())?;
        let target = self.target?;
        let config = self.config;
        let cluster = target.is_cluster();
        check_prefix(&config.stream_prefix, cluster)?;
        let streams = streams(&routed, &config, cluster);
        let consumer_name = config.consumer_name.clone().unwrap_or_else(default_name);
        let readers = readers(&target, &config, &streams)?;
        let commands = target.connector(config.connect_timeout, config.response_timeout)?;
        Ok(Consumer {
            inner: Arc::new(Inner {
                group: self.group,
                consumer_name,
                streams,
                cluster,
                dispatcher: routed.dispatcher,
                inbox: self.inbox,
                executor: I::EXECUTOR,
                config,
                readers,
                commands,
                counters: Counters::default(),
                health: HealthState::default(),
            }),
            acks: None,
        })
    }
}

/// The checks that need no Redis address, after the handlers': the config, the group
/// name, at least one handler, partition counts only of handled topics.
fn check(group: &str, config: &ConsumerConfig, topics: &[&str]) -> Result<()> {
    config.validate()?;
    if group.is_empty() || group.len() > outbox_core::MAX_CONSUMER_GROUP_LEN {
        return Err(InvalidConfig::new(
            "group",
            format!(
                "must be 1 to {} bytes long (it is recorded in `consumed_msg`); got {group:?}",
                outbox_core::MAX_CONSUMER_GROUP_LEN,
            ),
        )
        .into());
    }
    if topics.is_empty() {
        return Err(Error::NoHandler);
    }
    if let Some(topic) = (config.partitions.keys()).find(|t| !topics.contains(&t.as_str())) {
        return Err(InvalidConfig::new(
            "partitions",
            format!("names the topic {topic:?}, which no handler of this consumer reads"),
        )
        .into());
    }
    Ok(())
}

/// The streams of the handled topics: one per topic, or one per partition of a topic
/// with a partition count above one (`<prefix><topic>:<p>`): the config's count, else
/// the one its event type declares.
fn streams<C: 'static>(
    routed: &Routed<C>,
    config: &ConsumerConfig,
    cluster: bool,
) -> Vec<Arc<str>> {
    let prefix = &config.stream_prefix;
    let mut streams = Vec::new();
    for topic in routed.dispatcher.topics() {
        let partitions = routed.partitions(&config.partitions, topic);
        if partitions.is_partitioned() {
            streams.extend(
                (0..partitions.get())
                    .map(|p| Arc::from(partition_stream_name(prefix, topic, p, cluster))),
            );
        } else {
            streams.push(Arc::from(stream_name(prefix, topic, cluster)));
        }
    }
    streams
}

/// One blocking reader for all streams; on a cluster one per hash slot, each on its own
/// connection (a blocked read holds up its connection to that node), whose response
/// timeout exceeds the block time.
fn readers(
    target: &Target,
    config: &ConsumerConfig,
    streams: &[Arc<str>],
) -> RedisResult<Vec<Reader>> {
    by_slot(target.is_cluster(), streams.iter().cloned(), |s| s)
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
        .collect()
}

/// A consumer name unique per process: `<hostname>-<pid>-<random>`.
fn default_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_owned());
    format!("{host}-{}-{:08x}", std::process::id(), fastrand::u32(..))
}

impl Consumer<NoInbox, ()> {
    /// Starts building a consumer of group `group` on the Redis at `redis` (a URL such as
    /// `redis://127.0.0.1:6379`; it is checked by [`build`](ConsumerBuilder::build)).
    pub fn builder<C: 'static>(
        redis: impl IntoConnectionInfo,
        group: impl Into<String>,
    ) -> ConsumerBuilder<C, NoInbox> {
        Self::builder_on(Target::single(redis).map_err(Error::from), group.into())
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
        Self::builder_on(Target::cluster(nodes).map_err(Error::from), group.into())
    }

    /// Starts building a consumer of group `group` on the primary that Redis Sentinel
    /// names (feature `sentinel`). It reads the streams a
    /// [`RedisPublisher::sentinel`](crate::RedisPublisher::sentinel) (or a publisher on
    /// the primary itself) writes, named as on one server.
    ///
    /// Every connection of the consumer asks the sentinels for the primary when it
    /// opens, and opens again after a connection error, a `READONLY` reply or a failover
    /// announced on `+switch-master` (see [`SentinelConfig`](crate::SentinelConfig)).
    /// After a failover the promoted replica's group may lag behind the old primary's:
    /// entries already handled can be delivered again (a last-delivered id that moved
    /// back, pending entries acked on the old primary only); the idempotency store skips
    /// them by `msg_id` and counts them as duplicates, and they are acked again.
    ///
    /// ```no_run
    /// use outbox_core::{Delivery, Handler, HandlerError, MemoryDb, MemoryTx, OutboxEvent, Relay};
    /// use outbox_redis::{Consumer, RedisPublisher, SentinelConfig};
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
    /// let sentinels = ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"];
    /// let primary = SentinelConfig::new(sentinels, "mymaster")?;
    ///
    /// let relay = Relay::new(MemoryDb::new(()), RedisPublisher::sentinel(primary.clone())?);
    /// relay.run_once().await?;
    ///
    /// let consumer = Consumer::builder_sentinel(primary, "points")
    ///     .handle::<OrderPaid, _>(AwardPoints)
    ///     .idempotency(MemoryDb::new(0_i64))
    ///     .build()?;
    /// consumer.run_until(std::future::pending()).await?;
    /// # Ok::<_, Box<dyn std::error::Error>>(()) })?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    #[cfg(feature = "sentinel")]
    pub fn builder_sentinel<C: 'static>(
        config: crate::SentinelConfig,
        group: impl Into<String>,
    ) -> ConsumerBuilder<C, NoInbox> {
        Self::builder_on(Target::sentinel(config), group.into())
    }

    fn builder_on<C: 'static>(
        target: Result<Target>,
        group: String,
    ) -> ConsumerBuilder<C, NoInbox> {
        ConsumerBuilder {
            target,
            group,
            routes: Routes::new(),
            inbox: NoInbox,
            config: ConsumerConfig::default(),
        }
    }
}
