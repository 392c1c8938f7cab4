//! The end of the run: its end state read on a quiet system, everything taken down, the
//! verdict and the summary printed.

use std::collections::HashSet;
use std::time::Duration;

use crate::check::{self, Findings};
use crate::config::{Backend, Config};
use crate::db::PartitionsEnd;
use crate::db_restart::DbRestart;
use crate::procs::{Proc, Role};
use crate::producer::Produced;
use crate::tally::Tally;
use crate::world::World;
use crate::{BoxError, GROUP};

/// What the run's end state shows, read once every process has stopped.
pub(crate) struct EndState {
    findings: Findings,
    /// Applications out of sequence at the handler (a failure with ordered consumers).
    handler_order_breaks: i64,
    /// Entries on the streams' dead-letter streams.
    dead_letters: u64,
    /// `--partitioned`: what retention did.
    partitions_end: Option<PartitionsEnd>,
    /// `--partitioned`: the expired partitions kept by a relay, the maintenance steps
    /// that failed, and the least margin of partitions made ahead.
    kept: usize,
    steps_failed: usize,
    min_margin: Option<f64>,
    /// `--cdc`: takeovers from a silent holder (a SIGSTOPped relay) of the slot
    /// (PostgreSQL) or of the readers' lock (MariaDB), from the relays' logs.
    takeovers: usize,
}

/// How the run ended, besides its end state.
pub(crate) struct Ending {
    /// When every committed message was applied, after the last fault (`None`: timeout).
    pub(crate) drained_after: Option<Duration>,
    /// Consumer processes not reading after the last fault.
    pub(crate) stuck: Vec<String>,
    /// Processes stopped by the final SIGTERMs.
    pub(crate) final_terms: u64,
    /// Processes or servers left behind.
    pub(crate) leftovers: Vec<String>,
    /// Processes still known by pid (0: a server still answering) after the take-down.
    pub(crate) pids: Vec<u32>,
}

impl World<'_> {
    /// Reads the end state: the streams, the database, the processes' logs.
    pub(crate) fn read_end_state(&mut self, produced: &Produced) -> Result<EndState, BoxError> {
        let c = self.c;
        let redis = self.redis.as_ref().expect("started");
        // A key lives on one stream: its order of first appearance is checked there.
        let mut entries = Vec::new();
        let mut dead_letters = 0;
        for stream in &self.streams {
            entries.extend(redis.read_stream(stream)?);
            dead_letters += redis.len(&format!("{stream}:dead"))?;
        }
        let contents = self.db().contents(GROUP)?;
        // What retention did: partitions seen during the run and gone at its end.
        let partitions_end = if c.partitioned {
            Some(self.db().partitions_end()?)
        } else {
            None
        };
        let rolled_back: HashSet<u64> = produced.rolled_back.iter().copied().collect();
        // The outbox rows are all there unless retention took some.
        let mut findings = check::check(
            &contents,
            &entries,
            &rolled_back,
            &produced.committed,
            !c.partitioned,
            c.fault_one_in,
        );
        if c.ordered {
            findings.handler_order_breaks = u64::try_from(contents.handler_order_breaks)?;
        }
        if c.cdc {
            // The CDC relay marks nothing SENT: NEW is where its rows stay (what was
            // relayed is checked on the stream and at the handler instead).
            findings.outbox_new = 0;
        }
        let (seen_fail, seen_panic) = handler_faults_in_logs(&self.procs);
        let (kept, steps_failed) = maintenance_in_logs(&self.procs);
        self.tally.faults.insert("handler_fail", seen_fail as u64);
        self.tally.faults.insert("handler_panic", seen_panic as u64);
        Ok(EndState {
            findings,
            handler_order_breaks: contents.handler_order_breaks,
            dead_letters,
            partitions_end,
            kept,
            steps_failed,
            min_margin: self.db.as_ref().and_then(|d| d.min_margin),
            takeovers: takeovers_in_logs(&self.procs),
        })
    }

    /// Takes everything down; the processes (by pid) and servers still there, and the
    /// processes naming the run, which must be none.
    pub(crate) fn take_down(&mut self) -> Result<(Vec<u32>, Vec<String>), BoxError> {
        let mut pids: Vec<u32> = self.procs.iter().filter_map(Proc::pid).collect();
        self.procs.clear();
        if let Some(mut redis) = self.redis.take() {
            let port = redis.port();
            redis.down(false)?;
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                pids.push(0);
            }
        }
        if let Some(mut server) = self.server.take() {
            // The run's database goes with its server (its files stay when kept).
            self.db = None;
            let port = server.stop();
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                pids.push(0);
            }
        }
        Ok((pids, leftovers(&self.tag)))
    }
}

/// The run's verdict and its printed summary.
pub(crate) struct Verdict<'a> {
    pub(crate) c: &'a Config,
    pub(crate) tally: &'a Tally,
    pub(crate) produced: &'a Produced,
    /// How the transaction held open failed, if it did.
    pub(crate) held_failed: Option<String>,
    pub(crate) hold_open: bool,
    pub(crate) end: EndState,
    pub(crate) ending: Ending,
}

impl Verdict<'_> {
    /// Retention must have worked: partitions of both tables dropped during the run.
    fn none_dropped(&self) -> bool {
        self.end.partitions_end.as_ref().is_some_and(|p| {
            ["outbox", "consumed_msg"]
                .iter()
                .any(|t| p.dropped.get(t).copied().unwrap_or(0) == 0)
        })
    }

    /// An emit whose time has no partition fails: the margin ahead must never run out.
    fn ran_out(&self) -> bool {
        self.end.min_margin.is_some_and(|m| m <= 0.0)
    }

    /// Whether a check failed.
    pub(crate) fn failed(&self) -> bool {
        let (c, tally, end, ending) = (self.c, self.tally, &self.end, &self.ending);
        let db_failed = tally.db.as_ref().is_some_and(DbRestart::failed)
            || (c.db_restart.is_some() && tally.db.is_none());
        end.findings.failed()
            || self.held_failed.is_some()
            || !tally.maint_held.is_empty()
            || db_failed
            || self.none_dropped()
            || self.ran_out()
            || ending.drained_after.is_none()
            || !tally.unexpected_exits.is_empty()
            || !tally.bad_terms.is_empty()
            || !ending.leftovers.is_empty()
            || !ending.pids.is_empty()
            || end.dead_letters > 0
            || !tally.injection_errors.is_empty()
            || !ending.stuck.is_empty()
    }

    /// Prints the notes, the lines of detail and the summary line; whether a check failed.
    pub(crate) fn print(&self) -> bool {
        let failed = self.failed();
        self.print_notes();
        self.print_partitions();
        self.print_details();
        self.print_summary(failed);
        failed
    }

    /// The problems, one a line.
    fn print_notes(&self) {
        for note in &self.end.findings.notes {
            eprintln!("chaos: {note}");
        }
        for note in self.tally.db.iter().flat_map(DbRestart::notes) {
            eprintln!("chaos: {note}");
        }
        if let Some(e) = &self.held_failed {
            eprintln!("chaos: {e}");
        }
        for e in &self.tally.injection_errors {
            eprintln!("chaos: fault not injected: {e}");
        }
        for s in &self.ending.stuck {
            eprintln!("chaos: consumer not reading after the last fault: {s}");
        }
        for l in &self.ending.leftovers {
            eprintln!("chaos: left behind: {l}");
        }
    }

    /// `--partitioned`: what retention and the maintenance faults did.
    fn print_partitions(&self) {
        let Some(p) = &self.end.partitions_end else {
            return;
        };
        eprintln!(
            "chaos: partitions dropped: {:?}; detached and left: {:?}; least margin ahead: \
             {:.1} s; expired partitions kept by a relay (NEW or DEAD rows): {}; \
             maintenance steps failed (retried): {}; maint_kills in a DETACH or DROP: {}; \
             maint_stops still holding the lock: {:?}; a transaction held open across the \
             retention: {}",
            p.dropped,
            p.detached_left,
            self.end.min_margin.unwrap_or(f64::NAN),
            self.end.kept,
            self.end.steps_failed,
            self.tally.maint_kills_retiring,
            self.tally.maint_held,
            match (self.hold_open, &self.held_failed) {
                (false, _) => "none",
                (true, None) => "committed",
                (true, Some(_)) => "FAILED",
            },
        );
        if self.none_dropped() {
            eprintln!("chaos: the relays dropped no partition of a table: retention did not work");
        }
        if self.ran_out() {
            eprintln!("chaos: the partitions made ahead ran out: emits had no partition");
        }
    }

    /// The faults by role, the outages, the producers, the handler faults, the SIGTERMs.
    fn print_details(&self) {
        let (tally, produced, findings) = (self.tally, self.produced, &self.end.findings);
        let roles: Vec<String> = tally
            .by_role
            .iter()
            .map(|((k, r), v)| format!("{k}/{r}={v}"))
            .collect();
        eprintln!(
            "chaos: by role: {}; Redis down {:.0} s in all; producer: {} transactions committed, \
             {} rolled back ({} events), {} failed (of them, looked up afterwards: {} committed, \
             {} not); planned handler faults: {} fail, {} panic; \
             SIGTERMs answered: {} (slowest {:.1} s, {} at the end)",
            roles.join(" "),
            tally.redis_down.as_secs_f64(),
            produced.txs,
            produced.rolled_back.len(),
            produced.rolled_back_events,
            produced.errors,
            produced.resolved_committed,
            produced.resolved_rolled_back,
            findings.planned_fail,
            findings.planned_panic,
            tally.terms_answered,
            tally.slowest_term.as_secs_f64(),
            self.ending.final_terms,
        );
    }

    /// The one summary line on stdout.
    fn print_summary(&self, failed: bool) {
        let (c, tally, end, ending) = (self.c, self.tally, &self.end, &self.ending);
        let findings = &end.findings;
        let faults: Vec<String> = tally
            .faults
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        println!(
            "chaos seed={} backend={} events={} partitions={}{} faults: {} | lost={} double_applied={} \
             order={:.3}% order_breaks={} handler_order_breaks={} stream_duplicates={} rolled_back_seen={} dead={} \
             dead_letters={} bad_sums={} stuck_consumers={} unexpected_exits={} bad_sigterms={} leftovers={}{}{}{} \
             drain={} | {}",
            c.seed,
            c.backend.name(),
            findings.committed,
            c.partitions,
            mode(c),
            faults.join(" "),
            findings.lost,
            findings.double_applied,
            findings.order_percent(),
            findings.order_breaks,
            // Printed in every mode (without ordered consumers it shows what they
            // prevent), counted as a failure with them only.
            end.handler_order_breaks,
            findings.stream_duplicates,
            findings.rolled_back_seen,
            findings.outbox_dead,
            end.dead_letters,
            findings.bad_sums,
            ending.stuck.len(),
            tally.unexpected_exits.len(),
            tally.bad_terms.len(),
            ending.leftovers.len() + ending.pids.len(),
            // Only with --partitioned: both tables' partitions the relays dropped.
            end.partitions_end
                .as_ref()
                .map_or(String::new(), |p| format!(
                    " partitions_dropped={}",
                    p.dropped.values().sum::<usize>()
                )),
            tally.db.as_ref().map_or(String::new(), db_restart_fields),
            // Only with --cdc: on MariaDB the binlog relay's one reader holds a named
            // lock, not a slot.
            match (c.cdc, c.backend) {
                (false, _) => String::new(),
                (true, Backend::Postgres) => format!(" slot_takeovers={}", end.takeovers),
                (true, Backend::Mysql) => format!(" lock_takeovers={}", end.takeovers),
            },
            ending
                .drained_after
                .map_or("timeout".to_owned(), |d| format!("{:.1}s", d.as_secs_f64())),
            if failed { "FAIL" } else { "PASS" },
        );
    }
}

/// The summary's words for the options that change the run's mode.
fn mode(c: &Config) -> String {
    format!(
        "{}{}{}{}{}",
        if c.cdc { " relay=cdc" } else { "" },
        if c.ordered { " ordered" } else { "" },
        if c.async_inbox { " async_inbox" } else { "" },
        if c.partitioned {
            " layout=partitioned"
        } else {
            ""
        },
        c.batch.map(|n| format!(" batch={n}")).unwrap_or_default(),
    )
}

/// The summary's fields of the `db_restart` fault (only with `--db-restart`, so that the
/// other runs' lines stay as they were).
fn db_restart_fields(d: &DbRestart) -> String {
    format!(
        " db_down={:.1}s db_resume={} db_exits={} db_unreported={} db_idle={} \
         db_not_live={} db_not_resumed={} db_bad_sigterms={}",
        d.down.as_secs_f64(),
        d.resumed
            .map_or("never".to_owned(), |r| format!("{:.1}s", r.as_secs_f64())),
        d.exits.len(),
        d.unreported.len(),
        d.idle.len(),
        d.not_live.len(),
        d.not_resumed.len(),
        d.bad_sigterms.len(),
    )
}

/// Distinct messages whose handler failed / panicked, as the consumers' logs tell.
fn handler_faults_in_logs(procs: &[Proc]) -> (usize, usize) {
    let mut fail = HashSet::new();
    let mut panic = HashSet::new();
    for p in procs.iter().filter(|p| p.role == Role::Consumer) {
        let Ok(text) = std::fs::read_to_string(p.log_path()) else {
            continue;
        };
        for line in text.lines() {
            for (needle, set) in [
                (" fails on its first delivery", &mut fail),
                (" panics on its first delivery", &mut panic),
            ] {
                if let Some(end) = line.find(needle)
                    && let Some(start) = line[..end].rfind("chaos: ")
                {
                    set.insert(line[start + 7..end].to_owned());
                }
            }
        }
    }
    (fail.len(), panic.len())
}

/// `--partitioned`: the expired partitions the relays kept for their NEW or DEAD rows
/// (distinct), and the maintenance steps that failed, as the relays' logs tell.
fn maintenance_in_logs(procs: &[Proc]) -> (usize, usize) {
    let mut kept = HashSet::new();
    let mut failed = 0;
    for p in procs.iter().filter(|p| p.role == Role::Relay) {
        let Ok(text) = std::fs::read_to_string(p.log_path()) else {
            continue;
        };
        for line in text.lines() {
            if line.contains("expired partition kept") {
                let name = line
                    .split("partition=")
                    .nth(1)
                    .and_then(|r| r.split([' ', ',', '}', '"']).next());
                kept.insert(name.unwrap_or(line).to_owned());
            } else if line.contains("partition maintenance step failed")
                || line.contains("partition maintenance failed")
            {
                failed += 1;
            }
        }
    }
    (kept.len(), failed)
}

/// `--cdc`: the slot (PostgreSQL) or the readers' lock (MariaDB) taken over from a
/// holder that ran nothing for the takeover time (SIGSTOPped).
fn takeovers_in_logs(procs: &[Proc]) -> usize {
    procs
        .iter()
        .filter(|p| p.role == Role::Relay)
        .filter_map(|p| std::fs::read_to_string(p.log_path()).ok())
        .map(|text| {
            text.matches("takes the slot over").count()
                + text
                    .matches("its session was ended, this relay takes over")
                    .count()
        })
        .sum()
}

/// Processes other than this one whose command line names the run.
fn leftovers(tag: &str) -> Vec<String> {
    let me = std::process::id().to_string();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter(|e| e.file_name() != me.as_str())
        .filter_map(|e| {
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            cmd.contains(tag)
                .then(|| format!("pid {}: {cmd}", e.file_name().to_string_lossy()))
        })
        .collect()
}
