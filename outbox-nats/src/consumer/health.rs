//! What a running consumer reports: counts ([`ConsumerStats`]) and its state for
//! probes ([`ConsumerHealth`], outbox-core's, the same for every broker).

use std::sync::atomic::{AtomicU64, Ordering};

pub(crate) use outbox_core::__private::consumer::HealthState;
pub use outbox_core::ConsumerHealth;

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
