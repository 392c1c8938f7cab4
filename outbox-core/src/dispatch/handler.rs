use std::future::Future;

#[cfg(doc)]
use crate::{AsyncInbox, Error, Inbox};
use crate::{Envelope, HandlerError, OutboxEvent};

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
