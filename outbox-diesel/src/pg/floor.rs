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
//!    the transactions that hold a lock on this database's `outbox` table (`pg_locks`;
//!    any role may read it). An insert into `outbox` locks the table before its
//!    default draws the id, and keeps the lock to its end: a transaction that drew an
//!    id at or below S is among them, or has ended. (Only these: a transaction in
//!    another database, or one in this database that never touched `outbox`, cannot
//!    hold a row of it, and must not hold the floor.)
//! 2. At a later step, once none of them that has written is left, every row up to S
//!    is visible or never will be: the floor rises to the first NEW row at or above it,
//!    at most S + 1. A transaction that has only read (the report, `pg_dump` holding
//!    the horizon back) has no transaction id and does not hold the floor: the insert
//!    that draws an id takes one in the same statement. Only an insert stalled for a
//!    whole step between the two (a backend descheduled that long) could be passed; its
//!    row lands in the watch window (below), and its key waits for it.
//! 3. A prepared transaction has given up its virtual id: while one holds a lock on
//!    `outbox`, the floor stays.
//!
//! Lowering the floor is always safe, and it comes down, without waiting for any
//! transaction:
//!
//! - to 0 when the server is another one, or restarted, or `outbox` was created again
//!   (the postmaster's start time or the table's oid: a failover, a restore, a crash,
//!   which may also have lost the claims' SENT marks, committed asynchronously);
//! - to 0 when the sequence is below the floor (ids went backwards: a `setval`, a
//!   failover to an asynchronous standby that is behind);
//! - to a NEW row in its watch window, the ids its last rise passed (where an insert
//!   stalled as above, or ids moved back by less than a step's worth, land): at each
//!   step. Until then the per-key claim holds the later rows of that row's key back
//!   (`Floor::watch`);
//! - to the first NEW row from 0 when a partition was attached or dropped (one attached
//!   back may hold NEW rows), and every [`RESET_EVERY`]: a row made NEW by hand further
//!   below (an `UPDATE`) waits that long at most.
//!
//! A redrive gives its rows new ids (`Dialect::redrive`), above the floor: they are
//! claimed at the next claim.
//!
//! The steps run in the claim's own transaction (its connection, a savepoint), before
//! its statement, which walks from what the step found, at most once per
//! [`STEP_EVERY`]: a few index lookups, nothing on the claim's path otherwise.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use diesel::sql_types::{Array, BigInt, Bool, Text};
use diesel::{Connection as _, PgConnection, QueryableByName, RunQueryDsl as _};

use crate::Result;
use crate::backend::Floor;

/// Time between two steps. The floor lags one to two steps behind the rows marked SENT,
/// and while the horizon is held back a claim walks every dead entry of that lag: a short
/// step keeps it to a tenth of a second's rows (BENCHMARKS.md, "Scale"). Reading
/// `pg_locks` takes every lock-manager partition's lock for a moment (a fraction of a
/// millisecond), and only a relay that is claiming steps.
const STEP_EVERY: Duration = Duration::from_millis(100);
/// Time between two resets of the floor to the first NEW row from 0.
pub(super) const RESET_EVERY: Duration = Duration::from_secs(30);

/// The relay's floor and the step in progress.
#[derive(Debug)]
pub(super) struct ClaimFloor {
    state: Mutex<State>,
}

#[derive(Debug, Clone)]
struct State {
    floor: Floor,
    /// What the floor was computed on; `None` before the first step.
    identity: Option<Identity>,
    /// Read at the last step; the floor may rise to it once its transactions ended.
    pending: Option<Candidate>,
    next_step: Instant,
    next_reset: Instant,
}

#[derive(Debug, Clone)]
struct Candidate {
    /// The sequence's `last_value` when it was read.
    seq: i64,
    /// The virtual transaction ids that held a lock on `outbox` just after.
    open: Vec<String>,
}

/// A step to run in a claim's transaction ([`ClaimFloor::step`]).
#[derive(Debug)]
pub(super) struct Step {
    floor: Floor,
    identity: Option<Identity>,
    pending: Option<Candidate>,
    reset: bool,
}

/// What a step found ([`ClaimFloor::finish`]).
#[derive(Debug)]
pub(super) struct Stepped {
    /// The floor, if it moved.
    floor: Option<Floor>,
    /// It was reset ([`RESET_EVERY`]).
    reset: bool,
    identity: Identity,
    pending: Option<Candidate>,
}

impl Default for ClaimFloor {
    fn default() -> Self {
        let now = Instant::now();
        Self {
            state: Mutex::new(State {
                floor: Floor::default(),
                identity: None,
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
        self.lock().floor.at
    }

    /// The floor for a claim starting now, and the step to run in it if one is due (one
    /// look at the state per claim).
    pub(super) fn for_claim(&self) -> (Floor, Option<Step>) {
        let mut s = self.lock();
        let now = Instant::now();
        if now < s.next_step {
            return (s.floor, None);
        }
        s.next_step = now + STEP_EVERY;
        let step = Step {
            floor: s.floor,
            identity: s.identity.clone(),
            pending: s.pending.clone(),
            reset: now >= s.next_reset,
        };
        (s.floor, Some(step))
    }

    /// Takes what a step found.
    pub(super) fn finish(&self, stepped: Stepped) {
        let mut s = self.lock();
        if let Some(floor) = stepped.floor {
            s.floor = floor;
        }
        if stepped.reset {
            s.next_reset = Instant::now() + RESET_EVERY;
        }
        s.identity = Some(stepped.identity);
        s.pending = stepped.pending;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Stepped {
    /// The floor, if the step moved it.
    pub(super) fn floor(&self) -> Option<Floor> {
        self.floor
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
        let server = server(c)?;
        let mut stepped = Stepped {
            floor: None,
            reset: self.reset,
            identity: server.identity.clone(),
            pending: self.pending.clone(),
        };
        let seen = self.identity.as_ref();
        let moved = seen.is_none_or(|seen| seen.server != server.identity.server);
        if moved || server.seq + 1 < self.floor.at {
            // Another server, or ids that went backwards: nothing known holds, and what
            // was pending was read there.
            if self.identity.is_some() {
                tracing::info!(
                    floor = self.floor.at,
                    seq = server.seq,
                    "the claim's floor starts over from 0: {}",
                    if moved {
                        "the server restarted or changed, or the outbox table was created again"
                    } else {
                        "the id sequence went back below it"
                    }
                );
            }
            stepped.floor = Some(Floor::default());
            stepped.pending = candidate(c, server.seq)?;
            return Ok(stepped);
        }
        // Down to a NEW row below the floor: from 0 at a reset or when a partition came
        // or went (one attached back holds rows the floor passed), else in the window the
        // claims watch. Lowering needs no wait.
        let attached = seen.is_some_and(|seen| seen.partitions != server.identity.partitions);
        let from = if self.reset || attached {
            0
        } else {
            self.floor.watch
        };
        let mut floor = self.floor;
        if from < floor.at {
            floor.at = first_new(c, from, floor.at)?;
            floor.watch = floor.watch.min(floor.at);
        }
        if let Some(candidate) = &self.pending {
            if still_open(c, &candidate.open)? {
                stepped.floor = (floor != self.floor).then_some(floor);
                return Ok(stepped);
            }
            let raised = first_new(c, floor.at, candidate.seq + 1)?;
            if raised > floor.at {
                floor = Floor {
                    at: raised,
                    watch: floor.at,
                };
            }
            stepped.pending = None;
        }
        stepped.floor = (floor != self.floor).then_some(floor);
        if stepped.pending.is_none() {
            stepped.pending = candidate(c, server.seq)?;
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

/// What the floor is computed on.
#[derive(Debug, Clone, PartialEq, QueryableByName)]
struct Identity {
    /// The server's start time and the `outbox` table's oid: a failover, a restore, a
    /// restart or a table created again changes it, and the floor starts over from 0.
    #[diesel(sql_type = Text)]
    server: String,
    /// The table's partitions: one attached back may hold NEW rows the floor passed.
    #[diesel(sql_type = Text)]
    partitions: String,
}

/// Read at the start of each step (any role may read all of it).
#[derive(QueryableByName)]
struct Server {
    #[diesel(embed)]
    identity: Identity,
    /// The id sequence's `last_value` (0 before its first id).
    #[diesel(sql_type = BigInt)]
    seq: i64,
}

fn server(c: &mut PgConnection) -> Result<Server> {
    Ok(diesel::sql_query(
        "SELECT pg_postmaster_start_time()::text || ' ' || 'outbox'::regclass::oid::text \
         AS server, (SELECT count(*) || '/' || COALESCE(sum(inhrelid::int8), 0) \
         FROM pg_inherits WHERE inhparent = 'outbox'::regclass) AS partitions, \
         COALESCE(pg_sequence_last_value(pg_get_serial_sequence('outbox', 'id')::regclass), 0) \
         AS seq",
    )
    .get_result(c)?)
}

/// The locks on this database's `outbox` table, in `pg_locks` (a relation's oid is
/// unique only within its database).
const OUTBOX_LOCKS: &str = "FROM pg_locks WHERE locktype = 'relation' \
     AND relation = 'outbox'::regclass \
     AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";

/// Whether any of `open` that has written (holds a transaction id) is still running, or
/// a prepared transaction holds a lock on `outbox`. A transaction that has not written
/// cannot hold a row: the insert that draws an id takes a transaction id in the same
/// statement.
fn still_open(c: &mut PgConnection, open: &[String]) -> Result<bool> {
    Ok(diesel::sql_query(format!(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'transactionid' \
           AND mode = 'ExclusiveLock' AND granted AND virtualtransaction = ANY($1)) \
         OR EXISTS (SELECT 1 {OUTBOX_LOCKS} AND pid IS NULL) AS b"
    ))
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

/// The transactions holding a lock on `outbox` after the sequence's `seq` was read (in
/// an earlier statement: see the module docs): the next candidate (none while a
/// prepared transaction holds one; its `pid` is null).
fn candidate(c: &mut PgConnection, seq: i64) -> Result<Option<Candidate>> {
    let open = diesel::sql_query(format!(
        "SELECT ARRAY(SELECT DISTINCT virtualtransaction {OUTBOX_LOCKS} AND pid IS NOT NULL) \
         AS open, EXISTS (SELECT 1 {OUTBOX_LOCKS} AND pid IS NULL) AS prepared"
    ))
    .get_result::<Open>(c)?;
    Ok((!open.prepared).then_some(Candidate {
        seq,
        open: open.open,
    }))
}
