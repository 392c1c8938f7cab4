use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::prepared::{Prepared, Run};
use super::upgrade::{Payload, Step, decode};
use crate::{
    AsyncHandler, AsyncTxHandler, Delivery, Envelope, Error, Handler, OutboxEvent, TxFuture,
};
#[cfg(doc)]
use crate::{AsyncInbox, Inbox};

pub(super) type Decode<C> = Arc<dyn Fn(&Envelope, Payload) -> Result<Run<C>, Error> + Send + Sync>;

/// The handler of an event type, and the schema version its event type is at.
struct Route<C> {
    version: u32,
    decode: Decode<C>,
}

impl<C> Clone for Route<C> {
    fn clone(&self) -> Self {
        Self {
            version: self.version,
            decode: Arc::clone(&self.decode),
        }
    }
}

/// Routes messages by event type to typed handlers over connection type `C`, upgrading
/// payloads of older schema versions on the way ([`upgrade`](Self::upgrade)).
pub struct Dispatcher<C> {
    routes: HashMap<&'static str, Route<C>>,
    /// Per event type, the upgrade steps by the version they start from.
    pub(super) upgrades: HashMap<&'static str, BTreeMap<u32, Step>>,
    pub(super) topics: Vec<&'static str>,
}

impl<C> Default for Dispatcher<C> {
    fn default() -> Self {
        Self {
            routes: HashMap::new(),
            upgrades: HashMap::new(),
            topics: Vec::new(),
        }
    }
}

impl<C> Clone for Dispatcher<C> {
    fn clone(&self) -> Self {
        Self {
            routes: self.routes.clone(),
            upgrades: self.upgrades.clone(),
            topics: self.topics.clone(),
        }
    }
}

impl<C> std::fmt::Debug for Dispatcher<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut types: Vec<_> = self.routes.keys().collect();
        types.sort();
        let mut upgrades: Vec<_> = self
            .upgrades
            .iter()
            .map(|(t, steps)| (*t, steps.keys().collect::<Vec<_>>()))
            .collect();
        upgrades.sort();
        f.debug_struct("Dispatcher")
            .field("event_types", &types)
            .field("upgrades_from", &upgrades)
            .field("topics", &self.topics)
            .finish()
    }
}

impl<C: 'static> Dispatcher<C> {
    /// An empty dispatcher.
    pub fn new() -> Self {
        Self::default()
    }

    /// Routes every event type of `E` to `handler`. Fails if one is already routed.
    pub fn register<E, H>(&mut self, handler: H) -> Result<(), Error>
    where
        E: OutboxEvent,
        H: Handler<E, Conn = C>,
    {
        let handler = Arc::new(handler);
        self.route::<E>(Arc::new(move |envelope: &Envelope, payload: Payload| {
            let event: E = decode(envelope, payload)?;
            let handler = Arc::clone(&handler);
            Ok(Run::Blocking(Box::new(
                move |conn: &mut C, d: &Delivery| handler.handle(event, conn, d),
            )))
        }))
    }

    /// Routes every event type of `E` to an [`AsyncTxHandler`], for a consumer on an
    /// [`AsyncInbox`]. Fails if one is already routed.
    pub fn register_tx<E, H>(&mut self, handler: H) -> Result<(), Error>
    where
        E: OutboxEvent,
        H: AsyncTxHandler<E, Conn = C>,
        C: Send,
    {
        let handler = Arc::new(handler);
        self.route::<E>(Arc::new(move |envelope: &Envelope, payload: Payload| {
            let event: E = decode(envelope, payload)?;
            let handler = Arc::clone(&handler);
            Ok(Run::Awaited(Box::new(
                move |conn: &mut C, d: &Delivery| -> TxFuture<'_> {
                    Box::pin(async move { handler.handle(event, conn, d).await })
                },
            )))
        }))
    }

    /// Routes every event type of `E` to an [`AsyncHandler`]. Fails if one is already
    /// routed. The handler runs inside the dedup transaction: with an [`Inbox`] on the
    /// blocking thread that holds it, driven by the current tokio runtime, with an
    /// [`AsyncInbox`] awaited; see [`AsyncHandler`] for what that guarantees.
    pub fn register_async<E, H>(&mut self, handler: H) -> Result<(), Error>
    where
        E: OutboxEvent,
        H: AsyncHandler<E>,
    {
        let handler = Arc::new(handler);
        self.route::<E>(Arc::new(move |envelope: &Envelope, payload: Payload| {
            let event: E = decode(envelope, payload)?;
            let handler = Arc::clone(&handler);
            Ok(Run::Awaited(Box::new(
                move |_: &mut C, d: &Delivery| -> TxFuture<'_> {
                    Box::pin(async move { handler.handle(event, d).await })
                },
            )))
        }))
    }

    fn route<E: OutboxEvent>(&mut self, decode: Decode<C>) -> Result<(), Error> {
        if let Some(taken) = E::EVENT_TYPES.iter().find(|t| self.routes.contains_key(*t)) {
            return Err(Error::DuplicateHandler((*taken).to_owned()));
        }
        let route = Route {
            version: E::SCHEMA_VERSION,
            decode,
        };
        for t in E::EVENT_TYPES {
            self.routes.insert(t, route.clone());
        }
        for t in E::TOPICS {
            if !self.topics.contains(t) {
                self.topics.push(t);
            }
        }
        Ok(())
    }

    /// The topics the registered handlers listen to, in registration order.
    pub fn topics(&self) -> &[&'static str] {
        &self.topics
    }

    /// Whether a handler is registered for `event_type`.
    pub fn handles(&self, event_type: &str) -> bool {
        self.routes.contains_key(event_type)
    }

    /// Finds the handler, upgrades the payload if it is of an older schema version
    /// ([`upgrade`](Self::upgrade)) and decodes it, before any transaction is opened.
    /// Unknown types, payloads of a newer schema version than the handler's event type
    /// ([`OutboxEvent::SCHEMA_VERSION`]), payloads an upgrade step refuses and
    /// undecodable payloads are errors ([`Error::is_poison`]).
    pub fn prepare(&self, envelope: &Envelope) -> Result<Prepared<C>, Error> {
        let route = self
            .routes
            .get(envelope.event_type.as_str())
            .ok_or_else(|| Error::UnknownEventType(envelope.event_type.clone()))?;
        let payload = self.upgraded(envelope, route.version)?;
        (route.decode)(envelope, payload).map(Prepared)
    }
}
