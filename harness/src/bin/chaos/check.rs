//! The end-of-run checks on what the database and the stream hold.

use std::collections::{HashMap, HashSet};

use outbox_core::OutboxEvent as _;
use outbox_harness::chaos::{HandlerFault, Tick, handler_fault, parse_msg_id};

use crate::db::Contents;

/// What the checks found. Every count but `stream_duplicates`, `committed` and the
/// planned handler faults must be 0 for the run to pass.
#[derive(Debug, Default)]
pub(crate) struct Findings {
    /// Committed messages.
    pub(crate) committed: u64,
    /// Committed messages never applied.
    pub(crate) lost: u64,
    /// Committed messages applied more than once.
    pub(crate) double_applied: u64,
    /// Keys whose sum or count is not that of their sequence `1..=n`.
    pub(crate) bad_sums: u64,
    /// Messages whose first appearance on the stream was not the next of their key.
    pub(crate) order_breaks: u64,
    /// With ordered consumers: applications at the handler that did not follow their
    /// key's last one (without, consumers promise no order at the handler: 0).
    pub(crate) handler_order_breaks: u64,
    /// Distinct committed messages on the stream.
    pub(crate) on_stream: u64,
    /// Entries beyond the first of their message (a relay republished them: allowed).
    pub(crate) stream_duplicates: u64,
    /// Committed messages missing from the stream.
    pub(crate) not_on_stream: u64,
    /// Traces of rolled-back transactions: outbox rows, stream entries, applications,
    /// dedup records.
    pub(crate) rolled_back_seen: u64,
    /// Committed messages (by the keys' counters) the producers did not log as committed.
    pub(crate) unlogged: u64,
    /// Committed messages without an outbox row (where retention drops none).
    pub(crate) outbox_missing: u64,
    /// Outbox rows still NEW.
    pub(crate) outbox_new: u64,
    /// Outbox rows DEAD (no message fails on its own here: any is an outage's doing).
    pub(crate) outbox_dead: u64,
    /// Stream entries, applications or rows that belong to no committed message.
    pub(crate) strangers: u64,
    /// Committed messages picked to fail / panic on their first delivery.
    pub(crate) planned_fail: u64,
    pub(crate) planned_panic: u64,
    /// Human-readable notes on the first few problems.
    pub(crate) notes: Vec<String>,
}

impl Findings {
    fn note(&mut self, s: String) {
        if self.notes.len() < 20 {
            self.notes.push(s);
        }
    }

    /// Per-key order of first appearances, as a percentage.
    pub(crate) fn order_percent(&self) -> f64 {
        if self.on_stream == 0 {
            return 100.0;
        }
        100.0 * (self.on_stream - self.order_breaks.min(self.on_stream)) as f64
            / self.on_stream as f64
    }

    pub(crate) fn failed(&self) -> bool {
        self.lost
            + self.double_applied
            + self.bad_sums
            + self.order_breaks
            + self.handler_order_breaks
            + self.not_on_stream
            + self.rolled_back_seen
            + self.unlogged
            + self.outbox_missing
            + self.outbox_new
            + self.outbox_dead
            + self.strangers
            > 0
    }
}

/// Checks the run's end state: the database `db`, the stream's entries `stream`
/// (`(entry id, msg_id)` in stream order), the producers' rolled-back transactions and
/// their log of committed events (`logged`). With `outbox_complete` every committed
/// message must still have its outbox row; without (`--partitioned`: retention drops
/// partitions of sent rows) the rows left are checked, the rest stands on the log, the
/// stream and the applications: a message whose row went while NEW is never applied
/// (`lost`).
pub(crate) fn check(
    db: &Contents,
    stream: &[(String, String)],
    rolled_back: &HashSet<u64>,
    logged: &[Tick],
    outbox_complete: bool,
    fault_one_in: u64,
) -> Findings {
    let mut f = Findings::default();
    let committed: HashMap<&str, i64> =
        db.committed.iter().map(|(k, n)| (k.as_str(), *n)).collect();
    f.committed = committed.values().map(|&n| n as u64).sum();
    let known = Known {
        tx_of: f.log(logged, &committed, rolled_back, fault_one_in),
        rolled_back,
    };
    f.outbox_rows(db, &known, outbox_complete);
    f.stream(stream, &known);
    f.applications(db, &known);
    f.sums(db, &committed);
    f
}

/// The committed messages, as the producers' log tells, and the rolled-back
/// transactions.
struct Known<'a> {
    /// The transaction of each committed `(key, seq)`.
    tx_of: HashMap<(String, i64), u64>,
    rolled_back: &'a HashSet<u64>,
}

impl Known<'_> {
    /// A msg_id is committed if its (key, seq) is and its transaction is the one that
    /// committed that position.
    fn classify(&self, msg_id: &str) -> Kind {
        match parse_msg_id(msg_id) {
            Some((_, _, tx)) if self.rolled_back.contains(&tx) => Kind::RolledBack,
            Some((key, seq, tx)) if self.tx_of.get(&(key.to_owned(), seq)) == Some(&tx) => {
                Kind::Committed
            }
            _ => Kind::Stranger,
        }
    }
}

impl Findings {
    /// The producers' log, against the keys' `committed` counts: the transaction of each
    /// committed `(key, seq)`.
    fn log(
        &mut self,
        logged: &[Tick],
        committed: &HashMap<&str, i64>,
        rolled_back: &HashSet<u64>,
        fault_one_in: u64,
    ) -> HashMap<(String, i64), u64> {
        // A committed message is (key, seq) with 1 <= seq <= n; its transaction is known
        // from the producers' log.
        let is_committed =
            |key: &str, seq: i64| committed.get(key).is_some_and(|&n| (1..=n).contains(&seq));
        let mut tx_of: HashMap<(String, i64), u64> = HashMap::new();
        for tick in logged {
            let msg_id = tick
                .msg_id()
                .map(|id| id.as_str().to_owned())
                .unwrap_or_default();
            if rolled_back.contains(&tick.tx) {
                self.strangers += 1;
                self.note(format!("{msg_id} is logged both committed and rolled back"));
                continue;
            }
            if !is_committed(&tick.key, tick.seq)
                || tx_of
                    .insert((tick.key.clone(), tick.seq), tick.tx)
                    .is_some()
            {
                self.strangers += 1;
                self.note(format!(
                    "logged {msg_id} is beyond its key's committed sequence, or logged twice"
                ));
                continue;
            }
            match handler_fault(&msg_id, fault_one_in) {
                Some(HandlerFault::Fail) => self.planned_fail += 1,
                Some(HandlerFault::Panic) => self.planned_panic += 1,
                None => {}
            }
        }
        self.unlogged = self.committed.saturating_sub(tx_of.len() as u64);
        if self.unlogged > 0 {
            self.note(format!(
                "{} committed messages are not in the producers' log",
                self.unlogged
            ));
        }
        tx_of
    }

    /// The outbox rows: each one a logged message, once; with `complete`, every logged
    /// message has one.
    fn outbox_rows(&mut self, db: &Contents, known: &Known<'_>, complete: bool) {
        let rolled_back = known.rolled_back;
        let mut rows: HashSet<(&str, i64)> = HashSet::new();
        for (msg_id, status) in &db.outbox {
            let Some((key, seq, tx)) = parse_msg_id(msg_id) else {
                self.strangers += 1;
                self.note(format!("outbox row {msg_id:?} is not a chaos message"));
                continue;
            };
            if rolled_back.contains(&tx) {
                self.rolled_back_seen += 1;
                self.note(format!(
                    "outbox holds {msg_id} of a rolled-back transaction"
                ));
                continue;
            }
            if known.tx_of.get(&(key.to_owned(), seq)) != Some(&tx) || !rows.insert((key, seq)) {
                self.strangers += 1;
                self.note(format!(
                    "outbox row {msg_id} is no committed message, or a second row of one"
                ));
            }
            match status {
                0 => self.outbox_new += 1,
                2 => {
                    self.outbox_dead += 1;
                    self.note(format!("outbox row {msg_id} is DEAD"));
                }
                _ => {}
            }
        }
        if complete {
            self.outbox_missing = (known.tx_of.len() as u64).saturating_sub(rows.len() as u64);
            if self.outbox_missing > 0 {
                self.note(format!(
                    "{} committed messages have no outbox row",
                    self.outbox_missing
                ));
            }
        }
    }

    /// The stream: first appearances per key in sequence order, duplicates, strays.
    fn stream(&mut self, stream: &[(String, String)], known: &Known<'_>) {
        let mut seen: HashSet<&str> = HashSet::new();
        let mut last_first: HashMap<&str, i64> = HashMap::new();
        for (entry, msg_id) in stream {
            match known.classify(msg_id) {
                Kind::RolledBack => {
                    self.rolled_back_seen += 1;
                    self.note(format!("stream entry {entry} carries rolled-back {msg_id}"));
                    continue;
                }
                Kind::Stranger => {
                    self.strangers += 1;
                    self.note(format!("stream entry {entry} carries unknown {msg_id:?}"));
                    continue;
                }
                Kind::Committed => {}
            }
            if !seen.insert(msg_id) {
                self.stream_duplicates += 1;
                continue;
            }
            let (key, seq, _) = parse_msg_id(msg_id).expect("classified as committed");
            let last = last_first.entry(key).or_insert(0);
            if seq != *last + 1 {
                self.order_breaks += 1;
                self.note(format!(
                    "stream entry {entry}: {key} #{seq} appears first after #{last}"
                ));
            }
            *last = (*last).max(seq);
        }
        self.on_stream = seen.len() as u64;
        self.not_on_stream = self.committed.saturating_sub(self.on_stream);
    }

    /// The applications (each committed message once, nothing else) and the dedup
    /// records.
    fn applications(&mut self, db: &Contents, known: &Known<'_>) {
        let mut applied: HashMap<&str, u64> = HashMap::new();
        for msg_id in &db.log {
            match known.classify(msg_id) {
                Kind::Committed => *applied.entry(msg_id).or_default() += 1,
                Kind::RolledBack => {
                    self.rolled_back_seen += 1;
                    self.note(format!("rolled-back {msg_id} was applied"));
                }
                Kind::Stranger => {
                    self.strangers += 1;
                    self.note(format!("unknown {msg_id:?} was applied"));
                }
            }
        }
        for (msg_id, &n) in &applied {
            if n > 1 {
                self.double_applied += 1;
                self.note(format!("{msg_id} was applied {n} times"));
            }
        }
        self.lost = self.committed.saturating_sub(applied.len() as u64);
        if self.lost > 0 {
            let missing: Vec<String> = known
                .tx_of
                .iter()
                .map(|((k, s), tx)| format!("{k}/{s}/{tx}:Tick"))
                .filter(|id| !applied.contains_key(id.as_str()))
                .take(5)
                .collect();
            self.note(format!(
                "{} committed messages never applied, e.g. {missing:?}",
                self.lost
            ));
        }
        for msg_id in &db.consumed {
            if known.classify(msg_id) == Kind::RolledBack {
                self.rolled_back_seen += 1;
                self.note(format!("consumed_msg records rolled-back {msg_id}"));
            }
        }
    }

    /// The per-key effect: each key's sum and count those of its sequence `1..=n`.
    fn sums(&mut self, db: &Contents, committed: &HashMap<&str, i64>) {
        let sums: HashMap<&str, (i64, i64)> = db
            .sums
            .iter()
            .map(|(k, t, a)| (k.as_str(), (*t, *a)))
            .collect();
        for (key, &n) in committed {
            let want = (n * (n + 1) / 2, n);
            let got = sums.get(key).copied().unwrap_or((0, 0));
            if got != want {
                self.bad_sums += 1;
                self.note(format!(
                    "{key}: sum {} count {}, expected sum {} count {}",
                    got.0, got.1, want.0, want.1
                ));
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Committed,
    RolledBack,
    Stranger,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contents(log: &[&str]) -> Contents {
        Contents {
            committed: vec![("k0".into(), 2), ("k1".into(), 1)],
            sums: vec![("k0".into(), 3, 2), ("k1".into(), 1, 1)],
            handler_order_breaks: 0,
            log: log.iter().map(|s| (*s).to_owned()).collect(),
            outbox: vec![
                ("k0/1/5:Tick".into(), 1),
                ("k0/2/6:Tick".into(), 1),
                ("k1/1/6:Tick".into(), 1),
            ],
            consumed: vec![],
        }
    }

    /// The producers' log of [`contents`]' committed messages.
    fn logged() -> Vec<Tick> {
        [("k0", 1, 5), ("k0", 2, 6), ("k1", 1, 6)]
            .into_iter()
            .map(|(key, seq, tx)| Tick {
                key: key.into(),
                seq,
                tx,
            })
            .collect()
    }

    fn stream(ids: &[&str]) -> Vec<(String, String)> {
        ids.iter()
            .enumerate()
            .map(|(i, id)| (format!("{i}-0"), (*id).to_owned()))
            .collect()
    }

    #[test]
    fn a_clean_run_passes_and_duplicates_on_the_stream_are_allowed() {
        let db = contents(&["k0/1/5:Tick", "k1/1/6:Tick", "k0/2/6:Tick"]);
        let s = stream(&["k0/1/5:Tick", "k0/2/6:Tick", "k0/1/5:Tick", "k1/1/6:Tick"]);
        let f = check(&db, &s, &HashSet::from([7]), &logged(), true, 0);
        assert!(!f.failed(), "{f:?}");
        assert_eq!((f.committed, f.on_stream, f.stream_duplicates), (3, 3, 1));
    }

    #[test]
    fn rows_gone_with_their_partition_stand_on_the_log_and_a_new_one_is_lost() {
        // Retention dropped the rows of k0/1 and k0/2 after they were applied.
        let mut db = contents(&["k0/1/5:Tick", "k1/1/6:Tick", "k0/2/6:Tick"]);
        db.outbox.drain(..2);
        let s = stream(&["k0/1/5:Tick", "k0/2/6:Tick", "k1/1/6:Tick"]);
        let f = check(&db, &s, &HashSet::new(), &logged(), false, 0);
        assert!(!f.failed(), "{f:?}");
        // Where nothing is dropped, a missing row is a defect.
        let f = check(&db, &s, &HashSet::new(), &logged(), true, 0);
        assert_eq!(f.outbox_missing, 2);
        assert!(f.failed());
        // A partition dropped while it held the NEW row of k0/2: never published, never
        // applied.
        let mut gone = contents(&["k0/1/5:Tick", "k1/1/6:Tick"]);
        gone.outbox.remove(1);
        let s = stream(&["k0/1/5:Tick", "k1/1/6:Tick"]);
        let f = check(&gone, &s, &HashSet::new(), &logged(), false, 0);
        assert_eq!((f.lost, f.not_on_stream), (1, 1), "{:?}", f.notes);
        assert!(f.failed());
        // A committed position the producers did not log.
        let mut short = logged();
        short.pop();
        let db = contents(&["k0/1/5:Tick", "k1/1/6:Tick", "k0/2/6:Tick"]);
        let f = check(&db, &s, &HashSet::new(), &short, false, 0);
        assert_eq!(f.unlogged, 1);
        assert!(f.failed());
    }

    #[test]
    fn every_kind_of_defect_is_caught() {
        // k0/1 applied twice, k0/2 never; k1 #1 of rolled-back tx 7 applied.
        let mut db = contents(&["k0/1/5:Tick", "k0/1/5:Tick", "k1/1/6:Tick", "k1/1/7:Tick"]);
        db.outbox.push(("k1/1/7:Tick".into(), 1));
        let s = stream(&["k0/2/6:Tick", "k0/1/5:Tick", "k1/1/7:Tick"]);
        let f = check(&db, &s, &HashSet::from([7]), &logged(), true, 0);
        assert_eq!(f.double_applied, 1);
        assert_eq!(f.lost, 1);
        assert_eq!(f.order_breaks, 2, "{:?}", f.notes);
        assert_eq!(f.not_on_stream, 1);
        assert_eq!(f.rolled_back_seen, 3);
        assert!(f.failed());
    }
}
