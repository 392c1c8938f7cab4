//! Building a consumer: handlers, the idempotency store, the configuration.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_nats::jetstream;
use outbox_core::__private::consumer::Transactions;
use outbox_core::{
    AsyncInbox, AsyncStore, AsyncTxHandler, ConsumerStore, Dispatcher, Handler, Inbox,
    InvalidConfig, MAX_CONSUMER_GROUP_LEN, OutboxEvent, Partitions,
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
    dispatcher: Dispatcher<C>,
    error: Option<outbox_core::Error>,
    inbox: I,
    config: ConsumerConfig,
    /// Each handled topic's partition count, as its event types declare it.
    declared: BTreeMap<&'static str, Partitions>,
    conflict: Option<InvalidConfig>,
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
            dispatcher: Dispatcher::new(),
            error: None,
            inbox: NoInbox,
            config: ConsumerConfig::default(),
            declared: BTreeMap::new(),
            conflict: None,
        }
    }
}

impl<C: 'static, I> ConsumerBuilder<C, I> {
    /// Routes the event types of `E` to `handler`, run in the store's transaction.
    pub fn handle<E, H>(self, handler: H) -> Self
    where
        E: OutboxEvent,
        H: Handler<E, Conn = C>,
    {
        self.route::<E>(|d| d.register::<E, H>(handler))
    }

    /// Routes the event types of `E` to an [`AsyncHandler`](outbox_core::AsyncHandler)
    /// (an effect outside the database, awaited inside the dedup transaction).
    pub fn handle_async<E, H>(self, handler: H) -> Self
    where
        E: OutboxEvent,
        H: outbox_core::AsyncHandler<E>,
    {
        self.route::<E>(|d| d.register_async::<E, H>(handler))
    }

    /// Routes the event types of `E` to an [`AsyncTxHandler`], awaited inside the dedup
    /// transaction with its connection (a consumer on an [`AsyncInbox`]).
    pub fn handle_tx<E, H>(self, handler: H) -> Self
    where
        E: OutboxEvent,
        H: AsyncTxHandler<E, Conn = C>,
        C: Send,
    {
        self.route::<E>(|d| d.register_tx::<E, H>(handler))
    }

    fn route<E: OutboxEvent>(
        mut self,
        register: impl FnOnce(&mut Dispatcher<C>) -> std::result::Result<(), outbox_core::Error>,
    ) -> Self {
        if let Err(e) = register(&mut self.dispatcher) {
            self.error.get_or_insert(e);
        }
        let partitions = Partitions::of_event::<E>();
        for topic in E::TOPICS {
            match self.declared.insert(topic, partitions) {
                Some(earlier) if earlier != partitions && self.conflict.is_none() => {
                    self.conflict = Some(InvalidConfig::new(
                        "partitions",
                        format!(
                            "the event types handled on the topic {topic:?} declare different partition counts ({} and {})",
                            earlier.get(),
                            partitions.get()
                        ),
                    ));
                }
                _ => {}
            }
        }
        self
    }

    /// Registers the step that upgrades a payload of `E`'s schema version `from` to
    /// `from + 1`; see [`Dispatcher::upgrade`].
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
            dispatcher: self.dispatcher,
            error: self.error,
            inbox: store,
            config: self.config,
            declared: self.declared,
            conflict: self.conflict,
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
        if let Some(e) = self.error {
            return Err(e.into());
        }
        if let Some(e) = self.conflict {
            return Err(e.into());
        }
        if self.dispatcher.topics().is_empty() {
            return Err(Error::Core(outbox_core::Error::Config(InvalidConfig::new(
                "handlers",
                "a consumer needs at least one handler",
            ))));
        }
        let naming = &self.config.naming;
        let topics = (self.dispatcher.topics().iter())
            .map(|&topic| {
                let partitions = (self.config.partitions.get(topic).copied())
                    .or_else(|| self.declared.get(topic).copied())
                    .unwrap_or_default();
                Topic {
                    name: Arc::from(topic),
                    stream: Arc::from(naming.stream(topic)),
                    partitions,
                }
            })
            .collect();
        let js = jetstream::new(self.client.clone());
        Ok(Consumer {
            inner: Arc::new(Inner {
                group: self.group,
                client: self.client,
                js,
                topics,
                dispatcher: self.dispatcher,
                executor: <I as Transactions>::EXECUTOR,
                inbox: self.inbox,
                config: self.config,
                counters: Default::default(),
                health: Default::default(),
                outages: Default::default(),
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
