//! The idempotency store a consumer runs its transactions on: a blocking
//! [`Inbox`] on a blocking thread, or an [`AsyncInbox`] awaited ([`AsyncStore`]).

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;

use futures_util::FutureExt as _;
use outbox_core::{
    AsyncInbox, Delivery, Dispatcher, HandlerError, Inbox, InboxBatchOutcomes, MsgId, Prepared,
    Processed,
};

/// How a store run ended: the store's outcome, or the run itself crashed.
#[derive(Debug)]
pub(crate) enum StoreRun<T> {
    /// The transaction ran and the store reported this outcome.
    Done(T),
    /// The store failed: the transaction did not commit (an outage, a conflict, a
    /// handler's failure).
    Failed(outbox_core::Error),
    /// The run itself crashed (a panic outside the handlers, a cancelled blocking task),
    /// with what happened ("panicked: ..", "task failed: ..").
    Crashed(String),
}

impl<T> StoreRun<T> {
    /// The store's result as a run that did not crash.
    fn ran(result: Result<T, outbox_core::Error>) -> Self {
        match result {
            Ok(done) => Self::Done(done),
            Err(e) => Self::Failed(e),
        }
    }
}

/// A boxed store run.
pub(crate) type StoreFuture<T> = Pin<Box<dyn Future<Output = StoreRun<T>> + Send>>;

/// The idempotency store of a [`Consumer`](crate::Consumer): any blocking [`Inbox`]
/// (given to [`idempotency`](crate::ConsumerBuilder::idempotency); its transactions run on
/// tokio's blocking threads), or an [`AsyncInbox`] wrapped in [`AsyncStore`] (given to
/// [`idempotency_async`](crate::ConsumerBuilder::idempotency_async); awaited on the
/// runtime, no blocking thread per message).
///
/// Sealed: how a store runs its transactions is in a crate-private supertrait, so this
/// trait can be named in bounds but neither implemented (it is, for those two only) nor
/// have those methods called outside this crate.
// `private_bounds`: the crate-private supertrait is the seal.
#[allow(private_bounds)]
pub trait ConsumerStore:
    Transactions<Connection = <Self as ConsumerStore>::Conn> + Send + Sync + 'static
{
    /// What the handlers receive: the store's connection type.
    type Conn: 'static;
}

/// What a [`ConsumerStore`] does. Crate-private and the public trait's supertrait, as
/// outbox-diesel seals `OutboxConnection` over its `Backend`. Its connection type is
/// named apart from [`ConsumerStore::Conn`] (which it equals) so that `I::Conn` stays
/// unambiguous for a bound `I: ConsumerStore`.
pub(crate) trait Transactions {
    /// The store's connection type: [`ConsumerStore::Conn`].
    type Connection: 'static;

    /// How many transactions the store runs at once, if bounded.
    fn capacity(&self) -> Option<usize>;

    /// One prepared message in its dedup transaction.
    fn run_one(
        self: Arc<Self>,
        group: String,
        prepared: Prepared<Self::Connection>,
        delivery: Delivery,
    ) -> StoreFuture<Processed>;

    /// Whether [`run_one_here`](Self::run_one_here) runs the transaction (a blocking
    /// inbox).
    fn runs_here(&self) -> bool;

    /// One prepared message in its dedup transaction, on the calling thread, which may
    /// block: only where [`runs_here`](Self::runs_here) says so.
    fn run_one_here(
        &self,
        group: &str,
        prepared: Prepared<Self::Connection>,
        delivery: &Delivery,
    ) -> StoreRun<Processed>;

    /// A batch of deliveries through the dispatcher, in one store transaction.
    fn run_batch(
        self: Arc<Self>,
        dispatcher: Arc<Dispatcher<Self::Connection>>,
        group: String,
        deliveries: Vec<Delivery>,
    ) -> StoreFuture<InboxBatchOutcomes>;

    /// Whether `msg_id` was applied before, asked by a transaction whose handler refuses
    /// with `refusal`: `Duplicate` if it was, the refusal otherwise; nothing is written.
    fn applied_before(
        self: Arc<Self>,
        group: String,
        msg_id: MsgId,
        refusal: String,
    ) -> StoreFuture<Processed>;
}

/// What a crashed blocking task did.
fn join_failure<T>(e: tokio::task::JoinError) -> StoreRun<T> {
    StoreRun::Crashed(match e.try_into_panic() {
        Ok(panic) => format!("panicked: {}", outbox_core::panic_message(&*panic)),
        Err(e) => format!("task failed: {e}"),
    })
}

/// A blocking task's run: its result, or how it crashed.
async fn joined<T>(task: tokio::task::JoinHandle<Result<T, outbox_core::Error>>) -> StoreRun<T> {
    task.await.map_or_else(join_failure, StoreRun::ran)
}

/// Blocking inboxes: each transaction on a blocking thread, in the caller's span (so the
/// handler's own spans and events belong to the message's).
impl<I: Inbox> ConsumerStore for I {
    type Conn = I::Conn;
}

impl<I: Inbox> Transactions for I {
    type Connection = I::Conn;

    fn capacity(&self) -> Option<usize> {
        Inbox::capacity(self)
    }

    fn run_one(
        self: Arc<Self>,
        group: String,
        prepared: Prepared<I::Conn>,
        delivery: Delivery,
    ) -> StoreFuture<Processed> {
        let span = tracing::Span::current();
        let task = tokio::task::spawn_blocking(move || {
            let _entered = span.enter();
            self.process(&group, &delivery.envelope.msg_id, |conn| {
                prepared.run(conn, &delivery)
            })
        });
        Box::pin(joined(task))
    }

    fn runs_here(&self) -> bool {
        true
    }

    fn run_one_here(
        &self,
        group: &str,
        prepared: Prepared<I::Conn>,
        delivery: &Delivery,
    ) -> StoreRun<Processed> {
        // As `spawn_blocking` reported it in `run_one`: a panic unwinding out of the
        // inbox is a crashed run (the connection, still in its transaction, is
        // discarded by the pool).
        std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.process(group, &delivery.envelope.msg_id, |conn| {
                prepared.run(conn, delivery)
            })
        }))
        .map_or_else(|panic| crashed(&*panic), StoreRun::ran)
    }

    fn run_batch(
        self: Arc<Self>,
        dispatcher: Arc<Dispatcher<I::Conn>>,
        group: String,
        deliveries: Vec<Delivery>,
    ) -> StoreFuture<InboxBatchOutcomes> {
        let span = tracing::Span::current();
        let task = tokio::task::spawn_blocking(move || {
            let _entered = span.enter();
            dispatcher.consume_batch(&*self, &group, &deliveries)
        });
        Box::pin(joined(task))
    }

    fn applied_before(
        self: Arc<Self>,
        group: String,
        msg_id: MsgId,
        refusal: String,
    ) -> StoreFuture<Processed> {
        let task = tokio::task::spawn_blocking(move || {
            self.process(&group, &msg_id, |_| Err(HandlerError::msg(refusal)))
        });
        Box::pin(joined(task))
    }
}

/// An [`AsyncInbox`] as a consumer's store: its transactions are awaited on the runtime,
/// so a consumer holds no blocking thread per message. Build it with
/// [`ConsumerBuilder::idempotency_async`](crate::ConsumerBuilder::idempotency_async).
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

    fn capacity(&self) -> Option<usize> {
        AsyncInbox::capacity(&self.0)
    }

    fn run_one(
        self: Arc<Self>,
        group: String,
        prepared: Prepared<I::Conn>,
        delivery: Delivery,
    ) -> StoreFuture<Processed> {
        caught(
            async move { Dispatcher::consume_prepared(&self.0, &group, prepared, delivery).await },
        )
    }

    fn runs_here(&self) -> bool {
        false
    }

    fn run_one_here(&self, _: &str, _: Prepared<I::Conn>, _: &Delivery) -> StoreRun<Processed> {
        StoreRun::Crashed(
            "an async inbox's transactions are awaited, not run on a worker".to_owned(),
        )
    }

    fn run_batch(
        self: Arc<Self>,
        dispatcher: Arc<Dispatcher<I::Conn>>,
        group: String,
        deliveries: Vec<Delivery>,
    ) -> StoreFuture<InboxBatchOutcomes> {
        caught(async move {
            dispatcher
                .consume_batch_async(&self.0, &group, &deliveries)
                .await
        })
    }

    fn applied_before(
        self: Arc<Self>,
        group: String,
        msg_id: MsgId,
        refusal: String,
    ) -> StoreFuture<Processed> {
        caught(async move {
            self.0
                .process(&group, &msg_id, move |_| {
                    Box::pin(std::future::ready(Err(HandlerError::msg(refusal))))
                })
                .await
        })
    }
}

/// `run` boxed, with a panic while it is polled reported as a crashed run.
fn caught<T: 'static>(
    run: impl Future<Output = Result<T, outbox_core::Error>> + Send + 'static,
) -> StoreFuture<T> {
    Box::pin(async move {
        AssertUnwindSafe(run)
            .catch_unwind()
            .await
            .map_or_else(|panic| crashed(&*panic), StoreRun::ran)
    })
}

/// A panic that unwound out of a store run.
fn crashed<T>(panic: &(dyn std::any::Any + Send)) -> StoreRun<T> {
    StoreRun::Crashed(format!("panicked: {}", outbox_core::panic_message(panic)))
}
