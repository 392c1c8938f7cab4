//! Building a consumer: handlers, the idempotency store, the configuration.

use std::sync::Arc;

use async_nats::jetstream;
use outbox_core::__private::builder::Routes;
use outbox_core::__private::consumer::Transactions;
use outbox_core::{
    AsyncInbox, AsyncStore, AsyncTxHandler, ConsumerStore, Handler, Inbox, InvalidConfig,
    MAX_CONSUMER_GROUP_LEN, OutboxEvent,
};

use super::{Consumer, ConsumerConfig, Inner, Topic};
use crate::{Error, Result};

/// Marks a [`ConsumerBuilder`] that has no idempotency store yet; see
/// [`ConsumerBuilder::idempotency`].
#[derive(Debug, Clone, Copy, Default)]
pub struct NoInbox;

/// Builds a [`Consumer`]: register handlers, give the idempotency store and, unless the
/// defaults do, the configuration, then [`build`](Self::build), which checks it all.
/// `C` is the handlers' connection type, the store's [`Inbox::Conn`] (or
/// [`AsyncInbox::Conn`]). The same calls as outbox-redis's builder.
pub struct ConsumerBuilder<C, I = NoInbox> {
    client: async_nats::Client,
    group: String,
    /// The handlers, the partition counts their types declare, a registration's error.
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

impl Consumer<NoInbox, ()> {
    /// Starts building a consumer of group `group` on `client`'s NATS server (or
    /// cluster). The group is the durable consumer's name on each stream: letters,
    /// digits, `-` and `_`, at most 64 bytes (checked by [`build`](ConsumerBuilder::build)).
    pub fn builder<C: 'static>(
        client: async_nats::Client,
        group: impl Into<String>,
    ) -> ConsumerBuilder<C, NoInbox> {
        ConsumerBuilder {
            client,
            group: group.into(),
            routes: Routes::new(),
            inbox: NoInbox,
            config: ConsumerConfig::default(),
        }
    }
}

impl<C: 'static, I> ConsumerBuilder<C, I> {
    /// Routes the event types of `E` to `handler`, run in the store's transaction.
    pub fn handle<E, H>(mut self, handler: H) -> Self
    where
        E: OutboxEvent,
        H: Handler<E, Conn = C>,
    {
        self.routes.handle::<E, H>(handler);
        self
    }

    /// Routes the event types of `E` to an [`AsyncHandler`](outbox_core::AsyncHandler)
    /// (an effect outside the database, awaited inside the dedup transaction).
    pub fn handle_async<E, H>(mut self, handler: H) -> Self
    where
        E: OutboxEvent,
        H: outbox_core::AsyncHandler<E>,
    {
        self.routes.handle_async::<E, H>(handler);
        self
    }

    /// Routes the event types of `E` to an [`AsyncTxHandler`], awaited inside the dedup
    /// transaction with its connection (a consumer on an [`AsyncInbox`]).
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
    /// `from + 1`; see [`Dispatcher::upgrade`](outbox_core::Dispatcher::upgrade).
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

    /// The idempotency store: any [`Inbox`] whose connection is the handlers' (an
    /// outbox-diesel inbox over a pool, or `outbox_core::MemoryDb` in tests). Its
    /// transactions run on tokio's blocking threads.
    pub fn idempotency<J: Inbox<Conn = C>>(self, store: J) -> ConsumerBuilder<C, J> {
        self.with_store(store)
    }

    /// The idempotency store, async: an [`AsyncInbox`] whose transactions are awaited
    /// on the runtime.
    pub fn idempotency_async<J>(self, store: J) -> ConsumerBuilder<C, AsyncStore<J>>
    where
        J: AsyncInbox<Conn = C>,
    {
        self.with_store(AsyncStore(store))
    }

    fn with_store<J>(self, store: J) -> ConsumerBuilder<C, J> {
        ConsumerBuilder {
            client: self.client,
            group: self.group,
            routes: self.routes,
            inbox: store,
            config: self.config,
        }
    }

    /// The configuration, whole, checked by [`build`](Self::build).
    pub fn with_config(mut self, config: ConsumerConfig) -> Self {
        self.config = config;
        self
    }
}

impl<C: 'static, I: ConsumerStore<Conn = C>> ConsumerBuilder<C, I> {
    /// Checks the group name, the configuration ([`ConsumerConfig::validate`]) and the
    /// handlers, and builds the consumer (without contacting the server). Fails on an
    /// invalid setting ([`Error::Config`]), a handler registered twice, or no handler
    /// at all.
    pub fn build(self) -> Result<Consumer<I, C>> {
        check_group(&self.group)?;
        self.config.validate()?;
        let routed = self.routes.finish::<Error>()?;
        if routed.dispatcher.topics().is_empty() {
            return Err(Error::Core(outbox_core::Error::Config(InvalidConfig::new(
                "handlers",
                "a consumer needs at least one handler",
            ))));
        }
        let naming = &self.config.naming;
        let topics = (routed.dispatcher.topics().iter())
            .map(|&topic| Topic {
                name: Arc::from(topic),
                stream: Arc::from(naming.stream(topic)),
                partitions: routed.partitions(&self.config.partitions, topic),
            })
            .collect();
        let js = jetstream::new(self.client.clone());
        Ok(Consumer {
            inner: Arc::new(Inner {
                group: self.group,
                client: self.client,
                js,
                topics,
                dispatcher: routed.dispatcher,
                executor: <I as Transactions>::EXECUTOR,
                inbox: self.inbox,
                config: self.config,
                counters: Default::default(),
                health: Default::default(),
            }),
        })
    }
}

/// A group name must be one subject token and a durable consumer name.
fn check_group(group: &str) -> Result<(), InvalidConfig> {
    let ok = !group.is_empty()
        && group.len() <= MAX_CONSUMER_GROUP_LEN
        && group
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(InvalidConfig::new(
            "group",
            format!(
                "must be 1 to {MAX_CONSUMER_GROUP_LEN} letters, digits, `-` or `_` (a NATS consumer name and subject token); got {group:?}"
            ),
        ))
    }
}
