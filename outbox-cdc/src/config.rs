//! The relay's settings.

use std::time::Duration;

use outbox_core::{InvalidConfig, OutageBackoff, RetryPolicy};

/// The default slot and publication name: `outbox_cdc`.
pub const DEFAULT_SLOT: &str = "outbox_cdc";

/// Settings of [`setup`](crate::setup) and [`CdcRelay`](crate::CdcRelay). `Default`
/// gives the slot and publication `outbox_cdc`, publish calls of up to 500 messages, the
/// default [`RetryPolicy`] and [`OutageBackoff`], and a takeover of a silent slot holder
/// after 10 s; each `with_*` setter changes one field and keeps the others.
///
/// ```
/// use std::time::Duration;
/// use outbox_cdc::CdcConfig;
///
/// let config = CdcConfig::default().with_takeover_after(Duration::from_secs(5));
/// assert_eq!(config.slot, "outbox_cdc");
/// assert!(config.validate().is_ok());
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct CdcConfig {
    /// The logical replication slot (default `outbox_cdc`). One slot per outbox: the
    /// relays of one outbox share it, one reading at a time.
    pub slot: String,
    /// The publication of the `outbox` table's inserts (default `outbox_cdc`).
    pub publication: String,
    /// Most messages per publish call (default 500). Several commits go into one call;
    /// a commit larger than this is published in several calls, and confirmed after
    /// the last.
    pub batch_size: usize,
    /// Retries of messages the broker refuses on their own.
    pub retry: RetryPolicy,
    /// Pauses while the broker, the database or the replication connection is down.
    pub outage_backoff: OutageBackoff,
    /// How often the relay reports its position to the server while it has news
    /// (default 1 s), and the longest silence of an idle stream: the heartbeat by which
    /// a waiting relay knows the holder is alive (`pg_stat_replication.reply_time`).
    pub status_interval: Duration,
    /// How long the slot's holder may stay silent (no status update) before a waiting
    /// relay ends its session with `pg_terminate_backend` and takes the slot over
    /// (default 10 s). Must exceed [`status_interval`](Self::status_interval) several
    /// times over. A holder that is only slow (a long broker outage while its stream is
    /// quiet) may be taken over too: harmless, the new holder resumes from the confirmed
    /// position.
    pub takeover_after: Duration,
    /// How often a waiting relay looks whether the slot is free (default 1 s).
    pub standby_poll: Duration,
    /// How often the relay looks for refused messages due for a retry (default 1 s).
    pub retry_poll: Duration,
    /// How often the relay refreshes its lag gauges, its report in `outbox_cdc` and the
    /// relayed watermark (default 10 s).
    pub lag_interval: Duration,
    /// Most memory one transaction's outbox rows may take while the relay reads it
    /// (default 32 MiB). A larger transaction is held as its row ids alone and its rows
    /// are read back from the table, `batch_size` at a time, when it is published: one
    /// huge commit (a bulk import emitting a million events) cannot exhaust the relay's
    /// memory, and the rows read are the committed ones.
    pub transaction_memory: usize,
}

impl Default for CdcConfig {
    fn default() -> Self {
        Self {
            slot: DEFAULT_SLOT.to_owned(),
            publication: DEFAULT_SLOT.to_owned(),
            batch_size: 500,
            retry: RetryPolicy::default(),
            outage_backoff: OutageBackoff::default(),
            status_interval: Duration::from_secs(1),
            takeover_after: Duration::from_secs(10),
            standby_poll: Duration::from_secs(1),
            retry_poll: Duration::from_secs(1),
            lag_interval: Duration::from_secs(10),
            transaction_memory: 32 << 20,
        }
    }
}

macro_rules! setter {
    ($(#[$doc:meta] $name:ident: $field:ident: $ty:ty),* $(,)?) => {
        impl CdcConfig {
            $(
                #[$doc]
                #[must_use]
                pub fn $name(mut self, $field: $ty) -> Self {
                    self.$field = $field;
                    self
                }
            )*
        }
    };
}

setter! {
    /// Sets [`batch_size`](Self::batch_size).
    with_batch_size: batch_size: usize,
    /// Sets [`retry`](Self::retry).
    with_retry: retry: RetryPolicy,
    /// Sets [`outage_backoff`](Self::outage_backoff).
    with_outage_backoff: outage_backoff: OutageBackoff,
    /// Sets [`status_interval`](Self::status_interval).
    with_status_interval: status_interval: Duration,
    /// Sets [`takeover_after`](Self::takeover_after).
    with_takeover_after: takeover_after: Duration,
    /// Sets [`standby_poll`](Self::standby_poll).
    with_standby_poll: standby_poll: Duration,
    /// Sets [`retry_poll`](Self::retry_poll).
    with_retry_poll: retry_poll: Duration,
    /// Sets [`lag_interval`](Self::lag_interval).
    with_lag_interval: lag_interval: Duration,
    /// Sets [`transaction_memory`](Self::transaction_memory).
    with_transaction_memory: transaction_memory: usize,
}

impl CdcConfig {
    /// Sets [`slot`](Self::slot).
    #[must_use]
    pub fn with_slot(mut self, slot: impl Into<String>) -> Self {
        self.slot = slot.into();
        self
    }

    /// Sets [`publication`](Self::publication).
    #[must_use]
    pub fn with_publication(mut self, publication: impl Into<String>) -> Self {
        self.publication = publication.into();
        self
    }

    /// Checks every field: names of 1 to 63 lowercase letters, digits and underscores
    /// that start with a letter or `_` (slot names allow no more), `batch_size` from 1 to
    /// [`MAX_BATCH_SIZE`], each interval above zero and at most [`MAX_INTERVAL`] (a zero
    /// would spin against the database, a century would overflow the clock),
    /// `takeover_after` at least three `status_interval`s, the nested policies.
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        for (field, name) in [("slot", &self.slot), ("publication", &self.publication)] {
            if !is_name(name) {
                return Err(InvalidConfig::new(
                    field,
                    "must be 1 to 63 characters of a-z, 0-9 and _, not starting with a digit",
                ));
            }
        }
        if !(1..=MAX_BATCH_SIZE).contains(&self.batch_size) {
            return Err(InvalidConfig::new(
                "batch_size",
                format!("must be from 1 to {MAX_BATCH_SIZE}"),
            ));
        }
        for (field, interval) in [
            ("status_interval", self.status_interval),
            ("takeover_after", self.takeover_after),
            ("standby_poll", self.standby_poll),
            ("retry_poll", self.retry_poll),
            ("lag_interval", self.lag_interval),
        ] {
            if interval.is_zero() || interval > MAX_INTERVAL {
                return Err(InvalidConfig::new(
                    field,
                    format!("must be above zero and at most {MAX_INTERVAL:?}"),
                ));
            }
        }
        if self.takeover_after < self.status_interval * 3 {
            return Err(InvalidConfig::new(
                "takeover_after",
                "must be at least three status_intervals",
            ));
        }
        self.retry.validate().map_err(|e| e.in_field("retry"))?;
        self.outage_backoff
            .validate()
            .map_err(|e| e.in_field("outage_backoff"))
    }
}

/// The largest [`CdcConfig::batch_size`]: a publish call's pipeline and the relay's
/// read-ahead are sized by it.
pub const MAX_BATCH_SIZE: usize = 100_000;

/// The longest interval [`CdcConfig`] takes (a day).
pub const MAX_INTERVAL: Duration = Duration::from_secs(24 * 60 * 60);

/// Whether `name` is a slot or publication name the relay puts in SQL as it is: 1 to 63
/// of `a-z`, `0-9` and `_`, not starting with a digit. Names read back from the
/// database are checked again before they are used.
pub(crate) fn is_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_intervals_out_of_range_are_refused_and_named() {
        assert!(CdcConfig::default().validate().is_ok());
        let bad = CdcConfig::default().with_slot("Outbox-CDC").validate();
        assert_eq!(bad.unwrap_err().field(), "slot");
        let bad = CdcConfig::default().with_publication("").validate();
        assert_eq!(bad.unwrap_err().field(), "publication");
        let bad = CdcConfig::default().with_batch_size(0).validate();
        assert_eq!(bad.unwrap_err().field(), "batch_size");
        let bad = CdcConfig::default()
            .with_takeover_after(Duration::from_secs(2))
            .validate();
        assert_eq!(bad.unwrap_err().field(), "takeover_after");
        let bad = CdcConfig::default().with_publication("9p").validate();
        assert_eq!(bad.unwrap_err().field(), "publication");
    }

    #[test]
    fn sizes_and_intervals_that_would_spin_or_overflow_are_refused() {
        for (bad, field) in [
            (
                CdcConfig::default().with_batch_size(usize::MAX),
                "batch_size",
            ),
            (
                CdcConfig::default().with_status_interval(Duration::MAX),
                "status_interval",
            ),
            (
                CdcConfig::default().with_takeover_after(Duration::MAX),
                "takeover_after",
            ),
            (
                CdcConfig::default().with_standby_poll(Duration::ZERO),
                "standby_poll",
            ),
            (
                CdcConfig::default().with_retry_poll(Duration::ZERO),
                "retry_poll",
            ),
            (
                CdcConfig::default().with_retry_poll(Duration::MAX),
                "retry_poll",
            ),
            (
                CdcConfig::default().with_lag_interval(Duration::ZERO),
                "lag_interval",
            ),
            (
                CdcConfig::default().with_lag_interval(Duration::MAX),
                "lag_interval",
            ),
        ] {
            assert_eq!(bad.validate().unwrap_err().field(), field);
        }
        let largest = CdcConfig::default()
            .with_batch_size(MAX_BATCH_SIZE)
            .with_status_interval(MAX_INTERVAL / 3)
            .with_takeover_after(MAX_INTERVAL)
            .with_standby_poll(MAX_INTERVAL)
            .with_retry_poll(MAX_INTERVAL)
            .with_lag_interval(MAX_INTERVAL);
        assert!(largest.validate().is_ok());
    }
}
