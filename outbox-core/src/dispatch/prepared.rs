use futures_util::FutureExt as _;

#[cfg(doc)]
use crate::{AsyncHandler, AsyncInbox, AsyncTxHandler, Handler};
use crate::{Delivery, HandlerError, TxFuture};

/// A handler that runs to the end when called.
pub(super) type BlockingRun<C> =
    Box<dyn FnOnce(&mut C, &Delivery) -> Result<(), HandlerError> + Send>;
/// A handler whose future is awaited: on the async path directly, on the blocking path
/// through the current runtime.
pub(super) type AwaitedRun<C> =
    Box<dyn for<'c> FnOnce(&'c mut C, &'c Delivery) -> TxFuture<'c> + Send>;

pub(super) enum Run<C> {
    Blocking(BlockingRun<C>),
    Awaited(AwaitedRun<C>),
}

/// A decoded message with its handler, ready to run in a transaction.
pub struct Prepared<C>(pub(super) Run<C>);

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
pub(super) async fn run_async_catching_panic<C: Send>(
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
pub(super) fn run_catching_panic<C>(
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
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::{AsyncHandler, Dispatcher, Envelope, Error, MemoryDb, OutboxEvent, Processed};

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
        let delivery = super::super::first_delivery(envelope);
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
        let delivery = super::super::first_delivery(envelope);
        let err = dispatcher
            .consume(&MemoryDb::new(()), "mail", &delivery)
            .unwrap_err();
        let shown = crate::error_chain(&err).to_string();
        assert!(shown.contains("tokio runtime"), "{shown}");
    }
}
