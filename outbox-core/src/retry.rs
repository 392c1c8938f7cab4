use std::time::Duration;

use crate::InvalidConfig;

/// How a message that fails on its own is retried: exponential backoff with jitter and a
/// cap, then dead-lettered after `max_attempts` failed attempts.
///
/// Broker or database outages never consume these attempts (they back the relay off as a
/// whole), so a long outage dead-letters nothing.
///
/// ```
/// use std::time::Duration;
/// use outbox_core::{RetryDecision, RetryPolicy};
///
/// let policy = RetryPolicy::default().with_jitter(0.0);
/// assert_eq!(policy.decide(1, 0.5), RetryDecision::RetryAfter(Duration::from_secs(1)));
/// assert_eq!(policy.decide(3, 0.5), RetryDecision::RetryAfter(Duration::from_secs(4)));
/// assert_eq!(policy.decide(policy.max_attempts, 0.5), RetryDecision::Dead);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Failed attempts after which the message becomes DEAD (default 10).
    pub max_attempts: u32,
    /// Delay after the first failure (default 1 s); doubles with each further failure.
    pub base_delay: Duration,
    /// Upper bound on any delay (default 5 min).
    pub max_delay: Duration,
    /// Relative jitter in `0.0..=1.0` (default 0.2): a delay `d` becomes a uniform pick in
    /// `d·(1−jitter) ..= d·(1+jitter)`, still capped, so failing messages do not retry in
    /// lock-step.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 10,
            base_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(300),
            jitter: 0.2,
        }
    }
}

impl RetryPolicy {
    /// Sets [`max_attempts`](Self::max_attempts).
    #[must_use]
    pub fn with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    /// Sets [`base_delay`](Self::base_delay).
    #[must_use]
    pub fn with_base_delay(mut self, base_delay: Duration) -> Self {
        self.base_delay = base_delay;
        self
    }

    /// Sets [`max_delay`](Self::max_delay).
    #[must_use]
    pub fn with_max_delay(mut self, max_delay: Duration) -> Self {
        self.max_delay = max_delay;
        self
    }

    /// Sets [`jitter`](Self::jitter).
    #[must_use]
    pub fn with_jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter;
        self
    }

    /// Checks every field: `max_attempts` at least 1, `base_delay` at most `max_delay`,
    /// `jitter` within `0.0..=1.0`. [`RelayConfig::validate`](crate::RelayConfig::validate)
    /// calls it.
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        if self.max_attempts == 0 {
            return Err(InvalidConfig::new("max_attempts", "must be at least 1"));
        }
        if self.base_delay > self.max_delay {
            return Err(InvalidConfig::new(
                "base_delay",
                format!("must be at most max_delay ({:?})", self.max_delay),
            ));
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err(InvalidConfig::new("jitter", "must be within 0.0..=1.0"));
        }
        Ok(())
    }
}

/// What to do with a message after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    /// Try again after this delay.
    RetryAfter(Duration),
    /// The limit is reached: mark it DEAD.
    Dead,
}

impl RetryPolicy {
    /// Decides after the `failed_attempts`-th failure (1 for the first). `unit` is a
    /// uniform sample from `0.0..1.0` that drives the jitter; passing it in keeps this
    /// function pure and testable.
    pub fn decide(&self, failed_attempts: u32, unit: f64) -> RetryDecision {
        if failed_attempts >= self.max_attempts {
            RetryDecision::Dead
        } else {
            RetryDecision::RetryAfter(self.delay(failed_attempts, unit))
        }
    }

    /// [`decide`](Self::decide) with a random jitter sample.
    pub fn decide_now(&self, failed_attempts: u32) -> RetryDecision {
        self.decide(failed_attempts, fastrand::f64())
    }

    /// The backoff after the `failed_attempts`-th failure, before the limit is considered.
    pub fn delay(&self, failed_attempts: u32, unit: f64) -> Duration {
        let exp = failed_attempts.saturating_sub(1).min(62);
        let raw = self.base_delay.as_secs_f64() * (1u64 << exp) as f64;
        let capped = raw.min(self.max_delay.as_secs_f64());
        let jitter = self.jitter.clamp(0.0, 1.0);
        let factor = 1.0 - jitter + 2.0 * jitter * unit.clamp(0.0, 1.0);
        // `try_from`: a `max_delay` near `Duration::MAX` does not survive the f64 round trip.
        Duration::try_from_secs_f64((capped * factor).min(self.max_delay.as_secs_f64()))
            .unwrap_or(self.max_delay)
    }
}

/// Bounded exponential backoff for outages of the broker or database, which pause the
/// whole relay (or consumer) and never touch per-message retries.
///
/// The longest pause is also how long a recovered service may wait before it is used
/// again, so the default keeps it short (5 s): a pause costs one reconnect attempt,
/// and a few a minute cost a down server nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutageBackoff {
    /// First pause (default 100 ms).
    pub min: Duration,
    /// Longest pause (default 5 s).
    pub max: Duration,
}

impl Default for OutageBackoff {
    fn default() -> Self {
        Self {
            min: Duration::from_millis(100),
            max: Duration::from_secs(5),
        }
    }
}

impl OutageBackoff {
    /// Sets [`min`](Self::min).
    #[must_use]
    pub fn with_min(mut self, min: Duration) -> Self {
        self.min = min;
        self
    }

    /// Sets [`max`](Self::max).
    #[must_use]
    pub fn with_max(mut self, max: Duration) -> Self {
        self.max = max;
        self
    }

    /// Checks that `min` is at most `max`. The relay's and the consumer's configs call
    /// it.
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        if self.min > self.max {
            return Err(InvalidConfig::new(
                "min",
                format!("must be at most max ({:?})", self.max),
            ));
        }
        Ok(())
    }

    /// The pause after `consecutive` outages in a row (1 for the first).
    pub fn pause(&self, consecutive: u32) -> Duration {
        let exp = consecutive.saturating_sub(1).min(30);
        self.min.saturating_mul(1u32 << exp).min(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_jitter() -> RetryPolicy {
        RetryPolicy {
            jitter: 0.0,
            ..RetryPolicy::default()
        }
    }

    #[test]
    fn doubles_from_base_then_caps() {
        let p = no_jitter();
        let secs: Vec<u64> = (1..=10).map(|n| p.delay(n, 0.0).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]);
        assert_eq!(
            p.delay(u32::MAX, 0.0),
            p.max_delay,
            "huge attempt counts must not overflow"
        );
    }

    #[test]
    fn dead_exactly_at_the_limit() {
        let p = RetryPolicy {
            max_attempts: 3,
            ..no_jitter()
        };
        assert!(matches!(p.decide(1, 0.0), RetryDecision::RetryAfter(_)));
        assert!(matches!(p.decide(2, 0.0), RetryDecision::RetryAfter(_)));
        assert_eq!(p.decide(3, 0.0), RetryDecision::Dead);
        assert_eq!(p.decide(4, 0.0), RetryDecision::Dead);
    }

    #[test]
    fn jitter_spreads_within_bounds_and_respects_cap() {
        let p = RetryPolicy {
            jitter: 0.5,
            ..RetryPolicy::default()
        };
        assert_eq!(p.delay(3, 0.0), Duration::from_secs(2));
        assert_eq!(p.delay(3, 1.0), Duration::from_secs(6));
        assert_eq!(p.delay(3, 0.5), Duration::from_secs(4));
        assert_eq!(
            p.delay(20, 1.0),
            p.max_delay,
            "jitter never exceeds the cap"
        );
        for _ in 0..1000 {
            let d = p.delay(2, fastrand::f64());
            assert!(
                d >= Duration::from_secs(1) && d <= Duration::from_secs(3),
                "{d:?}"
            );
        }
    }

    #[test]
    fn extreme_settings_do_not_panic() {
        let p = RetryPolicy {
            max_delay: Duration::MAX,
            base_delay: Duration::MAX,
            ..RetryPolicy::default()
        };
        for n in [1, 2, 63, u32::MAX] {
            let _ = p.delay(n, 1.0);
            let _ = p.decide(n, 0.5);
        }
        assert_eq!(
            OutageBackoff {
                min: Duration::MAX,
                max: Duration::MAX
            }
            .pause(40),
            Duration::MAX
        );
    }

    #[test]
    fn outage_backoff_is_bounded() {
        let b = OutageBackoff::default();
        assert_eq!(b.pause(1), Duration::from_millis(100));
        assert_eq!(b.pause(2), Duration::from_millis(200));
        assert_eq!(b.pause(100), Duration::from_secs(5));
    }
}
