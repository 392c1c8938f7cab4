//! The fault plan: which faults happen when, drawn from the seed before the run starts.

use std::time::Duration;

use crate::config::{Broker, Config};
use crate::{BoxError, db};

/// The kinds of process-level faults, in the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    SigKill,
    SigTerm,
    SigStop,
    ClientKill,
    SessionKill,
}

impl Fault {
    pub(crate) const ALL: [Self; 5] = [
        Self::SigKill,
        Self::SigTerm,
        Self::SigStop,
        Self::ClientKill,
        Self::SessionKill,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::SigKill => "sigkill",
            Self::SigTerm => "sigterm",
            Self::SigStop => "sigstop",
            Self::ClientKill => "client_kill",
            Self::SessionKill => "session_kill",
        }
    }
}

/// When each fault happens, from the start of the run.
pub(crate) struct Plan {
    pub(crate) faults: Vec<(Duration, Fault)>,
    /// `(start, length, by SIGKILL)`.
    pub(crate) outages: Vec<(Duration, Duration, bool)>,
    /// `--db-restart`: `(when, how long down)`. The fault takes the time it takes
    /// (settling, the outage, the resume, the SIGTERMs); the plan's later times move by
    /// as much, so nothing else happens during it.
    pub(crate) db_restart: Option<(Duration, Duration)>,
    /// `--partitioned`: when to SIGKILL the relay found running partition maintenance
    /// (each waits for one to hold the maintenance lock).
    pub(crate) maint_kills: Vec<Duration>,
    /// `--partitioned`: when to SIGSTOP the relay found holding the maintenance lock, and
    /// for how long.
    pub(crate) maint_stops: Vec<(Duration, Duration)>,
}

impl Plan {
    /// Draws the plan; the draws come in a fixed order (process faults, Redis outages,
    /// `db_restart`, `maint_kill`, `maint_stop`), so that a seed gives the same faults
    /// whatever options add draws after them.
    pub(crate) fn new(c: &Config, rng: &mut fastrand::Rng) -> Result<Self, BoxError> {
        let d = c.duration.as_secs_f64();
        // The run ends with a Redis outage of 12–20 s, longer than the consumer's claim
        // interval plus its longest outage backoff, and nothing else after it: every
        // process must get back to work on its own, no restart hides a stuck one.
        let last_len = 12.0 + rng.f64() * 8.0;
        let last_start = d - last_len;
        let before = last_start - 1.0;
        let mut faults: Vec<(Duration, Fault)> = Fault::ALL
            .iter()
            .flat_map(|&f| std::iter::repeat_n(f, c.faults_per_kind))
            .map(|f| (Duration::from_secs_f64(rng.f64() * before.max(0.0)), f))
            .collect();
        faults.sort_by_key(|&(t, _)| t);
        // Drawn all the same, so that a seed's other faults do not depend on the broker.
        if c.broker == Broker::Nats {
            faults.retain(|&(_, f)| f != Fault::ClientKill);
        }
        let outages = redis_outages(c, rng, d, last_start, last_len)?;
        let db_restart = match c.db_restart {
            None => None,
            Some(len) => Some(db_restart(rng, len, before, last_start, &outages)?),
        };
        // Drawn last, so that the other faults are those of the run without.
        let (maint_kills, maint_stops) = if c.partitioned {
            (maint_kills(c, rng, before), maint_stops(c, rng, before))
        } else {
            (Vec::new(), Vec::new())
        };
        Ok(Self {
            faults,
            outages,
            db_restart,
            maint_kills,
            maint_stops,
        })
    }
}

/// `(start, length, by SIGKILL)` of each Redis outage: `--redis-outages` less one of
/// 1–20 s spread over the time before the last one, which starts at `last_start`.
fn redis_outages(
    c: &Config,
    rng: &mut fastrand::Rng,
    d: f64,
    last_start: f64,
    last_len: f64,
) -> Result<Vec<(Duration, Duration, bool)>, BoxError> {
    let before = last_start - 1.0;
    let lengths: Vec<f64> = (1..c.redis_outages)
        .map(|_| 1.0 + rng.f64() * 19.0)
        .collect();
    let down: f64 = lengths.iter().sum();
    let up = before - down;
    if up < 2.0 * (lengths.len() + 1) as f64 {
        return Err(format!(
            "{} Redis outages ({:.0} s) do not fit in {d:.0} s; lengthen --duration",
            c.redis_outages,
            down + last_len
        )
        .into());
    }
    let weights: Vec<f64> = (0..=lengths.len()).map(|_| 0.5 + rng.f64()).collect();
    let total: f64 = weights.iter().sum();
    let mut t = 0.0;
    let mut outages = Vec::new();
    for (len, w) in lengths.iter().zip(&weights) {
        t += up * w / total;
        outages.push((
            Duration::from_secs_f64(t),
            Duration::from_secs_f64(*len),
            rng.bool(),
        ));
        t += len;
    }
    outages.push((
        Duration::from_secs_f64(last_start),
        Duration::from_secs_f64(last_len),
        rng.bool(),
    ));
    Ok(outages)
}

/// `--db-restart`: when, and for how long (`len`, else 45–60 s); between 30% and 50% of
/// the faults, out of any Redis outage.
fn db_restart(
    rng: &mut fastrand::Rng,
    len: Option<Duration>,
    before: f64,
    last_start: f64,
    outages: &[(Duration, Duration, bool)],
) -> Result<(Duration, Duration), BoxError> {
    let len = len.unwrap_or_else(|| Duration::from_secs_f64(45.0 + rng.f64() * 15.0));
    let mut at = before * (0.3 + 0.2 * rng.f64());
    for &(start, l, _) in outages {
        let (s, e) = (start.as_secs_f64(), (start + l).as_secs_f64());
        if at > s - 2.0 && at < e + 2.0 {
            at = e + 2.0;
        }
    }
    if at > last_start - 2.0 {
        return Err("no room for the db_restart fault between the Redis \
                    outages; lengthen --duration"
            .into());
    }
    Ok((Duration::from_secs_f64(at), len))
}

/// `--partitioned`: the `maint_kill` times, from when the first partitions expire (90 s
/// and a partition or two after the start) on, so that some of the runs killed are
/// detaching.
fn maint_kills(c: &Config, rng: &mut fastrand::Rng, before: f64) -> Vec<Duration> {
    let from = (db::PARTITION_RETENTION + 2 * db::PARTITION_INTERVAL)
        .as_secs_f64()
        .min(before * 0.5);
    let mut kills: Vec<Duration> = (0..c.faults_per_kind)
        .map(|_| Duration::from_secs_f64(from + rng.f64() * (before - from).max(0.0)))
        .collect();
    kills.sort();
    kills
}

/// `--partitioned`: the `maint_stop` times and lengths: longer than a stopped holder may
/// keep the lock (`MAINT_STOP_CHECK`), and over before the last Redis outage.
fn maint_stops(c: &Config, rng: &mut fastrand::Rng, before: f64) -> Vec<(Duration, Duration)> {
    (0..(c.faults_per_kind / 5).max(1))
        .map(|_| {
            let len = 50.0 + rng.f64() * 10.0;
            let at = 5.0 + rng.f64() * (before - len - 5.0).max(0.0);
            (Duration::from_secs_f64(at), Duration::from_secs_f64(len))
        })
        .collect()
}
