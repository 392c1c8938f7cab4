//! The run loop of [`Consumer::run_until`]: a short driver over [`Run`], the state one
//! run keeps between its rounds.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::ConsumerStore;
use super::store::Transactions;
use redis::{RedisError, RedisResult};
use tokio::sync::{Mutex, Semaphore};
use tokio::task::{JoinError, JoinSet};
use tracing::Instrument as _;

use super::ack::AckQueue;
use super::executor::Executor;
use super::in_flight::InFlight;
use super::lanes::lanes;
use super::read::Reads;
use super::stats::Count;
use super::work::Workers;
use super::{Consumer, ConsumerConfig, Done, Job};
use crate::Result;

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// Runs until `shutdown` completes: creates the groups, then reads, claims and
    /// processes entries.
    ///
    /// Fails only if the groups cannot be created for a reason other than an outage (a
    /// wrong type at a stream's key, missing permissions). A Redis unreachable at start
    /// is waited for with the outage backoff, as later outages of Redis or the store are:
    /// logged, counted and backed off from, never ending the run.
    ///
    /// Whatever the timings of an outage, the loop gets back to reading as soon as Redis
    /// answers again: every failure kind (reads and claims, store outages) has its own
    /// consecutive count that its next success resets, and a claim is always followed
    /// by a read.
    ///
    /// On shutdown it stops reading, lets the messages in flight (and those read ahead
    /// for them, see [`max_in_flight`](ConsumerConfig::max_in_flight)) finish, sends
    /// their acknowledgements, then returns, within
    /// [`shutdown_timeout`](ConsumerConfig::shutdown_timeout): messages still in flight
    /// then stay pending (on a blocking inbox, a transaction that still commits after the
    /// run returned is acknowledged by the thread that ran it, if the process and Redis
    /// are still there). Entries handed to a read that the shutdown cut short stay
    /// pending and are claimed again after `min_idle`. Dropping the future instead
    /// abandons the messages in flight the same way: nothing is lost, and their
    /// transactions decide whether a redelivery is a duplicate.
    pub async fn run_until(&self, shutdown: impl Future<Output = ()>) -> Result<()> {
        let mut shutdown = std::pin::pin!(shutdown);
        if !self.wait_for_groups(&mut shutdown).await? {
            return Ok(());
        }
        let inner = &self.inner;
        let span = tracing::info_span!("outbox.consumer", group = %inner.group, consumer = %inner.consumer_name);
        if inner.config.ordered.is_some() {
            tracing::info!(parent: &span, streams = ?inner.streams, "ordered consumer started");
            let running = Running::new(&inner.health);
            self.run_ordered(&mut shutdown, span.clone()).await;
            drop(running);
            tracing::info!(parent: &span, "consumer stopped");
            return Ok(());
        }
        let in_flight = InFlight::default();
        let keep_alive = tokio::spawn(
            self.clone()
                .keep_in_flight_alive(in_flight.clone())
                .instrument(span.clone()),
        );
        // Work spawned by this run acks through `acks`; the flusher ends once every
        // copy of its sender is gone (the run's worker and its tasks), after sending
        // what they queued.
        // After the run, what is queued goes out and the flusher ends, even if a worker's
        // handler still runs past the shutdown timeout (it then acks by itself).
        let (queue, queued) = tokio::sync::mpsc::unbounded_channel();
        let acks = AckQueue {
            queue,
            failed: Arc::default(),
        };
        let (close_acks, closing) = tokio::sync::oneshot::channel::<()>();
        let flusher = tokio::spawn(
            self.clone()
                .flush_acks_until(queued, Arc::clone(&acks.failed), async {
                    let _ = closing.await;
                })
                .instrument(span.clone()),
        );
        let mut run = Run::new(self, acks, in_flight, span.clone());
        tracing::info!(parent: &span, streams = ?inner.streams, "consumer started");
        let running = Running::new(&inner.health);
        while run.round(&mut shutdown).await.is_some() {}
        drop(running);
        run.stop().await;
        let _ = close_acks.send(());
        keep_alive.abort();
        // The run, and with it the worker's ack sender, is gone: the acks of what
        // finished go out before the run returns.
        if let Err(e) = flusher.await {
            tracing::error!(parent: &span, error = %e, "ack task failed");
        }
        tracing::info!(parent: &span, "consumer stopped");
        Ok(())
    }
}

/// What one [`run_until`](Consumer::run_until) keeps between its rounds.
struct Run<I, C> {
    /// The consumer as given: it reads, claims, trims and counts.
    consumer: Consumer<I, C>,
    /// The same consumer acking through this run's queue: what the work tasks run.
    worker: Consumer<I, C>,
    /// Set by the ack task when an `XACK` failed (the loop then backs off).
    acks_failed: Arc<AtomicBool>,
    span: tracing::Span,
    /// One per transaction that may run at once.
    permits: Arc<Semaphore>,
    /// Most tasks at once: entries read beyond the free permits wait for one in their
    /// task, so that the next message is at hand when one finishes instead of a read
    /// away.
    task_limit: usize,
    /// The least room worth a read: half the transactions at once (at least one). A busy
    /// consumer that reads as soon as one task ends takes one or two entries per
    /// `XREADGROUP` (BENCHMARKS.md, "Consumer single mode at 8 in flight"); waiting until
    /// a few are free reads them together, while the entries still waiting keep every
    /// transaction slot busy.
    read_at: usize,
    tasks: JoinSet<Done>,
    /// Single mode on a blocking inbox: the workers, instead of a task per entry.
    workers: Option<Workers>,
    in_flight: InFlight,
    /// Batch mode: one task at a time per lane of keys (see [`lanes`]).
    lane_locks: Arc<[Mutex<()>]>,
    next_claim: Instant,
    /// Whether the last round claimed: a claim is always followed by a read.
    claimed_last: bool,
    next_trim: Option<Instant>,
    reads: Reads,
}

impl<I, C> Run<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    fn new(
        consumer: &Consumer<I, C>,
        acks: AckQueue,
        in_flight: InFlight,
        span: tracing::Span,
    ) -> Self {
        let config = &consumer.inner.config;
        // No more transactions at once than the store can run: a task waiting for a
        // pooled connection would time out and look like a store outage.
        let transactions = config
            .max_in_flight
            .min(Transactions::capacity(&consumer.inner.inbox).unwrap_or(usize::MAX))
            .max(1);
        let task_limit = config.max_in_flight.saturating_mul(2);
        let read_at = (transactions / 2).max(1);
        let acks_failed = Arc::clone(&acks.failed);
        let worker = Consumer {
            inner: Arc::clone(&consumer.inner),
            acks: Some(acks),
        };
        let on_workers = consumer.inner.executor == Executor::Threads;
        let workers = (config.batch_size.is_none() && on_workers).then(|| {
            let wake_at = task_limit.saturating_sub(read_at);
            Workers::start(&worker, transactions, wake_at, &in_flight, &span)
        });
        Self {
            acks_failed,
            worker,
            consumer: consumer.clone(),
            span,
            permits: Arc::new(Semaphore::new(transactions)),
            task_limit,
            read_at,
            tasks: JoinSet::new(),
            workers,
            in_flight,
            // (Twice as many lanes as transactions measured slower: 1.6 instead of 1.9
            // times single mode at 8 in flight, 1.3 instead of 1.5 under contention.)
            lane_locks: (0..config.max_in_flight).map(|_| Mutex::new(())).collect(),
            next_claim: Instant::now(),
            claimed_last: false,
            next_trim: config.trim_interval.map(|i| Instant::now() + i),
            reads: Reads::default(),
        }
    }

    fn config(&self) -> &ConsumerConfig {
        &self.consumer.inner.config
    }

    /// One round: takes in finished work, backs off after failures, trims when due,
    /// then claims or reads and starts the work on what came. `None`: shut down.
    async fn round<S: Future<Output = ()>>(&mut self, shutdown: &mut Pin<&mut S>) -> Option<()> {
        self.consumer.inner.health.round();
        while let Some(done) = self.tasks.try_join_next() {
            self.finished(done);
        }
        if self.acks_failed.swap(false, Ordering::Relaxed) {
            self.consumer.inner.health.work_ended(true);
        }
        let health = &self.consumer.inner.health;
        if let Some(pause) = health.pause(&self.config().outage_backoff) {
            unless(shutdown, tokio::time::sleep(pause)).await?;
        }
        let busy = match &self.workers {
            Some(workers) => workers.queue.busy(),
            None => self.tasks.len(),
        };
        let free = self.task_limit.saturating_sub(busy);
        if free < self.read_at {
            match &self.workers {
                Some(workers) => {
                    let room = self.task_limit - self.read_at;
                    unless(shutdown, workers.queue.room_for(room)).await?;
                }
                None => {
                    if let Some(done) = unless(shutdown, self.tasks.join_next()).await? {
                        self.finished(done);
                    }
                }
            }
            return Some(());
        }
        self.trim_when_due(shutdown).await?;
        let jobs = self.claim_or_read(free, shutdown).await?;
        self.start(jobs).await;
        Some(())
    }

    /// The periodic trim, if one is due. `None`: shut down.
    async fn trim_when_due<S: Future<Output = ()>>(
        &mut self,
        shutdown: &mut Pin<&mut S>,
    ) -> Option<()> {
        let (Some(at), Some(interval)) = (self.next_trim, self.config().trim_interval) else {
            return Some(());
        };
        if Instant::now() < at {
            return Some(());
        }
        let trim = self.consumer.periodic_trim().instrument(self.span.clone());
        unless(shutdown, trim).await?;
        self.next_trim = Some(Instant::now() + interval);
        Some(())
    }

    /// Claims when a claim is due, else reads: as many entries as fit, one per free
    /// slot or a batch per free slot. `None`: shut down.
    async fn claim_or_read<S: Future<Output = ()>>(
        &mut self,
        free: usize,
        shutdown: &mut Pin<&mut S>,
    ) -> Option<RedisResult<Vec<Job>>> {
        // A claim is always followed by a read, whatever the timings: a loop that only
        // claimed (pauses longer than the claim interval) would never see a new entry
        // again.
        let claiming = !self.claimed_last && Instant::now() >= self.next_claim;
        self.claimed_last = claiming;
        let config = self.config();
        let room = match config.batch_size {
            None => free.min(config.read_count),
            Some(size) => free.saturating_mul(size),
        };
        let interval = config.claim_interval;
        let Self {
            consumer,
            in_flight,
            reads,
            span,
            ..
        } = self;
        let step = async {
            if claiming {
                consumer.claim(room, in_flight).await
            } else {
                consumer.read(room, reads).await
            }
        };
        let jobs = unless(shutdown, step.instrument(span.clone())).await?;
        if claiming {
            self.next_claim = Instant::now() + interval;
        }
        Some(jobs)
    }

    /// Starts the work on what a claim or read returned, or reacts to its failure.
    async fn start(&mut self, jobs: RedisResult<Vec<Job>>) {
        match jobs {
            Ok(jobs) => {
                // Redis answered: whatever failed before, it is back.
                self.consumer.inner.health.broker_answered();
                let fresh: Vec<Job> = jobs
                    .into_iter()
                    // Skips entries claimed back while this consumer still works on them.
                    .filter(|job| self.in_flight.insert(job))
                    .collect();
                self.spawn_work(fresh);
            }
            Err(e) => self.read_failed(e).await,
        }
    }

    /// A failed read or claim: counted and backed off from; a group deleted under the
    /// consumer is created again.
    async fn read_failed(&mut self, e: RedisError) {
        let span = &self.span;
        self.consumer.count(Count::RedisError, None);
        let health = &self.consumer.inner.health;
        if e.code() == Some("NOGROUP") {
            // The stream or group was deleted under us: recreate it.
            tracing::warn!(parent: span, error = %e, "consumer group missing; recreating it");
            if let Err(e) = self.consumer.ensure_groups().await {
                let e = outbox_core::error_chain(&e);
                tracing::warn!(parent: span, error = %e, "cannot recreate consumer groups");
                health.broker_failed(&e);
            }
        } else {
            tracing::warn!(parent: span, error = %e, "redis read failed; backing off");
            health.broker_failed(&e);
        }
    }

    /// Starts processing `jobs`: to the workers, or one task per entry (an async inbox);
    /// in batch mode one task per lane (see [`lanes`]), which waits for the lane's
    /// previous task, then runs its batches one after another where the executor runs
    /// work.
    fn spawn_work(&mut self, jobs: Vec<Job>) {
        if let Some(workers) = &self.workers {
            workers.push(jobs);
            return;
        }
        let Some(size) = self.config().batch_size else {
            for job in jobs {
                let this = self.worker.clone();
                let permits = Arc::clone(&self.permits);
                self.tasks.spawn(
                    async move {
                        let _permit = permits.acquire_owned().await;
                        this.process(job).await
                    }
                    .instrument(self.span.clone()),
                );
            }
            return;
        };
        for (n, lane) in lanes(jobs, size, self.lane_locks.len()) {
            let this = self.worker.clone();
            let permits = Arc::clone(&self.permits);
            let lane_locks = Arc::clone(&self.lane_locks);
            self.tasks.spawn(
                async move {
                    // The lane first: a task waiting for its lane holds no connection.
                    let _lane = lane_locks[n].lock().await;
                    let _permit = permits.acquire_owned().await;
                    let executor = this.inner.executor;
                    executor.run(this.process_lane(lane)).await
                }
                .instrument(self.span.clone()),
            );
        }
    }

    /// Work that ended: its entries are no longer in flight; an outage counts toward the
    /// backoff, anything else resets it.
    fn finished(&mut self, done: Result<Done, JoinError>) {
        match done {
            Ok(done) => {
                self.in_flight.remove(&done.entries);
                self.consumer.inner.health.work_ended(done.outage);
            }
            // `process` catches handler panics; this is a bug in the runner itself, or
            // a task aborted at the shutdown timeout. The entry stays pending and is
            // claimed again.
            Err(e) => tracing::error!(error = %e, "consumer task failed"),
        }
    }

    /// After the shutdown signal: stops reading and lets the work in flight finish
    /// within `shutdown_timeout`; what still runs then is abandoned and stays pending.
    async fn stop(mut self) {
        // Reads still blocking (on a cluster) stop here; what they may have read stays
        // pending, as with a read the shutdown cut short.
        drop(std::mem::take(&mut self.reads));
        if let Some(workers) = self.workers.take() {
            let in_flight = workers.queue.busy();
            tracing::info!(parent: &self.span, in_flight, "consumer stopping");
            let abandoned = workers.stop(self.config().shutdown_timeout).await;
            if abandoned > 0 {
                tracing::warn!(parent: &self.span, abandoned, "shutdown timeout reached; the messages still in flight stay pending for other consumers");
            }
            return;
        }
        tracing::info!(parent: &self.span, in_flight = self.tasks.len(), "consumer stopping");
        let grace = tokio::time::sleep(self.config().shutdown_timeout);
        tokio::pin!(grace);
        loop {
            tokio::select! {
                done = self.tasks.join_next() => match done {
                    Some(done) => self.finished(done),
                    None => break,
                },
                () = &mut grace => {
                    tracing::warn!(parent: &self.span, abandoned = self.tasks.len(), "shutdown timeout reached; the messages still in flight stay pending for other consumers");
                    // Their store transactions roll back when their connections close
                    // (or commit, and a redelivery is then a duplicate).
                    self.tasks.abort_all();
                    break;
                }
            }
        }
    }
}

/// Marks the consumer running for [`Consumer::health`] while it lives: until the loop
/// ends, or the future of [`run_until`](Consumer::run_until) is dropped.
struct Running<'a>(&'a super::health::HealthState);

impl<'a> Running<'a> {
    fn new(health: &'a super::health::HealthState) -> Self {
        health.set_running(true);
        Self(health)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.set_running(false);
    }
}

/// `work`'s output, or `None` if `shutdown` completes first. The signal is looked at
/// first: once it came, nothing new starts.
async fn unless<S: Future<Output = ()>, T>(
    shutdown: &mut Pin<&mut S>,
    work: impl Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        biased;
        () = shutdown.as_mut() => None,
        out = work => Some(out),
    }
}
