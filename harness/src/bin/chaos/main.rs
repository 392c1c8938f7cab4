//! Run with: cargo build --release -p typed-outbox-cli -p outbox-harness --bins && target/release/chaos --seed 1 --events 5000 --duration 120s [--backend mysql]
//!
//! The chaos run: the outbox's guarantees checked the way an operator meets faults, with
//! real processes, real kills and real restarts.
//!
//! It creates a database of its own (PostgreSQL, or MariaDB with `--backend mysql`) and a
//! private `redis-server` (AOF, `appendfsync always`, so a restart loses nothing), then
//! runs `--relays` processes of the real `outbox relay` (per-key order, the default) and
//! `--consumers` `chaos_consumer` processes (default consumer settings, a diesel inbox,
//! a handler that adds each event's sequence number to a per-key sum), while producer
//! threads commit per-key sequences in transactions of 1 to 10 events, one in ten rolled
//! back on purpose.
//!
//! Faults, at seeded random times and targets: SIGKILL, SIGTERM (then a restart) and
//! SIGSTOP for 1–40 s (past the consumer's 30 s `min_idle`, so stopped consumers' entries
//! get claimed by others) of relays and consumers; Redis stopped (SIGKILL or SIGTERM) for
//! 1–20 s; `CLIENT KILL TYPE normal`; `pg_terminate_backend`
//! (MariaDB: `KILL CONNECTION`) of one process's sessions; handlers that fail or panic
//! on a message's first delivery (about one in `--handler-fault-one-in` each, picked by
//! a hash of the msg_id). The run ends with a Redis outage of 12–20 s (longer than the
//! consumer's claim interval plus its longest outage backoff) and no other fault after
//! it, so no restart can hide a process that does not recover on its own.
//!
//! After the last fault it waits (at most `--drain-timeout`) until every committed
//! message is applied, stops everything with SIGTERM and checks: every committed message
//! applied exactly once (the per-key sums and counts, and a log of applications), no
//! trace of a rolled-back message (outbox, stream, applications, dedup records), per-key
//! order of first appearance on the stream, no DEAD row, every consumer process reading
//! again (an `XREADGROUP` of its own within 10 s, seen with `MONITOR`), every SIGTERM
//! answered by exit 0 and no process exiting on its own, no process or server left
//! behind. It prints one
//! summary line and exits with 1 if a check failed (2 if the run itself could not run).
//!
//! `--partitions N --ordered` runs the same with the topic spread over N partition
//! streams and ordered consumers (docs/partitions.md), and also checks the order at the
//! handler: every application of a key must follow its last one (`handler_order_breaks`).
//! Its SIGSTOPs (1–40 s) outlast the 10 s lease, so partitions change hands under
//! stopped holders that later resume.
//!
//! `--async-inbox` runs the consumers on the async inbox (`AsyncPgInbox` on diesel-async,
//! an async handler awaiting its writes in the dedup transaction), PostgreSQL only: the
//! same checks under the same process faults. `--batch N` runs the consumers in batch
//! mode (up to N messages per transaction).
//!
//! `--partitioned` puts `outbox` and `consumed_msg` on the partitioned layout
//! (docs/table-partitions.md): partitions of 5 s, made and, 90 s after their range ends,
//! detached and dropped by the relays themselves under the faults (`db.rs`). The checks
//! then stand on the producers' log of committed events and the consumers' applications,
//! not on the outbox rows: a partition dropped with a NEW row in it shows as `lost`. It
//! adds the `maint_kill` fault (SIGKILL of the relay holding the maintenance lock, in the
//! middle of its run) and the `maint_stop` fault (SIGSTOP of the relay holding it, for
//! 50–60 s: the run fails if the lock is still that relay's 45 s into the stop), and a
//! transaction held open across a retention boundary (`producer::hold_open`, without
//! `--db-restart`: it must commit, and its late emit land in its expired partition). It
//! counts the partitions the relays dropped (`partitions_dropped`) and fails if they
//! dropped none of either table, or if the partitions made ahead ran out.
//! `--ci` gives it 150 s of faults, so that drops begin some 95 s into them.
//!
//! `--db-restart` adds the `db_restart` fault (see `db_restart.rs`): the run's database
//! lives on a private server the run starts itself (PostgreSQL: `initdb` on a free port;
//! MariaDB: `mariadb-install-db` and a `mariadbd` of its own), crashed once while
//! producers, relays and consumers work (`pg_ctl -m immediate stop`; MariaDB SIGKILL),
//! kept down for `--db-down` (45 s with `--ci`, else 45–60 s: past every timeout and
//! backoff in the code), then started again on the same files and port. Every process
//! must stay up, report the outage on its probe, work again within 20 s and answer a
//! SIGTERM with exit 0; the producers retry their transactions and look up the outcome
//! of a commit the crash cut off. Nothing else happens during the fault.
//!
//! `--cdc` runs the relays as `outbox relay --cdc` (the CDC relay of `outbox-cdc`:
//! PostgreSQL logical decoding, no UPDATE per message) on a private cluster of the run's
//! own with `wal_level = logical`, set up with `outbox migrate --cdc`: one relay reads the
//! slot, the others wait; a SIGKILLed or SIGTERMed holder's slot is taken at once, a
//! SIGSTOPped one's after the 10 s takeover. The same faults and checks, but that the
//! outbox rows stay NEW (the stream and the handler carry the checks); with
//! `--db-restart` the cluster is crashed as above and the relays resume from the slot's
//! confirmed position. With `--backend mysql` it is the binlog relay
//! (`outbox_cdc::mysql`) on a private MariaDB with the binlog in row format: the relays
//! (each with a user holding `REPLICATION SLAVE`, `BINLOG MONITOR`, `PROCESS` and
//! `CONNECTION ADMIN`) wait for the readers' named lock instead of a slot, a SIGSTOPped
//! holder's session is ended after the 10 s takeover (`lock_takeovers`), and after a
//! crash the holder resumes from the GTID position it stored.
//!
//! `--broker nats` runs the relays as `outbox relay --broker nats://…` and the consumers
//! as the NATS consumer (`chaos_consumer --nats-url`), on a private `nats-server -js`
//! (`nats_server.rs`) whose outages are the server stopped and started again on its
//! store; no `client_kill` (nats-server 2.9 cannot drop its clients). With `--ordered`
//! the NATS consumers read each partition subject through a durable consumer of its own
//! with one message in hand (outbox-nats's ordered mode). `--nats-cluster` runs three
//! servers in one JetStream cluster with a three-replica stream, each outage its leader
//! killed (`nats_cluster.rs`).
//! `broker.rs` is what the run asks of either broker.
//!
//! `--ci` is the short version for CI: 2000 events, 60 s of faults (5 of each process
//! kind, two Redis outages, the last 12–20 s), under two minutes in all (150 s of faults
//! with `--partitioned`).
//!
//! The `outbox` and `chaos_consumer` binaries are taken from the directory of this one
//! (build them together, as above) unless `--outbox-bin` / `--consumer-bin` say otherwise. Logs of every
//! process and the Redis files are kept in a temporary directory when a check fails.
//!
//! Where the parts are: `run` below reads as the run's phases, each a method of its
//! `World` (`world.rs`: the servers, the processes, the start, the drain and the final
//! SIGTERMs; `faults.rs`: the faults phase; `report.rs`: the end state, the verdict and
//! the summary). `config.rs` holds the command line, `plan.rs` the seeded fault plan,
//! `tally.rs` what happened; the rest are the pieces they drive (`procs.rs`,
//! `producer.rs`, `db.rs`, `db_server.rs`, `redis_server.rs`, `db_restart.rs`,
//! `check.rs`, `probe.rs`).

mod broker;
mod check;
mod config;
mod db;
mod db_restart;
mod db_server;
mod faults;
mod nats_cluster;
mod nats_server;
mod plan;
mod probe;
mod procs;
mod producer;
mod redis_server;
mod report;
mod tally;
mod world;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Parser;

use crate::config::{Args, Config};
use crate::plan::Plan;
use crate::report::{Ending, Verdict};
use crate::world::World;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The consumer group of the run.
const GROUP: &str = "chaos";

/// Set by SIGINT or SIGTERM of the harness: the run stops and cleans up.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

fn watch_interrupts() {
    std::thread::spawn(|| {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            use tokio::signal::unix::{SignalKind, signal};
            let Ok(mut term) = signal(SignalKind::terminate()) else {
                return;
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            eprintln!("chaos: interrupted, cleaning up");
            INTERRUPTED.store(true, Ordering::SeqCst);
        });
    });
}

fn interrupted() -> Result<(), BoxError> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        Err("interrupted".into())
    } else {
        Ok(())
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    watch_interrupts();
    let config = match Config::from_args(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("chaos: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&config) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("chaos: the run failed: {}", outbox_core::error_chain(&*e));
            ExitCode::from(2)
        }
    }
}

/// The run, phase by phase; whether every check passed.
fn run(c: &Config) -> Result<bool, BoxError> {
    let mut rng = fastrand::Rng::with_seed(c.seed);
    let plan = Plan::new(c, &mut rng)?;
    let mut world = World::new(c, &plan)?;
    world.start()?;
    let producers = world.start_producers();
    let faults = world.inject_faults(&plan, &mut rng);
    if faults.is_err() {
        producers.stop();
    }
    let (produced, held_failed) = producers.join()?;
    let last_fault_end = faults?;

    // Drain: everything is up; wait until every committed message is applied.
    let drained_after = world.drain()?.map(|at| at.duration_since(last_fault_end));
    // Every consumer process must be reading again, not only enough of them to drain.
    let stuck = world.stuck_consumers()?;
    // Stop every process with SIGTERM: each must exit with 0.
    let final_terms = world.terminate_all()?;
    // The checks, on a quiet system; then nothing may be left behind.
    let end = world.read_end_state(&produced)?;
    let (pids, leftovers) = world.take_down()?;

    let verdict = Verdict {
        c,
        tally: &world.tally,
        produced: &produced,
        held_failed,
        hold_open: world.hold_open,
        end,
        ending: Ending {
            drained_after,
            stuck,
            final_terms,
            leftovers,
            pids,
        },
    };
    let failed = verdict.print();
    world.keep |= failed;
    Ok(!failed)
}
