//! Ordered consumers as processes, against the real Redis and PostgreSQL: 3 consumers
//! over 8 partitions, 200 keys, each event carrying its key's sequence number, applied by
//! `outbox_harness::ordered::ApplyInOrder`, which checks in its inbox transaction that
//! each follows its key's last one and records every violation. Mid-run one consumer is
//! killed (`SIGKILL`), one is stopped (`SIGSTOP`) for longer than the lease TTL and then
//! resumed, and one is added; about one first delivery in ten fails or panics. Every
//! key's events must be applied in sequence order, exactly once, with nothing left
//! pending. Run in single mode and in batch mode (16 per transaction).
//!
//! The consumer processes are this test binary run again with the consumer's arguments
//! in `OUTBOX_ORDERED_CONSUMER_ARGS` (the test `ordered_consumer_process`, ignored in a
//! normal run, which fails without them): the same code as `bin/ordered_consumer.rs`,
//! which another package's test cannot start.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use diesel::connection::SimpleConnection as _;
use diesel::prelude::*;
use diesel::sql_types::BigInt;
use outbox_core::{Envelope, Partitions, partition_of};
use outbox_harness::chaos::Tick;
use outbox_harness::ordered::{Args, POSTGRES_SETUP, run_until_signal};
use outbox_redis::entry_fields;
use outbox_tests::{Isolated, redis_url, unique, unique_prefix, wait_until_explained};

const ARGS: &str = "OUTBOX_ORDERED_CONSUMER_ARGS";
const PARTITIONS: u32 = 8;
const KEYS: usize = 200;
/// Steps per key, produced in three waves.
const STEPS: i64 = 15;

/// Not a test on its own: the consumer process the tests below start (with `--ignored`
/// and its arguments in `OUTBOX_ORDERED_CONSUMER_ARGS`). Ignored, so that it is not
/// counted as a test that passed; run without its arguments, it fails.
#[test]
#[ignore = "the consumer process of the tests below, started by them"]
fn ordered_consumer_process() {
    let args = std::env::var(ARGS).unwrap_or_else(|_| {
        panic!("{ARGS} is not set: this is the consumer process the other tests start")
    });
    let args = Args::from_args(args.split('\n').map(str::to_owned)).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let stats = runtime.block_on(run_until_signal(&args)).unwrap();
    eprintln!("ordered consumer stopped cleanly: {stats:?}");
}

/// A consumer process, its stderr in a log file; killed on drop.
struct Process {
    child: Child,
    log: PathBuf,
}

impl Process {
    fn start(args: &[String]) -> Self {
        let log = std::env::temp_dir().join(format!("{}.log", unique("ordered_consumer")));
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "ordered_consumer_process",
                "--ignored",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(ARGS, args.join("\n"))
            .env("RUST_LOG", "warn,outbox_redis=info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Self { child, log }
    }

    fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([format!("-{sig}"), self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{sig}");
    }

    /// SIGTERM, then a clean exit.
    fn stop(mut self) {
        self.signal("TERM");
        let log = self.log.clone();
        let child = &mut self.child;
        let mut status = None;
        wait_until_explained(
            Duration::from_secs(60),
            || {
                status = child.try_wait().unwrap();
                status.is_some()
            },
            || {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                format!("the consumer did not exit; log:\n{log}")
            },
        );
        assert!(status.unwrap().success(), "log:\n{}", self.log());
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Publishes steps `seqs` of every key as a foreign producer: each to its key's partition.
fn produce(redis: &mut redis::Connection, prefix: &str, seqs: std::ops::RangeInclusive<i64>) {
    let partitions = Partitions::new(PARTITIONS).unwrap();
    let mut pipe = redis::pipe();
    for seq in seqs {
        for k in 0..KEYS {
            let tick = Tick {
                key: format!("k{k}"),
                seq,
                tx: 0,
            };
            let envelope = Envelope::from_event(&tick, 1 << 20).unwrap();
            let p = partition_of(&tick.key, partitions);
            let cmd = pipe
                .cmd("XADD")
                .arg(format!("{prefix}chaos.tick:{p}"))
                .arg("*");
            for (field, value) in entry_fields(&envelope) {
                cmd.arg(field).arg(&*value);
            }
            cmd.ignore();
        }
    }
    let () = pipe.query(redis).unwrap();
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

fn count(db: &mut PgConnection, sql: &str) -> i64 {
    diesel::sql_query(sql).get_result::<Count>(db).unwrap().n
}

fn pending(redis: &mut redis::Connection, prefix: &str, group: &str) -> usize {
    (0..PARTITIONS)
        .map(|p| {
            let reply: redis::streams::StreamPendingReply = redis::cmd("XPENDING")
                .arg(format!("{prefix}chaos.tick:{p}"))
                .arg(group)
                .query(redis)
                .unwrap();
            reply.count()
        })
        .sum()
}

fn wait_applied(db: &mut PgConnection, n: i64, consumers: &[&Process]) {
    let have = std::cell::Cell::new(0);
    wait_until_explained(
        Duration::from_secs(180),
        || {
            have.set(count(db, "SELECT count(*) AS n FROM ordered_log"));
            have.get() >= n
        },
        || {
            let logs: Vec<String> = consumers.iter().map(|c| c.log()).collect();
            format!(
                "{n} applications (have {}); logs:\n{}",
                have.get(),
                logs.join("\n-----\n")
            )
        },
    );
}

#[test]
fn three_ordered_consumers_keep_every_key_in_order_through_a_kill_a_stop_and_a_newcomer() {
    scenario(None);
}

#[test]
fn the_same_in_batch_mode() {
    scenario(Some(16));
}

/// The run of the module's documentation, in single mode or batch mode.
fn scenario(batch_size: Option<usize>) {
    let schema = Isolated::postgres("ordered");
    let mut db = PgConnection::establish(&schema.url).unwrap();
    outbox_diesel::migrate(&mut db).unwrap();
    db.batch_execute(POSTGRES_SETUP).unwrap();
    let prefix = unique_prefix("ordered");
    let group = unique("ordered");
    let mut redis = redis::Client::open(redis_url())
        .unwrap()
        .get_connection()
        .unwrap();
    let args: Vec<String> = [
        "--database-url",
        &schema.url,
        "--redis-url",
        &redis_url(),
        "--stream-prefix",
        &prefix,
        "--group",
        &group,
        "--partitions",
        &PARTITIONS.to_string(),
        "--fault-one-in",
        "20",
        "--lease-ttl",
        "2s",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain(
        batch_size
            .into_iter()
            .flat_map(|n| ["--batch-size".to_owned(), n.to_string()]),
    )
    .collect();
    let consumers: Vec<Process> = (0..3).map(|_| Process::start(&args)).collect();
    let [killed, stopped, kept] = <[Process; 3]>::try_from(consumers).ok().unwrap();

    produce(&mut redis, &prefix, 1..=5);
    let all = i64::try_from(KEYS).unwrap() * STEPS;
    wait_applied(&mut db, all / 6, &[&killed, &stopped, &kept]);
    // A crash with entries in hand: its partitions are taken over after the TTL, their
    // pending entries first.
    killed.signal("KILL");
    produce(&mut redis, &prefix, 6..=10);
    // A stall longer than the lease: it must not handle anything of its partitions
    // after it resumes, whatever it had read.
    stopped.signal("STOP");
    std::thread::sleep(Duration::from_secs(5));
    let newcomer = Process::start(&args);
    stopped.signal("CONT");
    wait_applied(&mut db, all * 2 / 3, &[&stopped, &kept, &newcomer]);
    produce(&mut redis, &prefix, 11..=STEPS);
    wait_applied(&mut db, all, &[&stopped, &kept, &newcomer]);
    let left = std::cell::Cell::new(0);
    wait_until_explained(
        Duration::from_secs(60),
        || {
            left.set(pending(&mut redis, &prefix, &group));
            left.get() == 0
        },
        || format!("nothing pending; {} are", left.get()),
    );
    for consumer in [stopped, kept, newcomer] {
        consumer.stop();
    }
    drop(killed);

    let violations: Vec<(String, i64, i64)> =
        diesel::sql_query("SELECT k, seq, last FROM ordered_violations ORDER BY id")
            .load::<Violation>(&mut db)
            .unwrap()
            .into_iter()
            .map(|v| (v.k, v.seq, v.last))
            .collect();
    assert!(violations.is_empty(), "out of order: {violations:?}");
    assert_eq!(count(&mut db, "SELECT count(*) AS n FROM ordered_log"), all);
    let exact = format!(
        "SELECT count(*) AS n FROM (SELECT k FROM ordered_log GROUP BY k \
         HAVING count(*) = {STEPS} AND count(DISTINCT seq) = {STEPS} \
         AND min(seq) = 1 AND max(seq) = {STEPS}) keys"
    );
    assert_eq!(count(&mut db, &exact), i64::try_from(KEYS).unwrap());
    assert_eq!(
        count(&mut db, "SELECT count(*) AS n FROM consumed_msg"),
        all
    );
    let _: () = redis::cmd("EVAL")
        .arg("for _, k in ipairs(redis.call('KEYS', ARGV[1])) do redis.call('DEL', k) end")
        .arg(0)
        .arg(format!("{prefix}*"))
        .query(&mut redis)
        .unwrap();
}

#[derive(QueryableByName)]
struct Violation {
    #[diesel(sql_type = diesel::sql_types::Text)]
    k: String,
    #[diesel(sql_type = BigInt)]
    seq: i64,
    #[diesel(sql_type = BigInt)]
    last: i64,
}
