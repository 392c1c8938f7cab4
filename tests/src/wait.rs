//! Waiting for a condition instead of sleeping a fixed time: a test polls until the
//! condition holds and fails, naming what it waited for, only after a generous bound
//! (never a timing assertion).

use std::time::{Duration, Instant};

/// How often the condition is polled.
const POLL: Duration = Duration::from_millis(20);

/// Blocks until `cond` holds, polling it every 20 ms; panics with
/// "timed out after {timeout}: waiting for {what}" once `timeout` has passed.
pub fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?}: waiting for {what}"
        );
        std::thread::sleep(POLL);
    }
}

/// [`wait_until`] for async tests: sleeps on the Tokio timer between polls, so the
/// tasks under test keep running on the same runtime.
pub async fn eventually(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?}: waiting for {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}
