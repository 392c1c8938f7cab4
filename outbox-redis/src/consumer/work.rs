//! Single mode on a blocking inbox: long-lived workers, one per transaction that may run
//! at once, each taking the next entry from a queue and processing it to the end on its
//! own blocking thread.
//!
//! Why workers: a task per message, with a `spawn_blocking` hop there and back for its
//! transaction, would pay for each message a spawn, a wait for a permit, the wake of a
//! blocking thread and the wake back, and a wake of the run loop (BENCHMARKS.md,
//! "Single mode at 8 in flight: long-lived workers"). A worker that is busy takes the
//! next entry without being woken; one that waits is woken once; the run loop is woken
//! once per read's worth of room ([`WorkQueue::done`]). The acknowledgements go through
//! the run's ack queue, which many entries finished together share.
//!
//! A worker runs the message's whole path ([`process_one`](Consumer::process_one)) on
//! its own thread, as [`Executor::Threads`](super::executor::Executor::Threads) has it:
//! the transaction in place, and the rare Redis commands (dead letters, delivery counts)
//! and pauses awaited there too ([`block_on`]).

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tracing::Instrument as _;

use super::executor::{block_on, waker};
use super::in_flight::InFlight;
use super::{Consumer, ConsumerStore, Job};

/// The entries handed to the workers and not yet finished.
pub(super) struct WorkQueue {
    state: Mutex<State>,
    /// Workers waiting for an entry.
    ready: Condvar,
    /// The run loop waiting for room.
    room: Notify,
    /// At this many entries left (queued or running) the run loop is woken: a read's
    /// worth of room.
    wake_at: usize,
}

struct State {
    jobs: VecDeque<Job>,
    /// Entries queued or running.
    busy: usize,
    /// Workers waiting in [`WorkQueue::next`].
    waiting: usize,
    /// No more entries come: the workers end once the queue is empty.
    closed: bool,
}

impl WorkQueue {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state holds no invariant a panic could break halfway.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Entries queued or running.
    pub(super) fn busy(&self) -> usize {
        self.lock().busy
    }

    /// Hands `jobs` to the workers, waking as many waiting ones as there are jobs.
    fn push(&self, jobs: Vec<Job>) {
        let n = jobs.len();
        let wake = {
            let mut state = self.lock();
            state.busy += n;
            state.jobs.extend(jobs);
            state.waiting.min(n)
        };
        for _ in 0..wake {
            self.ready.notify_one();
        }
    }

    /// The next entry, waiting for one; `None` once the queue is closed and empty.
    fn next(&self) -> Option<Job> {
        let mut state = self.lock();
        loop {
            if let Some(job) = state.jobs.pop_front() {
                return Some(job);
            }
            if state.closed {
                return None;
            }
            state.waiting += 1;
            state = self
                .ready
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
            state.waiting -= 1;
        }
    }

    /// An entry ended; the run loop is woken when this makes a read's worth of room.
    fn done(&self) {
        let busy = {
            let mut state = self.lock();
            state.busy -= 1;
            state.busy
        };
        if busy == self.wake_at {
            // Kept if the loop is not waiting yet: its next wait returns at once.
            self.room.notify_one();
        }
    }

    /// Until at most `most` entries are queued or running.
    pub(super) async fn room_for(&self, most: usize) {
        while self.busy() > most {
            self.room.notified().await;
        }
    }

    /// No more entries: the workers finish what is queued, then end.
    fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    /// Closes the queue and takes back what no worker started (they stay pending, and
    /// are claimed again after `min_idle`): how many there were.
    fn abandon(&self) -> usize {
        let dropped = {
            let mut state = self.lock();
            state.closed = true;
            let dropped = state.jobs.len();
            state.jobs.clear();
            state.busy -= dropped;
            dropped
        };
        self.ready.notify_all();
        dropped
    }
}

/// The workers of one run: dropped, they end after the entry each is on (the entries
/// still queued stay pending), so that a dropped [`run_until`](Consumer::run_until)
/// leaves no thread behind.
pub(super) struct Workers {
    pub(super) queue: Arc<WorkQueue>,
    handles: Vec<JoinHandle<()>>,
}

impl Workers {
    /// `count` workers running `consumer`'s single mode; the run loop is woken for room
    /// when only `wake_at` entries are left.
    pub(super) fn start<I, C>(
        consumer: &Consumer<I, C>,
        count: usize,
        wake_at: usize,
        in_flight: &InFlight,
        span: &tracing::Span,
    ) -> Self
    where
        I: ConsumerStore<Conn = C>,
        C: 'static,
    {
        let queue = Arc::new(WorkQueue {
            state: Mutex::new(State {
                jobs: VecDeque::new(),
                busy: 0,
                waiting: 0,
                closed: false,
            }),
            ready: Condvar::new(),
            room: Notify::new(),
            wake_at,
        });
        let handles = (0..count)
            .map(|_| {
                let this = consumer.clone();
                let queue = Arc::clone(&queue);
                let in_flight = in_flight.clone();
                let span = span.clone();
                tokio::task::spawn_blocking(move || this.work(&queue, &in_flight, &span))
            })
            .collect();
        Self { queue, handles }
    }

    /// Hands `jobs` to the workers.
    pub(super) fn push(&self, jobs: Vec<Job>) {
        if !jobs.is_empty() {
            self.queue.push(jobs);
        }
    }

    /// After the shutdown signal: the workers finish what is queued and end, within
    /// `grace`; returns how many entries were abandoned then (running or queued: they
    /// stay pending).
    pub(super) async fn stop(mut self, grace: std::time::Duration) -> usize {
        self.queue.close();
        let handles = std::mem::take(&mut self.handles);
        let all = async {
            for handle in handles {
                if let Err(e) = handle.await {
                    tracing::error!(error = %e, "consumer worker failed");
                }
            }
        };
        match tokio::time::timeout(grace, all).await {
            Ok(()) => 0,
            Err(_) => {
                let running = self.queue.busy();
                self.queue.abandon();
                running
            }
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.queue.abandon();
    }
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// A worker: processes entries from `queue` to the end, one after another, until the
    /// queue is closed and empty.
    fn work(self, queue: &WorkQueue, in_flight: &InFlight, span: &tracing::Span) {
        let waker = waker();
        while let Some(job) = queue.next() {
            let processed = std::panic::catch_unwind(AssertUnwindSafe(|| {
                block_on(&waker, self.process_one(&job).instrument(span.clone()))
            }));
            let outage = match processed {
                Ok(outcome) => outcome.outage(),
                // `process_one` catches handler panics: this is a bug in the runner. The
                // entry stays pending and is claimed again.
                Err(panic) => {
                    let panic = outbox_core::panic_message(&*panic);
                    tracing::error!(parent: span, error = %panic, "consumer task failed");
                    false
                }
            };
            in_flight.remove(&[(job.stream, job.entry.id)]);
            self.inner.health.work_ended(outage);
            queue.done();
        }
    }
}
