//! The producer: threads committing per-key sequences in transactions of 1 to 10 events,
//! one in ten rolled back on purpose, paced to spread the events over the run.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use diesel::{Connection as _, MysqlConnection, PgConnection};
use outbox_harness::chaos::{ChaosDb, Tick, key_name};

use crate::BoxError;
use crate::config::Backend;
use crate::db::Conn;

/// What the producers did.
#[derive(Debug, Default)]
pub(crate) struct Produced {
    /// The producers' log: every committed event (what the checks hold the stream and
    /// the applications against; the outbox rows go with their partitions).
    pub(crate) committed: Vec<Tick>,
    /// Transactions committed.
    pub(crate) txs: u64,
    /// Transactions rolled back on purpose, by id.
    pub(crate) rolled_back: Vec<u64>,
    /// Events in them.
    pub(crate) rolled_back_events: u64,
    /// Transactions that failed on their own (and were not retried as such).
    pub(crate) errors: u64,
    /// Of those, transactions whose outcome was looked up afterwards: committed after
    /// all, or not.
    pub(crate) resolved_committed: u64,
    pub(crate) resolved_rolled_back: u64,
}

impl Produced {
    /// Adds what another producer did.
    fn add(&mut self, part: Self) {
        self.txs += part.txs;
        self.errors += part.errors;
        self.rolled_back_events += part.rolled_back_events;
        self.resolved_committed += part.resolved_committed;
        self.resolved_rolled_back += part.resolved_rolled_back;
        self.rolled_back.extend(part.rolled_back);
        self.committed.extend(part.committed);
    }

    /// Events committed.
    fn events(&self) -> u64 {
        self.committed.len() as u64
    }
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

/// How long a producer waits for its database to take connections again before the run
/// fails: well past the longest planned outage (`--db-restart`).
const DOWN_LIMIT: Duration = Duration::from_secs(300);

/// The producer threads and, `--partitioned`, the transaction held open.
pub(crate) struct Producers {
    threads: Vec<JoinHandle<Result<Produced, String>>>,
    held: Option<JoinHandle<Result<Vec<Tick>, String>>>,
    stop: Arc<AtomicBool>,
}

impl Producers {
    /// Starts `threads` producer threads sharing `settings.events` and, with `hold`
    /// (`(key, how long)`), a transaction held open ([`hold_open`]).
    pub(crate) fn start(
        settings: &Settings,
        threads: usize,
        hold: Option<(String, Duration)>,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = start(settings, threads, stop.clone());
        let held = hold.map(|(key, hold)| hold_open(settings.url.clone(), key, hold, stop.clone()));
        Self {
            threads,
            held,
            stop,
        }
    }

    /// Tells the producers to stop early (the run failed).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Waits for the producers; what they did, and how the transaction held open failed
    /// if it did (its ticks are in [`Produced::committed`] if it committed).
    pub(crate) fn join(self) -> Result<(Produced, Option<String>), BoxError> {
        let mut produced = Produced::default();
        for p in self.threads {
            let part = p
                .join()
                .map_err(|_| "a producer thread panicked")?
                .map_err(|e| format!("producer: {e}"))?;
            produced.add(part);
        }
        let held_failed = match self.held.map(JoinHandle::join) {
            None => None,
            Some(Ok(Ok(ticks))) => {
                produced.committed.extend(ticks);
                None
            }
            Some(Ok(Err(e))) => Some(e),
            Some(Err(_)) => Some("the thread of the transaction held open panicked".to_owned()),
        };
        Ok((produced, held_failed))
    }
}

/// Starts `threads` producer threads sharing `settings.events`.
fn start(
    settings: &Settings,
    threads: usize,
    stop: Arc<AtomicBool>,
) -> Vec<JoinHandle<Result<Produced, String>>> {
    let threads = threads.max(1) as u64;
    (0..threads)
        .map(|i| {
            let share = settings.events / threads + u64::from(i < settings.events % threads);
            let seed = settings.seed.wrapping_mul(31).wrapping_add(i);
            let mut p = Producer {
                rng: fastrand::Rng::with_seed(seed),
                id: i,
                share,
                keys: settings.keys,
                within: settings.within,
                stop: stop.clone(),
                backend: settings.backend,
                url: settings.url.clone(),
            };
            std::thread::spawn(move || p.run().map_err(|e| e.to_string()))
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
    backend: Backend,
    url: String,
}

/// One producer transaction: the next `Tick` of each of `keys`, rolled back if `doomed`;
/// the ticks it emitted go to `ticks`.
fn transact<C: ChaosDb>(
    c: &mut C,
    keys: &[String],
    tx: u64,
    doomed: bool,
    ticks: &mut Vec<Tick>,
) -> Result<(), TxError> {
    ticks.clear();
    c.transaction(|c| {
        for k in keys {
            ticks.push(c.emit_next(k, tx)?);
        }
        if doomed {
            return Err(TxError::Rollback);
        }
        c.record_tx(tx)?;
        Ok(())
    })
}

/// Whether transaction `tx` committed: its `chaos_txs` row exists exactly if it did (its
/// outbox rows may be gone with their partition).
fn committed(conn: &mut Conn, tx: u64) -> Result<bool, diesel::result::Error> {
    match conn {
        Conn::Pg(c) => c.tx_committed(tx),
        Conn::My(c) => c.tx_committed(tx),
    }
}

/// Looks up whether transaction `tx`, whose COMMIT's outcome is unknown, committed, and
/// counts it in `out`; gives it back if the look-up failed.
fn resolve(
    conn: &mut Conn,
    tx: u64,
    ticks: Vec<Tick>,
    out: &mut Produced,
) -> Result<(), (u64, Vec<Tick>)> {
    match committed(conn, tx) {
        Ok(true) => {
            out.txs += 1;
            out.resolved_committed += 1;
            out.committed.extend(ticks);
        }
        Ok(false) => out.resolved_rolled_back += 1,
        Err(_) => return Err((tx, ticks)),
    }
    Ok(())
}

impl Producer {
    fn connect(&self) -> diesel::ConnectionResult<Conn> {
        match self.backend {
            Backend::Postgres => PgConnection::establish(&self.url).map(Conn::Pg),
            Backend::Mysql => MysqlConnection::establish(&self.url).map(Conn::My),
        }
    }

    /// The connection, made again if it is gone (`None` after a pause if that fails;
    /// an error once the database has been unreachable for [`DOWN_LIMIT`]).
    fn connection<'c>(
        &self,
        conn: &'c mut Option<Conn>,
        down_since: &mut Option<Instant>,
    ) -> Result<Option<&'c mut Conn>, BoxError> {
        if conn.is_some() {
            return Ok(conn.as_mut());
        }
        match self.connect() {
            Ok(c) => {
                *down_since = None;
                Ok(Some(conn.insert(c)))
            }
            Err(e) => {
                let since = *down_since.get_or_insert_with(Instant::now);
                if since.elapsed() > DOWN_LIMIT {
                    return Err(format!(
                        "producer {}: no connection for {DOWN_LIMIT:?}: {e}",
                        self.id
                    )
                    .into());
                }
                std::thread::sleep(Duration::from_millis(200));
                Ok(None)
            }
        }
    }

    fn run(&mut self) -> Result<Produced, BoxError> {
        let mut out = Produced::default();
        let started = Instant::now();
        let per_sec = self.share as f64 / self.within.as_secs_f64().max(0.001);
        let mut failures_in_a_row = 0;
        let mut n = 0u64;
        let mut conn: Option<Conn> = None;
        let mut down_since: Option<Instant> = None;
        // A transaction that failed with the outcome of its COMMIT unknown (the server
        // crashed around it): looked up once a connection works again, so that the
        // counts stay exact. (Its numbers were taken in the transaction itself, so the
        // next one never reuses them: nothing is emitted again.)
        let mut unresolved: Option<(u64, Vec<Tick>)> = None;
        let mut ticks = Vec::new();
        while out.events() < self.share && !self.stop.load(Ordering::Relaxed) {
            let Some(c) = self.connection(&mut conn, &mut down_since)? else {
                continue;
            };
            if let Some((tx, ticks)) = unresolved.take() {
                if let Err(again) = resolve(c, tx, ticks, &mut out) {
                    unresolved = Some(again);
                    conn = None;
                }
                continue;
            }
            let due = started + Duration::from_secs_f64(out.events() as f64 / per_sec);
            let now = Instant::now();
            if now < due {
                std::thread::sleep((due - now).min(Duration::from_millis(100)));
                continue;
            }
            let size = self.rng.u64(1..=10).min(self.share - out.events());
            let doomed = self.rng.u8(0..10) == 0;
            // Transaction ids are unique per thread and run: (thread + 1) << 40 | n.
            let tx = ((self.id + 1) << 40) | n;
            n += 1;
            // Keys locked in one order by every thread: no deadlocks between them.
            let mut keys: Vec<String> = (0..size)
                .map(|_| key_name(self.rng.usize(0..self.keys)))
                .collect();
            keys.sort();
            let result = match c {
                Conn::Pg(c) => transact(c, &keys, tx, doomed, &mut ticks),
                Conn::My(c) => transact(c, &keys, tx, doomed, &mut ticks),
            };
            match result {
                Ok(()) => {
                    out.txs += 1;
                    out.committed.append(&mut ticks);
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
                    // The connection may be gone with its server: a new one, on which
                    // the outcome is looked up first.
                    conn = None;
                    if doomed {
                        // Never committed, whatever failed: no trace of it may show.
                        out.rolled_back.push(tx);
                        out.rolled_back_events += size;
                    } else {
                        unresolved = Some((tx, std::mem::take(&mut ticks)));
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        Ok(out)
    }
}

/// `--partitioned`: one transaction held open across a retention boundary, on a key of
/// its own (transaction id 0, which no producer takes). It emits the key's first tick,
/// waits `hold` (past the end of its partition plus the retention, while the relays
/// maintain), emits the next, which goes to the same expired partition (a row's time is
/// its transaction's start), and commits; its ticks. A partition detached under it
/// would fail that emit, or hide its rows from the claim.
fn hold_open(
    url: String,
    key: String,
    hold: Duration,
    stop: Arc<AtomicBool>,
) -> JoinHandle<Result<Vec<Tick>, String>> {
    std::thread::spawn(move || {
        let mut c = PgConnection::establish(&url).map_err(|e| e.to_string())?;
        let held = c.transaction(|c| {
            let first = c.emit_next(&key, 0)?;
            let until = Instant::now() + hold;
            while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
            }
            let late = c.emit_next(&key, 0)?;
            c.record_tx(0)?;
            Ok::<_, TxError>(vec![first, late])
        });
        held.map_err(|e| match e {
            TxError::Failed(e) => format!("the transaction held open failed: {e}"),
            TxError::Rollback => "the transaction held open rolled back".to_owned(),
        })
    })
}
