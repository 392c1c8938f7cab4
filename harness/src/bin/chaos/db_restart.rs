//! The `db_restart` fault (`--db-restart`): the run's private database server crashed
//! in the middle of the work and started again, with the processes watched through
//! their probes all along.
//!
//! 1. Every process up and healthy (the relay's `/healthz`, the consumer's `/readyz`).
//! 2. The consumers stopped (SIGSTOP) until the relays have put [`FREEZE_ENTRIES`]
//!    entries on the stream, then the server crashed while producers and relays are
//!    mid-transaction, and the consumers resumed at once: each meets the outage with
//!    messages in hand (more than three reads' worth wait, some already delivered to
//!    the reads the consumers were blocked in). Resumed before the crash, a consumer
//!    could finish its share before the server was gone and have nothing to fail on.
//! 3. Down for the planned length: every process must stay up; the relay's `/healthz`
//!    and the consumer's `/readyz` must report the outage (503), the consumer's
//!    `/healthz` (liveness) must stay 200: an outage is no reason to restart it. An
//!    ordered consumer that holds no partition's lease all along (the consumers' leases
//!    expire while they are stopped, and whichever resumes first may take every
//!    partition) has no work, touches no database, and has nothing to report: it is
//!    noted (`db_idle`), not failed. Readiness reports failing work, not a database the
//!    consumer does not use at the moment.
//! 4. Started again on the same files and port: every process must work again within
//!    [`RESUME_LIMIT`]. A consumer works again once it is ready again (a message of its
//!    own committed). A relay works again at its first publish, or, when the other relay
//!    takes all the work (a busy relay claims again at once, an idle one polls), once
//!    [`QUIET`] passes without a failed claim while its `/healthz` is 200: its claims
//!    work again at the latest one outage backoff after its last failed one.
//! 5. SIGTERM to every process that lived through it: each must exit 0 (then it is
//!    started again, as after a `sigterm` fault).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::procs::{Event, Proc, Role, TERM_TIMEOUT};
use crate::world::World;
use crate::{BoxError, interrupted, probe};

/// The longest a process may take to work again once the server takes sessions. The
/// longest backoff a process meets then is r2d2's pause between attempts to connect
/// again, which doubles up to half the pool's connection timeout: 15 s for the
/// consumer's pool (r2d2's default 30 s), 5 s for the relay's (10 s); the outage backoff
/// of both is 5 s at most. Plus slack for a loaded 2-core machine.
pub(crate) const RESUME_LIMIT: Duration = Duration::from_secs(20);
/// The relay's longest pause after a failed claim (`OutageBackoff::default().max`).
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Longer than [`BACKOFF_MAX`]: a relay that counts no outage for this long while the
/// server is up claims again.
const QUIET: Duration = Duration::from_secs(6);
/// Entries the relays must publish while the consumers are stopped before the crash:
/// more than the three consumers' reads take (a consumer reads at most as many as it
/// has room for, 32 with the default `max_in_flight` of 16), so that each gets some.
const FREEZE_ENTRIES: u64 = 100;
/// The longest the consumers stay stopped before the crash, whatever was published.
const FREEZE_LIMIT: Duration = Duration::from_secs(15);
/// The longest wait for every process to be healthy before the crash.
const SETTLE_LIMIT: Duration = Duration::from_secs(60);

/// What the fault found.
#[derive(Debug, Default)]
pub(crate) struct DbRestart {
    /// How long the server was down.
    pub(crate) down: Duration,
    /// From the server's return to the last process working again.
    pub(crate) resumed: Option<Duration>,
    /// Entries published while the consumers were stopped, before the crash.
    pub(crate) frozen_entries: u64,
    /// Processes that exited on their own from the crash until they were told to stop.
    pub(crate) exits: Vec<String>,
    /// Processes whose probe never reported the outage.
    pub(crate) unreported: Vec<String>,
    /// Ordered consumers that held no partition's lease at any probe of the outage, and
    /// did not report it: they had nothing to do, so touched no database, and their
    /// readiness (which reports failing work, not a database it does not use) had
    /// nothing to fail on. Not a failure; noted.
    pub(crate) idle: Vec<String>,
    /// Consumers whose liveness probe failed during the outage.
    pub(crate) not_live: Vec<String>,
    /// Processes not working again within [`RESUME_LIMIT`].
    pub(crate) not_resumed: Vec<String>,
    /// SIGTERMs after the restart answered by anything but exit 0.
    pub(crate) bad_sigterms: Vec<String>,
    /// Processes not healthy before the crash (the fault then tests less).
    pub(crate) unhealthy_before: Vec<String>,
}

impl DbRestart {
    pub(crate) fn failed(&self) -> bool {
        self.resumed.is_none()
            || !self.exits.is_empty()
            || !self.unreported.is_empty()
            || !self.not_live.is_empty()
            || !self.not_resumed.is_empty()
            || !self.bad_sigterms.is_empty()
            || !self.unhealthy_before.is_empty()
    }

    pub(crate) fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        for (what, names) in [
            ("exited on its own during the database outage", &self.exits),
            ("did not report the database outage", &self.unreported),
            ("not live during the database outage", &self.not_live),
            (
                "not working again within the resume limit",
                &self.not_resumed,
            ),
            (
                "answered SIGTERM after the restart badly",
                &self.bad_sigterms,
            ),
            (
                "not healthy before the database crash",
                &self.unhealthy_before,
            ),
        ] {
            for n in names {
                notes.push(format!("db_restart: {n} {what}"));
            }
        }
        notes
    }
}

/// Polls every process (restarting those due if `restart`); returns the events after
/// handing them to the tally.
fn poll_all(world: &mut World<'_>, restart: bool) -> Result<Vec<Event>, BoxError> {
    let now = Instant::now();
    let mut events = Vec::new();
    for p in &mut world.procs {
        if let Some(e) = p.poll(now, restart)? {
            events.push(e);
        }
    }
    for e in &events {
        world.tally.event(e.clone());
    }
    Ok(events)
}

/// Healthy as its supervisor sees it: the relay's `/healthz`, the consumer's `/readyz`.
fn healthy(p: &Proc) -> bool {
    let path = match p.role {
        Role::Relay => "/healthz",
        Role::Consumer => "/readyz",
    };
    probe::status(p.admin_port, path) == Some(200)
}

fn stream_len(world: &World<'_>) -> Result<u64, BoxError> {
    let redis = world.redis.as_ref().expect("started");
    let mut n = 0;
    for s in &world.streams {
        n += redis.len(s)?;
    }
    Ok(n)
}

fn names(world: &World<'_>, set: &BTreeSet<usize>) -> Vec<String> {
    set.iter().map(|&i| world.procs[i].name.clone()).collect()
}

/// Runs the fault with the server down for `len` (see the module's documentation).
pub(crate) fn inject(world: &mut World<'_>, len: Duration) -> Result<DbRestart, BoxError> {
    let mut report = DbRestart::default();
    settle(world, &mut report)?;
    freeze(world, &mut report)?;
    let down_at = crash(world, &mut report, len)?;
    resume(world, &mut report, down_at)?;
    terminate(world, &mut report)?;
    Ok(report)
}

/// 1. Everything up and healthy.
fn settle(world: &mut World<'_>, report: &mut DbRestart) -> Result<(), BoxError> {
    let now = Instant::now();
    for p in &mut world.procs {
        p.resume()?;
        p.restart_now(now);
    }
    let deadline = now + SETTLE_LIMIT;
    loop {
        interrupted()?;
        poll_all(world, true)?;
        let sick: BTreeSet<usize> = (0..world.procs.len())
            .filter(|&i| !world.procs[i].is_running() || !healthy(&world.procs[i]))
            .collect();
        if sick.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            report.unhealthy_before = names(world, &sick);
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// 2. A backlog in the consumers' hands.
fn freeze(world: &mut World<'_>, report: &mut DbRestart) -> Result<(), BoxError> {
    let base = stream_len(world)?;
    let frozen = Instant::now();
    for p in world.procs.iter_mut().filter(|p| p.role == Role::Consumer) {
        p.sigstop(frozen + FREEZE_LIMIT + Duration::from_secs(5))?;
    }
    loop {
        interrupted()?;
        poll_all(world, true)?;
        report.frozen_entries = stream_len(world)?.saturating_sub(base);
        if report.frozen_entries >= FREEZE_ENTRIES || frozen.elapsed() > FREEZE_LIMIT {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// 3. The crash, and the outage watched through the probes; when the server went down.
fn crash(
    world: &mut World<'_>,
    report: &mut DbRestart,
    len: Duration,
) -> Result<Instant, BoxError> {
    let server = world.server.as_mut().expect("--db-restart has a server");
    server.crash()?;
    let down_at = Instant::now();
    for p in &mut world.procs {
        p.resume()?;
    }
    world.tally.fault("db_restart", None);
    eprintln!(
        "chaos: db_restart: server crashed ({} entries published with the consumers \
         stopped); down for {:.1} s",
        report.frozen_entries,
        len.as_secs_f64()
    );
    let mut reported = BTreeSet::new();
    let mut not_live = BTreeSet::new();
    let mut leased = BTreeSet::new();
    let mut next_probe = down_at;
    while down_at.elapsed() < len {
        interrupted()?;
        // Not restarted while the server is down: a process starting then fails at
        // once by design (`outbox relay` checks its database first).
        for e in poll_all(world, false)? {
            if let Event::UnexpectedExit(name, _) = e {
                report.exits.push(name);
            }
        }
        if Instant::now() >= next_probe {
            note_leases(world, &mut leased);
            for (i, p) in world.procs.iter().enumerate() {
                if !p.is_running() {
                    continue;
                }
                if !healthy(p) {
                    reported.insert(i);
                }
                if p.role == Role::Consumer && probe::status(p.admin_port, "/healthz") != Some(200)
                {
                    eprintln!(
                        "chaos: db_restart: {} not live at {:.1} s into the outage",
                        p.name,
                        down_at.elapsed().as_secs_f64()
                    );
                    not_live.insert(i);
                }
            }
            next_probe += Duration::from_secs(1);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let (idle, unreported): (BTreeSet<usize>, BTreeSet<usize>) = (0..world.procs.len())
        .filter(|i| !reported.contains(i))
        .partition(|&i| {
            world.c.ordered && world.procs[i].role == Role::Consumer && !leased.contains(&i)
        });
    report.unreported = names(world, &unreported);
    report.idle = names(world, &idle);
    for name in &report.idle {
        eprintln!(
            "chaos: db_restart: {name} held no partition during the outage (nothing to \
             fail on): not counted as unreported"
        );
    }
    report.not_live = names(world, &not_live);
    Ok(down_at)
}

/// Adds to `leased` the ordered consumers holding a partition's lease now (by the pid
/// in their name, `<host>-<pid>-<random>`). If Redis cannot tell, every consumer counts
/// as holding one: the check stays strict.
fn note_leases(world: &World<'_>, leased: &mut BTreeSet<usize>) {
    if !world.c.ordered {
        return;
    }
    let redis = world.redis.as_deref().expect("started");
    let holders = redis.lease_holders(&world.streams);
    for (i, p) in world.procs.iter().enumerate() {
        if p.role != Role::Consumer {
            continue;
        }
        let holds = match (&holders, p.pid()) {
            (Ok(holders), Some(pid)) => {
                let pid = format!("-{pid}-");
                holders.iter().any(|h| h.contains(&pid))
            }
            _ => true,
        };
        if holds {
            leased.insert(i);
        }
    }
}

/// 4. Back, and every process working again.
fn resume(world: &mut World<'_>, report: &mut DbRestart, down_at: Instant) -> Result<(), BoxError> {
    let before: Vec<Option<(u64, u64)>> = world
        .procs
        .iter()
        .map(|p| probe::relay_counters(p.admin_port))
        .collect();
    let server = world.server.as_mut().expect("--db-restart has a server");
    server.up()?;
    let up_at = Instant::now();
    report.down = up_at.duration_since(down_at);
    eprintln!(
        "chaos: db_restart: server back after {:.1} s",
        report.down.as_secs_f64()
    );
    let mut resumed: Vec<Option<Duration>> = vec![None; world.procs.len()];
    // Per relay: its outage count and when it was last seen to change.
    let mut outages: Vec<(Option<u64>, Instant)> =
        before.iter().map(|c| (c.map(|(_, o)| o), up_at)).collect();
    while resumed.iter().any(Option::is_none) && up_at.elapsed() < 3 * RESUME_LIMIT {
        interrupted()?;
        for e in poll_all(world, true)? {
            if let Event::UnexpectedExit(name, _) = e {
                report.exits.push(name);
            }
        }
        check_resumed(world, &before, &mut outages, &mut resumed, up_at);
        std::thread::sleep(Duration::from_millis(100));
    }
    let slow: BTreeSet<usize> = (0..world.procs.len())
        .filter(|&i| resumed[i].is_none_or(|d| d > RESUME_LIMIT))
        .collect();
    report.not_resumed = names(world, &slow);
    report.resumed = resumed
        .iter()
        .copied()
        .collect::<Option<Vec<_>>>()
        .and_then(|r| r.into_iter().max());
    eprintln!(
        "chaos: db_restart: working again after {}",
        resume_times(world, &resumed)
    );
    Ok(())
}

/// Marks in `resumed` the processes working again (see the module's documentation),
/// `before` the relays' counters before the server came back, `outages` each relay's
/// outage count and when it last changed.
fn check_resumed(
    world: &World<'_>,
    before: &[Option<(u64, u64)>],
    outages: &mut [(Option<u64>, Instant)],
    resumed: &mut [Option<Duration>],
    up_at: Instant,
) {
    for (i, p) in world.procs.iter().enumerate() {
        if resumed[i].is_some() || !p.is_running() {
            continue;
        }
        let now = Instant::now();
        match p.role {
            Role::Consumer => {
                if healthy(p) {
                    resumed[i] = Some(now.duration_since(up_at));
                }
            }
            Role::Relay => {
                let Some((sent, failed)) = probe::relay_counters(p.admin_port) else {
                    continue;
                };
                if before[i].is_none_or(|(b, _)| sent > b) {
                    resumed[i] = Some(now.duration_since(up_at));
                } else if outages[i].0 != Some(failed) {
                    outages[i] = (Some(failed), now);
                } else if now.duration_since(outages[i].1) >= QUIET && healthy(p) {
                    // Its first claim after the last failed one, at the latest.
                    resumed[i] = Some(outages[i].1.duration_since(up_at) + BACKOFF_MAX);
                }
            }
        }
    }
}

/// `name=<time to work again>` of every process.
fn resume_times(world: &World<'_>, resumed: &[Option<Duration>]) -> String {
    let times: Vec<String> = world
        .procs
        .iter()
        .zip(resumed)
        .map(|(p, r)| {
            format!(
                "{}={}",
                p.name,
                r.map_or("never".to_owned(), |d| format!("{:.1}s", d.as_secs_f64()))
            )
        })
        .collect();
    times.join(" ")
}

/// 5. SIGTERM to every process that lived through it.
fn terminate(world: &mut World<'_>, report: &mut DbRestart) -> Result<(), BoxError> {
    let now = Instant::now();
    let mut waiting = 0;
    for p in world.procs.iter_mut().filter(|p| p.is_running()) {
        p.sigterm(now)?;
        waiting += 1;
    }
    let deadline = now + TERM_TIMEOUT + Duration::from_secs(5);
    while waiting > 0 && Instant::now() < deadline {
        interrupted()?;
        for e in poll_all(world, false)? {
            match e {
                Event::TermAnswered(name, status, _) => {
                    waiting -= 1;
                    if !status.success() {
                        report.bad_sigterms.push(format!("{name} ({status})"));
                    }
                }
                Event::TermIgnored(name) => {
                    waiting -= 1;
                    report.bad_sigterms.push(format!("{name} (no exit)"));
                }
                Event::UnexpectedExit(name, _) => report.exits.push(name),
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}
