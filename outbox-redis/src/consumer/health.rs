//! What a running consumer reports to its service's probes: [`Consumer::health`]. The
//! state and its rules are outbox-core's, the same for every broker.

use std::time::Duration;

pub(super) use outbox_core::__private::consumer::HealthState;
pub use outbox_core::ConsumerHealth;

use super::ConsumerStore;
use super::{Consumer, ConsumerConfig};

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

    #[test]
    fn the_stall_limit_covers_a_blocking_read_a_backoff_and_a_slow_message() {
        let config = ConsumerConfig::default();
        let limit = stall_limit(&config);
        assert!(limit > config.block + config.response_timeout);
        assert!(limit > config.outage_backoff.max);
        assert!(limit > config.min_idle);
    }
}
