//! What happened during the run: the faults injected and how the processes met them.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::db_restart::DbRestart;
use crate::procs::{Event, Role, TERM_TIMEOUT};

/// What happened during the run.
#[derive(Default)]
pub(crate) struct Tally {
    /// Faults injected by kind, and by kind and role.
    pub(crate) faults: BTreeMap<&'static str, u64>,
    pub(crate) by_role: BTreeMap<(&'static str, &'static str), u64>,
    /// Processes that exited without being told to.
    pub(crate) unexpected_exits: Vec<String>,
    /// SIGTERMs answered by something else than a prompt exit 0.
    pub(crate) bad_terms: Vec<String>,
    pub(crate) terms_answered: u64,
    pub(crate) slowest_term: Duration,
    /// Faults that could not be injected (the harness's own trouble).
    pub(crate) injection_errors: Vec<String>,
    pub(crate) redis_down: Duration,
    /// `--db-restart`: what the fault found.
    pub(crate) db: Option<DbRestart>,
    /// `--partitioned`: maintenance runs SIGKILLed in a `DETACH` or a `DROP`.
    pub(crate) maint_kills_retiring: u64,
    /// `--partitioned`: relays SIGSTOPped holding the maintenance lock that still held it
    /// [`MAINT_STOP_CHECK`](crate::faults::MAINT_STOP_CHECK) later.
    pub(crate) maint_held: Vec<String>,
}

impl Tally {
    pub(crate) fn fault(&mut self, kind: &'static str, role: Option<Role>) {
        *self.faults.entry(kind).or_default() += 1;
        if let Some(r) = role {
            *self.by_role.entry((kind, r.name())).or_default() += 1;
        }
    }

    pub(crate) fn event(&mut self, e: Event) {
        match e {
            Event::UnexpectedExit(name, status) => {
                eprintln!("chaos: {name} exited on its own: {status}");
                self.unexpected_exits.push(format!("{name}: {status}"));
            }
            Event::TermAnswered(name, status, after) => {
                self.terms_answered += 1;
                self.slowest_term = self.slowest_term.max(after);
                if !status.success() {
                    eprintln!("chaos: {name} answered SIGTERM with {status}");
                    self.bad_terms.push(format!("{name}: {status}"));
                }
            }
            Event::TermIgnored(name) => {
                eprintln!("chaos: {name} did not exit within {TERM_TIMEOUT:?} of SIGTERM");
                self.bad_terms
                    .push(format!("{name}: no exit in {TERM_TIMEOUT:?}"));
            }
        }
    }
}
