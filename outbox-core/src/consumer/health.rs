//! What a running consumer reports to its service's probes, the same for every broker:
//! [`ConsumerHealth`], kept up by its run loop through [`HealthState`].

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::OutageBackoff;

/// A snapshot of a consumer's state for liveness and readiness probes (the broker
/// crate's `Consumer::health`; with its `http` feature, its `health_router` serves it as
/// `/healthz` and `/readyz`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerHealth {
    /// The consumer's `run_until` is running and what it reads exists on the broker
    /// (Redis: its consumer groups; NATS: its streams and durable consumers).
    pub running: bool,
    /// How long ago the run loop last began a round (`None`: it never did).
    pub last_round: Option<Duration>,
    /// How long ago the broker last answered a read (Redis: a read or claim, or in
    /// ordered mode a round of lease keeping; NATS: a pull) (`None`: it never did).
    pub last_broker_answer: Option<Duration>,
    /// Reads that failed in a row since the broker last answered one.
    pub broker_failures: u32,
    /// Messages or batches in a row that ended in an outage of the idempotency store (or
    /// a failed acknowledgement).
    pub store_failures: u32,
    /// The last failure's text, while the consumer is failing.
    pub last_error: Option<String>,
    /// How long the loop may go without a round before [`is_live`](Self::is_live) says
    /// no: the longest a healthy round takes (see the broker crate's `Consumer::health`).
    pub stall_limit: Duration,
}

impl ConsumerHealth {
    /// Liveness: the run loop turns. False while it is stopped, or when it has begun no
    /// round for longer than [`stall_limit`](Self::stall_limit) (it hangs: a restart
    /// helps). Outages of the broker or the store do not make a consumer dead: it backs
    /// off and recovers by itself.
    pub fn is_live(&self) -> bool {
        self.running && self.last_round.is_some_and(|age| age <= self.stall_limit)
    }

    /// Readiness: live, the last read succeeded, and no message is failing on a store
    /// outage. False during an outage of the broker or the store, true again once they
    /// answer.
    pub fn is_ready(&self) -> bool {
        self.is_live() && self.broker_failures == 0 && self.store_failures == 0
    }
}

/// The run loop's side of [`ConsumerHealth`]: written by the loop, read by probes and by
/// the loop's own backoff ([`pause`](Self::pause)). For the broker crates.
#[derive(Debug)]
pub struct HealthState {
    since: Instant,
    running: AtomicBool,
    /// Milliseconds since `since`, plus one (0: never).
    last_round: AtomicU64,
    last_broker_answer: AtomicU64,
    broker_failures: AtomicU32,
    /// Readers (see [`reader`](HealthState::reader)) whose last read failed. Changed
    /// under its lock together with `broker_failures`, so that the last failing reader's
    /// answer cannot reset a count another reader's first failure just raised.
    failing_readers: Mutex<u32>,
    store_failures: AtomicU32,
    last_error: Mutex<Option<String>>,
}

impl Default for HealthState {
    fn default() -> Self {
        Self {
            since: Instant::now(),
            running: AtomicBool::new(false),
            last_round: AtomicU64::new(0),
            last_broker_answer: AtomicU64::new(0),
            broker_failures: AtomicU32::new(0),
            failing_readers: Mutex::new(0),
            store_failures: AtomicU32::new(0),
            last_error: Mutex::new(None),
        }
    }
}

/// The text a failed message or batch leaves when its caller has no reason to give.
const STORE_OUTAGE: &str = "the idempotency store or an acknowledgement failed (see the logs)";

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

    /// The state now, for probes.
    pub fn snapshot(&self, stall_limit: Duration) -> ConsumerHealth {
        ConsumerHealth {
            running: self.running.load(Ordering::Relaxed),
            last_round: self.age(&self.last_round),
            last_broker_answer: self.age(&self.last_broker_answer),
            broker_failures: self.broker_failures.load(Ordering::Relaxed),
            store_failures: self.store_failures.load(Ordering::Relaxed),
            last_error: self.error().clone(),
            stall_limit,
        }
    }

    /// A run starts (its failures in a row start from none) or ends.
    pub fn set_running(&self, running: bool) {
        self.running.store(running, Ordering::Relaxed);
        if running {
            self.broker_failures.store(0, Ordering::Relaxed);
            self.store_failures.store(0, Ordering::Relaxed);
            self.clear_error();
            self.round();
        }
    }

    /// The pause before the loop's next round, after failures. Each kind of failure in a
    /// row is reset by its own success, so a success of one kind (a claim that works) can
    /// never hide that the other recovered, nor keep the loop pausing after the broker
    /// answers again.
    pub fn pause(&self, backoff: &OutageBackoff) -> Option<Duration> {
        let failures = self
            .broker_failures
            .load(Ordering::Relaxed)
            .max(self.store_failures.load(Ordering::Relaxed));
        (failures > 0).then(|| backoff.pause(failures))
    }

    /// The loop begins a round.
    pub fn round(&self) {
        self.last_round.store(self.now(), Ordering::Relaxed);
    }

    /// The broker answered a read.
    pub fn broker_answered(&self) {
        self.last_broker_answer.store(self.now(), Ordering::Relaxed);
        self.broker_failures.store(0, Ordering::Relaxed);
        self.clear_error();
    }

    /// A read failed; returns the failures in a row.
    pub fn broker_failed(&self, error: &dyn std::fmt::Display) -> u32 {
        self.note_error(error);
        self.broker_failures.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// One of several read loops sharing this state (each reads its own stream or
    /// partition): the broker's failures count until every reader answers again, so one
    /// reader's answers do not make the consumer look ready while another keeps
    /// failing. A loop that is the only reader may use
    /// [`broker_answered`](Self::broker_answered) and
    /// [`broker_failed`](Self::broker_failed) directly.
    pub fn reader(&self) -> ReaderHealth<'_> {
        ReaderHealth {
            state: self,
            failures: 0,
        }
    }

    fn failing_readers(&self) -> std::sync::MutexGuard<'_, u32> {
        self.failing_readers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A message or batch ended: `outage` says whether the store (or an ack) failed.
    pub fn work_ended(&self, outage: bool) {
        if outage {
            self.store_failed(&STORE_OUTAGE);
        } else {
            self.store_answered();
        }
    }

    /// A message's work reached the store (applied, a duplicate, or a handler's error).
    pub fn store_answered(&self) {
        if self.store_failures.swap(0, Ordering::Relaxed) > 0 {
            self.clear_error();
        }
    }

    /// A message's work met an outage of the store; returns the outages in a row.
    pub fn store_failed(&self, error: &dyn std::fmt::Display) -> u32 {
        self.note_error(error);
        self.store_failures.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn error(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.last_error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn note_error(&self, error: &dyn std::fmt::Display) {
        *self.error() = Some(error.to_string());
    }

    fn clear_error(&self) {
        if self.broker_failures.load(Ordering::Relaxed) == 0
            && self.store_failures.load(Ordering::Relaxed) == 0
        {
            *self.error() = None;
        }
    }
}

/// One read loop's side of a [`HealthState`] shared by several
/// ([`HealthState::reader`]). Dropping it (its loop ended) stops counting it as failing.
#[derive(Debug)]
pub struct ReaderHealth<'a> {
    state: &'a HealthState,
    /// This reader's reads that failed in a row.
    failures: u32,
}

impl ReaderHealth<'_> {
    /// This reader's read was answered. The consumer's broker failures are reset only
    /// when no other reader is failing.
    pub fn answered(&mut self) {
        let state = self.state;
        state
            .last_broker_answer
            .store(state.now(), Ordering::Relaxed);
        if self.failures > 0 {
            self.failures = 0;
            self.stop_failing();
        }
    }

    /// This reader's read failed; returns its failures in a row.
    pub fn failed(&mut self, error: &dyn std::fmt::Display) -> u32 {
        let state = self.state;
        state.note_error(error);
        // A first failure counts this reader as failing under the lock; a later one
        // needs none (while it is counted, no other reader's answer resets the count).
        let counting = (self.failures == 0).then(|| {
            let mut failing = state.failing_readers();
            *failing += 1;
            failing
        });
        state.broker_failures.fetch_add(1, Ordering::Relaxed);
        drop(counting);
        self.failures += 1;
        self.failures
    }

    fn stop_failing(&self) {
        let state = self.state;
        let mut failing = state.failing_readers();
        *failing = failing.saturating_sub(1);
        if *failing == 0 {
            state.broker_failures.store(0, Ordering::Relaxed);
            drop(failing);
            state.clear_error();
        }
    }
}

impl Drop for ReaderHealth<'_> {
    fn drop(&mut self) {
        if self.failures > 0 {
            self.stop_failing();
        }
    }
}

/// `/healthz` (liveness) and `/readyz` (readiness) from `probe`, as an axum
/// [`Router`](axum::Router): the body of each broker crate's `health_router`. Each
/// answers `200` or `503` with the [`ConsumerHealth`] as JSON.
#[cfg(feature = "http")]
pub fn health_router<P>(broker: &'static str, probe: P) -> axum::Router
where
    P: Fn() -> ConsumerHealth + Clone + Send + Sync + 'static,
{
    use axum::routing::get;
    let ready = probe.clone();
    axum::Router::new()
        .route(
            "/healthz",
            get(move || {
                let health = probe();
                async move { respond(broker, health.is_live(), &health) }
            }),
        )
        .route(
            "/readyz",
            get(move || {
                let health = ready();
                async move { respond(broker, health.is_ready(), &health) }
            }),
        )
}

#[cfg(feature = "http")]
fn respond(
    broker: &str,
    ok: bool,
    health: &ConsumerHealth,
) -> impl axum::response::IntoResponse + use<> {
    use axum::http::{StatusCode, header};
    let ms = |d: Option<Duration>| d.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let body = serde_json::json!({
        "ok": ok,
        "broker": broker,
        "running": health.running,
        "last_round_ms_ago": ms(health.last_round),
        "last_broker_answer_ms_ago": ms(health.last_broker_answer),
        "broker_failures": health.broker_failures,
        "store_failures": health.store_failures,
        "last_error": health.last_error,
    });
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
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
        assert_eq!(h.last_broker_answer, None);
    }

    #[test]
    fn an_outage_makes_it_unready_but_live_and_an_answer_ready_again() {
        let state = HealthState::default();
        state.set_running(true);
        state.broker_answered();
        assert!(health(&state).is_ready());
        assert_eq!(state.broker_failed(&"connection refused"), 1);
        let h = health(&state);
        assert!(h.is_live() && !h.is_ready());
        assert_eq!(h.last_error.as_deref(), Some("connection refused"));
        state.broker_answered();
        let h = health(&state);
        assert!(h.is_ready(), "{h:?}");
        assert_eq!(h.last_error, None);
        state.work_ended(true);
        assert!(!health(&state).is_ready());
        state.work_ended(false);
        assert!(health(&state).is_ready());
    }

    #[test]
    fn a_store_outage_keeps_its_reason_until_the_store_answers() {
        let state = HealthState::default();
        state.set_running(true);
        assert_eq!(state.store_failed(&"pool timed out"), 1);
        assert_eq!(state.store_failed(&"pool timed out"), 2);
        state.broker_answered();
        let h = health(&state);
        assert!(!h.is_ready());
        assert_eq!(h.last_error.as_deref(), Some("pool timed out"));
        state.store_answered();
        let h = health(&state);
        assert!(h.is_ready() && h.last_error.is_none(), "{h:?}");
    }

    #[test]
    fn one_reader_failing_keeps_the_consumer_unready_while_another_answers() {
        let state = HealthState::default();
        state.set_running(true);
        let (mut failing, mut answering) = (state.reader(), state.reader());
        answering.answered();
        assert!(health(&state).is_ready());
        assert_eq!(failing.failed(&"no responders"), 1);
        answering.answered();
        let h = health(&state);
        assert!(h.is_live() && !h.is_ready(), "{h:?}");
        assert_eq!(h.last_error.as_deref(), Some("no responders"));
        assert_eq!(failing.failed(&"no responders"), 2);
        answering.answered();
        assert!(!health(&state).is_ready());
        failing.answered();
        let h = health(&state);
        assert!(h.is_ready() && h.last_error.is_none(), "{h:?}");
        assert_eq!(failing.failed(&"no responders"), 1);
        drop(failing);
        assert!(
            health(&state).is_ready(),
            "a reader that ended no longer counts"
        );
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
}
