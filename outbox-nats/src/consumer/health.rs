//! What a running consumer reports: counts ([`ConsumerStats`]) and its state for
//! probes ([`ConsumerHealth`]).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Counts of what a consumer did since it was built ([`Consumer::stats`](crate::Consumer::stats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// Messages applied (their handler's transaction committed).
    pub consumed: u64,
    /// Messages acknowledged as already applied.
    pub duplicates: u64,
    /// Failed attempts (a handler's error or panic, or an outage of the store).
    pub failures: u64,
    /// Messages moved to the dead-letter stream.
    pub dead_lettered: u64,
    /// Messages of types no handler takes, acknowledged
    /// ([`ignore_unknown_types`](crate::ConsumerConfig::ignore_unknown_types)).
    pub ignored: u64,
    /// Redriven messages for another group, acknowledged unapplied.
    pub redrives_for_others: u64,
    /// Failed requests to NATS (pulls, acknowledgements, dead-letter publishes).
    pub nats_errors: u64,
}

/// What one message counts as.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Count {
    Consumed,
    Duplicate,
    Failure,
    DeadLettered,
    Ignored,
    RedriveForOthers,
    NatsError,
}

/// The counters behind [`ConsumerStats`], also sent to the `metrics` facade.
#[derive(Debug, Default)]
pub(crate) struct Counters([AtomicU64; 7]);

impl Counters {
    pub(crate) fn add(&self, what: Count, group: &str, n: u64) {
        self.0[what as usize].fetch_add(n, Ordering::Relaxed);
        let name = match what {
            Count::Consumed => "outbox_consumer_consumed_total",
            Count::Duplicate => "outbox_consumer_duplicates_total",
            Count::Failure => "outbox_consumer_failures_total",
            Count::DeadLettered => "outbox_consumer_dead_lettered_total",
            Count::Ignored => "outbox_consumer_ignored_total",
            Count::RedriveForOthers => "outbox_consumer_redrives_for_others_total",
            Count::NatsError => "outbox_consumer_nats_errors_total",
        };
        metrics::counter!(name, "group" => group.to_owned(), "broker" => "nats").increment(n);
    }

    pub(crate) fn snapshot(&self) -> ConsumerStats {
        let get = |c: Count| self.0[c as usize].load(Ordering::Relaxed);
        ConsumerStats {
            consumed: get(Count::Consumed),
            duplicates: get(Count::Duplicate),
            failures: get(Count::Failure),
            dead_lettered: get(Count::DeadLettered),
            ignored: get(Count::Ignored),
            redrives_for_others: get(Count::RedriveForOthers),
            nats_errors: get(Count::NatsError),
        }
    }
}

/// A snapshot of a consumer's state for liveness and readiness probes
/// ([`Consumer::health`](crate::Consumer::health)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerHealth {
    /// [`run_until`](crate::Consumer::run_until) is running and its streams and durable
    /// consumers exist.
    pub running: bool,
    /// How long ago a reader last began a pull (`None`: never).
    pub last_round: Option<Duration>,
    /// Pulls that failed in a row since NATS last answered one.
    pub nats_failures: u32,
    /// Messages in a row that met an outage of the idempotency store.
    pub store_failures: u32,
    /// The last failure's text, while the consumer is failing.
    pub last_error: Option<String>,
    /// How long a reader may go without a pull before [`is_live`](Self::is_live) says
    /// no.
    pub stall_limit: Duration,
}

impl ConsumerHealth {
    /// Liveness: the run loop turns (began a pull within
    /// [`stall_limit`](Self::stall_limit)). Outages do not make a consumer dead: it
    /// backs off and recovers by itself.
    pub fn is_live(&self) -> bool {
        self.running && self.last_round.is_some_and(|age| age <= self.stall_limit)
    }

    /// Readiness: live, the last pull succeeded, and no message is failing on a store
    /// outage.
    pub fn is_ready(&self) -> bool {
        self.is_live() && self.nats_failures == 0 && self.store_failures == 0
    }
}

/// The run loop's side of [`ConsumerHealth`].
#[derive(Debug)]
pub(crate) struct HealthState {
    since: Instant,
    pub(crate) running: AtomicBool,
    /// Milliseconds since `since`, plus one (0: never).
    last_round: AtomicU64,
    nats_failures: AtomicU32,
    store_failures: AtomicU32,
    last_error: Mutex<Option<String>>,
}

impl Default for HealthState {
    fn default() -> Self {
        Self {
            since: Instant::now(),
            running: AtomicBool::new(false),
            last_round: AtomicU64::new(0),
            nats_failures: AtomicU32::new(0),
            store_failures: AtomicU32::new(0),
            last_error: Mutex::new(None),
        }
    }
}

impl HealthState {
    pub(crate) fn round(&self) {
        let ms = u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_round
            .store(ms.saturating_add(1), Ordering::Relaxed);
    }

    /// A pull answered (`None`) or failed; returns the failures in a row.
    pub(crate) fn nats(&self, error: Option<String>) -> u32 {
        match error {
            None => {
                self.nats_failures.store(0, Ordering::Relaxed);
                self.clear_error();
                0
            }
            Some(e) => {
                *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                self.nats_failures.fetch_add(1, Ordering::Relaxed) + 1
            }
        }
    }

    /// A message's store run ended in an outage (`Some`) or not; returns the outages in
    /// a row.
    pub(crate) fn store(&self, outage: Option<String>) -> u32 {
        match outage {
            None => {
                self.store_failures.store(0, Ordering::Relaxed);
                0
            }
            Some(e) => {
                *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                self.store_failures.fetch_add(1, Ordering::Relaxed) + 1
            }
        }
    }

    fn clear_error(&self) {
        if self.store_failures.load(Ordering::Relaxed) == 0 {
            *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
    }

    pub(crate) fn snapshot(&self, stall_limit: Duration) -> ConsumerHealth {
        let last = self.last_round.load(Ordering::Relaxed);
        let now = self.since.elapsed();
        ConsumerHealth {
            running: self.running.load(Ordering::Relaxed),
            last_round: (last > 0).then(|| now.saturating_sub(Duration::from_millis(last - 1))),
            nats_failures: self.nats_failures.load(Ordering::Relaxed),
            store_failures: self.store_failures.load(Ordering::Relaxed),
            last_error: self
                .last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            stall_limit,
        }
    }
}
