//! A task that runs until the test stops it: a relay's or a consumer's
//! `run_until(shutdown)`, spawned with the sender that ends it.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The sender that stops the task (send, or drop it) and the task.
pub type Stoppable<T> = (oneshot::Sender<()>, JoinHandle<T>);

/// The shutdown signal handed to the task: completes when the [`Stoppable`]'s sender
/// sends or is dropped.
#[derive(Debug)]
pub struct Shutdown(oneshot::Receiver<()>);

impl Future for Shutdown {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        Pin::new(&mut self.0).poll(cx).map(|_| ())
    }
}

/// Spawns `run(shutdown)` on the current runtime, e.g.
/// `spawn_until(move |stop| async move { relay.run_until(stop).await })`.
pub fn spawn_until<T, F>(run: impl FnOnce(Shutdown) -> F) -> Stoppable<T>
where
    F: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let (stop, stopped) = oneshot::channel();
    (stop, tokio::spawn(run(Shutdown(stopped))))
}
