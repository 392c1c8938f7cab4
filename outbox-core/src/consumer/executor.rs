//! Where a consumer runs the work on its messages, chosen once from its store's kind.

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use tracing::Instrument as _;

/// Where a consumer runs the work on a message or a batch (its whole path: checks,
/// transaction, dead letters, acks). A consumer's builder takes it from the store
/// ([`Transactions::EXECUTOR`](super::store::Transactions::EXECUTOR)),
/// and every path that starts work asks it instead of deciding again: a blocking
/// transaction then never runs on the runtime's threads, and an awaited one never holds
/// a thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Executor {
    /// A blocking [`Inbox`](crate::Inbox): the work runs on blocking threads, its
    /// transactions in place; in single mode on a runner's long-lived workers (as
    /// outbox-redis has them), else on a blocking thread per task ([`run`](Self::run)).
    Threads,
    /// An [`AsyncInbox`](crate::AsyncInbox): the work runs as tasks on the
    /// runtime, its transactions awaited.
    Tasks,
}

impl Executor {
    /// `work` run to the end where this executor runs work, in the caller's span; a
    /// panic in it unwinds here.
    pub async fn run<T: Send + 'static>(self, work: impl Future<Output = T> + Send + 'static) -> T {
        match self {
            Self::Tasks => work.await,
            Self::Threads => {
                let work = work.instrument(tracing::Span::current());
                let thread = tokio::task::spawn_blocking(move || block_on(&waker(), work));
                thread.await.unwrap_or_else(|e| {
                    let panic = e.try_into_panic();
                    std::panic::resume_unwind(panic.unwrap_or_else(|e| Box::new(e.to_string())))
                })
            }
        }
    }
}

/// A waker that unparks the calling thread, for [`block_on`] there.
pub fn waker() -> Waker {
    Waker::from(Arc::new(Unpark(std::thread::current())))
}

struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Drives `future` to the end on this blocking thread (which has the runtime's context:
/// timers, IO and spawns work), parking it while the future waits. Almost every
/// message's future ends at its first poll.
// Not tokio's `Handle::block_on`: inside it, `Prepared::run` could not drive an async
// handler of a blocking inbox with that same `block_on`, which tokio refuses to nest.
pub fn block_on<F: Future>(waker: &Waker, future: F) -> F::Output {
    let mut cx = Context::from_waker(waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}
