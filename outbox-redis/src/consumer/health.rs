//! What a running consumer reports to its service's probes: [`Consumer::health`].

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::ConsumerStore;
use outbox_core::OutageBackoff;

use super::{Consumer, ConsumerConfig};

/// A snapshot of a consumer's state for liveness and readiness probes
/// ([`Consumer::health`]; with the `http` feature,
#[cfg_attr(feature = "http", doc = "[`health_router`](crate::health_router)")]
#[cfg_attr(not(feature = "http"), doc = "`health_router`")]
/// serves it as `/healthz` and `/readyz`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerHealth {
    /// [`run_until`](Consumer::run_until) is running and its consumer groups exist.
    pub running: bool,
    /// How long ago the run loop last began a round (`None`: it never did).
    pub last_round: Option<Duration>,
    /// How long ago Redis last answered a read or claim, or in ordered mode a round of
    /// lease keeping (`None`: it never did).
    pub last_redis_answer: Option<Duration>,
    /// Reads and claims (in ordered mode, also rounds of lease keeping) failed in a row
    /// since Redis last answered.
    pub redis_failures: u32,
    /// Messages or batches in a row that ended in an outage of the idempotency store (or
    /// a failed `XACK`).
    pub store_failures: u32,
    /// The last failure's text, while the consumer is failing.
    pub last_error: Option<String>,
    /// How long the loop may go without a round before [`is_live`](Self::is_live) says
    /// no: the longest a healthy round takes (see [`Consumer::health`]).
    pub stall_limit: Duration,
}

impl ConsumerHealth {
    /// Liveness: the run loop turns. False while it is stopped, or when it has begun no
    /// round for longer than [`stall_limit`](Self::stall_limit) (it hangs: a restart
    /// helps). Outages of Redis or the store do not make a consumer dead: it backs off
    /// and recovers by itself.
    pub fn is_live(&self) -> bool {
        self.running && self.last_round.is_some_and(|age| age <= self.stall_limit)
    }

    /// Readiness: live, the last read or claim (in ordered mode, or round of lease
    /// keeping) succeeded, and no message is failing on a store outage. False during an
    /// outage of Redis or the store, true again once they answer.
    pub fn is_ready(&self) -> bool {
        self.is_live() && self.redis_failures == 0 && self.store_failures == 0
    }
}

/// The run loop's side of [`ConsumerHealth`]: written by the loop, read by probes and by
/// the loop's own backoff ([`pause`](Self::pause)).
#[derive(Debug)]
pub(super) struct HealthState {
    since: Instant,
    running: AtomicBool,
    /// Milliseconds since `since`, plus one (0: never).
    last_round: AtomicU64,
    last_redis_answer: AtomicU64,
    redis_failures: AtomicU32,
    store_failures: AtomicU32,
    last_error: Mutex<Option<String>>,
}

impl Default for HealthState {
    fn default() -> Self {
        Self {
            since: Instant::now(),
            running: AtomicBool::new(false),
            last_round: AtomicU64::new(0),
            last_redis_answer: AtomicU64::new(0),
            redis_failures: AtomicU32::new(0),
            store_failures: AtomicU32::new(0),
            last_error: Mutex::new(None),
        }
    }
}

impl HealthState {
    fn now(&self) -> u64 {
        u64::try_from(self.since.elapsed().as_millis())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }

    fn age(&self, at: &AtomicU64) -> Option<Duration> {
        match at.load(Ordering::Relaxed) {
            0 => None,
            t => Some(Duration::from_millis(self.now().saturating_sub(t))),
        }
    }

    fn snapshot(&self, stall_limit: Duration) -> ConsumerHealth {
        ConsumerHealth {
            running: self.running.load(Ordering::Relaxed),
            last_round: self.age(&self.last_round),
            last_redis_answer: self.age(&self.last_redis_answer),
            redis_failures: self.redis_failures.load(Ordering::Relaxed),
            store_failures: self.store_failures.load(Ordering::Relaxed),
            last_error: self
                .last_error
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
            stall_limit,
        }
    }

    /// A run starts (its failures in a row start from none) or ends.
    pub(super) fn set_running(&self, running: bool) {
        self.running.store(running, Ordering::Relaxed);
        if running {
            self.redis_failures.store(0, Ordering::Relaxed);
            self.store_failures.store(0, Ordering::Relaxed);
            self.clear_error();
            self.round();
        }
    }

    /// The pause before the loop's next round, after failures. Each kind of failure in a
    /// row is reset by its own success, so a success of one kind (a claim that works) can
    /// never hide that the other recovered, nor keep the loop pausing after Redis answers
    /// again.
    pub(super) fn pause(&self, backoff: &OutageBackoff) -> Option<Duration> {
        let failures = self
            .redis_failures
            .load(Ordering::Relaxed)
            .max(self.store_failures.load(Ordering::Relaxed));
        (failures > 0).then(|| backoff.pause(failures))
    }

    pub(super) fn round(&self) {
        self.last_round.store(self.now(), Ordering::Relaxed);
    }

    pub(super) fn redis_answered(&self) {
        self.last_redis_answer.store(self.now(), Ordering::Relaxed);
        self.redis_failures.store(0, Ordering::Relaxed);
        self.clear_error();
    }

    pub(super) fn redis_failed(&self, error: &dyn std::fmt::Display) {
        self.redis_failures.fetch_add(1, Ordering::Relaxed);
        self.note_error(error);
    }

    /// A message or batch ended: `outage` says whether the store (or an ack) failed.
    pub(super) fn work_ended(&self, outage: bool) {
        if outage {
            self.store_failures.fetch_add(1, Ordering::Relaxed);
            self.note_error(&"the idempotency store or an XACK failed (see the logs)");
        } else if self.store_failures.swap(0, Ordering::Relaxed) > 0 {
            self.clear_error();
        }
    }

    fn note_error(&self, error: &dyn std::fmt::Display) {
        *self
            .last_error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(error.to_string());
    }

    fn clear_error(&self) {
        if self.redis_failures.load(Ordering::Relaxed) == 0
            && self.store_failures.load(Ordering::Relaxed) == 0
        {
            *self
                .last_error
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        }
    }
}

/// The longest a healthy round of the loop takes: a blocking read and its response
/// timeout, or the longest outage pause, or waiting for a message in flight (handlers
/// are to take well under `min_idle`); plus slack for a loaded machine.
fn stall_limit(config: &ConsumerConfig) -> Duration {
    let read = config.block + config.response_timeout;
    read.max(config.outage_backoff.max)
        .max(config.min_idle)
        .saturating_add(Duration::from_secs(10))
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// Its state for the service's probes: cheap (a few atomic loads), so a probe can
    /// ask as often as it likes.
    ///
    /// - Liveness ([`ConsumerHealth::is_live`]): the loop of
    ///   [`run_until`](Self::run_until) is running and has begun a round within the
    ///   stall limit: the longest of `block + response_timeout`, the outage backoff's
    ///   `max` and `min_idle`, plus 10 s.
    /// - Readiness ([`ConsumerHealth::is_ready`]): live, and neither Redis nor the
    ///   idempotency store is failing.
    ///
    /// ```
    /// # #![allow(dead_code)]
    /// fn probe(consumer: &outbox_redis::Consumer<outbox_core::MemoryDb<()>>) {
    /// let health = consumer.health();
    /// if !health.is_ready() {
    ///     eprintln!("not ready: {:?}", health.last_error);
    /// }
    /// }
    /// ```
    pub fn health(&self) -> ConsumerHealth {
        self.inner.health.snapshot(stall_limit(&self.inner.config))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(state: &HealthState) -> ConsumerHealth {
        state.snapshot(Duration::from_secs(60))
    }

    #[test]
    fn a_consumer_that_never_ran_is_neither_live_nor_ready() {
        let state = HealthState::default();
        let h = health(&state);
        assert!(!h.is_live() && !h.is_ready());
        assert_eq!(h.last_round, None);
    }

    #[test]
    fn an_outage_makes_it_unready_but_live_and_an_answer_ready_again() {
        let state = HealthState::default();
        state.set_running(true);
        state.redis_answered();
        assert!(health(&state).is_ready());
        state.redis_failed(&"connection refused");
        let h = health(&state);
        assert!(h.is_live() && !h.is_ready());
        assert_eq!(h.last_error.as_deref(), Some("connection refused"));
        state.redis_answered();
        let h = health(&state);
        assert!(h.is_ready(), "{h:?}");
        assert_eq!(h.last_error, None);
        state.work_ended(true);
        assert!(!health(&state).is_ready());
        state.work_ended(false);
        assert!(health(&state).is_ready());
    }

    #[test]
    fn a_loop_that_stopped_turning_is_not_live() {
        let state = HealthState::default();
        state.set_running(true);
        let mut h = health(&state);
        h.stall_limit = Duration::ZERO;
        std::thread::sleep(Duration::from_millis(5));
        h.last_round = state.age(&state.last_round);
        assert!(!h.is_live());
        state.set_running(false);
        assert!(!health(&state).is_live());
    }

    #[test]
    fn the_stall_limit_covers_a_blocking_read_a_backoff_and_a_slow_message() {
        let config = ConsumerConfig::default();
        let limit = stall_limit(&config);
        assert!(limit > config.block + config.response_timeout);
        assert!(limit > config.outage_backoff.max);
        assert!(limit > config.min_idle);
    }
}
