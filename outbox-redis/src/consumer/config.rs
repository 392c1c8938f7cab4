//! Consumer settings.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_core::{InvalidConfig, OutageBackoff, Partitions};

use crate::publisher::DEFAULT_STREAM_PREFIX;

/// Where a newly created consumer group starts reading.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StartFrom {
    /// From the first entry still in the stream (`0`): nothing published before the
    /// group's first start is lost. The default.
    #[default]
    Beginning,
    /// From entries added after the group is created (`$`).
    End,
}

/// Consumer settings; `Default` gives the values documented on each field. Each
/// `with_*` setter changes one field and keeps the others; [`validate`](Self::validate)
/// checks the whole, and [`ConsumerBuilder::build`](crate::ConsumerBuilder::build) calls it.
/// The builder takes the config whole, with
/// [`with_config`](crate::ConsumerBuilder::with_config): it has no setter of its own
/// for any of these fields.
///
/// ```
/// use std::time::Duration;
/// use outbox_redis::ConsumerConfig;
///
/// let config = ConsumerConfig::default()
///     .with_consumer_name("points-1")
///     .with_batch_size(100)
///     .with_min_idle(Duration::from_secs(60));
/// assert_eq!(config.batch_size, Some(100));
/// assert_eq!(config.consumer_name.as_deref(), Some("points-1"));
/// assert!(config.validate().is_ok());
///
/// let err = config.with_read_count(0).validate().unwrap_err();
/// assert_eq!(err.field(), "read_count");
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ConsumerConfig {
    /// Prepended to each topic to name its stream (default `outbox:`, as the publisher's).
    /// On a cluster the topic is then wrapped in braces (`outbox:{order.paid}`), and the
    /// prefix must not contain `{` or `}`.
    pub stream_prefix: String,
    /// This process's consumer name within the group (default `None`: a name unique per
    /// process, `<hostname>-<pid>-<random>`). Set it only to something unique per process.
    pub consumer_name: Option<String>,
    /// Where a group that does not exist yet starts (default [`StartFrom::Beginning`]).
    pub start_from: StartFrom,
    /// How long one `XREADGROUP ... BLOCK` waits for new entries (default 2 s). The read
    /// connection's response timeout is this plus [`response_timeout`](Self::response_timeout),
    /// so blocking reads are never cut short by the client.
    pub block: Duration,
    /// Most entries read per stream and call (default 64). In batch mode a read takes up
    /// to [`batch_size`](Self::batch_size) entries per free batch instead.
    pub read_count: usize,
    /// Most messages processed at once (default 16; with a database inbox, at most the
    /// pool's size is useful), batches in batch mode; as many again are read ahead. See
    /// [threads](crate::Consumer#threads).
    pub max_in_flight: usize,
    /// Opt-in [batch mode](crate::Consumer#batch-mode) (default `None`: one transaction
    /// per message): at most `n` messages per transaction, a savepoint each. `Some(100)`
    /// is a good start; a larger batch holds its transaction's locks longer.
    pub batch_size: Option<usize>,
    /// How long an entry stays unacknowledged before it is claimed again and retried
    /// (default 30 s). This is also how long a crashed consumer's entries wait. Keep it
    /// well above the slowest handler.
    pub min_idle: Duration,
    /// How often pending entries are looked for with `XAUTOCLAIM` (default 5 s); at
    /// most once per read, so a long [`block`](Self::block) spaces claims out too.
    pub claim_interval: Duration,
    /// Deliveries after which a failing message is dead-lettered (default 5); an entry
    /// claimed with a higher count (its consumers crashed while handling it) is
    /// dead-lettered without running the handler again.
    pub max_deliveries: u64,
    /// Appended to a stream's name to name its dead-letter stream (default `:dead`).
    pub dead_letter_suffix: String,
    /// Most entries a dead-letter stream keeps (default `Some(100_000)`), an exact
    /// `MAXLEN` on each dead-letter `XADD`; `None` keeps every one. At least 1.
    pub dead_letter_max_len: Option<usize>,
    /// Acknowledge and count entries whose event type has no handler, instead of
    /// dead-lettering them (default `false`). Useful when several consumer groups share
    /// a topic and each handles only some of its types.
    pub ignore_unknown_types: bool,
    /// How long opening a connection may take (default 2 s).
    pub connect_timeout: Duration,
    /// Response timeout of every command except the blocking read (default 5 s).
    pub response_timeout: Duration,
    /// Opt-in periodic [`trim_acknowledged`](crate::Consumer::trim_acknowledged) of this
    /// consumer's streams (default `None`); a failed trim is logged and counted, never
    /// fatal. `outbox trim` does the same from outside.
    pub trim_interval: Option<Duration>,
    /// Partition counts that override what the handled event types declare
    /// ([`OutboxEvent::PARTITIONS`](outbox_core::OutboxEvent::PARTITIONS)); must match
    /// the publisher's. Set with [`with_partitions`](Self::with_partitions).
    pub partitions: BTreeMap<String, Partitions>,
    /// Opt-in [ordered mode](crate::Consumer#partitioned-topics-and-ordered-mode)
    /// (default `None`): one consumer of the group per stream at a time, the entries of
    /// a key in stream order. See [`OrderedConfig`].
    pub ordered: Option<OrderedConfig>,
    /// Pauses after Redis or the idempotency store fails as a whole.
    pub outage_backoff: OutageBackoff,
    /// How long [`run_until`](crate::Consumer::run_until) waits after its shutdown signal
    /// for the messages in flight (default 20 s); those still running stay pending and
    /// are claimed again after [`min_idle`](Self::min_idle).
    pub shutdown_timeout: Duration,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            stream_prefix: DEFAULT_STREAM_PREFIX.to_owned(),
            consumer_name: None,
            start_from: StartFrom::Beginning,
            block: Duration::from_secs(2),
            read_count: 64,
            max_in_flight: 16,
            batch_size: None,
            min_idle: Duration::from_secs(30),
            claim_interval: Duration::from_secs(5),
            max_deliveries: 5,
            dead_letter_suffix: ":dead".to_owned(),
            dead_letter_max_len: Some(100_000),
            ignore_unknown_types: false,
            connect_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(5),
            trim_interval: None,
            partitions: BTreeMap::new(),
            ordered: None,
            outage_backoff: OutageBackoff::default(),
            shutdown_timeout: Duration::from_secs(20),
        }
    }
}

/// The longest duration a setting may have: deadlines are computed from them, and a day
/// is far beyond any sensible value while it keeps `Instant` arithmetic (and Redis's
/// millisecond arguments) in range.
const DAY: Duration = Duration::from_secs(24 * 3600);

impl ConsumerConfig {
    /// Sets [`stream_prefix`](Self::stream_prefix); it must match the publisher's.
    #[must_use]
    pub fn with_stream_prefix(mut self, stream_prefix: impl Into<String>) -> Self {
        self.stream_prefix = stream_prefix.into();
        self
    }

    /// Sets [`consumer_name`](Self::consumer_name): a name unique per process.
    #[must_use]
    pub fn with_consumer_name(mut self, consumer_name: impl Into<String>) -> Self {
        self.consumer_name = Some(consumer_name.into());
        self
    }

    /// Sets [`start_from`](Self::start_from).
    #[must_use]
    pub fn with_start_from(mut self, start_from: StartFrom) -> Self {
        self.start_from = start_from;
        self
    }

    /// Sets [`block`](Self::block).
    #[must_use]
    pub fn with_block(mut self, block: Duration) -> Self {
        self.block = block;
        self
    }

    /// Sets [`read_count`](Self::read_count).
    #[must_use]
    pub fn with_read_count(mut self, read_count: usize) -> Self {
        self.read_count = read_count;
        self
    }

    /// Sets [`max_in_flight`](Self::max_in_flight).
    #[must_use]
    pub fn with_max_in_flight(mut self, max_in_flight: usize) -> Self {
        self.max_in_flight = max_in_flight;
        self
    }

    /// Sets [`batch_size`](Self::batch_size): a number turns batch mode on, `None` off.
    #[must_use]
    pub fn with_batch_size(mut self, batch_size: impl Into<Option<usize>>) -> Self {
        self.batch_size = batch_size.into();
        self
    }

    /// Sets [`min_idle`](Self::min_idle).
    #[must_use]
    pub fn with_min_idle(mut self, min_idle: Duration) -> Self {
        self.min_idle = min_idle;
        self
    }

    /// Sets [`claim_interval`](Self::claim_interval).
    #[must_use]
    pub fn with_claim_interval(mut self, claim_interval: Duration) -> Self {
        self.claim_interval = claim_interval;
        self
    }

    /// Sets [`max_deliveries`](Self::max_deliveries).
    #[must_use]
    pub fn with_max_deliveries(mut self, max_deliveries: u64) -> Self {
        self.max_deliveries = max_deliveries;
        self
    }

    /// Sets [`dead_letter_suffix`](Self::dead_letter_suffix).
    #[must_use]
    pub fn with_dead_letter_suffix(mut self, dead_letter_suffix: impl Into<String>) -> Self {
        self.dead_letter_suffix = dead_letter_suffix.into();
        self
    }

    /// Sets [`dead_letter_max_len`](Self::dead_letter_max_len): a number, or `None` to
    /// keep every dead letter.
    #[must_use]
    pub fn with_dead_letter_max_len(
        mut self,
        dead_letter_max_len: impl Into<Option<usize>>,
    ) -> Self {
        self.dead_letter_max_len = dead_letter_max_len.into();
        self
    }

    /// Sets [`ignore_unknown_types`](Self::ignore_unknown_types).
    #[must_use]
    pub fn with_ignore_unknown_types(mut self, ignore_unknown_types: bool) -> Self {
        self.ignore_unknown_types = ignore_unknown_types;
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout).
    #[must_use]
    pub fn with_connect_timeout(mut self, connect_timeout: Duration) -> Self {
        self.connect_timeout = connect_timeout;
        self
    }

    /// Sets [`response_timeout`](Self::response_timeout).
    #[must_use]
    pub fn with_response_timeout(mut self, response_timeout: Duration) -> Self {
        self.response_timeout = response_timeout;
        self
    }

    /// Sets [`trim_interval`](Self::trim_interval): an interval turns periodic trimming
    /// on, `None` off.
    #[must_use]
    pub fn with_trim_interval(mut self, trim_interval: impl Into<Option<Duration>>) -> Self {
        self.trim_interval = trim_interval.into();
        self
    }

    /// Sets the partition count of `topic` in [`partitions`](Self::partitions), keeping
    /// the other topics' counts.
    #[must_use]
    pub fn with_partitions(mut self, topic: impl Into<String>, partitions: Partitions) -> Self {
        self.partitions.insert(topic.into(), partitions);
        self
    }

    /// Sets [`ordered`](Self::ordered): `Some(OrderedConfig::default())` turns ordered
    /// mode on, `None` off.
    #[must_use]
    pub fn with_ordered(mut self, ordered: impl Into<Option<OrderedConfig>>) -> Self {
        self.ordered = ordered.into();
        self
    }

    /// Sets [`outage_backoff`](Self::outage_backoff).
    #[must_use]
    pub fn with_outage_backoff(mut self, outage_backoff: OutageBackoff) -> Self {
        self.outage_backoff = outage_backoff;
        self
    }

    /// Sets [`shutdown_timeout`](Self::shutdown_timeout).
    #[must_use]
    pub fn with_shutdown_timeout(mut self, shutdown_timeout: Duration) -> Self {
        self.shutdown_timeout = shutdown_timeout;
        self
    }

    /// Checks every field: `consumer_name` and `dead_letter_suffix` not empty;
    /// `read_count`, `max_in_flight`, `batch_size`, `max_deliveries`,
    /// `dead_letter_max_len` at least 1; `block` and `min_idle` at least 1 ms;
    /// `claim_interval`, `trim_interval`, `connect_timeout` and `response_timeout` not
    /// zero; `block`, `min_idle`, `claim_interval`, `response_timeout`,
    /// `shutdown_timeout` and `trim_interval` at most a day; and
    /// [`OutageBackoff::validate`] (reported as `outage_backoff.min`).
    /// [`ConsumerBuilder::build`](crate::ConsumerBuilder::build) calls it (and checks the
    /// prefix against the deployment: no braces on a cluster).
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        let broken = |field: &str, rule: &str| Err(InvalidConfig::new(field, rule));
        if self.consumer_name.as_deref() == Some("") {
            return broken("consumer_name", "must not be empty");
        }
        if self.block < Duration::from_millis(1) {
            // BLOCK 0 would wait forever and never see a shutdown.
            return broken("block", "must be at least 1 ms");
        }
        for (field, n) in [
            ("read_count", Some(self.read_count)),
            ("max_in_flight", Some(self.max_in_flight)),
            ("batch_size", self.batch_size),
        ] {
            if n == Some(0) {
                return broken(field, "must be at least 1");
            }
        }
        if self.max_deliveries == 0 {
            return broken("max_deliveries", "must be at least 1");
        }
        if self.min_idle < Duration::from_millis(1) {
            return broken("min_idle", "must be at least 1 ms");
        }
        if self.dead_letter_suffix.is_empty() {
            return broken("dead_letter_suffix", "must not be empty");
        }
        if self.dead_letter_max_len == Some(0) {
            return broken(
                "dead_letter_max_len",
                "must be at least 1 (None keeps every dead letter)",
            );
        }
        for (field, interval) in [
            ("claim_interval", Some(self.claim_interval)),
            ("trim_interval", self.trim_interval),
            // A zero timeout would fail every connection or command: an endless outage.
            ("connect_timeout", Some(self.connect_timeout)),
            ("response_timeout", Some(self.response_timeout)),
        ] {
            if interval.is_some_and(|i| i.is_zero()) {
                return broken(field, "must not be zero");
            }
        }
        for (field, duration) in [
            ("block", Some(self.block)),
            ("min_idle", Some(self.min_idle)),
            ("claim_interval", Some(self.claim_interval)),
            ("response_timeout", Some(self.response_timeout)),
            ("shutdown_timeout", Some(self.shutdown_timeout)),
            ("trim_interval", self.trim_interval),
        ] {
            if duration.is_some_and(|d| d > DAY) {
                return broken(field, "must be at most a day");
            }
        }
        if let Some(ordered) = &self.ordered {
            ordered.validate().map_err(|e| e.in_field("ordered"))?;
        }
        self.outage_backoff
            .validate()
            .map_err(|e| e.in_field("outage_backoff"))
    }
}

/// What an ordered consumer does with a key once one of its entries was dead-lettered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum AfterDeadLetter {
    /// The key moves on to its next entry (the default): the dead-lettered entry is
    /// skipped, and an operator may redrive it later (it then comes after the key's
    /// later entries).
    #[default]
    MoveOn,
    /// The key stays blocked: its later entries wait, pending, until an operator
    /// removes the key from the partition's hash of blocked keys
    /// (`HDEL <stream>:blocked:<group> <key>`, or [`unblock_key`](crate::unblock_key));
    /// [`blocked_keys`](crate::blocked_keys) lists them. A blocked key holds its
    /// entries in memory and, once they fill the read-ahead, holds its whole
    /// partition back.
    Block,
}

/// Settings of ordered mode ([`ConsumerConfig::ordered`]); `Default` gives the values
/// documented on each field.
///
/// Each stream (a partition of a partitioned topic, or an unpartitioned topic's stream)
/// is read only by the consumer holding its lease in Redis (`<stream>:lease:<group>`).
/// A lease lasts [`lease_ttl`](Self::lease_ttl), is renewed every third of it, and a
/// holder that could not renew it in time stops handling the stream's entries at once.
/// The live consumers of the group share the streams evenly (each holds at most
/// `ceil(streams / consumers)`); one that joins, leaves or dies is rebalanced within a
/// few lease periods.
///
/// ```
/// use std::time::Duration;
/// use outbox_redis::{AfterDeadLetter, ConsumerConfig, OrderedConfig};
///
/// let config = ConsumerConfig::default().with_ordered(
///     OrderedConfig::default()
///         .with_lease_ttl(Duration::from_secs(5))
///         .with_after_dead_letter(AfterDeadLetter::Block),
/// );
/// assert!(config.validate().is_ok());
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct OrderedConfig {
    /// How long a lease lasts without renewal (default 10 s): how long the streams of a
    /// consumer that died (or stalled) wait before another consumer takes them over.
    /// Renewed every third of it; at least 300 ms and at most a day.
    pub lease_ttl: Duration,
    /// What happens to a key after one of its entries was dead-lettered (default
    /// [`AfterDeadLetter::MoveOn`]).
    pub after_dead_letter: AfterDeadLetter,
}

impl Default for OrderedConfig {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(10),
            after_dead_letter: AfterDeadLetter::MoveOn,
        }
    }
}

impl OrderedConfig {
    /// Sets [`lease_ttl`](Self::lease_ttl).
    #[must_use]
    pub fn with_lease_ttl(mut self, lease_ttl: Duration) -> Self {
        self.lease_ttl = lease_ttl;
        self
    }

    /// Sets [`after_dead_letter`](Self::after_dead_letter).
    #[must_use]
    pub fn with_after_dead_letter(mut self, after_dead_letter: AfterDeadLetter) -> Self {
        self.after_dead_letter = after_dead_letter;
        self
    }

    /// Checks `lease_ttl`: from 300 ms (a renewal every 100 ms) to a day.
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        if self.lease_ttl < Duration::from_millis(300) || self.lease_ttl > DAY {
            return Err(InvalidConfig::new(
                "lease_ttl",
                "must be between 300 ms and a day",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_valid() {
        assert_eq!(ConsumerConfig::default().validate(), Ok(()));
    }

    #[test]
    fn each_rule_names_its_field() {
        let ok = ConsumerConfig::default;
        let too_long = DAY + Duration::from_millis(1);
        let cases = [
            (ok().with_consumer_name(""), "consumer_name"),
            (ok().with_block(Duration::ZERO), "block"),
            (ok().with_block(Duration::from_micros(999)), "block"),
            (ok().with_block(too_long), "block"),
            (ok().with_read_count(0), "read_count"),
            (ok().with_max_in_flight(0), "max_in_flight"),
            (ok().with_batch_size(0), "batch_size"),
            (ok().with_max_deliveries(0), "max_deliveries"),
            (ok().with_min_idle(Duration::ZERO), "min_idle"),
            (ok().with_min_idle(too_long), "min_idle"),
            (ok().with_claim_interval(Duration::ZERO), "claim_interval"),
            (ok().with_claim_interval(Duration::MAX), "claim_interval"),
            (ok().with_dead_letter_suffix(""), "dead_letter_suffix"),
            (ok().with_dead_letter_max_len(0), "dead_letter_max_len"),
            (ok().with_trim_interval(Duration::ZERO), "trim_interval"),
            (ok().with_trim_interval(too_long), "trim_interval"),
            (ok().with_connect_timeout(Duration::ZERO), "connect_timeout"),
            (
                ok().with_response_timeout(Duration::ZERO),
                "response_timeout",
            ),
            (ok().with_response_timeout(too_long), "response_timeout"),
            (ok().with_shutdown_timeout(too_long), "shutdown_timeout"),
            (
                ok().with_ordered(OrderedConfig::default().with_lease_ttl(Duration::ZERO)),
                "ordered.lease_ttl",
            ),
            (
                ok().with_outage_backoff(
                    OutageBackoff::default()
                        .with_min(Duration::from_secs(10))
                        .with_max(Duration::from_secs(1)),
                ),
                "outage_backoff.min",
            ),
        ];
        for (config, field) in cases {
            let err = config.validate().expect_err(field);
            assert_eq!(err.field(), field, "{err}");
        }
    }

    #[test]
    fn the_bounds_themselves_are_valid() {
        let ok = ConsumerConfig::default;
        for config in [
            ok().with_block(Duration::from_millis(1))
                .with_min_idle(Duration::from_millis(1)),
            ok().with_read_count(1)
                .with_max_in_flight(1)
                .with_batch_size(1),
            ok().with_max_deliveries(1).with_dead_letter_max_len(1),
            ok().with_dead_letter_max_len(None).with_batch_size(None),
            ok().with_shutdown_timeout(Duration::ZERO),
            ok().with_block(DAY)
                .with_min_idle(DAY)
                .with_claim_interval(DAY)
                .with_response_timeout(DAY)
                .with_shutdown_timeout(DAY)
                .with_trim_interval(DAY),
        ] {
            assert_eq!(config.validate(), Ok(()), "{config:?}");
        }
    }

    #[test]
    fn each_setter_keeps_the_other_fields() {
        let config = ConsumerConfig::default()
            .with_stream_prefix("app:")
            .with_consumer_name("c-1")
            .with_start_from(StartFrom::End)
            .with_block(Duration::from_millis(50))
            .with_read_count(7)
            .with_max_in_flight(3)
            .with_batch_size(20)
            .with_min_idle(Duration::from_secs(9))
            .with_claim_interval(Duration::from_secs(2))
            .with_max_deliveries(4)
            .with_dead_letter_suffix(":dlq")
            .with_dead_letter_max_len(None)
            .with_ignore_unknown_types(true)
            .with_connect_timeout(Duration::from_secs(1))
            .with_response_timeout(Duration::from_secs(3))
            .with_trim_interval(Duration::from_secs(60))
            .with_outage_backoff(OutageBackoff::default().with_max(Duration::from_secs(7)))
            .with_shutdown_timeout(Duration::from_secs(11));
        assert_eq!(config.stream_prefix, "app:");
        assert_eq!(config.consumer_name.as_deref(), Some("c-1"));
        assert_eq!(config.start_from, StartFrom::End);
        assert_eq!(config.block, Duration::from_millis(50));
        assert_eq!(config.read_count, 7);
        assert_eq!(config.max_in_flight, 3);
        assert_eq!(config.batch_size, Some(20));
        assert_eq!(config.min_idle, Duration::from_secs(9));
        assert_eq!(config.claim_interval, Duration::from_secs(2));
        assert_eq!(config.max_deliveries, 4);
        assert_eq!(config.dead_letter_suffix, ":dlq");
        assert_eq!(config.dead_letter_max_len, None);
        assert!(config.ignore_unknown_types);
        assert_eq!(config.connect_timeout, Duration::from_secs(1));
        assert_eq!(config.response_timeout, Duration::from_secs(3));
        assert_eq!(config.trim_interval, Some(Duration::from_secs(60)));
        assert_eq!(config.outage_backoff.max, Duration::from_secs(7));
        assert_eq!(config.shutdown_timeout, Duration::from_secs(11));
        assert_eq!(config.validate(), Ok(()));
    }
}
