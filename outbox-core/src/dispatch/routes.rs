//! The broker-free half of a consumer builder: the handlers registered by event type,
//! the partition counts their event types declare, and the first mistake made while
//! registering them, reported when the builder builds. outbox-redis's and outbox-nats's
//! builders keep one of these each, so that every way of registering a handler goes
//! through the same path on both brokers.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::{
    AsyncHandler, AsyncTxHandler, BoxError, Dispatcher, Error, Handler, InvalidConfig, OutboxEvent,
    Partitions,
};

/// The handlers a consumer builder collects (see the module's documentation).
pub struct Routes<C> {
    dispatcher: Dispatcher<C>,
    /// The first registration that failed (a type handled twice, a bad upgrade step).
    error: Option<Error>,
    /// Each handled topic's partition count, as its event types declare it
    /// ([`OutboxEvent::PARTITIONS`]).
    declared: BTreeMap<&'static str, Partitions>,
    /// Two handled event types of one topic that declare different counts: which one
    /// would be read is a guess, so [`finish`](Self::finish) refuses it.
    conflict: Option<InvalidConfig>,
}

/// What [`Routes::finish`] gives the builder: the dispatcher and the declared counts.
#[derive(Debug)]
pub struct Routed<C> {
    /// The handlers by event type.
    pub dispatcher: Dispatcher<C>,
    /// Each handled topic's partition count as its event types declare it.
    pub declared: BTreeMap<&'static str, Partitions>,
}

impl<C> Routed<C> {
    /// `topic`'s partition count: the configuration's (`overrides`) if it has one, else
    /// the one its event types declare, else one.
    pub fn partitions(&self, overrides: &BTreeMap<String, Partitions>, topic: &str) -> Partitions {
        (overrides.get(topic).copied())
            .or_else(|| self.declared.get(topic).copied())
            .unwrap_or_default()
    }
}

impl<C> Default for Routes<C> {
    fn default() -> Self {
        Self {
            dispatcher: Dispatcher::default(),
            error: None,
            declared: BTreeMap::new(),
            conflict: None,
        }
    }
}

impl<C> std::fmt::Debug for Routes<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routes")
            .field("dispatcher", &self.dispatcher)
            .field("declared", &self.declared)
            .finish_non_exhaustive()
    }
}

impl<C> Routes<C> {
    /// The dispatcher so far (for the builders' `Debug`).
    pub fn dispatcher(&self) -> &Dispatcher<C> {
        &self.dispatcher
    }
}

impl<C: 'static> Routes<C> {
    /// No handler yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Routes the event types of `E` to `handler`, run in the store's transaction.
    pub fn handle<E, H>(&mut self, handler: H)
    where
        E: OutboxEvent,
        H: Handler<E, Conn = C>,
    {
        self.route::<E>(|d| d.register::<E, H>(handler));
    }

    /// Routes the event types of `E` to an [`AsyncHandler`].
    pub fn handle_async<E, H>(&mut self, handler: H)
    where
        E: OutboxEvent,
        H: AsyncHandler<E>,
    {
        self.route::<E>(|d| d.register_async::<E, H>(handler));
    }

    /// Routes the event types of `E` to an [`AsyncTxHandler`].
    pub fn handle_tx<E, H>(&mut self, handler: H)
    where
        E: OutboxEvent,
        H: AsyncTxHandler<E, Conn = C>,
        C: Send,
    {
        self.route::<E>(|d| d.register_tx::<E, H>(handler));
    }

    /// Registers an upgrade step of `E` ([`Dispatcher::upgrade`]).
    pub fn upgrade<E: OutboxEvent>(
        &mut self,
        from: u32,
        step: impl Fn(Value) -> Result<Value, BoxError> + Send + Sync + 'static,
    ) {
        if let Err(e) = self.dispatcher.upgrade::<E>(from, step) {
            self.error.get_or_insert(e);
        }
    }

    /// The one path of every registration: `register` routes `E`'s types in the
    /// dispatcher, and the streams to read follow `E`'s topics and partition count, so
    /// that no way of registering a handler reads other streams than the relay writes.
    fn route<E: OutboxEvent>(
        &mut self,
        register: impl FnOnce(&mut Dispatcher<C>) -> Result<(), Error>,
    ) {
        if let Err(e) = register(&mut self.dispatcher) {
            self.error.get_or_insert(e);
        }
        self.declare::<E>();
    }

    /// Notes the partition count `E` declares for its topics, and a count that differs
    /// from another handled type's for the same topic.
    fn declare<E: OutboxEvent>(&mut self) {
        let partitions = Partitions::of_event::<E>();
        for topic in E::TOPICS {
            match self.declared.insert(topic, partitions) {
                Some(earlier) if earlier != partitions && self.conflict.is_none() => {
                    self.conflict = Some(InvalidConfig::new(
                        "partitions",
                        format!(
                            "the event types handled on the topic {topic:?} declare different partition counts ({} and {} for {}); declare one count on all of them",
                            earlier.get(),
                            partitions.get(),
                            std::any::type_name::<E>(),
                        ),
                    ));
                }
                _ => {}
            }
        }
    }

    /// The registrations, or the first that failed (as `E` from an [`Error`]), then a
    /// conflict of partition counts (as `E` from an [`InvalidConfig`]). Having no handler
    /// at all is the builder's to report (each broker crate has its own error for it).
    pub fn finish<E: From<Error> + From<InvalidConfig>>(self) -> Result<Routed<C>, E> {
        if let Some(e) = self.error {
            return Err(e.into());
        }
        if let Some(e) = self.conflict {
            return Err(e.into());
        }
        Ok(Routed {
            dispatcher: self.dispatcher,
            declared: self.declared,
        })
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use super::*;
    use crate::{Delivery, HandlerError, MemoryTx};

    #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
    #[outbox(topic = "routes.a", partitions = 4)]
    struct A {
        #[outbox(id)]
        id: String,
    }

    #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
    #[outbox(topic = "routes.a", partitions = 2)]
    struct B {
        #[outbox(id)]
        id: String,
    }

    struct Nothing;
    impl<E: OutboxEvent> Handler<E> for Nothing {
        type Conn = MemoryTx<()>;
        fn handle(&self, _: E, _: &mut Self::Conn, _: &Delivery) -> Result<(), HandlerError> {
            Ok(())
        }
    }

    #[test]
    fn a_type_handled_twice_is_reported_at_finish() {
        let mut routes = Routes::new();
        routes.handle::<A, _>(Nothing);
        routes.handle::<A, _>(Nothing);
        assert!(matches!(
            routes.finish::<Error>(),
            Err(Error::DuplicateHandler(_))
        ));
    }

    #[test]
    fn types_of_one_topic_with_different_counts_are_refused() {
        let mut routes = Routes::new();
        routes.handle::<A, _>(Nothing);
        routes.handle::<B, _>(Nothing);
        let Err(e) = routes.finish::<Error>() else {
            panic!("a conflict of partition counts was accepted")
        };
        let Error::Config(e) = e else {
            panic!("not a configuration error: {e}")
        };
        assert_eq!(e.field(), "partitions");
    }

    #[test]
    fn the_configured_count_overrides_the_declared_one() {
        let mut routes = Routes::new();
        routes.handle::<A, _>(Nothing);
        let routed = routes.finish::<Error>().unwrap();
        assert_eq!(routed.partitions(&BTreeMap::new(), "routes.a").get(), 4);
        let overrides = BTreeMap::from([("routes.a".to_owned(), Partitions::new(8).unwrap())]);
        assert_eq!(routed.partitions(&overrides, "routes.a").get(), 8);
        assert_eq!(routed.partitions(&overrides, "routes.b").get(), 1);
    }
}
