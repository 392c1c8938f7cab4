//! What a consumer did: counts, also metrics.

use std::sync::atomic::{AtomicU64, Ordering};

use super::ConsumerStore;

use super::Consumer;

/// Counts of what a [`Consumer`] did since it was built. Each count is also a metric.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Messages whose handler ran and committed (`outbox_consumer_consumed_total`).
    pub consumed: u64,
    /// Messages recognised as already applied and acked without running the handler
    /// (`outbox_consumer_duplicates_total`).
    pub duplicates: u64,
    /// Failed attempts: handler errors and panics, and store outages
    /// (`outbox_consumer_failures_total`).
    pub failures: u64,
    /// Entries copied to a dead-letter stream (`outbox_consumer_dead_lettered_total`).
    pub dead_lettered: u64,
    /// Entries of unhandled types acked without processing, when
    /// [`ignore_unknown_types`](crate::ConsumerConfig::ignore_unknown_types) is set
    /// (`outbox_consumer_ignored_total`).
    pub ignored: u64,
    /// Entries a redrive put back for another group, acknowledged without running a
    /// handler or asking the inbox (`outbox_consumer_redrives_for_others_total`; see
    /// [`REDRIVE_GROUP_FIELD`](crate::REDRIVE_GROUP_FIELD)).
    pub redrives_for_others: u64,
    /// Entries taken over with `XAUTOCLAIM` (`outbox_consumer_reclaimed_total`).
    pub reclaimed: u64,
    /// Transactions that met a transient conflict (deadlock, serialization failure,
    /// lock wait timeout) and ran again (`outbox_consumer_conflicts_total`). A few
    /// immediate runs again do not count as deliveries; a conflict that persists
    /// through them is a failed delivery.
    pub conflicts: u64,
    /// Failed reads, claims and acks: Redis errors the runner backed off from
    /// (`outbox_consumer_redis_errors_total`).
    pub redis_errors: u64,
}

/// The counts behind [`ConsumerStats`], shared by the run's tasks.
#[derive(Default)]
pub(super) struct Counters {
    consumed: AtomicU64,
    duplicates: AtomicU64,
    failures: AtomicU64,
    dead_lettered: AtomicU64,
    ignored: AtomicU64,
    redrives_for_others: AtomicU64,
    reclaimed: AtomicU64,
    conflicts: AtomicU64,
    redis_errors: AtomicU64,
}

/// What [`Consumer::count`] counts.
#[derive(Clone, Copy)]
pub(super) enum Count {
    Consumed,
    Duplicate,
    Failure,
    DeadLettered,
    Ignored,
    RedriveForOthers,
    Reclaimed,
    Conflict,
    RedisError,
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// What this consumer has done so far.
    pub fn stats(&self) -> ConsumerStats {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerStats {
            consumed: get(&c.consumed),
            duplicates: get(&c.duplicates),
            failures: get(&c.failures),
            dead_lettered: get(&c.dead_lettered),
            ignored: get(&c.ignored),
            redrives_for_others: get(&c.redrives_for_others),
            reclaimed: get(&c.reclaimed),
            conflicts: get(&c.conflicts),
            redis_errors: get(&c.redis_errors),
        }
    }

    /// Adds one to `what`, and to its metric (labelled by `stream`, if given).
    pub(super) fn count(&self, what: Count, stream: Option<&str>) {
        let c = &self.inner.counters;
        let (atomic, name) = match what {
            Count::Consumed => (&c.consumed, "outbox_consumer_consumed_total"),
            Count::Duplicate => (&c.duplicates, "outbox_consumer_duplicates_total"),
            Count::Failure => (&c.failures, "outbox_consumer_failures_total"),
            Count::DeadLettered => (&c.dead_lettered, "outbox_consumer_dead_lettered_total"),
            Count::Ignored => (&c.ignored, "outbox_consumer_ignored_total"),
            Count::RedriveForOthers => (
                &c.redrives_for_others,
                "outbox_consumer_redrives_for_others_total",
            ),
            Count::Reclaimed => (&c.reclaimed, "outbox_consumer_reclaimed_total"),
            Count::Conflict => (&c.conflicts, "outbox_consumer_conflicts_total"),
            Count::RedisError => (&c.redis_errors, "outbox_consumer_redis_errors_total"),
        };
        atomic.fetch_add(1, Ordering::Relaxed);
        let group = self.inner.group.clone();
        match stream {
            Some(stream) => {
                metrics::counter!(name, "group" => group, "stream" => stream.to_owned())
                    .increment(1);
            }
            None => metrics::counter!(name, "group" => group).increment(1),
        }
    }
}
