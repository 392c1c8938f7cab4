//! Ordered mode ([`ConsumerConfig::ordered`](super::ConsumerConfig::ordered)): each
//! stream read only by the holder of its lease, and the entries of one key handled one
//! after another in stream order.
//!
//! - [`leases`]: membership, renewals, acquisitions up to a fair share, takeovers;
//! - [`fenced`]: reads that deliver only to the lease's holder;
//! - [`keys`]: one queue per key, of which only the head runs.
//!
//! The loop here owns the queues and the leases held. Every third of the lease TTL a task
//! renews the leases and acquires free streams ([`Consumer::keep_leases`]); a stream
//! acquired brings the entries its previous holder left pending, queued before anything
//! read from it later. Work is started per key head (in batch mode, up to `batch_size`
//! heads of different keys per transaction), at most `max_in_flight` at once. A head that
//! failed waits in its queue (the outage backoff's pause for its delivery count) and runs
//! again, holding its key back, until it is applied or dead-lettered. A lease whose
//! local deadline passed is dropped at once with everything queued for it, and no work
//! starts on an entry of a stream whose lease is not held.

mod fenced;
mod keys;
mod leases;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::ConsumerStore;
use crate::consumer::store::Transactions;
use redis::RedisResult;
use tokio::task::{JoinError, JoinHandle, JoinSet};
use tracing::Instrument as _;

use super::ack::AckQueue;
use super::{AfterDeadLetter, Consumer, Job, Outcome};
use crate::lease::Lease;
use fenced::Read;
use keys::Keys;
use leases::{Holding, Tick};

/// A stream whose lease this consumer holds.
struct Held {
    lease: Arc<Lease>,
    /// Above its share: no more reads; released once its queues are empty.
    releasing: bool,
}

/// How the heads of one task ended, each with the lease it ran under: a result counts
/// only while that very lease is the stream's current one (an epoch would not do: the
/// counters start again after Redis loses its data).
type Ended = Vec<(Job, Outcome, Arc<Lease>)>;

/// A stream, with the lease it is (or was) held under.
type Under = (Arc<str>, Arc<Lease>);

/// What one ordered run keeps between its rounds.
struct Ordered<I, C> {
    consumer: Consumer<I, C>,
    /// The same consumer acking through this run's queue: what the work tasks run.
    worker: Consumer<I, C>,
    acks_failed: Arc<AtomicBool>,
    span: tracing::Span,
    held: HashMap<Arc<str>, Held>,
    keys: Keys,
    tasks: JoinSet<Ended>,
    /// The streams and leases of each running task: what to drop when one crashes, and
    /// which streams not to take again while work of an earlier holding still runs.
    running: HashMap<tokio::task::Id, Vec<Under>>,
    /// Most tasks (transactions) at once.
    task_limit: usize,
    /// Most entries queued (read and not yet settled).
    read_ahead: usize,
    read: Option<JoinHandle<RedisResult<Read>>>,
    tick: Option<JoinHandle<Tick>>,
    next_tick: Instant,
    /// After a failure: no reads and no new work before then.
    paused_until: Instant,
    /// Live consumers of the group, as the last round of lease keeping saw.
    live: usize,
    /// Whether the first round (membership only) has started.
    joined: bool,
    /// When the periodic trim is due, if on (`trim_interval`).
    next_trim: Option<Instant>,
}

/// The pause between a consumer's first round of lease keeping, which only makes it a
/// member of the group, and its first acquisitions (at most a third of the TTL): consumers
/// started together then see each other and take their fair shares at once, instead of
/// the first taking everything and releasing most of it a renewal period later.
const JOIN_DELAY: Duration = Duration::from_millis(250);

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// [`run_until`](Self::run_until) in ordered mode, once the groups exist.
    pub(super) async fn run_ordered<S: Future<Output = ()>>(
        &self,
        shutdown: &mut Pin<&mut S>,
        span: tracing::Span,
    ) {
        let (queue, queued) = tokio::sync::mpsc::unbounded_channel();
        let acks = AckQueue {
            queue,
            failed: Arc::default(),
        };
        let flusher = tokio::spawn(
            self.clone()
                .flush_acks(queued, Arc::clone(&acks.failed))
                .instrument(span.clone()),
        );
        let mut run = Ordered::new(self, acks, span.clone());
        while run.round(shutdown).await.is_some() {}
        let held = run.stop().await;
        if let Err(e) = flusher.await {
            tracing::error!(parent: &span, error = %e, "ack task failed");
        }
        // After the acks: the next holder finds only what is really unfinished.
        self.release_all(held).instrument(span).await;
    }

    /// Gives the leases back and leaves the members (at shutdown). Best effort: what is
    /// not released expires.
    async fn release_all(&self, held: Vec<Arc<Lease>>) {
        if let Ok(mut conn) = self.inner.commands.get().await {
            for lease in held {
                let released = lease.release(&mut conn).await;
                self.redis_done(released, "cannot release a lease").await;
            }
        }
        self.leave().await;
    }

    /// Runs the heads `jobs`, each of a stream whose lease is in `leases`: one
    /// transaction (single mode: `jobs` is one entry) or one batch. An entry whose lease
    /// is no longer held is not run (it stays pending for the next holder). A head that
    /// failed has its delivery counted in Redis, as a redelivery would.
    async fn run_heads(self, jobs: Vec<Job>, leases: Vec<Arc<Lease>>) -> Ended {
        let (run, lost): (Vec<_>, Vec<_>) = jobs
            .into_iter()
            .zip(&leases)
            .partition(|(_, lease)| lease.is_held());
        let (run, run_leases): (Vec<Job>, Vec<Arc<Lease>>) = run
            .into_iter()
            .map(|(job, lease)| (job, Arc::clone(lease)))
            .unzip();
        let outcomes = if self.inner.config.batch_size.is_some() {
            self.process_batch_outcomes(&run).await
        } else {
            let mut outcomes = Vec::with_capacity(run.len());
            for job in &run {
                outcomes.push(self.process_one(job).await);
            }
            outcomes
        };
        let mut ended = Vec::with_capacity(run.len() + lost.len());
        for ((job, outcome), lease) in run.into_iter().zip(outcomes).zip(run_leases) {
            if outcome == (Outcome::Pending { outage: false }) {
                self.set_delivery_count(&job, job.delivery_count + 1).await;
            }
            ended.push((job, outcome, lease));
        }
        ended.extend(
            lost.into_iter()
                .map(|(job, lease)| (job, Outcome::Pending { outage: false }, Arc::clone(lease))),
        );
        ended
    }
}

impl<I, C> Ordered<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    fn new(consumer: &Consumer<I, C>, acks: AckQueue, span: tracing::Span) -> Self {
        let config = &consumer.inner.config;
        let task_limit = config
            .max_in_flight
            .min(Transactions::capacity(&consumer.inner.inbox).unwrap_or(usize::MAX))
            .max(1);
        let per_task = config.batch_size.unwrap_or(1);
        let now = Instant::now();
        Self {
            acks_failed: Arc::clone(&acks.failed),
            worker: Consumer {
                inner: Arc::clone(&consumer.inner),
                acks: Some(acks),
            },
            consumer: consumer.clone(),
            span,
            held: HashMap::new(),
            keys: Keys::new(&consumer.inner.group),
            tasks: JoinSet::new(),
            running: HashMap::new(),
            task_limit,
            // Room for twice the heads that run at once, so that a key whose head
            // finishes finds its next entry at hand.
            read_ahead: config
                .read_count
                .max(task_limit * 2)
                .saturating_mul(per_task),
            read: None,
            tick: None,
            next_tick: now,
            paused_until: now,
            live: 1,
            joined: false,
            next_trim: config.trim_interval.map(|i| now + i),
        }
    }

    /// One round: drops lost leases, releases drained ones, starts work, a read and the
    /// lease keeping when due, then waits for one of them (or a timer). `None`: shut
    /// down.
    async fn round<S: Future<Output = ()>>(&mut self, shutdown: &mut Pin<&mut S>) -> Option<()> {
        let health = &self.consumer.inner.health;
        health.round();
        if self.acks_failed.swap(false, Ordering::Relaxed) {
            health.work_ended(true);
        }
        self.drop_lost();
        self.release_drained();
        let now = Instant::now();
        let next_wake = self.keys.wake(now);
        if now >= self.paused_until {
            self.start_work();
            self.start_read();
        }
        if self.tick.is_none() && now >= self.next_tick {
            self.start_tick();
        }
        self.trim_when_due(now);
        let mut until = self.next_tick.max(now + Duration::from_millis(1));
        if let Some(trim) = self.next_trim {
            until = until.min(trim.max(now + Duration::from_millis(1)));
        }
        for at in next_wake
            .into_iter()
            .chain((self.paused_until > now).then_some(self.paused_until))
            .chain(self.held.values().map(|h| h.lease.valid_until()))
        {
            until = until.min(at.max(now + Duration::from_millis(1)));
        }
        let Self {
            tasks, read, tick, ..
        } = self;
        let event = tokio::select! {
            biased;
            () = shutdown.as_mut() => return None,
            Some(done) = tasks.join_next_with_id(), if !tasks.is_empty() => Event::Work(done),
            r = joined(read) => Event::Read(r),
            t = joined(tick) => Event::Tick(t),
            () = tokio::time::sleep_until(until.into()) => Event::Timer,
        };
        match event {
            Event::Work(done) => self.finished(done),
            Event::Read(read) => {
                self.read = None;
                self.read_done(read).await;
            }
            Event::Tick(tick) => {
                self.tick = None;
                self.tick_done(tick);
            }
            Event::Timer => {}
        }
        Some(())
    }

    /// The periodic trim, when due: in a task of its own, as it never fails and nothing
    /// waits for it.
    fn trim_when_due(&mut self, now: Instant) {
        let (Some(at), Some(interval)) = (self.next_trim, self.consumer.inner.config.trim_interval)
        else {
            return;
        };
        if now >= at {
            self.next_trim = Some(now + interval);
            let consumer = self.consumer.clone();
            tokio::spawn(
                async move { consumer.periodic_trim().await }.instrument(self.span.clone()),
            );
        }
    }

    /// Drops the streams whose lease's local deadline passed, with all queued for them.
    fn drop_lost(&mut self) {
        let lost: Vec<(Arc<str>, Arc<Lease>)> = self
            .held
            .iter()
            .filter(|(_, h)| !h.lease.is_held())
            .map(|(s, h)| (Arc::clone(s), Arc::clone(&h.lease)))
            .collect();
        for (stream, lease) in lost {
            self.drop_stream(&stream, &lease);
        }
    }

    /// Whether `lease` is the one `stream` is held under now.
    fn is_current(&self, stream: &str, lease: &Arc<Lease>) -> bool {
        self.held
            .get(stream)
            .is_some_and(|h| Arc::ptr_eq(&h.lease, lease))
    }

    /// Drops `stream` if it is still held under `lease`: news of a lease lost is about
    /// that lease, not about a later one of the same stream.
    fn drop_stream(&mut self, stream: &str, lease: &Arc<Lease>) {
        if !self.is_current(stream, lease) {
            return;
        }
        if let Some(held) = self.held.remove(stream) {
            held.lease.give_up();
            tracing::warn!(parent: &self.span, stream, epoch = held.lease.epoch(), "lease lost: the stream's entries are left to the next holder");
            self.keys.drop_stream(stream);
        }
    }

    /// Releases the streams above this consumer's share whose work is done.
    fn release_drained(&mut self) {
        let drained: Vec<Arc<str>> = self
            .held
            .iter()
            .filter(|(s, h)| h.releasing && self.keys.runnable_in(s) == 0)
            .map(|(s, _)| Arc::clone(s))
            .collect();
        for stream in drained {
            let Some(held) = self.held.remove(&stream) else {
                continue;
            };
            tracing::info!(parent: &self.span, stream = &*stream, epoch = held.lease.epoch(), "lease released to rebalance");
            // Only blocked keys may be left: their entries wait for the next holder.
            self.keys.drop_stream(&stream);
            let consumer = self.consumer.clone();
            tokio::spawn(async move {
                let released = async {
                    let mut conn = consumer.inner.commands.get().await?;
                    held.lease.release(&mut conn).await
                }
                .await;
                consumer
                    .redis_done(released, "cannot release a lease")
                    .await;
            });
        }
    }

    /// Starts work on ready heads, up to the task limit.
    fn start_work(&mut self) {
        let per_task = self.consumer.inner.config.batch_size.unwrap_or(1);
        while self.tasks.len() < self.task_limit {
            let held = &self.held;
            let jobs = self
                .keys
                .take(per_task, |s| held.get(s).is_some_and(|h| h.lease.is_held()));
            if jobs.is_empty() {
                return;
            }
            let leases: Vec<Arc<Lease>> = jobs
                .iter()
                .filter_map(|job| self.held.get(&job.stream).map(|h| Arc::clone(&h.lease)))
                .collect();
            let streams = jobs
                .iter()
                .map(|job| Arc::clone(&job.stream))
                .zip(leases.iter().cloned())
                .collect();
            let worker = self.worker.clone();
            let heads = worker.inner.executor.run(worker.run_heads(jobs, leases));
            let task = self.tasks.spawn(heads.instrument(self.span.clone()));
            self.running.insert(task.id(), streams);
        }
    }

    /// Starts a read of the streams held (not being released), if none runs and there
    /// is room for what it brings. Entries of blocked keys (which wait for an operator)
    /// take no room from the others: a stream is only left unread once it holds a whole
    /// read-ahead itself, so that one blocked key cannot stall every stream held.
    fn start_read(&mut self) {
        if self.read.is_some() {
            return;
        }
        let readable: Vec<(Arc<str>, Arc<Lease>)> = self
            .held
            .iter()
            .filter(|(s, h)| {
                !h.releasing && h.lease.is_held() && self.keys.queued_in(s) < self.read_ahead
            })
            .map(|(s, h)| (Arc::clone(s), Arc::clone(&h.lease)))
            .collect();
        let queued = self.keys.runnable();
        let room = self.read_ahead.saturating_sub(queued);
        // A read for every few entries finished would cost a round trip (and a script
        // per stream) per few entries: read once half the read-ahead is free, or when
        // the work is about to run dry.
        if readable.is_empty()
            || room == 0
            || (room * 2 < self.read_ahead && queued >= self.task_limit)
        {
            return;
        }
        let count = room.div_ceil(readable.len());
        let read = self.consumer.clone().read_fenced(readable, count);
        self.read = Some(tokio::spawn(read.instrument(self.span.clone())));
    }

    /// Starts a round of lease keeping: the first one only joins the members, the next
    /// ones also take free streams.
    fn start_tick(&mut self) {
        let acquire = self.joined;
        self.joined = true;
        let holding = Holding {
            held: self
                .held
                .iter()
                .map(|(s, h)| (Arc::clone(s), Arc::clone(&h.lease)))
                .collect(),
            blocked: self
                .held
                .keys()
                .filter(|s| self.keys.has_blocked(s))
                .cloned()
                .collect(),
            acquire,
            queued: self.keys.entries().clone(),
            busy: self.busy_streams(),
        };
        let every = self.consumer.lease_ttl() / 3;
        self.next_tick = Instant::now()
            + if acquire {
                every
            } else {
                every.min(JOIN_DELAY)
            };
        let keep = self.consumer.clone().keep_leases(holding);
        self.tick = Some(tokio::spawn(keep.instrument(self.span.clone())));
    }

    /// The streams with work still running under a lease they are no longer held
    /// under: not to be taken again until it ends, or two holdings' heads of one key
    /// would run at once.
    fn busy_streams(&self) -> Vec<Arc<str>> {
        let mut busy: Vec<Arc<str>> = Vec::new();
        for (stream, lease) in self.running.values().flatten() {
            if !self.is_current(stream, lease) && !busy.contains(stream) {
                busy.push(Arc::clone(stream));
            }
        }
        busy
    }

    /// Work that ended: each head settled, or waits to run again.
    fn finished(&mut self, done: Result<(tokio::task::Id, Ended), JoinError>) {
        let ended = match done {
            Ok((id, ended)) => {
                self.running.remove(&id);
                ended
            }
            // `process` catches handler panics: this is a bug in the runner itself (or a
            // task aborted at the shutdown timeout). Its heads would stay busy for good,
            // holding their keys back: their streams are dropped instead, and the next
            // holder takes their entries over.
            Err(e) => {
                tracing::error!(parent: &self.span, error = %e, "consumer task failed; dropping its streams");
                for (stream, lease) in self.running.remove(&e.id()).unwrap_or_default() {
                    self.drop_stream(&stream, &lease);
                }
                return;
            }
        };
        let config = &self.consumer.inner.config;
        let blocking = config
            .ordered
            .as_ref()
            .is_some_and(|o| o.after_dead_letter == AfterDeadLetter::Block);
        let health = &self.consumer.inner.health;
        let outage = ended.iter().any(|(_, o, _)| o.outage());
        health.work_ended(outage);
        let now = Instant::now();
        if outage && let Some(pause) = health.pause(&config.outage_backoff) {
            self.paused_until = now + pause;
        }
        for (mut job, outcome, lease) in ended {
            // Of a lease since lost (and perhaps acquired again): its queues are gone, or
            // are the new lease's, whose heads this result must not move.
            if !self.is_current(&job.stream, &lease) {
                continue;
            }
            match outcome {
                Outcome::Acked => self.keys.done(job, true, now, false),
                Outcome::DeadLettered => self.keys.done(job, true, now, blocking),
                Outcome::Pending { outage } => {
                    if !outage {
                        job.delivery_count += 1;
                    }
                    let failures = u32::try_from(job.delivery_count).unwrap_or(u32::MAX);
                    let retry_at = now + config.outage_backoff.pause(failures);
                    self.keys.done(job, false, retry_at, false);
                }
            }
        }
    }

    /// A read returned: its entries are queued behind their keys' earlier ones.
    async fn read_done(&mut self, read: Result<RedisResult<Read>, JoinError>) {
        let health = &self.consumer.inner.health;
        match read {
            Ok(Ok(read)) => {
                health.broker_answered();
                for (stream, lease) in &read.lost {
                    self.drop_stream(stream, lease);
                }
                for (job, lease) in read.jobs {
                    // A stream dropped meanwhile: its entries stay pending for the next
                    // holder, which takes them over before it reads anything newer.
                    if self.is_current(&job.stream, &lease) {
                        self.keys.push(job);
                    }
                }
            }
            Ok(Err(e)) => {
                self.consumer.count(super::stats::Count::RedisError, None);
                if e.code() == Some("NOGROUP") {
                    tracing::warn!(parent: &self.span, error = %e, "consumer group missing; recreating it");
                    if let Err(e) = self.consumer.ensure_groups().await {
                        health.broker_failed(&outbox_core::error_chain(&e));
                    }
                } else {
                    tracing::warn!(parent: &self.span, error = %e, "redis read failed; backing off");
                    health.broker_failed(&e);
                }
                if let Some(pause) = health.pause(&self.consumer.inner.config.outage_backoff) {
                    self.paused_until = Instant::now() + pause;
                }
            }
            Err(e) => tracing::error!(parent: &self.span, error = %e, "read task failed"),
        }
    }

    /// A round of lease keeping returned: streams lost are dropped, streams acquired
    /// queue their pending entries first, and a consumer above its fair share starts
    /// releasing its extra streams.
    fn tick_done(&mut self, tick: Result<Tick, JoinError>) {
        let tick = match tick {
            Ok(tick) => tick,
            Err(e) => {
                tracing::error!(parent: &self.span, error = %e, "lease task failed");
                return;
            }
        };
        if tick.live > 0 {
            self.live = tick.live;
        }
        for (stream, lease) in &tick.lost {
            self.drop_stream(stream, lease);
        }
        for acquired in tick.acquired {
            for key in acquired.blocked {
                self.keys.block(&acquired.stream, key);
            }
            for job in acquired.pending {
                self.keys.push(job);
            }
            self.held.insert(
                acquired.stream,
                Held {
                    lease: acquired.lease,
                    releasing: false,
                },
            );
        }
        for (stream, still) in &tick.blocked {
            self.keys.unblock(stream, still);
        }
        for (job, lease) in tick.orphans {
            if self.is_current(&job.stream, &lease) {
                self.keys.push(job);
            }
        }
        if let Some(e) = tick.error {
            tracing::warn!(parent: &self.span, error = %e, "lease keeping failed");
            self.consumer.count(super::stats::Count::RedisError, None);
            self.consumer.inner.health.broker_failed(&e);
            return;
        }
        // Redis answered: a consumer that holds no stream reads nothing, and would
        // otherwise stay unready for good after an outage.
        self.consumer.inner.health.broker_answered();
        self.rebalance();
    }

    /// Above the fair share (`ceil(streams / live consumers)`): marks the extra streams,
    /// those with the least queued, for release.
    fn rebalance(&mut self) {
        let share = self.consumer.inner.streams.len().div_ceil(self.live.max(1));
        let mut active: Vec<(usize, Arc<str>)> = self
            .held
            .iter()
            .filter(|(_, h)| !h.releasing)
            .map(|(s, _)| (self.keys.queued_in(s), Arc::clone(s)))
            .collect();
        if active.len() <= share {
            return;
        }
        active.sort();
        let extra = active.len() - share;
        for (_, stream) in active.into_iter().take(extra) {
            if let Some(held) = self.held.get_mut(&stream) {
                held.releasing = true;
            }
        }
    }

    /// After the shutdown signal: no new reads or work; the work running finishes within
    /// `shutdown_timeout`. Returns the leases still held, to release once the acks are
    /// out. Entries queued and not started stay pending for the next holder.
    async fn stop(mut self) -> Vec<Arc<Lease>> {
        if let Some(read) = self.read.take() {
            read.abort();
        }
        if let Some(tick) = self.tick.take() {
            // A tick may be acquiring: its leases then expire.
            tick.abort();
        }
        tracing::info!(parent: &self.span, in_flight = self.tasks.len(), "consumer stopping");
        let grace = tokio::time::sleep(self.consumer.inner.config.shutdown_timeout);
        tokio::pin!(grace);
        loop {
            tokio::select! {
                done = self.tasks.join_next_with_id() => match done {
                    Some(done) => self.finished(done),
                    None => break,
                },
                () = &mut grace => {
                    tracing::warn!(parent: &self.span, abandoned = self.tasks.len(), "shutdown timeout reached; the messages still in flight stay pending for the next holder");
                    self.tasks.abort_all();
                    // Their transactions may still commit: the leases are left to
                    // expire rather than handed over while they run.
                    return Vec::new();
                }
            }
        }
        self.held.into_values().map(|h| h.lease).collect()
    }
}

/// What a round waited for.
enum Event {
    Work(Result<(tokio::task::Id, Ended), JoinError>),
    Read(Result<RedisResult<Read>, JoinError>),
    Tick(Result<Tick, JoinError>),
    Timer,
}

/// The output of the task in `handle`, or never if there is none.
async fn joined<T>(handle: &mut Option<JoinHandle<T>>) -> Result<T, JoinError> {
    match handle {
        Some(handle) => handle.await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use outbox_core::{Delivery, Handler, HandlerError, MemoryDb, MemoryTx, OutboxEvent};

    use super::{Held, Ordered};
    use crate::consumer::ack::AckQueue;
    use crate::lease::Lease;
    use crate::{Consumer, ConsumerConfig, OrderedConfig};

    #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
    #[outbox(topic = "ordered.unit")]
    struct Event {
        #[outbox(id)]
        id: String,
    }

    struct Nothing;

    impl Handler<Event> for Nothing {
        type Conn = MemoryTx<()>;

        fn handle(&self, _: Event, _: &mut MemoryTx<()>, _: &Delivery) -> Result<(), HandlerError> {
            Ok(())
        }
    }

    /// An ordered consumer of group `g` on the shared Redis, never run.
    pub(super) fn consumer() -> Consumer<MemoryDb<()>, MemoryTx<()>> {
        Consumer::builder(outbox_tests::redis_url(), "g")
            .handle::<Event, _>(Nothing)
            .idempotency(MemoryDb::new(()))
            .with_config(ConsumerConfig::default().with_ordered(OrderedConfig::default()))
            .build()
            .unwrap()
    }

    /// A work task that crashed (a bug of the runner: handler and store panics are
    /// caught) must not leave its heads busy for good, freezing their keys while the
    /// lease is renewed forever: its streams are dropped, for the next holder.
    #[tokio::test]
    async fn a_crashed_task_drops_its_streams() {
        let consumer = consumer();
        let (queue, _queued) = tokio::sync::mpsc::unbounded_channel();
        let acks = AckQueue {
            queue,
            failed: Arc::default(),
        };
        let mut run = Ordered::new(&consumer, acks, tracing::Span::none());
        let mut conn = consumer.inner.commands.get().await.unwrap();
        let key = outbox_tests::unique("lease");
        let lease = Lease::acquire(&mut conn, &key, "c", Duration::from_secs(10))
            .await
            .unwrap()
            .map(Arc::new)
            .unwrap();
        let stream: Arc<str> = Arc::from("s");
        run.held.insert(
            Arc::clone(&stream),
            Held {
                lease: Arc::clone(&lease),
                releasing: false,
            },
        );
        let task = run.tasks.spawn(async { panic!("a bug of the runner") });
        run.running
            .insert(task.id(), vec![(Arc::clone(&stream), Arc::clone(&lease))]);
        let done = run.tasks.join_next_with_id().await.unwrap();
        run.finished(done);
        assert!(!run.held.contains_key(&stream), "the stream is still held");
        assert!(!lease.is_held());
        assert!(run.running.is_empty());
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .arg(format!("{key}:epoch"))
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}
