//! The claim's floor: an id below which no row is NEW, so that a claim's walk of
//! `outbox_pending` starts there instead of at the start of the index.
//!
//! Every row the relay marks SENT leaves a dead entry in `outbox_pending`. Vacuum and
//! the index's own pruning remove it once no snapshot can see the old row version.
//! While a transaction holds the xmin horizon back (a long report, `pg_dump`, a lagging
//! replication slot), nothing is removed, and every claim walks all of them from the
//! start of the index, which slows the drain several times over (BENCHMARKS.md,
//! "Scale"; SCALING.md). With a floor the walk skips them.
//!
//! A floor read off committed rows alone would be wrong: a transaction that drew a
//! lower id may commit after the floor passed it, and its row would never be claimed.
//! So the floor only rises over ids whose transactions have all ended:
//!
//! 1. The id sequence's `last_value` S is read, then the virtual transaction ids of
//!    every open transaction (`pg_locks`, `locktype = 'virtualxid'`; any role may
//!    read them). A transaction that drew an id at or below S began before S was read,
//!    so it is among them or has ended.
//! 2. At a later step, once none of them that has written is left, every row up to S
//!    is visible or never will be: the floor rises to the first NEW row at or above it,
//!    at most S + 1. A transaction that has only read (the report, `pg_dump` holding
//!    the horizon back) has no transaction id and does not hold the floor: the insert
//!    that draws an id takes one in the same statement. Only an insert stalled for a
//!    whole step between the two (a backend descheduled for a second) could be passed;
//!    its row is then claimed at the next computation from 0 (below), late, not lost.
//! 3. A prepared transaction (`pg_prepared_xacts`) has given up its virtual id: while
//!    any exists, the floor stays.
//!
//! A row made NEW again below the floor (a redrive, a hand-written `UPDATE`) is found
//! when the floor is next computed from 0, every [`RESET_EVERY`]. It waits that long at
//! most; its key was freed when it went dead, so no later row of its key waits for it.
//!
//! The steps run in the claim's own transaction (its connection, a savepoint), at most
//! once per [`STEP_EVERY`]: a few index lookups, nothing on the claim's path otherwise.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use diesel::sql_types::{Array, BigInt, Bool, Text};
use diesel::{Connection as _, PgConnection, QueryableByName, RunQueryDsl as _};

use crate::Result;

/// Time between two steps. The floor lags one to two steps behind the rows marked SENT,
/// and while the horizon is held back a claim walks every dead entry of that lag: a short
/// step keeps it to a tenth of a second's rows (BENCHMARKS.md, "Scale"). Reading
/// `pg_locks` takes every lock-manager partition's lock for a moment (a fraction of a
/// millisecond), and only a relay that is claiming steps.
const STEP_EVERY: Duration = Duration::from_millis(100);
/// Time between two computations of the floor from 0.
pub(super) const RESET_EVERY: Duration = Duration::from_secs(30);

/// The relay's floor and the step in progress.
#[derive(Debug)]
pub(super) struct ClaimFloor {
    state: Mutex<State>,
}

#[derive(Debug, Clone)]
struct State {
    floor: i64,
    /// Read at the last step; the floor may rise to it once its transactions ended.
    pending: Option<Candidate>,
    next_step: Instant,
    next_reset: Instant,
}

#[derive(Debug, Clone)]
struct Candidate {
    /// The sequence's `last_value` when it was read.
    seq: i64,
    /// The virtual transaction ids open just after.
    open: Vec<String>,
}

/// A step to run in a claim's transaction ([`ClaimFloor::step`]).
#[derive(Debug)]
pub(super) struct Step {
    floor: i64,
    pending: Option<Candidate>,
    reset: bool,
}

/// What a step found ([`ClaimFloor::finish`]).
#[derive(Debug)]
pub(super) struct Stepped {
    /// The new floor, if the pending candidate settled.
    floor: Option<i64>,
    reset: bool,
    pending: Option<Candidate>,
}

impl Default for ClaimFloor {
    fn default() -> Self {
        let now = Instant::now();
        Self {
            state: Mutex::new(State {
                floor: 0,
                pending: None,
                next_step: now,
                next_reset: now + RESET_EVERY,
            }),
        }
    }
}

impl ClaimFloor {
    /// No row below this id is NEW (0 until the first steps settle).
    pub(super) fn get(&self) -> i64 {
        self.lock().floor
    }

    /// The floor for a claim starting now, and the step to run in it if one is due (one
    /// look at the state per claim).
    pub(super) fn for_claim(&self) -> (i64, Option<Step>) {
        let mut s = self.lock();
        let now = Instant::now();
        if now < s.next_step {
            return (s.floor, None);
        }
        s.next_step = now + STEP_EVERY;
        let step = Step {
            floor: s.floor,
            pending: s.pending.clone(),
            reset: now >= s.next_reset,
        };
        (s.floor, Some(step))
    }

    /// Takes what a step found.
    pub(super) fn finish(&self, stepped: Stepped) {
        let mut s = self.lock();
        if let Some(floor) = stepped.floor {
            if stepped.reset {
                s.floor = floor;
                s.next_reset = Instant::now() + RESET_EVERY;
            } else {
                s.floor = s.floor.max(floor);
            }
        }
        s.pending = stepped.pending;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Step {
    /// Runs the step on the claim's connection, inside its transaction, under a
    /// savepoint: a failure (a role that may not read the sequence) leaves the claim's
    /// transaction as it was, and the floor where it was.
    pub(super) fn run(self, conn: &mut PgConnection) -> Option<Stepped> {
        match conn.transaction(|c| self.run_in(c)) {
            Ok(stepped) => Some(stepped),
            Err(e) => {
                tracing::debug!(error = %e, "the claim's floor was not moved");
                None
            }
        }
    }

    fn run_in(&self, c: &mut PgConnection) -> Result<Stepped> {
        let mut stepped = Stepped {
            floor: None,
            reset: self.reset,
            pending: self.pending.clone(),
        };
        if let Some(candidate) = &self.pending {
            if still_open(c, &candidate.open)? {
                return Ok(stepped);
            }
            let from = if self.reset { 0 } else { self.floor };
            stepped.floor = Some(first_new(c, from, candidate.seq + 1)?);
            stepped.pending = None;
        }
        if stepped.pending.is_none() {
            stepped.pending = candidate(c)?;
        }
        Ok(stepped)
    }
}

#[derive(QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(QueryableByName)]
struct B {
    #[diesel(sql_type = Bool)]
    b: bool,
}

#[derive(QueryableByName)]
struct Open {
    #[diesel(sql_type = Array<Text>)]
    open: Vec<String>,
    #[diesel(sql_type = Bool)]
    prepared: bool,
}

/// Whether any of `open` that has written (holds a transaction id) is still running, or
/// any transaction is prepared. A transaction that has not written cannot hold a row:
/// the insert that draws an id takes a transaction id in the same statement.
fn still_open(c: &mut PgConnection, open: &[String]) -> Result<bool> {
    Ok(diesel::sql_query(
        "SELECT EXISTS (SELECT 1 FROM pg_locks v JOIN pg_locks x \
           ON x.virtualtransaction = v.virtualtransaction AND x.locktype = 'transactionid' \
           AND x.mode = 'ExclusiveLock' AND x.granted \
         WHERE v.locktype = 'virtualxid' AND v.virtualxid = ANY($1)) \
         OR EXISTS (SELECT 1 FROM pg_prepared_xacts) AS b",
    )
    .bind::<Array<Text>, _>(open)
    .get_result::<B>(c)?
    .b)
}

/// The first NEW row at or above `from`, or `cap` if none is below it: one step of the
/// walk the claims skip from then on.
fn first_new(c: &mut PgConnection, from: i64, cap: i64) -> Result<i64> {
    Ok(diesel::sql_query(
        "SELECT LEAST(COALESCE((SELECT id FROM outbox WHERE status = 0 AND id >= $1 \
         ORDER BY id LIMIT 1), $2), $2) AS n",
    )
    .bind::<BigInt, _>(from)
    .bind::<BigInt, _>(cap)
    .get_result::<N>(c)?
    .n)
}

/// The sequence's `last_value`, then the transactions open: the next candidate (none
/// while a transaction is prepared).
fn candidate(c: &mut PgConnection) -> Result<Option<Candidate>> {
    let seq = diesel::sql_query(
        "SELECT COALESCE(pg_sequence_last_value(pg_get_serial_sequence('outbox', 'id')::regclass), 0) AS n",
    )
    .get_result::<N>(c)?
    .n;
    // A statement of its own, after the sequence's: see the module docs.
    let open = diesel::sql_query(
        "SELECT ARRAY(SELECT virtualxid FROM pg_locks WHERE locktype = 'virtualxid' \
         AND virtualxid IS NOT NULL) AS open, EXISTS (SELECT 1 FROM pg_prepared_xacts) AS prepared",
    )
    .get_result::<Open>(c)?;
    Ok((!open.prepared).then_some(Candidate {
        seq,
        open: open.open,
    }))
}
