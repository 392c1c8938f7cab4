//! Waiting for a condition instead of sleeping a fixed time: a test polls until the
//! condition holds and fails, naming what it waited for, only after a generous bound
//! (never a timing assertion).

use std::time::{Duration, Instant};

/// How often the condition is polled.
const POLL: Duration = Duration::from_millis(20);

/// The default bound: generous, so a slow machine does not fail a correct test.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// [`wait_until_within`] [`PATIENCE`].
pub fn wait_until(what: &str, cond: impl FnMut() -> bool) {
    wait_until_within(what, PATIENCE, cond);
}

/// Blocks until `cond` holds, polling it every 20 ms; panics with
/// "timed out after {timeout}: waiting for {what}" once `timeout` has passed.
pub fn wait_until_within(what: &str, timeout: Duration, cond: impl FnMut() -> bool) {
    wait_until_explained(timeout, cond, || format!("waiting for {what}"));
}

/// [`wait_until_within`] whose failure message is built only when the time is up, e.g.
/// to show a child process's log as it is then: panics with
/// "timed out after {timeout}: {explain()}".
pub fn wait_until_explained(
    timeout: Duration,
    mut cond: impl FnMut() -> bool,
    explain: impl FnOnce() -> String,
) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?}: {}", explain());
        }
        std::thread::sleep(POLL);
    }
}

/// [`eventually_within`] [`PATIENCE`].
pub async fn eventually(what: &str, cond: impl FnMut() -> bool) {
    eventually_within(what, PATIENCE, cond).await;
}

/// [`wait_until_within`] for async tests: sleeps on the Tokio timer between polls, so
/// the tasks under test keep running on the same runtime.
pub async fn eventually_within(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    until_some(what, timeout, async || cond().then_some(())).await;
}

/// [`eventually_within`] for a condition read with an async client (a query on
/// `mysql_async`, a broker call): polls `probe` every 20 ms until it returns
/// `Some(value)`, and returns the value; panics with "timed out after {timeout}:
/// waiting for {what}" once `timeout` has passed.
pub async fn until_some<T>(
    what: &str,
    timeout: Duration,
    mut probe: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?}: waiting for {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}
