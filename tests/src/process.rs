//! Stopping a private server's process: what the scratch servers' `Drop` share.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// Sends `signal` (`"-TERM"`, `"-INT"`: the server's clean shutdown, which frees what
/// it holds beyond the process, such as PostgreSQL's shared memory), waits up to 10 s
/// for the process to end, then kills it (SIGKILL, if it still runs) and reaps it.
/// Never panics: it runs in `Drop`.
pub(crate) fn stop_child(child: &mut Child, signal: &str) {
    let _ = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(10);
    while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}
