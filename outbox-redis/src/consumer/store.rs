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

/// A store run's result: the store's outcome, or `Err` when the run itself crashed (a
/// panic outside the handlers, a cancelled blocking task), with what happened
/// ("panicked: ..", "task failed: ..").
pub type StoreRun<T> = Result<Result<T, outbox_core::Error>, String>;

/// A boxed store run.
pub type StoreFuture<T> = Pin<Box<dyn Future<Output = StoreRun<T>> + Send>>;

/// The idempotency store of a [`Consumer`](crate::Consumer): any blocking [`Inbox`]
/// (given to [`idempotency`](crate::ConsumerBuilder::idempotency); its transactions run on
/// tokio's blocking threads), or an [`AsyncInbox`] wrapped in [`AsyncStore`] (given to
/// [`idempotency_async`](crate::ConsumerBuilder::idempotency_async); awaited on the
/// runtime, no blocking thread per message). Sealed: implemented for those two only.
#[allow(private_bounds)] // the crate-private `Sealed` is the seal
pub trait ConsumerStore: Sealed + Send + Sync + 'static {
    /// What the handlers receive: the store's connection type.
    type Conn: 'static;

    /// How many transactions the store runs at once, if bounded.
    #[doc(hidden)]
    fn capacity(&self) -> Option<usize>;

    /// One prepared message in its dedup transaction.
    #[doc(hidden)]
    fn run_one(
        self: Arc<Self>,
        group: String,
        prepared: Prepared<Self::Conn>,
        delivery: Delivery,
    ) -> StoreFuture<Processed>;

    /// Whether [`run_one_here`](Self::run_one_here) runs the transaction (a blocking
    /// inbox).
    #[doc(hidden)]
    fn runs_here(&self) -> bool;

    /// One prepared message in its dedup transaction, on the calling thread, which may
    /// block: only where [`runs_here`](Self::runs_here) says so.
    #[doc(hidden)]
    fn run_one_here(
        &self,
        group: &str,
        prepared: Prepared<Self::Conn>,
        delivery: &Delivery,
    ) -> StoreRun<Processed>;

    /// A batch of deliveries through the dispatcher, in one store transaction.
    #[doc(hidden)]
    fn run_batch(
        self: Arc<Self>,
        dispatcher: Arc<Dispatcher<Self::Conn>>,
        group: String,
        deliveries: Vec<Delivery>,
    ) -> StoreFuture<InboxBatchOutcomes>;

    /// Whether `msg_id` was applied before, asked by a transaction whose handler refuses
    /// with `refusal`: `Duplicate` if it was, the refusal otherwise; nothing is written.
    #[doc(hidden)]
    fn applied_before(
        self: Arc<Self>,
        group: String,
        msg_id: MsgId,
        refusal: String,
    ) -> StoreFuture<Processed>;
}

pub(crate) trait Sealed {}

impl<I: Inbox> Sealed for I {}

/// What a crashed blocking task did.
fn join_failure(e: tokio::task::JoinError) -> String {
    match e.try_into_panic() {
        Ok(panic) => format!("panicked: {}", outbox_core::panic_message(&*panic)),
        Err(e) => format!("task failed: {e}"),
    }
}

/// Blocking inboxes: each transaction on a blocking thread, in the caller's span (so the
/// handler's own spans and events belong to the message's).
impl<I: Inbox> ConsumerStore for I {
    type Conn = I::Conn;

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
        let joined = tokio::task::spawn_blocking(move || {
            let _entered = span.enter();
            self.process(&group, &delivery.envelope.msg_id, |conn| {
                prepared.run(conn, &delivery)
            })
        });
        Box::pin(async move { joined.await.map_err(join_failure) })
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
        .map_err(|panic| format!("panicked: {}", outbox_core::panic_message(&*panic)))
    }

    fn run_batch(
        self: Arc<Self>,
        dispatcher: Arc<Dispatcher<I::Conn>>,
        group: String,
        deliveries: Vec<Delivery>,
    ) -> StoreFuture<InboxBatchOutcomes> {
        let span = tracing::Span::current();
        let joined = tokio::task::spawn_blocking(move || {
            let _entered = span.enter();
            dispatcher.consume_batch(&*self, &group, &deliveries)
        });
        Box::pin(async move { joined.await.map_err(join_failure) })
    }

    fn applied_before(
        self: Arc<Self>,
        group: String,
        msg_id: MsgId,
        refusal: String,
    ) -> StoreFuture<Processed> {
        let joined = tokio::task::spawn_blocking(move || {
            self.process(&group, &msg_id, |_| Err(HandlerError::msg(refusal)))
        });
        Box::pin(async move { joined.await.map_err(join_failure) })
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

impl<I: AsyncInbox> Sealed for AsyncStore<I> {}

impl<I> ConsumerStore for AsyncStore<I>
where
    I: AsyncInbox,
    I::Conn: 'static,
{
    type Conn = I::Conn;

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
        Err("an async inbox's transactions are awaited, not run on a worker".to_owned())
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
            .map_err(|panic| format!("panicked: {}", outbox_core::panic_message(&*panic)))
    })
}
