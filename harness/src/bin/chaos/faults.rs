//! The faults phase: the plan's faults injected at their times while the processes are
//! supervised, then everything restored.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::plan::{Fault, Plan};
use crate::procs::{Proc, Role};
use crate::world::World;
use crate::{BoxError, db_restart, interrupted};

/// How long after its SIGSTOP a relay caught holding the maintenance lock may still hold
/// it: its statement's own limit (a detach's 30 s) and the 10 s the server lets its
/// session sit idle, with room to spare.
pub(crate) const MAINT_STOP_CHECK: Duration = Duration::from_secs(45);

/// The plan's faults still to come, and those under way.
struct Pending {
    faults: VecDeque<(Duration, Fault)>,
    outages: VecDeque<(Duration, Duration, bool)>,
    maint_kills: VecDeque<Duration>,
    maint_stops: VecDeque<(Duration, Duration)>,
    db_restart: Option<(Duration, Duration)>,
    /// Relays stopped holding the maintenance lock, and when to look whose it is.
    stop_checks: Vec<(String, Instant)>,
    /// While Redis is down: when it comes back.
    redis_back_at: Option<Instant>,
    down_since: Instant,
    /// The time the db_restart fault took: the plan's clock stands still meanwhile.
    paused: Duration,
}

impl Pending {
    fn new(plan: &Plan, start: Instant) -> Self {
        Self {
            faults: plan.faults.iter().copied().collect(),
            outages: plan.outages.iter().copied().collect(),
            maint_kills: plan.maint_kills.iter().copied().collect(),
            maint_stops: plan.maint_stops.iter().copied().collect(),
            db_restart: plan.db_restart,
            stop_checks: Vec::new(),
            redis_back_at: None,
            down_since: start,
            paused: Duration::ZERO,
        }
    }
}

impl World<'_> {
    /// Injects the planned faults while supervising the processes; returns when the last
    /// fault ended (everything restored).
    pub(crate) fn inject_faults(
        &mut self,
        plan: &Plan,
        rng: &mut fastrand::Rng,
    ) -> Result<Instant, BoxError> {
        let start = Instant::now();
        let mut pending = Pending::new(plan, start);
        while start.elapsed() < self.c.duration + pending.paused {
            interrupted()?;
            let now = Instant::now();
            let t = now.duration_since(start).saturating_sub(pending.paused);
            if pending.redis_back_at.is_none()
                && let Some((at, len)) = pending.db_restart
                && t >= at
            {
                pending.db_restart = None;
                self.tally.db = Some(db_restart::inject(self, len)?);
                pending.paused += now.elapsed();
                continue;
            }
            self.redis_outages(&mut pending, now, t)?;
            self.process_faults(&mut pending.faults, rng, now, t);
            let maintenance_due = self.maintenance_faults(&mut pending, rng, now, t);
            self.poll_all(now, true)?;
            if self.c.partitioned {
                self.db().sample_partitions(false)?;
            }
            // A maintenance run is short: looked for more often.
            std::thread::sleep(Duration::from_millis(if maintenance_due { 10 } else { 50 }));
        }
        self.tally_unused(&pending);
        self.restore(pending.down_since)
    }

    /// Brings Redis back when its outage is over, and takes it down when the next one is
    /// due.
    fn redis_outages(
        &mut self,
        pending: &mut Pending,
        now: Instant,
        t: Duration,
    ) -> Result<(), BoxError> {
        let redis = self.redis.as_mut().expect("started");
        if let Some(back) = pending.redis_back_at
            && now >= back
        {
            redis.up()?;
            self.tally.redis_down += now.duration_since(pending.down_since);
            pending.redis_back_at = None;
        }
        if pending.redis_back_at.is_none()
            && let Some(&(at, len, crash)) = pending.outages.front()
            && t >= at
        {
            pending.outages.pop_front();
            redis.down(crash)?;
            self.tally.fault("redis_outage", None);
            pending.down_since = now;
            pending.redis_back_at = Some(now + len);
        }
        Ok(())
    }

    /// Injects the process faults that are due.
    fn process_faults(
        &mut self,
        faults: &mut VecDeque<(Duration, Fault)>,
        rng: &mut fastrand::Rng,
        now: Instant,
        t: Duration,
    ) {
        while let Some(&(at, fault)) = faults.front() {
            if t < at {
                break;
            }
            match self.inject(fault, rng, now) {
                Ok(Some(role)) => {
                    self.tally.fault(fault.name(), role);
                    faults.pop_front();
                }
                // No target now (all down, or Redis down for CLIENT KILL): try again soon.
                Ok(None) => break,
                Err(e) => {
                    self.tally.injection_errors.push(format!(
                        "{}: {}",
                        fault.name(),
                        outbox_core::error_chain(&*e)
                    ));
                    faults.pop_front();
                }
            }
        }
    }

    /// The `maint_kill` and `maint_stop` faults that are due, and the checks of the
    /// stopped holders; whether one of the faults is due (and waits for a maintenance
    /// run).
    fn maintenance_faults(
        &mut self,
        pending: &mut Pending,
        rng: &mut fastrand::Rng,
        now: Instant,
        t: Duration,
    ) -> bool {
        // Waits 10 s for a run that detaches or drops, then takes any.
        let kill_due = pending.maint_kills.front().copied().filter(|&at| t >= at);
        if let Some(at) = kill_due
            && self.maint_kill(rng, now, t >= at + Duration::from_secs(10))
        {
            pending.maint_kills.pop_front();
        }
        let stop_due = pending
            .maint_stops
            .front()
            .copied()
            .filter(|&(at, _)| t >= at);
        if let Some((_, len)) = stop_due
            && let Some(stopped) = self.maint_stop(now, len)
        {
            pending.maint_stops.pop_front();
            pending.stop_checks.push(stopped);
        }
        pending
            .stop_checks
            .retain(|(name, at)| now < *at || !self.maint_stop_check(name));
        kill_due.is_some() || stop_due.is_some()
    }

    /// Reports the planned faults that found no moment: the process faults as injection
    /// errors, the maintenance faults as notes.
    fn tally_unused(&mut self, pending: &Pending) {
        let left = pending.faults.len();
        let stops = pending.maint_stops.len() + pending.stop_checks.len();
        if stops > 0 {
            eprintln!(
                "chaos: {stops} maint_stop faults found no maintenance run or were not checked"
            );
        }
        let kills = pending.maint_kills.len();
        if kills > 0 {
            // Not a failure: no relay maintains while Redis is down, and the runs are short.
            eprintln!("chaos: {kills} maint_kill faults found no maintenance run before the end");
        }
        if left > 0 {
            self.tally.injection_errors.push(format!(
                "{left} planned faults found no target before the end"
            ));
        }
    }

    /// The end of the faults: Redis up, every process resumed or started again; when
    /// every one is.
    fn restore(&mut self, down_since: Instant) -> Result<Instant, BoxError> {
        let now = Instant::now();
        let redis = self.redis.as_mut().expect("started");
        if !redis.is_up() {
            redis.up()?;
            self.tally.redis_down += now.duration_since(down_since);
        }
        for p in &mut self.procs {
            p.resume()?;
            p.restart_now(now);
            if let Some(e) = p.poll(now, true)? {
                self.tally.event(e);
            }
        }
        // A process told to stop just before the end is restarted once it has exited.
        let mut last = Instant::now();
        while self
            .procs
            .iter()
            .any(|p| !p.is_running() && p.restart_due().is_none())
        {
            interrupted()?;
            std::thread::sleep(Duration::from_millis(20));
            let now = Instant::now();
            for p in &mut self.procs {
                if let Some(e) = p.poll(now, false)? {
                    self.tally.event(e);
                }
                p.restart_now(now);
                if let Some(e) = p.poll(now, true)? {
                    self.tally.event(e);
                }
            }
            last = now;
        }
        self.poll_all(last, true)?;
        Ok(last)
    }

    /// Injects `fault` on a random target; `Ok(None)` if there is none right now.
    fn inject(
        &mut self,
        fault: Fault,
        rng: &mut fastrand::Rng,
        now: Instant,
    ) -> Result<Option<Option<Role>>, BoxError> {
        if fault == Fault::ClientKill {
            let redis = self.redis();
            if !redis.is_up() {
                return Ok(None);
            }
            redis.kill_clients()?;
            return Ok(Some(None));
        }
        let candidates: Vec<usize> = (0..self.procs.len())
            .filter(|&i| {
                let p = &self.procs[i];
                p.is_running() || (fault == Fault::SessionKill && p.is_stopped())
            })
            .collect();
        if candidates.is_empty() {
            return Ok(None);
        }
        let p = &mut self.procs[candidates[rng.usize(..candidates.len())]];
        match fault {
            Fault::SigKill => p.sigkill(now + Duration::from_secs_f64(0.5 + rng.f64() * 2.5))?,
            Fault::SigTerm => p.sigterm(now)?,
            Fault::SigStop => p.sigstop(now + Duration::from_secs_f64(1.0 + rng.f64() * 39.0))?,
            Fault::SessionKill => {
                match self.db.as_ref().expect("created").kill_sessions(&p.name) {
                    Ok(0) => return Ok(None), // between connections (just restarted): later
                    Ok(_) => {}
                    // The harness's own admin session failed (seen: PostgreSQL's
                    // `max_connections` taken by other work on the machine): try again
                    // later; a fault that never finds its moment is reported at the end.
                    Err(e) => {
                        eprintln!("chaos: session_kill postponed: {e}");
                        return Ok(None);
                    }
                }
            }
            Fault::ClientKill => unreachable!("handled above"),
        }
        Ok(Some(Some(p.role)))
    }

    /// The `maint_kill` fault: SIGKILLs the relay holding the partition maintenance lock,
    /// if one does now and runs (restarted 0.5–3 s later), at any step of its run or only
    /// while it detaches or drops a partition; whether it did.
    fn maint_kill(&mut self, rng: &mut fastrand::Rng, now: Instant, any_step: bool) -> bool {
        // The database may be down or busy: try again at the next turn.
        let Ok(Some((name, query, session_age))) = self.db().maintaining() else {
            return false;
        };
        let retiring = query.starts_with("active")
            && (query.contains("DETACH PARTITION") || query.contains("DROP TABLE"));
        if !(any_step || retiring) {
            return false;
        }
        let Some(p) = running_relay(&mut self.procs, &name) else {
            return false;
        };
        // A session older than the process is its killed predecessor's, still finishing
        // its statement on the server (a SIGKILLed client's session ends at its next read).
        if session_age > p.started.elapsed().as_secs_f64() + 0.5 {
            return false;
        }
        if let Err(e) = p.sigkill(now + Duration::from_secs_f64(0.5 + rng.f64() * 2.5)) {
            self.tally.injection_errors.push(format!("maint_kill: {e}"));
            return true;
        }
        self.tally.fault("maint_kill", Some(Role::Relay));
        if retiring {
            self.tally.maint_kills_retiring += 1;
        }
        eprintln!("chaos: maint_kill: {name} SIGKILLed in its maintenance run ({query})");
        true
    }

    /// The `maint_stop` fault: SIGSTOPs the relay holding the partition maintenance lock
    /// now, at any step of its run, for `len`; its name and when to look whether it still
    /// holds the lock ([`MAINT_STOP_CHECK`]).
    fn maint_stop(&mut self, now: Instant, len: Duration) -> Option<(String, Instant)> {
        let (name, query, _) = self.db().maintaining().ok()??;
        let p = running_relay(&mut self.procs, &name)?;
        if let Err(e) = p.sigstop(now + len) {
            self.tally.injection_errors.push(format!("maint_stop: {e}"));
            return None;
        }
        self.tally.fault("maint_stop", Some(Role::Relay));
        eprintln!(
            "chaos: maint_stop: {name} SIGSTOPped for {:.0} s in its maintenance run ({query})",
            len.as_secs_f64()
        );
        Some((name, now + MAINT_STOP_CHECK))
    }

    /// Whether the maintenance lock is still held by `name`, stopped by `maint_stop`
    /// (recorded in `tally.maint_held`); false if the look must be tried again.
    fn maint_stop_check(&mut self, name: &str) -> bool {
        if !self.procs.iter().any(|p| p.name == name && p.is_stopped()) {
            eprintln!("chaos: maint_stop: {name} resumed before its check; not checked");
            return true;
        }
        match self.db().maintaining() {
            Err(_) => false,
            Ok(Some((holder, query, _))) if holder == name => {
                eprintln!(
                    "chaos: maint_stop: {name} still holds the maintenance lock \
                     {MAINT_STOP_CHECK:?} after its SIGSTOP ({query})"
                );
                self.tally.maint_held.push(format!("{name}: {query}"));
                true
            }
            Ok(_) => {
                eprintln!(
                    "chaos: maint_stop: the lock of {name}, stopped, was released within {MAINT_STOP_CHECK:?}"
                );
                true
            }
        }
    }
}

/// The running relay named `name`.
fn running_relay<'a>(procs: &'a mut [Proc], name: &str) -> Option<&'a mut Proc> {
    procs
        .iter_mut()
        .find(|p| p.name == name && p.role == Role::Relay && p.is_running())
}
