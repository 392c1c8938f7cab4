//! The holder's heartbeat: a session of its own on which it runs `SELECT 1` every
//! `status_interval`, named like its replication session (`application_name`). A waiting
//! relay reads its freshness in `pg_stat_activity` to tell a frozen holder from a busy
//! one.
//!
//! The replication session's `pg_stat_replication.reply_time` is not enough: while the
//! server streams a large transaction to a client that keeps up, the walsender takes the
//! fast path and reads the client's status updates only every `wal_sender_timeout / 2`
//! (30 s by default), so a healthy holder's `reply_time` goes stale and waiting relays
//! would end its session again and again. The heartbeat runs on a thread of its own: a
//! stopped process (SIGSTOP) stops it, a busy stream does not.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use diesel::connection::SimpleConnection as _;
use diesel::{Connection as _, PgConnection};

/// The heartbeat of one session; stopped on drop.
pub(crate) struct Heartbeat {
    stop: Arc<AtomicBool>,
}

impl Heartbeat {
    /// Starts beating on a connection to `url` named `name`, every `every`. A failing
    /// connection is opened again at the next beat (the waiting relays then fall back
    /// to `reply_time`).
    pub(crate) fn start(url: String, name: String, every: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("outbox-cdc-heartbeat".into())
            .spawn(move || {
                let mut conn: Option<PgConnection> = None;
                while !stopped.load(Ordering::Relaxed) {
                    let beat = match conn.as_mut() {
                        Some(c) => c.batch_execute("SELECT 1"),
                        None => PgConnection::establish(&url)
                            .map_err(|e| diesel::result::Error::QueryBuilderError(e.into()))
                            .and_then(|mut c| {
                                c.batch_execute(&format!(
                                    "SET application_name = '{}'",
                                    name.replace('\'', "''")
                                ))?;
                                conn = Some(c);
                                Ok(())
                            }),
                    };
                    if let Err(e) = beat {
                        tracing::debug!(error = %e, "CDC heartbeat failed; retried");
                        conn = None;
                    }
                    std::thread::sleep(every);
                }
            })
            .map_err(|e| tracing::warn!(error = %e, "CDC heartbeat thread not started"))
            .ok();
        Self { stop }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
