use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;

use serde_json::Value;

use futures_util::FutureExt as _;

use crate::{
    AsyncInbox, BoxError, Envelope, Error, HandlerError, Inbox, InboxBatchOutcomes, InvalidConfig,
    OutboxEvent, Processed, TxFuture,
};

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
    ///
    /// Return database errors (with `?`) rather than going on after them: a deadlock, a
    /// serialization failure or a lock wait timeout is then recognised by the inbox as
    /// [`Error::Transient`] and retried soon, without counting as the handler's failure.
    /// After a deadlock, MySQL and MariaDB have already rolled the transaction back, and
    /// whatever the handler writes next is outside it.
    fn handle(
        &self,
        event: E,
        conn: &mut Self::Conn,
        delivery: &Delivery,
    ) -> Result<(), HandlerError>;
}

/// Applies one event type through an effect outside the database: an HTTP call, an
/// email, a message to another system.
///
/// The consumer records `(consumer_group, msg_id)` in its dedup transaction, awaits the
/// handler inside that transaction, and commits after it succeeded. A failure (or panic)
/// rolls the dedup row back and the message is retried. If the process dies after the
/// effect but before the commit, the effect runs again on redelivery: the guarantee for
/// what the handler does outside the database is at-least-once, and its idempotency is
/// only as strong as the target's. Pass [`Delivery::envelope`]'s `msg_id` to the target
/// as an idempotency key where it accepts one. The transaction stays open while the
/// handler runs, so keep the call short and give it a timeout.
///
/// With a blocking [`Inbox`], runners call it on the blocking thread that holds the
/// transaction, where it is driven by the current tokio runtime; with an [`AsyncInbox`]
/// it is awaited like an [`AsyncTxHandler`].
pub trait AsyncHandler<E: OutboxEvent>: Send + Sync + 'static {
    /// Performs the effect of `event`.
    fn handle(
        &self,
        event: E,
        delivery: &Delivery,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// Applies one event type on an async connection, inside the consumer's dedup
/// transaction: the async twin of [`Handler`], for an [`AsyncInbox`] (`outbox-diesel`'s
/// `AsyncPgInbox` gives `&mut AsyncPgConnection`). Its writes through `conn` commit
/// together with the dedup row, or not at all; no blocking thread is held while it runs.
///
/// Write it as an `async fn`; the future must be `Send` (so must whatever it holds across
/// an `.await`), since the consumer runs it on a multi-threaded runtime:
///
/// ```
/// use outbox_core::{AsyncTxHandler, Delivery, HandlerError, OutboxEvent};
///
/// #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
/// struct OrderPaid { #[outbox(id)] order_id: String, amount_cents: i64 }
///
/// struct AwardPoints;
/// impl AsyncTxHandler<OrderPaid> for AwardPoints {
///     type Conn = Vec<String>; // with diesel-async: `AsyncPgConnection`
///     async fn handle(&self, e: OrderPaid, conn: &mut Self::Conn, _: &Delivery) -> Result<(), HandlerError> {
///         tokio::task::yield_now().await; // e.g. `diesel::update(..).execute(conn).await?`
///         conn.push(format!("{} +{}", e.order_id, e.amount_cents / 100));
///         Ok(())
///     }
/// }
///
/// # tokio::runtime::Builder::new_current_thread().build()?.block_on(async {
/// let e = OrderPaid { order_id: "o-1".into(), amount_cents: 1999 };
/// let envelope = outbox_core::Envelope::from_event(&e, 1024)?;
/// let delivery = Delivery { envelope, delivery_count: 1, entry_id: None };
/// let mut log = Vec::new();
/// AwardPoints.handle(e, &mut log, &delivery).await?;
/// assert_eq!(log, ["o-1 +19"]);
/// # Ok::<_, Box<dyn std::error::Error>>(()) })?;
/// # Ok::<_, Box<dyn std::error::Error>>(())
/// ```
///
/// As with [`Handler`]: return database errors with `?` rather than going on after them,
/// so that a deadlock or serialization failure is recognised as [`Error::Transient`]; an
/// error or a panic rolls the transaction back and leaves the message to be retried.
pub trait AsyncTxHandler<E: OutboxEvent>: Send + Sync + 'static {
    /// The connection type of the async dedup store this handler runs with
    /// ([`AsyncInbox::Conn`]).
    type Conn;

    /// Applies `event` through `conn`, the dedup transaction's connection.
    fn handle(
        &self,
        event: E,
        conn: &mut Self::Conn,
        delivery: &Delivery,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// A handler that runs to the end when called.
type BlockingRun<C> = Box<dyn FnOnce(&mut C, &Delivery) -> Result<(), HandlerError> + Send>;
/// A handler whose future is awaited: on the async path directly, on the blocking path
/// through the current runtime.
type AwaitedRun<C> = Box<dyn for<'c> FnOnce(&'c mut C, &'c Delivery) -> TxFuture<'c> + Send>;

enum Run<C> {
    Blocking(BlockingRun<C>),
    Awaited(AwaitedRun<C>),
}
type Decode<C> = Arc<dyn Fn(&Envelope, Payload) -> Result<Run<C>, Error> + Send + Sync>;
type Step = Arc<dyn Fn(Value) -> Result<Value, BoxError> + Send + Sync>;

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

/// A payload ready to decode: the text as it arrived (no step applied: decoded straight
/// from the text, as if there were no upgrades), or the JSON its upgrade steps made.
enum Payload {
    Text,
    Upgraded(Value),
}

/// Routes messages by event type to typed handlers over connection type `C`, upgrading
/// payloads of older schema versions on the way ([`upgrade`](Self::upgrade)).
pub struct Dispatcher<C> {
    routes: HashMap<&'static str, Route<C>>,
    /// Per event type, the upgrade steps by the version they start from.
    upgrades: HashMap<&'static str, BTreeMap<u32, Step>>,
    topics: Vec<&'static str>,
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

/// A decoded message with its handler, ready to run in a transaction.
pub struct Prepared<C>(Run<C>);

impl<C> Prepared<C> {
    /// Runs the handler, on a thread that may block: an async handler
    /// ([`AsyncHandler`], [`AsyncTxHandler`]) is driven to the end by the current tokio
    /// runtime (outside one it is a handler error).
    pub fn run(self, conn: &mut C, delivery: &Delivery) -> Result<(), HandlerError> {
        match self.0 {
            Run::Blocking(run) => run(conn, delivery),
            Run::Awaited(run) => {
                let runtime = tokio::runtime::Handle::try_current()
                    .map_err(|_| HandlerError::msg("an async handler needs a tokio runtime"))?;
                runtime.block_on(run(conn, delivery))
            }
        }
    }

    /// The handler as a future, for an [`AsyncInbox`]: an async handler is awaited, a
    /// blocking [`Handler`] runs when the future is first polled.
    pub fn run_async<'c>(self, conn: &'c mut C, delivery: &'c Delivery) -> TxFuture<'c>
    where
        C: Send,
    {
        match self.0 {
            Run::Awaited(run) => run(conn, delivery),
            Run::Blocking(run) => Box::pin(async move { run(conn, delivery) }),
        }
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

    /// Registers the step that turns a payload of `E`'s schema version `from` into
    /// version `from + 1`, so that a handler of `E` (at
    /// [`E::SCHEMA_VERSION`](OutboxEvent::SCHEMA_VERSION), `#[outbox(version = N)]`)
    /// receives the messages of producers still at an older version.
    ///
    /// A payload of version `v` below `E`'s goes through the steps from `v`, `v + 1`, ..
    /// in turn, each on the JSON the one before made, and is then decoded; a version
    /// without a step is taken as compatible and passed on unchanged (a field added with
    /// `#[serde(default)]` needs none). The handler's [`Delivery::envelope`] stays the
    /// message as it arrived. A payload newer than `E`
    /// ([`Error::UnsupportedSchemaVersion`]) and one a step fails or panics on
    /// ([`Error::Upgrade`]) are refused before decoding and are poison
    /// ([`Error::is_poison`]): a consumer dead-letters them at once.
    ///
    /// Steps belong to the consuming service, not to the event type (they may need its
    /// settings), and may be registered before or after the handler. Fails if `from` is
    /// 0 or not below `E`'s version, or if a step from `from` is already registered for
    /// one of `E`'s event types.
    ///
    /// ```
    /// use outbox_core::{Delivery, Dispatcher, Envelope, Handler, HandlerError, MemoryDb,
    ///                   MemoryTx, OutboxEvent, Processed};
    /// use serde_json::{Value, json};
    ///
    /// // Version 1: `{order_id, cents}`; version 2: `cents` renamed to `amount_cents`;
    /// // version 3: `currency` added.
    /// #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
    /// #[outbox(version = 3)]
    /// struct OrderPaid { #[outbox(id)] order_id: String, amount_cents: i64, currency: String }
    ///
    /// struct Revenue;
    /// impl Handler<OrderPaid> for Revenue {
    ///     type Conn = MemoryTx<Vec<String>>;
    ///     fn handle(&self, e: OrderPaid, tx: &mut Self::Conn, _: &Delivery) -> Result<(), HandlerError> {
    ///         tx.data().push(format!("{} {} {}", e.order_id, e.amount_cents, e.currency));
    ///         Ok(())
    ///     }
    /// }
    ///
    /// let mut dispatcher = Dispatcher::new();
    /// dispatcher.register::<OrderPaid, _>(Revenue)?;
    /// dispatcher
    ///     .upgrade::<OrderPaid>(1, |mut v: Value| {
    ///         let cents = v["cents"].take();
    ///         v["amount_cents"] = cents;
    ///         Ok(v)
    ///     })?
    ///     .upgrade::<OrderPaid>(2, |mut v: Value| {
    ///         v["currency"] = json!("EUR"); // orders before v3 are in euros
    ///         Ok(v)
    ///     })?;
    ///
    /// // A message from a producer still at version 1.
    /// let mut envelope = Envelope::from_event(
    ///     &OrderPaid { order_id: "o-1".into(), amount_cents: 0, currency: String::new() }, 1024)?;
    /// envelope.schema_version = 1;
    /// envelope.payload = r#"{"order_id":"o-1","cents":1999}"#.into();
    /// let db = MemoryDb::new(Vec::new());
    /// let v1 = Delivery { envelope, delivery_count: 1, entry_id: None };
    /// assert_eq!(dispatcher.consume(&db, "revenue", &v1)?, Processed::Applied);
    /// assert_eq!(db.read(|rows| rows.clone()), ["o-1 1999 EUR"]);
    ///
    /// // One from a newer producer is refused, not decoded.
    /// let mut v4 = v1.clone();
    /// v4.envelope.schema_version = 4;
    /// let refused = dispatcher.consume(&db, "revenue", &v4).unwrap_err();
    /// assert!(refused.is_poison());
    /// assert!(refused.to_string().ends_with("produced by a newer service (v4 > v3)"));
    /// # Ok::<_, outbox_core::Error>(())
    /// ```
    pub fn upgrade<E: OutboxEvent>(
        &mut self,
        from: u32,
        step: impl Fn(Value) -> Result<Value, BoxError> + Send + Sync + 'static,
    ) -> Result<&mut Self, Error> {
        let field = format!("upgrade step of `{}`", E::EVENT_TYPES.join("`, `"));
        if from == 0 || from >= E::SCHEMA_VERSION {
            let rule = format!(
                "must start from a version 1 to {} (below its version {}); got {from}",
                E::SCHEMA_VERSION.saturating_sub(1),
                E::SCHEMA_VERSION
            );
            return Err(InvalidConfig::new(field, rule).into());
        }
        if E::EVENT_TYPES
            .iter()
            .any(|t| self.upgrades.get(t).is_some_and(|s| s.contains_key(&from)))
        {
            let rule = format!("from version {from} is already registered");
            return Err(InvalidConfig::new(field, rule).into());
        }
        let step: Step = Arc::new(step);
        for t in E::EVENT_TYPES {
            self.upgrades
                .entry(t)
                .or_default()
                .insert(from, Arc::clone(&step));
        }
        Ok(self)
    }

    /// The payload of `envelope` at schema version `target`: refused if newer, upgraded
    /// through the registered steps if older.
    fn upgraded(&self, envelope: &Envelope, target: u32) -> Result<Payload, Error> {
        let version = envelope.schema_version;
        // A payload of a newer schema may carry fields the handler's type does not know,
        // which serde would drop without a word: refuse it before decoding.
        if version > target {
            return Err(Error::UnsupportedSchemaVersion {
                event_type: envelope.event_type.clone(),
                version,
                supported: target,
            });
        }
        let mut steps = match self.upgrades.get(envelope.event_type.as_str()) {
            Some(steps) => steps.range(version..target).peekable(),
            None => return Ok(Payload::Text),
        };
        if steps.peek().is_none() {
            return Ok(Payload::Text);
        }
        let mut value: Value =
            serde_json::from_str(&envelope.payload).map_err(|source| Error::Decode {
                event_type: envelope.event_type.clone(),
                source,
            })?;
        for (&from, step) in steps {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(value)))
                .unwrap_or_else(|panic| {
                    Err(format!("upgrade step panicked: {}", panic_message(&*panic)).into())
                });
            value = result.map_err(|source| Error::Upgrade {
                event_type: envelope.event_type.clone(),
                from,
                source,
            })?;
        }
        Ok(Payload::Upgraded(value))
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

    /// [`consume`](Self::consume) on an [`AsyncInbox`]: decodes `delivery`, then awaits
    /// the dedup transaction with the handler inside it. A panic of the handler is
    /// caught inside the transaction, which then rolls back, and reported as
    /// [`Error::Handler`] ("handler panicked: ..").
    pub async fn consume_async<I>(
        &self,
        inbox: &I,
        group: &str,
        delivery: &Delivery,
    ) -> Result<Processed, Error>
    where
        I: AsyncInbox<Conn = C>,
        C: Send,
    {
        let prepared = self.prepare(&delivery.envelope)?;
        Self::consume_prepared(inbox, group, prepared, delivery.clone()).await
    }

    /// The transaction of [`consume_async`](Self::consume_async) for a message prepared
    /// already ([`prepare`](Self::prepare)).
    pub async fn consume_prepared<I>(
        inbox: &I,
        group: &str,
        prepared: Prepared<C>,
        delivery: Delivery,
    ) -> Result<Processed, Error>
    where
        I: AsyncInbox<Conn = C>,
        C: Send,
    {
        let msg_id = delivery.envelope.msg_id.clone();
        inbox
            .process(group, &msg_id, move |conn| {
                Box::pin(async move { run_async_catching_panic(prepared, conn, &delivery).await })
            })
            .await
    }

    /// [`consume_batch`](Self::consume_batch) on an [`AsyncInbox`]: the deliveries go
    /// through one [`AsyncInbox::process_batch`], with the same outcomes; a handler's
    /// panic costs only its own message.
    pub async fn consume_batch_async<I>(
        &self,
        inbox: &I,
        group: &str,
        deliveries: &[Delivery],
    ) -> Result<InboxBatchOutcomes, Error>
    where
        I: AsyncInbox<Conn = C>,
        C: Send,
    {
        let PreparedBatch {
            mut outcomes,
            mut runs,
            msg_ids,
        } = self.prepare_all(deliveries);
        if runs.is_empty() {
            return Ok(outcomes.into_iter().flatten().collect());
        }
        let processed = inbox
            .process_batch(group, &msg_ids, |i, conn| {
                let (delivery, prepared) = &mut runs[i];
                let (delivery, prepared) = ((*delivery).clone(), prepared.take());
                Box::pin(async move {
                    let prepared = prepared.ok_or_else(|| {
                        HandlerError::msg("the inbox ran this message's handler twice")
                    })?;
                    run_async_catching_panic(prepared, conn, &delivery).await
                })
            })
            .await?;
        merge_outcomes(&mut outcomes, processed, msg_ids.len())
    }

    /// Prepares each delivery of a batch ([`PreparedBatch`]).
    fn prepare_all<'d>(&self, deliveries: &'d [Delivery]) -> PreparedBatch<'d, C> {
        let mut outcomes = Vec::with_capacity(deliveries.len());
        let mut runs = Vec::new();
        let mut msg_ids = Vec::new();
        for delivery in deliveries {
            match self.prepare(&delivery.envelope) {
                Ok(prepared) => {
                    outcomes.push(None);
                    runs.push((delivery, Some(prepared)));
                    msg_ids.push(delivery.envelope.msg_id.clone());
                }
                Err(e) => outcomes.push(Some(Err(e))),
            }
        }
        PreparedBatch {
            outcomes,
            runs,
            msg_ids,
        }
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

    /// Decodes and applies many deliveries for `group` through one
    /// [`Inbox::process_batch`]: with a store that has savepoints, one transaction for
    /// the batch and a savepoint per message.
    ///
    /// Returns one outcome per delivery, in order. A delivery that does not
    /// [`prepare`](Self::prepare) (an unknown type, an undecodable payload) gets that
    /// error ([`Error::is_poison`]) and never reaches the store; a handler that fails or
    /// panics (reported as [`Error::Handler`]) rolls back only its own message, and a
    /// message's transient conflict is its [`Error::Transient`]; the others commit
    /// together. The outer `Err` is the store's failure as a whole, or
    /// [`Error::TransientBatch`] when a conflict rolled back the whole transaction (see
    /// [`Inbox::process_batch`]): nothing is known to have committed.
    ///
    /// ```
    /// use outbox_core::{Delivery, Dispatcher, Envelope, Handler, HandlerError, MemoryDb,
    ///                   MemoryTx, OutboxEvent, Processed};
    ///
    /// #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
    /// struct OrderPaid { #[outbox(id)] order_id: String, amount_cents: i64 }
    ///
    /// struct Total;
    /// impl Handler<OrderPaid> for Total {
    ///     type Conn = MemoryTx<i64>;
    ///     fn handle(&self, e: OrderPaid, tx: &mut MemoryTx<i64>, _: &Delivery) -> Result<(), HandlerError> {
    ///         if e.amount_cents < 0 {
    ///             return Err(HandlerError::msg("negative amount"));
    ///         }
    ///         *tx.data() += e.amount_cents;
    ///         Ok(())
    ///     }
    /// }
    ///
    /// let mut dispatcher = Dispatcher::new();
    /// dispatcher.register::<OrderPaid, _>(Total)?;
    /// let delivery = |id: &str, amount_cents| -> Result<Delivery, outbox_core::Error> {
    ///     let e = OrderPaid { order_id: id.into(), amount_cents };
    ///     Ok(Delivery { envelope: Envelope::from_event(&e, 1024)?, delivery_count: 1, entry_id: None })
    /// };
    /// let batch = [delivery("o-1", 100)?, delivery("o-2", -5)?, delivery("o-3", 20)?];
    ///
    /// let db = MemoryDb::new(0_i64);
    /// let outcomes = dispatcher.consume_batch(&db, "totals", &batch)?;
    /// assert!(matches!(outcomes[0], Ok(Processed::Applied)));
    /// let refused = outcomes[1].as_ref().unwrap_err();
    /// assert!(outbox_core::error_chain(refused).to_string().contains("negative amount"));
    /// assert!(matches!(outcomes[2], Ok(Processed::Applied)));
    /// assert_eq!(db.read(|total| *total), 120);
    /// # Ok::<_, outbox_core::Error>(())
    /// ```
    pub fn consume_batch<I>(
        &self,
        inbox: &I,
        group: &str,
        deliveries: &[Delivery],
    ) -> Result<InboxBatchOutcomes, Error>
    where
        I: Inbox<Conn = C>,
    {
        let PreparedBatch {
            mut outcomes,
            mut runs,
            msg_ids,
        } = self.prepare_all(deliveries);
        if runs.is_empty() {
            return Ok(outcomes.into_iter().flatten().collect());
        }
        let processed = inbox.process_batch(group, &msg_ids, |i, conn| {
            let (delivery, prepared) = &mut runs[i];
            let prepared = prepared
                .take()
                .ok_or_else(|| HandlerError::msg("the inbox ran this message's handler twice"))?;
            run_catching_panic(prepared, conn, delivery)
        })?;
        merge_outcomes(&mut outcomes, processed, msg_ids.len())
    }
}

/// A batch of deliveries as [`Dispatcher::prepare_all`] prepared it.
struct PreparedBatch<'d, C> {
    /// One per delivery, in order: `None` for a prepared delivery (its outcome comes
    /// from the store), the delivery's error otherwise.
    outcomes: Vec<Option<Result<Processed, Error>>>,
    /// The prepared deliveries, in order; each `Prepared` is taken by its handler's run.
    runs: Vec<(&'d Delivery, Option<Prepared<C>>)>,
    /// The msg_ids of `runs`, in the same order, for the store.
    msg_ids: Vec<crate::MsgId>,
}

/// The outcomes of a batch in delivery order: those decided before the store
/// (`Some`), and the store's for the others, in turn.
fn merge_outcomes(
    outcomes: &mut Vec<Option<Result<Processed, Error>>>,
    processed: InboxBatchOutcomes,
    expected: usize,
) -> Result<InboxBatchOutcomes, Error> {
    if processed.len() != expected {
        // A broken `Inbox` implementation: nothing can be told about any message.
        return Err(Error::store(format!(
            "Inbox::process_batch returned {} outcomes for {expected} messages",
            processed.len(),
        )));
    }
    let mut processed = processed.into_iter();
    Ok(std::mem::take(outcomes)
        .into_iter()
        .map(|o| o.unwrap_or_else(|| processed.next().expect("lengths checked above")))
        .collect())
}

/// Decodes a payload as `E`: from the text, or from the JSON the upgrade steps made.
fn decode<E: OutboxEvent>(envelope: &Envelope, payload: Payload) -> Result<E, Error> {
    match payload {
        Payload::Text => envelope.decode(),
        Payload::Upgraded(value) => serde_json::from_value(value).map_err(|source| Error::Decode {
            event_type: envelope.event_type.clone(),
            source,
        }),
    }
}

/// The text of a caught panic's payload (`&str` or `String`), for error messages and
/// logs of code that catches a handler's panic.
///
/// ```
/// let panic = std::panic::catch_unwind(|| panic!("boom {}", 1)).unwrap_err();
/// assert_eq!(outbox_core::panic_message(&*panic), "boom 1");
/// ```
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("non-text panic payload")
}

/// [`run_catching_panic`] for the async path: a panic while the handler's future is
/// polled becomes its error, inside the transaction, which the inbox then rolls back.
async fn run_async_catching_panic<C: Send>(
    prepared: Prepared<C>,
    conn: &mut C,
    delivery: &Delivery,
) -> Result<(), HandlerError> {
    std::panic::AssertUnwindSafe(prepared.run_async(conn, delivery))
        .catch_unwind()
        .await
        .unwrap_or_else(|panic| {
            Err(HandlerError::msg(format_args!(
                "handler panicked: {}",
                panic_message(&*panic)
            )))
        })
}

/// Runs a handler, turning a panic into its error. Safe to continue after: the inbox
/// rolls back the message's savepoint (or in-memory copy) on this error, so whatever the
/// panic left half-written is discarded.
fn run_catching_panic<C>(
    prepared: Prepared<C>,
    conn: &mut C,
    delivery: &Delivery,
) -> Result<(), HandlerError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        prepared.run(conn, delivery)
    }))
    .unwrap_or_else(|panic| {
        Err(HandlerError::msg(format_args!(
            "handler panicked: {}",
            panic_message(&*panic)
        )))
    })
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::{MemoryDb, MemoryTx, MsgId};

    #[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
    struct Credit {
        #[outbox(id)]
        id: String,
        amount: i64,
    }

    #[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
    struct Credited {
        #[outbox(id)]
        id: String,
    }

    type Balances = BTreeMap<String, i64>;

    /// Credits the amount and emits `Credited`; a negative amount fails after writing,
    /// zero panics after writing.
    struct Apply(AtomicUsize);
    impl Handler<Credit> for Apply {
        type Conn = MemoryTx<Balances>;
        fn handle(
            &self,
            e: Credit,
            tx: &mut MemoryTx<Balances>,
            _: &Delivery,
        ) -> Result<(), HandlerError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            *tx.data().entry(e.id.clone()).or_default() += e.amount;
            tx.emit(Credited { id: e.id })?;
            match e.amount {
                0 => panic!("zero credit"),
                a if a < 0 => Err(HandlerError::msg("negative credit")),
                _ => Ok(()),
            }
        }
    }

    fn dispatcher() -> (Dispatcher<MemoryTx<Balances>>, Arc<Apply>) {
        struct Shared(Arc<Apply>);
        impl Handler<Credit> for Shared {
            type Conn = MemoryTx<Balances>;
            fn handle(
                &self,
                e: Credit,
                tx: &mut MemoryTx<Balances>,
                d: &Delivery,
            ) -> Result<(), HandlerError> {
                self.0.handle(e, tx, d)
            }
        }
        let apply = Arc::new(Apply(AtomicUsize::new(0)));
        let mut d = Dispatcher::new();
        d.register::<Credit, _>(Shared(Arc::clone(&apply))).unwrap();
        (d, apply)
    }

    /// `envelope` delivered for the first time.
    pub(super) fn first_delivery(envelope: Envelope) -> Delivery {
        Delivery {
            envelope,
            delivery_count: 1,
            entry_id: None,
        }
    }

    fn credit(id: &str, amount: i64) -> Delivery {
        let e = Credit {
            id: id.into(),
            amount,
        };
        first_delivery(Envelope::from_event(&e, 1024).unwrap())
    }

    fn id(s: &str) -> MsgId {
        MsgId::new(s).unwrap()
    }

    fn kinds(outcomes: &[Result<Processed, Error>]) -> Vec<String> {
        outcomes
            .iter()
            .map(|o| match o {
                Ok(p) => format!("{p:?}"),
                Err(e) => format!("Err({})", crate::error_chain(e)),
            })
            .collect()
    }

    /// An inbox with only `process`: gets the default `process_batch`.
    struct OnlyProcess {
        db: MemoryDb<Balances>,
        transactions: AtomicUsize,
    }

    impl Inbox for OnlyProcess {
        type Conn = MemoryTx<Balances>;
        fn process<F>(&self, group: &str, msg_id: &MsgId, handle: F) -> Result<Processed, Error>
        where
            F: FnOnce(&mut MemoryTx<Balances>) -> Result<(), HandlerError>,
        {
            self.transactions.fetch_add(1, Ordering::SeqCst);
            if msg_id.as_str() == "down:Credit" {
                return Err(Error::store("connection refused"));
            }
            Inbox::process(&self.db, group, msg_id, handle)
        }
    }

    #[test]
    fn a_failing_message_in_a_memory_batch_leaves_no_trace_and_the_others_commit() {
        let db = MemoryDb::new(Balances::new());
        let (d, apply) = dispatcher();
        let batch = [credit("a", 10), credit("b", -5), credit("c", 20)];
        let outcomes = d.consume_batch(&db, "g", &batch).unwrap();
        assert_eq!(
            kinds(&outcomes),
            ["Applied", "Err(handler failed: negative credit)", "Applied"]
        );
        assert_eq!(apply.0.load(Ordering::SeqCst), 3);
        assert_eq!(
            db.read(Clone::clone),
            Balances::from([("a".into(), 10), ("c".into(), 20)])
        );
        let emitted: Vec<_> = db
            .rows()
            .iter()
            .map(|r| r.envelope.msg_id.to_string())
            .collect();
        assert_eq!(emitted, ["a:Credited", "c:Credited"]);
        // No dedup row for `b`: its redelivery runs the handler again.
        let again = d.consume_batch(&db, "g", &[credit("b", 5)]).unwrap();
        assert_eq!(kinds(&again), ["Applied"]);
        assert_eq!(db.read(|b| b["b"]), 5);
    }

    #[test]
    fn duplicates_in_the_batch_and_against_earlier_commits_do_not_run_the_handler() {
        let db = MemoryDb::new(Balances::new());
        let (d, apply) = dispatcher();
        assert_eq!(
            d.consume(&db, "g", &credit("a", 1)).unwrap(),
            Processed::Applied
        );
        let batch = [
            credit("a", 1),
            credit("b", 2),
            credit("b", 2),
            credit("c", -1),
            credit("c", 3),
        ];
        let outcomes = d.consume_batch(&db, "g", &batch).unwrap();
        // The second `c` runs: the first attempt failed and left no dedup row.
        assert_eq!(
            kinds(&outcomes),
            [
                "Duplicate",
                "Applied",
                "Duplicate",
                "Err(handler failed: negative credit)",
                "Applied"
            ]
        );
        assert_eq!(apply.0.load(Ordering::SeqCst), 1 + 3);
        assert_eq!(
            db.read(Clone::clone),
            Balances::from([("a".into(), 1), ("b".into(), 2), ("c".into(), 3)])
        );
        // Another group has its own dedup rows.
        let other = Inbox::process_batch(&db, "h", &[id("a:Credit")], |_, _| Ok(())).unwrap();
        assert_eq!(kinds(&other), ["Applied"]);
    }

    #[test]
    fn a_panicking_handler_fails_only_its_own_message() {
        let db = MemoryDb::new(Balances::new());
        let (d, _) = dispatcher();
        let outcomes = d
            .consume_batch(&db, "g", &[credit("a", 1), credit("z", 0), credit("c", 3)])
            .unwrap();
        assert_eq!(
            kinds(&outcomes),
            [
                "Applied",
                "Err(handler failed: handler panicked: zero credit)",
                "Applied"
            ]
        );
        assert!(db.read(|b| !b.contains_key("z") && b.len() == 2));
        assert!(db.row("z:Credited").is_none());
    }

    #[test]
    fn poison_is_reported_per_message_without_touching_the_store() {
        let inbox = OnlyProcess {
            db: MemoryDb::new(Balances::new()),
            transactions: AtomicUsize::new(0),
        };
        let (d, apply) = dispatcher();
        let mut unknown = credit("u", 1);
        unknown.envelope.event_type = "Debit".into();
        let mut garbled = credit("g", 1);
        garbled.envelope.payload = "{not json".into();
        let outcomes = d
            .consume_batch(&inbox, "g", &[unknown.clone(), garbled.clone()])
            .unwrap();
        assert!(
            outcomes
                .iter()
                .all(|o| o.as_ref().is_err_and(Error::is_poison))
        );
        assert_eq!(inbox.transactions.load(Ordering::SeqCst), 0);
        assert_eq!(apply.0.load(Ordering::SeqCst), 0);

        let outcomes = d
            .consume_batch(
                &inbox,
                "g",
                &[unknown, credit("a", 1), garbled, credit("b", 2)],
            )
            .unwrap();
        assert!(matches!(outcomes[0], Err(Error::UnknownEventType(_))));
        assert!(matches!(outcomes[1], Ok(Processed::Applied)));
        assert!(matches!(outcomes[2], Err(Error::Decode { .. })));
        assert!(matches!(outcomes[3], Ok(Processed::Applied)));
        assert_eq!(inbox.db.read(|b| b.len()), 2);
    }

    #[test]
    fn the_default_batch_processes_one_message_per_transaction() {
        let inbox = OnlyProcess {
            db: MemoryDb::new(Balances::new()),
            transactions: AtomicUsize::new(0),
        };
        let mut seen = Vec::new();
        let ids = [
            id("a:Credit"),
            id("down:Credit"),
            id("b:Credit"),
            id("a:Credit"),
        ];
        let outcomes = inbox
            .process_batch("g", &ids, |i, tx| {
                seen.push(i);
                *tx.data().entry(ids[i].to_string()).or_default() += 1;
                Ok(())
            })
            .unwrap();
        assert_eq!(
            kinds(&outcomes),
            [
                "Applied",
                "Err(store error: connection refused)",
                "Applied",
                "Duplicate"
            ]
        );
        assert!(outcomes[1].as_ref().is_err_and(Error::is_outage));
        assert_eq!(seen, [0, 2]);
        assert_eq!(inbox.transactions.load(Ordering::SeqCst), 4);
    }

    #[test]
    fn an_empty_batch_is_empty() {
        let db = MemoryDb::new(Balances::new());
        let (d, _) = dispatcher();
        assert!(d.consume_batch(&db, "g", &[]).unwrap().is_empty());
        let none = Inbox::process_batch(&db, "g", &[], |_, _| Ok(())).unwrap();
        assert!(none.is_empty());
    }

    #[test]
    fn a_panic_inside_process_batch_itself_commits_nothing_in_memory() {
        let db = MemoryDb::new(Balances::new());
        let ids = [id("a:Credit"), id("b:Credit")];
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Inbox::process_batch(&db, "g", &ids, |i, tx: &mut MemoryTx<Balances>| {
                tx.data().insert("written".into(), 1);
                assert!(i == 0, "boom");
                Ok(())
            })
        }));
        assert!(unwound.is_err());
        assert!(db.read(|b| b.is_empty()));
        // Nor the dedup row of the message before the panic.
        let outcomes = Inbox::process_batch(&db, "g", &ids[..1], |_, _| Ok(())).unwrap();
        assert_eq!(kinds(&outcomes), ["Applied"]);
    }
}

#[cfg(all(test, feature = "memory"))]
mod upgrade_tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use serde_json::json;

    use super::*;
    use crate::{MemoryDb, MemoryTx};

    /// v1 `{order_id, cents}`; v2 renamed `cents` to `amount_cents`; v3 added `currency`.
    #[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
    #[outbox(version = 3)]
    struct OrderPaid {
        #[outbox(id)]
        order_id: String,
        amount_cents: i64,
        currency: String,
    }

    struct Record;
    impl Handler<OrderPaid> for Record {
        type Conn = MemoryTx<Vec<String>>;
        fn handle(
            &self,
            e: OrderPaid,
            tx: &mut Self::Conn,
            _: &Delivery,
        ) -> Result<(), HandlerError> {
            tx.data()
                .push(format!("{} {} {}", e.order_id, e.amount_cents, e.currency));
            Ok(())
        }
    }

    fn delivery(version: u32, payload: serde_json::Value) -> Delivery {
        let e = OrderPaid {
            order_id: payload["order_id"].as_str().unwrap().into(),
            amount_cents: 0,
            currency: String::new(),
        };
        let mut envelope = Envelope::from_event(&e, 1024).unwrap();
        envelope.schema_version = version;
        envelope.payload = payload.to_string();
        super::tests::first_delivery(envelope)
    }

    /// A dispatcher at v3 with both steps; counts the steps' calls.
    fn dispatcher() -> (Dispatcher<MemoryTx<Vec<String>>>, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let mut d = Dispatcher::new();
        let (c1, c2) = (Arc::clone(&calls), Arc::clone(&calls));
        // Steps before the handler: the order does not matter.
        d.upgrade::<OrderPaid>(2, move |mut v| {
            c2.fetch_add(1, Ordering::SeqCst);
            v["currency"] = json!("EUR");
            Ok(v)
        })
        .unwrap()
        .upgrade::<OrderPaid>(1, move |mut v| {
            c1.fetch_add(1, Ordering::SeqCst);
            let cents = v
                .get_mut("cents")
                .map(serde_json::Value::take)
                .ok_or("a v1 payload without `cents`")?;
            v["amount_cents"] = cents;
            Ok(v)
        })
        .unwrap();
        d.register::<OrderPaid, _>(Record).unwrap();
        (d, calls)
    }

    fn consume(d: &Dispatcher<MemoryTx<Vec<String>>>, delivery: &Delivery) -> Vec<String> {
        let db = MemoryDb::new(Vec::new());
        assert_eq!(d.consume(&db, "g", delivery).unwrap(), Processed::Applied);
        db.read(Clone::clone)
    }

    #[test]
    fn older_payloads_go_through_every_step_up_to_the_handlers_version() {
        let (d, calls) = dispatcher();
        let v1 = delivery(1, json!({"order_id": "o-1", "cents": 100}));
        assert_eq!(consume(&d, &v1), ["o-1 100 EUR"]);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        let v2 = delivery(2, json!({"order_id": "o-2", "amount_cents": 200}));
        assert_eq!(consume(&d, &v2), ["o-2 200 EUR"]);
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        // The handler's own version runs no step.
        let v3 = delivery(
            3,
            json!({"order_id": "o-3", "amount_cents": 300, "currency": "USD"}),
        );
        assert_eq!(consume(&d, &v3), ["o-3 300 USD"]);
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_newer_payload_is_poison_naming_both_versions() {
        let (d, calls) = dispatcher();
        let v4 = delivery(
            4,
            json!({"order_id": "o-4", "amount_cents": 400, "currency": "USD", "vat": 1}),
        );
        let err = d.prepare(&v4.envelope).err().unwrap();
        assert!(err.is_poison(), "{err}");
        assert!(
            matches!(
                err,
                Error::UnsupportedSchemaVersion {
                    version: 4,
                    supported: 3,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "`OrderPaid` payload has schema version 4; this consumer handles versions up to \
             3: produced by a newer service (v4 > v3)"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_failing_or_panicking_step_is_poison_naming_the_step() {
        let (d, _) = dispatcher();
        let bad = delivery(1, json!({"order_id": "o-1", "amount": 100}));
        let err = d.prepare(&bad.envelope).err().unwrap();
        assert!(err.is_poison(), "{err}");
        assert_eq!(
            crate::error_chain(&err).to_string(),
            "cannot upgrade a `OrderPaid` payload from schema version 1 to 2: a v1 payload \
             without `cents`"
        );

        let mut d = Dispatcher::<MemoryTx<Vec<String>>>::new();
        d.register::<OrderPaid, _>(Record).unwrap();
        d.upgrade::<OrderPaid>(2, |v| {
            assert!(v.get("amount_cents").is_some(), "no amount");
            Ok(v)
        })
        .unwrap();
        let err = d.prepare(&bad.envelope).err().unwrap();
        assert!(matches!(err, Error::Upgrade { from: 2, .. }), "{err}");
        assert!(
            crate::error_chain(&err)
                .to_string()
                .ends_with("upgrade step panicked: no amount")
        );
        // A payload that is not JSON cannot reach a step.
        let mut garbled = bad;
        garbled.envelope.payload = "{not json".into();
        let err = d.prepare(&garbled.envelope).err().unwrap();
        assert!(matches!(err, Error::Decode { .. }), "{err}");
    }

    #[test]
    fn a_version_without_a_step_is_passed_on_as_compatible() {
        // No steps at all: an older payload is decoded as it is (and fails if it lacks
        // what the newer type requires).
        let mut d = Dispatcher::<MemoryTx<Vec<String>>>::new();
        d.register::<OrderPaid, _>(Record).unwrap();
        let v2 = delivery(2, json!({"order_id": "o-2", "amount_cents": 2}));
        let err = d.prepare(&v2.envelope).err().unwrap();
        assert!(matches!(err, Error::Decode { .. }), "{err}");
        // Only 2 → 3: a v1 payload skips to it unchanged.
        d.upgrade::<OrderPaid>(2, |mut v| {
            v["currency"] = json!("EUR");
            Ok(v)
        })
        .unwrap();
        assert_eq!(consume(&d, &v2), ["o-2 2 EUR"]);
        let v1 = delivery(1, json!({"order_id": "o-1", "amount_cents": 1}));
        assert_eq!(consume(&d, &v1), ["o-1 1 EUR"]);
    }

    #[test]
    fn steps_outside_the_types_versions_or_twice_are_refused() {
        let (mut d, _) = dispatcher();
        for from in [0, 3, 4] {
            let err = d.upgrade::<OrderPaid>(from, Ok).err().unwrap();
            assert!(matches!(err, Error::Config(_)), "{err}");
            assert!(err.to_string().contains("from a version 1 to 2"), "{err}");
        }
        let err = d.upgrade::<OrderPaid>(1, Ok).err().unwrap();
        assert!(err.to_string().contains("already registered"), "{err}");
        assert!(format!("{d:?}").contains(r#"upgrades_from: [("OrderPaid", [1, 2])]"#));
    }
}

#[cfg(all(test, feature = "memory"))]
mod async_tests {
    use std::sync::Mutex;

    use super::*;
    use crate::MemoryDb;

    #[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
    struct Email {
        #[outbox(id)]
        to: String,
    }

    /// Sends "emails" into a list; fails while `refuse` is set.
    #[derive(Default)]
    struct Mailer {
        sent: Mutex<Vec<String>>,
        refuse: std::sync::atomic::AtomicBool,
    }

    impl AsyncHandler<Email> for Arc<Mailer> {
        async fn handle(&self, e: Email, d: &Delivery) -> Result<(), HandlerError> {
            tokio::task::yield_now().await;
            if self.refuse.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(HandlerError::msg("smtp refused"));
            }
            self.sent
                .lock()
                .unwrap()
                .push(format!("{} ({})", e.to, d.envelope.msg_id));
            Ok(())
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn async_handlers_run_in_the_dedup_transaction() {
        let mailer = Arc::new(Mailer::default());
        let mut dispatcher = Dispatcher::<crate::MemoryTx<()>>::new();
        dispatcher
            .register_async::<Email, _>(Arc::clone(&mailer))
            .unwrap();
        let db = MemoryDb::new(());
        let envelope = Envelope::from_event(&Email { to: "bob".into() }, 1024).unwrap();
        let delivery = super::tests::first_delivery(envelope);
        let consume = |d: Delivery| {
            let (dispatcher, db) = (dispatcher.clone(), db.clone());
            tokio::task::spawn_blocking(move || dispatcher.consume(&db, "mail", &d))
        };

        mailer
            .refuse
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let failed = consume(delivery.clone()).await.unwrap().unwrap_err();
        assert!(matches!(failed, Error::Handler(_)), "{failed}");
        mailer
            .refuse
            .store(false, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(
            consume(delivery.clone()).await.unwrap().unwrap(),
            Processed::Applied
        );
        assert_eq!(
            consume(delivery).await.unwrap().unwrap(),
            Processed::Duplicate
        );
        assert_eq!(*mailer.sent.lock().unwrap(), ["bob (bob:Email)"]);
    }

    #[test]
    fn an_async_handler_outside_a_runtime_is_a_handler_error() {
        let mut dispatcher = Dispatcher::<crate::MemoryTx<()>>::new();
        dispatcher
            .register_async::<Email, _>(Arc::new(Mailer::default()))
            .unwrap();
        let envelope = Envelope::from_event(&Email { to: "bob".into() }, 1024).unwrap();
        let delivery = super::tests::first_delivery(envelope);
        let err = dispatcher
            .consume(&MemoryDb::new(()), "mail", &delivery)
            .unwrap_err();
        let shown = crate::error_chain(&err).to_string();
        assert!(shown.contains("tokio runtime"), "{shown}");
    }
}

/// [`MemoryDb`](crate::MemoryDb) as an [`AsyncInbox`]: users' unit tests of
/// [`AsyncTxHandler`]s.
#[cfg(all(test, feature = "memory"))]
mod async_memory_inbox_tests {
    use super::*;
    use crate::{MemoryDb, MemoryTx, Status};

    #[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
    struct Deposit {
        #[outbox(id)]
        id: String,
        amount: i64,
    }

    #[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
    struct Deposited {
        #[outbox(id)]
        id: String,
    }

    /// Adds the amount to the balance across an await (a transaction that began in
    /// between would lose one of the two deposits) and emits `Deposited`; a negative
    /// amount fails after writing, zero panics after writing.
    struct Bank;
    impl AsyncTxHandler<Deposit> for Bank {
        type Conn = MemoryTx<i64>;
        async fn handle(
            &self,
            e: Deposit,
            tx: &mut MemoryTx<i64>,
            _: &Delivery,
        ) -> Result<(), HandlerError> {
            let before = *tx.data();
            tokio::task::yield_now().await;
            *tx.data() = before + e.amount;
            tx.emit(Deposited { id: e.id })?;
            match e.amount {
                0 => panic!("zero deposit"),
                a if a < 0 => Err(HandlerError::msg("negative deposit")),
                _ => Ok(()),
            }
        }
    }

    fn bank() -> Dispatcher<MemoryTx<i64>> {
        let mut d = Dispatcher::new();
        d.register_tx::<Deposit, _>(Bank).unwrap();
        d
    }

    fn deposit(id: &str, amount: i64) -> Delivery {
        let e = Deposit {
            id: id.into(),
            amount,
        };
        super::tests::first_delivery(Envelope::from_event(&e, 1024).unwrap())
    }

    /// The emitted `Deposited` rows, by msg_id.
    fn deposited(db: &MemoryDb<i64>) -> Vec<String> {
        db.rows()
            .into_iter()
            .filter(|r| r.status == Status::New)
            .map(|r| r.envelope.msg_id.to_string())
            .collect()
    }

    #[tokio::test]
    async fn applied_once_failures_and_panics_leave_nothing() {
        let (d, db) = (bank(), MemoryDb::new(0_i64));
        let consume = |delivery: Delivery| {
            let (d, db) = (&d, &db);
            async move { d.consume_async(db, "bank", &delivery).await }
        };
        assert_eq!(consume(deposit("a", 5)).await.unwrap(), Processed::Applied);
        assert_eq!(
            consume(deposit("a", 5)).await.unwrap(),
            Processed::Duplicate
        );
        let refused = consume(deposit("b", -1)).await.unwrap_err();
        assert!(matches!(refused, Error::Handler(_)), "{refused}");
        let panicked = consume(deposit("c", 0)).await.unwrap_err();
        assert!(
            crate::error_chain(&panicked)
                .to_string()
                .contains("zero deposit"),
            "{panicked}"
        );
        assert_eq!(db.read(|n| *n), 5, "failed handlers' writes rolled back");
        assert_eq!(deposited(&db), ["a:Deposited"]);
        // Neither left the database held, nor the dedup row behind.
        assert_eq!(consume(deposit("b", 2)).await.unwrap(), Processed::Applied);
        assert_eq!(db.read(|n| *n), 7);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn async_and_blocking_transactions_are_serial() {
        let (d, db) = (bank(), MemoryDb::new(0_i64));
        let blocking = {
            let db = db.clone();
            tokio::task::spawn_blocking(move || {
                for _ in 0..50 {
                    db.transaction(|tx| {
                        *tx.data() += 1;
                        Ok::<_, Error>(())
                    })
                    .unwrap();
                }
            })
        };
        // Interleaved at every await of one task, beside the blocking thread.
        let deposits: Vec<_> = (0..50).map(|i| deposit(&format!("d{i}"), 1)).collect();
        let outcomes = futures_util::future::join_all(
            deposits.iter().map(|x| d.consume_async(&db, "bank", x)),
        )
        .await;
        for outcome in outcomes {
            assert_eq!(outcome.unwrap(), Processed::Applied);
        }
        blocking.await.unwrap();
        assert_eq!(db.read(|n| *n), 100, "no deposit lost");
    }

    #[tokio::test]
    async fn a_batch_keeps_what_succeeded_and_nothing_of_what_failed() {
        let (d, db) = (bank(), MemoryDb::new(0_i64));
        d.consume_async(&db, "bank", &deposit("a", 1))
            .await
            .unwrap();
        let batch = [
            deposit("b", 10),
            deposit("c", -1),
            deposit("a", 1),
            deposit("d", 0),
            deposit("b", 10),
            deposit("e", 100),
        ];
        let outcomes = d.consume_batch_async(&db, "bank", &batch).await.unwrap();
        let kinds: Vec<_> = outcomes
            .iter()
            .map(|o| match o {
                Ok(p) => format!("{p:?}"),
                Err(e) => format!("Err({})", crate::error_chain(e)),
            })
            .collect();
        assert_eq!(kinds[0], "Applied");
        assert!(kinds[1].contains("negative deposit"), "{kinds:?}");
        assert_eq!(kinds[2], "Duplicate");
        assert!(kinds[3].contains("zero deposit"), "{kinds:?}");
        assert_eq!(kinds[4..], ["Duplicate", "Applied"]);
        assert_eq!(db.read(|n| *n), 111);
        assert_eq!(
            deposited(&db),
            ["a:Deposited", "b:Deposited", "e:Deposited"]
        );
    }
}
