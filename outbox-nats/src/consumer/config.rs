//! The consumer's configuration.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_core::{InvalidConfig, OutageBackoff, Partitions};

use crate::{Naming, StreamSettings};

/// Where a new consumer group starts reading a stream. A group that exists keeps its
/// position.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum StartFrom {
    /// Every message the stream holds (the default): a group added later still gets
    /// the messages published before it.
    #[default]
    Beginning,
    /// Only messages published after the group is created.
    New,
}

/// The configuration of a [`Consumer`](crate::Consumer). Start from `Default` and
/// change fields with the `with_*` setters, each of which keeps the others;
/// [`validate`](Self::validate) checks it in one place (the builder calls it).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ConsumerConfig {
    /// The subject and stream prefixes: the publisher's.
    pub naming: Naming,
    /// Partition counts by topic, overriding those the handled event types declare
    /// (`#[outbox(partitions = N)]`): the stream of a partitioned topic is created over
    /// its partition subjects. Must match the publisher's.
    pub partitions: BTreeMap<String, Partitions>,
    /// The settings of the streams created by the consumer when it starts before any
    /// publisher, and checked on those that exist.
    pub streams: StreamSettings,
    /// Where a new group starts. Default [`StartFrom::Beginning`].
    pub start_from: StartFrom,
    /// Messages asked for per pull. Default 100.
    pub fetch_count: usize,
    /// How long a pull waits for messages when there are none. Default one second:
    /// also how long shutdown waits for a pull in progress.
    pub fetch_wait: Duration,
    /// Messages handled at once in single mode (each its own transaction). Default 16.
    pub max_in_flight: usize,
    /// Batch mode: up to this many messages of one pull in one store transaction (a
    /// savepoint each, with a store that has them). `None` (the default): single mode.
    pub batch_size: Option<usize>,
    /// How long the server waits for an acknowledgement before it delivers a message
    /// again (to this or another process of the group). Longer than the slowest
    /// handler's transaction. Default 30 seconds. A durable consumer of the group that
    /// exists with another value is refused
    /// ([`Error::ConsumerMismatch`](crate::Error::ConsumerMismatch)).
    pub ack_wait: Duration,
    /// Deliveries of a message whose handler fails before it is dead-lettered with the
    /// last failure as its reason. Deliveries that met an outage of the store are not
    /// counted. Default 5.
    pub max_deliveries: u64,
    /// The delay before the first redelivery of a message whose handler failed; it
    /// doubles with each further failure, up to [`nak_max_delay`](Self::nak_max_delay).
    /// Default one second.
    pub nak_delay: Duration,
    /// The longest redelivery delay. Default one minute.
    pub nak_max_delay: Duration,
    /// Acknowledge messages of types no handler takes (another service's) instead of
    /// dead-lettering them. Default `false`.
    pub ignore_unknown_types: bool,
    /// How the consumer backs off while NATS or the store is unavailable.
    pub outage_backoff: OutageBackoff,
    /// How long shutdown waits for the messages in hand. Default 30 seconds.
    pub shutdown_timeout: Duration,
    /// Ordered mode: the messages of each partition subject (of an unpartitioned
    /// topic: of its subject) handled one at a time, in stream order, across every
    /// process of the group, so that the messages of one key reach the handler in the
    /// order they were published. Each partition gets a durable consumer of its own,
    /// `<group>~p<partition>`, that lets one message at a time be in hand (see
    /// [Ordered mode](crate::Consumer#ordered-mode)). Default `false`.
    pub ordered: bool,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            naming: Naming::default(),
            partitions: BTreeMap::new(),
            streams: StreamSettings::default(),
            start_from: StartFrom::Beginning,
            fetch_count: 100,
            fetch_wait: Duration::from_secs(1),
            max_in_flight: 16,
            batch_size: None,
            ack_wait: Duration::from_secs(30),
            max_deliveries: 5,
            nak_delay: Duration::from_secs(1),
            nak_max_delay: Duration::from_secs(60),
            ignore_unknown_types: false,
            outage_backoff: OutageBackoff::default(),
            shutdown_timeout: Duration::from_secs(30),
            ordered: false,
        }
    }
}

impl ConsumerConfig {
    /// With these prefixes.
    pub fn with_naming(mut self, naming: Naming) -> Self {
        self.naming = naming;
        self
    }

    /// With `topic` spread over `partitions`.
    pub fn with_partitions(mut self, topic: impl Into<String>, partitions: Partitions) -> Self {
        self.partitions.insert(topic.into(), partitions);
        self
    }

    /// With these stream settings.
    pub fn with_streams(mut self, streams: StreamSettings) -> Self {
        self.streams = streams;
        self
    }

    /// Starting a new group there.
    pub fn with_start_from(mut self, start_from: StartFrom) -> Self {
        self.start_from = start_from;
        self
    }

    /// With this many messages per pull.
    pub fn with_fetch_count(mut self, n: usize) -> Self {
        self.fetch_count = n;
        self
    }

    /// With pulls that wait this long.
    pub fn with_fetch_wait(mut self, wait: Duration) -> Self {
        self.fetch_wait = wait;
        self
    }

    /// With this many messages in hand at once in single mode.
    pub fn with_max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// In batch mode, up to `n` messages per transaction.
    pub fn with_batch_size(mut self, n: usize) -> Self {
        self.batch_size = Some(n);
        self
    }

    /// With this acknowledgement wait.
    pub fn with_ack_wait(mut self, wait: Duration) -> Self {
        self.ack_wait = wait;
        self
    }

    /// Dead-lettering after `n` failed deliveries.
    pub fn with_max_deliveries(mut self, n: u64) -> Self {
        self.max_deliveries = n;
        self
    }

    /// With these redelivery delays after a failed handler: the first, and the longest.
    pub fn with_nak_delays(mut self, first: Duration, max: Duration) -> Self {
        self.nak_delay = first;
        self.nak_max_delay = max;
        self
    }

    /// Acknowledging (`true`) or dead-lettering messages of unknown types.
    pub fn with_ignore_unknown_types(mut self, ignore: bool) -> Self {
        self.ignore_unknown_types = ignore;
        self
    }

    /// With this outage backoff.
    pub fn with_outage_backoff(mut self, backoff: OutageBackoff) -> Self {
        self.outage_backoff = backoff;
        self
    }

    /// With this shutdown timeout.
    pub fn with_shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// In ordered mode (`true`) or not; see [`ordered`](Self::ordered).
    pub fn with_ordered(mut self, ordered: bool) -> Self {
        self.ordered = ordered;
        self
    }

    /// Checks every field: counts above zero, `nak_delay <= nak_max_delay`, an
    /// `ack_wait` of at least a second, every duration at most a day (as the Redis
    /// consumer's: a century would overflow the clock where a wait is added to it), the
    /// outage backoff, the naming and the stream settings.
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        self.naming.validate()?;
        self.streams.validate()?;
        let positive = [
            ("fetch_count", self.fetch_count),
            ("max_in_flight", self.max_in_flight),
            ("batch_size", self.batch_size.unwrap_or(1)),
            (
                "max_deliveries",
                usize::try_from(self.max_deliveries).unwrap_or(1),
            ),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, n)| *n == 0) {
            return Err(InvalidConfig::new(*field, "must be at least 1"));
        }
        if self.fetch_wait < Duration::from_millis(10) {
            return Err(InvalidConfig::new("fetch_wait", "must be at least 10 ms"));
        }
        if self.ack_wait < Duration::from_secs(1) {
            return Err(InvalidConfig::new(
                "ack_wait",
                "must be at least one second",
            ));
        }
        const DAY: Duration = Duration::from_secs(24 * 3600);
        for (field, duration) in [
            ("fetch_wait", self.fetch_wait),
            ("ack_wait", self.ack_wait),
            ("nak_max_delay", self.nak_max_delay),
            ("shutdown_timeout", self.shutdown_timeout),
        ] {
            if duration > DAY {
                return Err(InvalidConfig::new(field, "must be at most a day"));
            }
        }
        self.outage_backoff
            .validate()
            .map_err(|e| e.in_field("outage_backoff"))?;
        if self.nak_delay > self.nak_max_delay {
            return Err(InvalidConfig::new(
                "nak_delay",
                format!("must not exceed nak_max_delay ({:?})", self.nak_max_delay),
            ));
        }
        Ok(())
    }

    /// The redelivery delay after the `failures`-th failed delivery.
    pub(crate) fn nak_delay_after(&self, failures: u64) -> Duration {
        let exp = u32::try_from(failures.saturating_sub(1).min(30)).unwrap_or(30);
        self.nak_delay
            .saturating_mul(1 << exp)
            .min(self.nak_max_delay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nak_delays_double_up_to_the_cap() {
        let c = ConsumerConfig::default()
            .with_nak_delays(Duration::from_millis(100), Duration::from_millis(500));
        let got: Vec<u128> = (1..=5).map(|n| c.nak_delay_after(n).as_millis()).collect();
        assert_eq!(got, [100, 200, 400, 500, 500]);
    }

    #[test]
    fn zero_counts_are_refused_with_their_field() {
        let c = ConsumerConfig::default().with_batch_size(0);
        assert_eq!(c.validate().unwrap_err().field(), "batch_size");
        let c = ConsumerConfig::default().with_max_deliveries(0);
        assert_eq!(c.validate().unwrap_err().field(), "max_deliveries");
        assert!(ConsumerConfig::default().validate().is_ok());
    }

    #[test]
    fn durations_past_a_day_and_a_backwards_backoff_are_refused() {
        for (c, field) in [
            (
                ConsumerConfig::default().with_fetch_wait(Duration::MAX),
                "fetch_wait",
            ),
            (
                ConsumerConfig::default().with_ack_wait(Duration::MAX),
                "ack_wait",
            ),
            (
                ConsumerConfig::default().with_shutdown_timeout(Duration::MAX),
                "shutdown_timeout",
            ),
            (
                ConsumerConfig::default().with_nak_delays(Duration::MAX, Duration::MAX),
                "nak_max_delay",
            ),
            (
                ConsumerConfig::default().with_outage_backoff(
                    OutageBackoff::default()
                        .with_min(Duration::from_secs(9))
                        .with_max(Duration::from_secs(1)),
                ),
                "outage_backoff.min",
            ),
        ] {
            assert_eq!(c.validate().unwrap_err().field(), field);
        }
    }
}
