use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Error, PublishOutcomes, Publisher, Rejected, StoredMessage};

/// How [`FlakyPublisher`] fails a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailAs {
    /// The whole call fails as a broker outage: nothing is published, no retry is spent.
    Outage,
    /// Every message of the call is rejected: each spends a retry.
    Rejection,
}

/// Wraps a publisher and fails some of its calls: the first `fail_first` calls, then each
/// call with probability `fail_ratio`. For failure-injection tests and demos against a
/// real broker.
///
/// ```
/// use outbox_core::{FailAs, FlakyPublisher, MemoryBroker};
/// let flaky = FlakyPublisher::new(MemoryBroker::new(), FailAs::Rejection).fail_first(2);
/// # let _ = flaky;
/// ```
#[derive(Debug)]
pub struct FlakyPublisher<P> {
    inner: P,
    fail_as: FailAs,
    fail_first: u64,
    fail_ratio: f64,
    calls: AtomicU64,
    failures: AtomicU64,
}

impl<P: Publisher> FlakyPublisher<P> {
    /// Wraps `inner`; it fails nothing until told to.
    pub fn new(inner: P, fail_as: FailAs) -> Self {
        Self {
            inner,
            fail_as,
            fail_first: 0,
            fail_ratio: 0.0,
            calls: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        }
    }

    /// Fails the first `n` calls.
    pub fn fail_first(mut self, n: u64) -> Self {
        self.fail_first = n;
        self
    }

    /// After those, fails each call with probability `ratio` (clamped to `0.0..=1.0`).
    pub fn fail_ratio(mut self, ratio: f64) -> Self {
        self.fail_ratio = ratio.clamp(0.0, 1.0);
        self
    }

    /// How many calls it has failed so far.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// The wrapped publisher.
    pub fn inner(&self) -> &P {
        &self.inner
    }
}

impl<P: Publisher> Publisher for FlakyPublisher<P> {
    async fn publish(&self, batch: &[StoredMessage]) -> Result<PublishOutcomes, Error> {
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        let fail =
            call < self.fail_first || (self.fail_ratio > 0.0 && fastrand::f64() < self.fail_ratio);
        if !fail {
            return self.inner.publish(batch).await;
        }
        self.failures.fetch_add(1, Ordering::Relaxed);
        match self.fail_as {
            FailAs::Outage => Err(Error::broker_unavailable(format!(
                "injected outage on call {}",
                call + 1
            ))),
            FailAs::Rejection => Ok(batch
                .iter()
                .map(|_| {
                    Err(Rejected::new(format!(
                        "injected failure on call {}",
                        call + 1
                    )))
                })
                .collect()),
        }
    }
}
