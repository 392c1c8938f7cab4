use std::collections::HashMap;
use std::sync::Arc;

use crate::{Envelope, Error, HandlerError, Inbox, OutboxEvent, Processed};

/// Where and how often a message was delivered, next to the message itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The message.
    pub envelope: Envelope,
    /// How many times the broker has delivered it (1 on the first delivery).
    pub delivery_count: u64,
    /// The broker's id for the entry (a Redis stream entry id), if it has one.
    pub entry_id: Option<String>,
}

/// Applies one event type. The handler runs inside the consumer's dedup transaction and
/// writes through `conn`, so its writes commit together with the dedup row, or not at all.
///
/// ```
/// use outbox_core::{Delivery, Handler, HandlerError, OutboxEvent};
/// use std::collections::HashMap;
///
/// #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
/// struct OrderPaid { #[outbox(id)] order_id: String, amount_cents: i64 }
///
/// struct AwardPoints;
/// impl Handler<OrderPaid> for AwardPoints {
///     type Conn = HashMap<String, i64>; // with diesel: `PgConnection`
///     fn handle(&self, e: OrderPaid, points: &mut Self::Conn, _: &Delivery) -> Result<(), HandlerError> {
///         *points.entry(e.order_id).or_default() += e.amount_cents / 100;
///         Ok(())
///     }
/// }
///
/// let mut points = HashMap::new();
/// let e = OrderPaid { order_id: "order-42".into(), amount_cents: 1999 };
/// let envelope = outbox_core::Envelope::from_event(&e, 1024)?;
/// let delivery = Delivery { envelope, delivery_count: 1, entry_id: None };
/// AwardPoints.handle(e, &mut points, &delivery)?;
/// assert_eq!(points["order-42"], 19);
/// # Ok::<_, Box<dyn std::error::Error>>(())
/// ```
pub trait Handler<E: OutboxEvent>: Send + Sync + 'static {
    /// The connection type of the dedup store this handler runs with.
    type Conn;

    /// Applies `event`. An error (or panic) rolls back the transaction and leaves the
    /// message unacknowledged, to be retried.
    fn handle(
        &self,
        event: E,
        conn: &mut Self::Conn,
        delivery: &Delivery,
    ) -> Result<(), HandlerError>;
}

type Run<C> = Box<dyn FnOnce(&mut C, &Delivery) -> Result<(), HandlerError> + Send>;
type Route<C> = Arc<dyn Fn(&Envelope) -> Result<Run<C>, Error> + Send + Sync>;

/// Routes messages by event type to typed handlers over connection type `C`.
pub struct Dispatcher<C> {
    routes: HashMap<&'static str, Route<C>>,
    topics: Vec<&'static str>,
}

impl<C> Default for Dispatcher<C> {
    fn default() -> Self {
        Self {
            routes: HashMap::new(),
            topics: Vec::new(),
        }
    }
}

impl<C> Clone for Dispatcher<C> {
    fn clone(&self) -> Self {
        Self {
            routes: self.routes.clone(),
            topics: self.topics.clone(),
        }
    }
}

impl<C> std::fmt::Debug for Dispatcher<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut types: Vec<_> = self.routes.keys().collect();
        types.sort();
        f.debug_struct("Dispatcher")
            .field("event_types", &types)
            .field("topics", &self.topics)
            .finish()
    }
}

/// A decoded message with its handler, ready to run in a transaction.
pub struct Prepared<C>(Run<C>);

impl<C> Prepared<C> {
    /// Runs the handler.
    pub fn run(self, conn: &mut C, delivery: &Delivery) -> Result<(), HandlerError> {
        (self.0)(conn, delivery)
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
        if let Some(taken) = E::EVENT_TYPES.iter().find(|t| self.routes.contains_key(*t)) {
            return Err(Error::DuplicateHandler((*taken).to_owned()));
        }
        let handler = Arc::new(handler);
        let route: Route<C> = Arc::new(move |envelope: &Envelope| {
            let event: E = envelope.decode()?;
            let handler = Arc::clone(&handler);
            Ok(
                Box::new(move |conn: &mut C, d: &Delivery| handler.handle(event, conn, d))
                    as Run<C>,
            )
        });
        for t in E::EVENT_TYPES {
            self.routes.insert(t, Arc::clone(&route));
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

    /// Finds the handler and decodes the payload, before any transaction is opened.
    /// Unknown types and undecodable payloads are errors ([`Error::is_poison`]).
    pub fn prepare(&self, envelope: &Envelope) -> Result<Prepared<C>, Error> {
        let route = self
            .routes
            .get(envelope.event_type.as_str())
            .ok_or_else(|| Error::UnknownEventType(envelope.event_type.clone()))?;
        route(envelope).map(Prepared)
    }

    /// Decodes and applies one delivery exactly once in effect for `group`: the dedup row
    /// and the handler's writes commit together in `inbox`.
    pub fn consume<I>(
        &self,
        inbox: &I,
        group: &str,
        delivery: &Delivery,
    ) -> Result<Processed, Error>
    where
        I: Inbox<Conn = C>,
    {
        let prepared = self.prepare(&delivery.envelope)?;
        inbox.process(group, &delivery.envelope.msg_id, |conn| {
            prepared.run(conn, delivery)
        })
    }
}
