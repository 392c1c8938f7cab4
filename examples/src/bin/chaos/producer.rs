//! The producer: threads committing per-key sequences in transactions of 1 to 10 events,
//! one in ten rolled back on purpose, paced to spread the events over the run.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use diesel::{Connection as _, MysqlConnection, PgConnection};
use outbox_examples::chaos::{ChaosDb, key_name};

use crate::db::Conn;
use crate::{Backend, BoxError};

/// What the producers did.
#[derive(Debug, Default)]
pub(crate) struct Produced {
    /// Events committed.
    pub(crate) events: u64,
    /// Transactions committed.
    pub(crate) txs: u64,
    /// Transactions rolled back on purpose, by id.
    pub(crate) rolled_back: Vec<u64>,
    /// Events in them.
    pub(crate) rolled_back_events: u64,
    /// Transactions that failed on their own (and were not retried as such).
    pub(crate) errors: u64,
}

pub(crate) struct Settings {
    pub(crate) backend: Backend,
    pub(crate) url: String,
    pub(crate) seed: u64,
    pub(crate) events: u64,
    pub(crate) keys: usize,
    /// Spread the events over this long.
    pub(crate) within: Duration,
}

enum TxError {
    Rollback,
    Failed(String),
}

impl From<diesel::result::Error> for TxError {
    fn from(e: diesel::result::Error) -> Self {
        Self::Failed(e.to_string())
    }
}

impl From<outbox_diesel::Error> for TxError {
    fn from(e: outbox_diesel::Error) -> Self {
        Self::Failed(outbox_core::error_chain(&e).to_string())
    }
}

/// Starts `threads` producer threads sharing `settings.events`.
pub(crate) fn start(
    settings: &Settings,
    threads: usize,
    stop: Arc<AtomicBool>,
) -> Vec<JoinHandle<Result<Produced, String>>> {
    let threads = threads.max(1) as u64;
    (0..threads)
        .map(|i| {
            let share = settings.events / threads + u64::from(i < settings.events % threads);
            let (backend, url, keys, within) = (
                settings.backend,
                settings.url.clone(),
                settings.keys,
                settings.within,
            );
            let seed = settings.seed.wrapping_mul(31).wrapping_add(i);
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut conn = match backend {
                    Backend::Postgres => PgConnection::establish(&url).map(Conn::Pg),
                    Backend::Mysql => MysqlConnection::establish(&url).map(Conn::My),
                }
                .map_err(|e| e.to_string())?;
                let mut p = Producer {
                    rng: fastrand::Rng::with_seed(seed),
                    id: i,
                    share,
                    keys,
                    within,
                    stop,
                };
                match &mut conn {
                    Conn::Pg(c) => p.run(c),
                    Conn::My(c) => p.run(c),
                }
                .map_err(|e| e.to_string())
            })
        })
        .collect()
}

struct Producer {
    rng: fastrand::Rng,
    id: u64,
    share: u64,
    keys: usize,
    within: Duration,
    stop: Arc<AtomicBool>,
}

impl Producer {
    fn run<C: ChaosDb>(&mut self, conn: &mut C) -> Result<Produced, BoxError> {
        let mut out = Produced::default();
        let started = Instant::now();
        let per_sec = self.share as f64 / self.within.as_secs_f64().max(0.001);
        let mut failures_in_a_row = 0;
        let mut n = 0u64;
        while out.events < self.share && !self.stop.load(Ordering::Relaxed) {
            let due = started + Duration::from_secs_f64(out.events as f64 / per_sec);
            let now = Instant::now();
            if now < due {
                std::thread::sleep((due - now).min(Duration::from_millis(100)));
                continue;
            }
            let size = self.rng.u64(1..=10).min(self.share - out.events);
            let doomed = self.rng.u8(0..10) == 0;
            // Transaction ids are unique per thread and run: (thread + 1) << 40 | n.
            let tx = ((self.id + 1) << 40) | n;
            n += 1;
            // Keys locked in one order by every thread: no deadlocks between them.
            let mut keys: Vec<String> = (0..size)
                .map(|_| key_name(self.rng.usize(0..self.keys)))
                .collect();
            keys.sort();
            let result = conn.transaction(|c| {
                for k in &keys {
                    c.emit_next(k, tx)?;
                }
                if doomed {
                    return Err(TxError::Rollback);
                }
                Ok(())
            });
            match result {
                Ok(()) => {
                    out.events += size;
                    out.txs += 1;
                    failures_in_a_row = 0;
                }
                Err(TxError::Rollback) => {
                    out.rolled_back.push(tx);
                    out.rolled_back_events += size;
                }
                Err(TxError::Failed(e)) => {
                    out.errors += 1;
                    failures_in_a_row += 1;
                    eprintln!("chaos: producer {}: transaction failed: {e}", self.id);
                    if failures_in_a_row > 20 {
                        return Err(
                            format!("producer {}: 20 failures in a row: {e}", self.id).into()
                        );
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        Ok(out)
    }
}
