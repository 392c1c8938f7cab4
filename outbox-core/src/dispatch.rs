use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use crate::{BatchOutcomes, Envelope, Error, HandlerError, Inbox, OutboxEvent, Processed};

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
/// Runners call it on a blocking thread (as they call every handler, diesel being
/// synchronous), where it is driven by the current tokio runtime.
pub trait AsyncHandler<E: OutboxEvent>: Send + Sync + 'static {
    /// Performs the effect of `event`.
    fn handle(
        &self,
        event: E,
        delivery: &Delivery,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
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
        let handler = Arc::new(handler);
        self.route::<E>(Arc::new(move |envelope: &Envelope| {
            let event: E = envelope.decode()?;
            let handler = Arc::clone(&handler);
            Ok(
                Box::new(move |conn: &mut C, d: &Delivery| handler.handle(event, conn, d))
                    as Run<C>,
            )
        }))
    }

    /// Routes every event type of `E` to an [`AsyncHandler`]. Fails if one is already
    /// routed. The handler runs inside the dedup transaction on the blocking thread that
    /// holds it, driven by the current tokio runtime; see [`AsyncHandler`] for what that
    /// guarantees.
    pub fn register_async<E, H>(&mut self, handler: H) -> Result<(), Error>
    where
        E: OutboxEvent,
        H: AsyncHandler<E>,
    {
        let handler = Arc::new(handler);
        self.route::<E>(Arc::new(move |envelope: &Envelope| {
            let event: E = envelope.decode()?;
            let handler = Arc::clone(&handler);
            Ok(Box::new(move |_: &mut C, d: &Delivery| {
                let runtime = tokio::runtime::Handle::try_current()
                    .map_err(|_| HandlerError::msg("an async handler needs a tokio runtime"))?;
                runtime.block_on(handler.handle(event, d))
            }) as Run<C>)
        }))
    }

    fn route<E: OutboxEvent>(&mut self, decode: Route<C>) -> Result<(), Error> {
        if let Some(taken) = E::EVENT_TYPES.iter().find(|t| self.routes.contains_key(*t)) {
            return Err(Error::DuplicateHandler((*taken).to_owned()));
        }
        // A payload of a newer schema than `E` may carry fields `E` does not know, which
        // serde would drop without a word: refuse it before decoding.
        let route: Route<C> = Arc::new(move |envelope: &Envelope| {
            if envelope.schema_version > E::SCHEMA_VERSION {
                return Err(Error::UnsupportedSchemaVersion {
                    event_type: envelope.event_type.clone(),
                    version: envelope.schema_version,
                    supported: E::SCHEMA_VERSION,
                });
            }
            decode(envelope)
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
    /// Unknown types, payloads of a newer schema version than the handler's event type
    /// ([`OutboxEvent::SCHEMA_VERSION`]; older ones are decoded) and undecodable payloads
    /// are errors ([`Error::is_poison`]).
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

    /// Decodes and applies many deliveries for `group` through one
    /// [`Inbox::process_batch`]: with a store that has savepoints, one transaction for
    /// the batch and a savepoint per message.
    ///
    /// Each delivery is prepared first ([`prepare`](Self::prepare)): an unknown type or
    /// an undecodable payload is that delivery's error ([`Error::is_poison`]) and never
    /// reaches the store. A handler that fails or panics rolls back only its own message
    /// (a panic is caught and reported as [`Error::Handler`] with the panic's message);
    /// the others commit together.
    ///
    /// The result has one outcome per delivery, in order; a message's transient conflict
    /// is its [`Error::Transient`]. The outer `Err` is the store's failure as a whole, or
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
    /// assert!(outcomes[1].as_ref().is_err_and(|e| e.to_string().contains("negative amount")));
    /// assert!(matches!(outcomes[2], Ok(Processed::Applied)));
    /// assert_eq!(db.read(|total| *total), 120);
    /// # Ok::<_, outbox_core::Error>(())
    /// ```
    pub fn consume_batch<I>(
        &self,
        inbox: &I,
        group: &str,
        deliveries: &[Delivery],
    ) -> Result<BatchOutcomes, Error>
    where
        I: Inbox<Conn = C>,
    {
        // `None`: prepared, its outcome comes from the store.
        let mut outcomes: Vec<Option<Result<Processed, Error>>> =
            Vec::with_capacity(deliveries.len());
        let mut runs: Vec<(&Delivery, Option<Prepared<C>>)> = Vec::new();
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
        if processed.len() != msg_ids.len() {
            // A broken `Inbox` implementation: nothing can be told about any message.
            return Err(Error::store(format!(
                "Inbox::process_batch returned {} outcomes for {} messages",
                processed.len(),
                msg_ids.len()
            )));
        }
        let mut processed = processed.into_iter();
        Ok(outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| processed.next().expect("lengths checked above")))
            .collect())
    }
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
        let message = panic
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("non-text panic payload");
        Err(HandlerError::msg(format_args!(
            "handler panicked: {message}"
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

    fn credit(id: &str, amount: i64) -> Delivery {
        let e = Credit {
            id: id.into(),
            amount,
        };
        Delivery {
            envelope: Envelope::from_event(&e, 1024).unwrap(),
            delivery_count: 1,
            entry_id: None,
        }
    }

    fn id(s: &str) -> MsgId {
        MsgId::new(s).unwrap()
    }

    fn kinds(outcomes: &[Result<Processed, Error>]) -> Vec<String> {
        outcomes
            .iter()
            .map(|o| match o {
                Ok(p) => format!("{p:?}"),
                Err(e) => format!("Err({e})"),
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
            self.db.process(group, msg_id, handle)
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
        let other = db
            .process_batch("h", &[id("a:Credit")], |_, _| Ok(()))
            .unwrap();
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
        let none = db.process_batch("g", &[], |_, _| Ok(())).unwrap();
        assert!(none.is_empty());
    }

    #[test]
    fn a_panic_inside_process_batch_itself_commits_nothing_in_memory() {
        let db = MemoryDb::new(Balances::new());
        let ids = [id("a:Credit"), id("b:Credit")];
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            db.process_batch("g", &ids, |i, tx: &mut MemoryTx<Balances>| {
                tx.data().insert("written".into(), 1);
                assert!(i == 0, "boom");
                Ok(())
            })
        }));
        assert!(unwound.is_err());
        assert!(db.read(|b| b.is_empty()));
        // Nor the dedup row of the message before the panic.
        let outcomes = db.process_batch("g", &ids[..1], |_, _| Ok(())).unwrap();
        assert_eq!(kinds(&outcomes), ["Applied"]);
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
        let delivery = Delivery {
            envelope,
            delivery_count: 1,
            entry_id: None,
        };
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
        let delivery = Delivery {
            envelope,
            delivery_count: 1,
            entry_id: None,
        };
        let err = dispatcher
            .consume(&MemoryDb::new(()), "mail", &delivery)
            .unwrap_err();
        assert!(err.to_string().contains("tokio runtime"), "{err}");
    }
}
