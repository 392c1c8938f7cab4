//! The idempotency store a consumer runs its transactions on: a blocking
//! [`Inbox`] in place on a blocking thread, or an [`AsyncInbox`] awaited ([`AsyncStore`]).
//! Broker-free: every broker's consumer runner (outbox-redis, outbox-nats) takes it.

use std::future::Future;
use std::panic::AssertUnwindSafe;

use super::executor::Executor;
use crate::{
    AsyncInbox, Delivery, Dispatcher, HandlerError, Inbox, InboxBatchOutcomes, MsgId, Prepared,
    Processed,
};
use futures_util::FutureExt as _;

/// How a store run ended: the store's outcome, or the run itself crashed.
#[derive(Debug)]
pub enum StoreRun<T> {
    /// The transaction ran and the store reported this outcome.
    Done(T),
    /// The store failed: the transaction did not commit (an outage, a conflict, a
    /// handler's failure).
    Failed(crate::Error),
    /// The run itself crashed (a panic outside the handlers), with what happened
    /// ("panicked: ..").
    Crashed(String),
}

impl<T> StoreRun<T> {
    /// The store's result as a run that did not crash.
    fn ran(result: Result<T, crate::Error>) -> Self {
        match result {
            Ok(done) => Self::Done(done),
            Err(e) => Self::Failed(e),
        }
    }
}

/// The idempotency store of a broker's consumer (`outbox_redis::Consumer`,
/// `outbox_nats::Consumer`): any blocking [`Inbox`] (given to the builder's
/// `idempotency`; its transactions run on tokio's blocking threads), or an
/// [`AsyncInbox`] wrapped in [`AsyncStore`] (given to `idempotency_async`; awaited on the
/// runtime, no blocking thread per message).
///
/// Implemented for those two only: how a store runs its transactions is in a hidden
/// supertrait that the consumer runners call, not part of the public API.
pub trait ConsumerStore:
    Transactions<Connection = <Self as ConsumerStore>::Conn> + Send + Sync + 'static
{
    /// What the handlers receive: the store's connection type.
    type Conn: 'static;
}

/// What a [`ConsumerStore`] does: the public trait's supertrait, hidden (reached
/// through `__private`), for the consumer runners of the broker crates. Its connection type is
/// named apart from [`ConsumerStore::Conn`] (which it equals) so that `I::Conn` stays
/// unambiguous for a bound `I: ConsumerStore`.
///
/// A blocking store runs a transaction in place, when its future is first polled: its
/// [`EXECUTOR`](Self::EXECUTOR), [`Executor::Threads`], has every consumer on it poll
/// that future on a blocking thread.
pub trait Transactions {
    /// The store's connection type: [`ConsumerStore::Conn`].
    type Connection: 'static;

    /// Where a consumer on this store runs its work.
    const EXECUTOR: Executor;

    /// How many transactions the store runs at once, if bounded.
    fn capacity(&self) -> Option<usize>;

    /// One prepared message in its dedup transaction.
    fn run_one<'a>(
        &'a self,
        group: &'a str,
        prepared: Prepared<Self::Connection>,
        delivery: &'a Delivery,
    ) -> impl Future<Output = StoreRun<Processed>> + Send + 'a;

    /// A batch of deliveries through the dispatcher, in one store transaction.
    fn run_batch<'a>(
        &'a self,
        dispatcher: &'a Dispatcher<Self::Connection>,
        group: &'a str,
        deliveries: &'a [Delivery],
    ) -> impl Future<Output = StoreRun<InboxBatchOutcomes>> + Send + 'a;

    /// Whether `msg_id` was applied before, asked by a transaction whose handler refuses
    /// with `refusal`: `Duplicate` if it was, the refusal otherwise; nothing is written.
    fn applied_before<'a>(
        &'a self,
        group: &'a str,
        msg_id: &'a MsgId,
        refusal: String,
    ) -> impl Future<Output = StoreRun<Processed>> + Send + 'a;
}

/// Blocking inboxes: each transaction in place, on the thread that runs the message's
/// work and in its span (so the handler's own spans and events belong to the message's).
/// A panic unwinding out of the inbox is a crashed run (the connection, still in its
/// transaction, is discarded by the pool).
impl<I: Inbox> ConsumerStore for I {
    type Conn = I::Conn;
}

impl<I: Inbox> Transactions for I {
    type Connection = I::Conn;
    const EXECUTOR: Executor = Executor::Threads;

    fn capacity(&self) -> Option<usize> {
        Inbox::capacity(self)
    }

    fn run_one<'a>(
        &'a self,
        group: &'a str,
        prepared: Prepared<I::Conn>,
        delivery: &'a Delivery,
    ) -> impl Future<Output = StoreRun<Processed>> + Send + 'a {
        let msg_id = &delivery.envelope.msg_id;
        caught(async move { self.process(group, msg_id, |conn| prepared.run(conn, delivery)) })
    }

    fn run_batch<'a>(
        &'a self,
        dispatcher: &'a Dispatcher<I::Conn>,
        group: &'a str,
        deliveries: &'a [Delivery],
    ) -> impl Future<Output = StoreRun<InboxBatchOutcomes>> + Send + 'a {
        caught(async move { dispatcher.consume_batch(self, group, deliveries) })
    }

    fn applied_before<'a>(
        &'a self,
        group: &'a str,
        msg_id: &'a MsgId,
        refusal: String,
    ) -> impl Future<Output = StoreRun<Processed>> + Send + 'a {
        caught(async move { self.process(group, msg_id, |_| Err(HandlerError::msg(refusal))) })
    }
}

/// An [`AsyncInbox`] as a consumer's store: its transactions are awaited on the runtime,
/// so a consumer holds no blocking thread per message. A consumer builder's
/// `idempotency_async` wraps the inbox in it.
///
/// A handler's panic is caught inside the transaction
/// ([`Dispatcher::consume_async`]) and is a failed delivery, as with a blocking inbox; a
/// panic of the store itself is caught too, and its transaction is left to the pool.
#[derive(Debug, Clone)]
pub struct AsyncStore<I>(pub I);

impl<I> ConsumerStore for AsyncStore<I>
where
    I: AsyncInbox,
    I::Conn: 'static,
{
    type Conn = I::Conn;
}

impl<I> Transactions for AsyncStore<I>
where
    I: AsyncInbox,
    I::Conn: 'static,
{
    type Connection = I::Conn;
    const EXECUTOR: Executor = Executor::Tasks;

    fn capacity(&self) -> Option<usize> {
        AsyncInbox::capacity(&self.0)
    }

    fn run_one<'a>(
        &'a self,
        group: &'a str,
        prepared: Prepared<I::Conn>,
        delivery: &'a Delivery,
    ) -> impl Future<Output = StoreRun<Processed>> + Send + 'a {
        let run = Dispatcher::consume_prepared(&self.0, group, prepared, delivery.clone());
        caught(run)
    }

    fn run_batch<'a>(
        &'a self,
        dispatcher: &'a Dispatcher<I::Conn>,
        group: &'a str,
        deliveries: &'a [Delivery],
    ) -> impl Future<Output = StoreRun<InboxBatchOutcomes>> + Send + 'a {
        caught(dispatcher.consume_batch_async(&self.0, group, deliveries))
    }

    fn applied_before<'a>(
        &'a self,
        group: &'a str,
        msg_id: &'a MsgId,
        refusal: String,
    ) -> impl Future<Output = StoreRun<Processed>> + Send + 'a {
        caught(self.0.process(group, msg_id, move |_| {
            Box::pin(std::future::ready(Err(HandlerError::msg(refusal))))
        }))
    }
}

/// `run`'s result, with a panic while it is polled reported as a crashed run.
async fn caught<T>(run: impl Future<Output = Result<T, crate::Error>>) -> StoreRun<T> {
    AssertUnwindSafe(run)
        .catch_unwind()
        .await
        .map_or_else(|panic| crashed(&*panic), StoreRun::ran)
}

/// A panic that unwound out of a store run.
fn crashed<T>(panic: &(dyn std::any::Any + Send)) -> StoreRun<T> {
    StoreRun::Crashed(format!("panicked: {}", crate::panic_message(panic)))
}
