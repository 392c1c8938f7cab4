//! Transient conflicts in handlers (deadlock, lock wait timeout, serialization failure)
//! through the inbox API, on PostgreSQL and MariaDB, with a second connection (the
//! "rival") that really collides with the handler's transaction.
//!
//! What a user relies on: such a conflict is `Error::is_transient()` (retry soon, not a
//! handler bug and not an outage), and rolled-back work is never reported `Applied`.
//! On MariaDB a deadlock rolls back the whole transaction, savepoints included: in batch
//! mode that is one transient failure of the whole batch, in single mode a handler that
//! swallowed the deadlock must not be acknowledged.

mod fixtures;

use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use diesel::connection::SimpleConnection as _;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool};
use diesel::{PgConnection, QueryResult, RunQueryDsl};
use fixtures::{Backend, My, Pg, PgParted, TestDb, exec};
use outbox_core::{Error, HandlerError, Inbox, MsgId, Processed};
use outbox_diesel::DieselInbox;

/// A backend on which the rival and the handler can collide.
trait Collide: Backend {
    /// Run by the rival before its transaction, so that the handler, not the rival, is
    /// the deadlock victim.
    const RIVAL_SESSION: &'static str;
    /// Run by the rival first in its transaction, for the same reason.
    const RIVAL_BALLAST: &'static str;
    /// Locks bob's row but gives up (at once, or after a second) when the rival holds it.
    const LOCK_BOB_IMPATIENTLY: &'static str;

    /// `sql` as a prepared statement (diesel's query builder path), where MySQL's 1213
    /// is reported as `SerializationFailure`; `batch_execute` reports it as `Unknown`.
    fn prepared(c: &mut Self::Conn, sql: &str) -> QueryResult<usize>;
}

impl Collide for Pg {
    // The handler's session keeps the default 1 s: its deadlock check runs first and
    // finds the cycle, so it is the victim.
    const RIVAL_SESSION: &'static str = "SET deadlock_timeout = '60s'";
    const RIVAL_BALLAST: &'static str = "SELECT 1";
    const LOCK_BOB_IMPATIENTLY: &'static str =
        "SELECT id FROM accounts WHERE id = 'bob' FOR UPDATE NOWAIT";

    fn prepared(c: &mut PgConnection, sql: &str) -> QueryResult<usize> {
        diesel::sql_query(sql).execute(c)
    }
}

impl Collide for PgParted {
    const RIVAL_SESSION: &'static str = Pg::RIVAL_SESSION;
    const RIVAL_BALLAST: &'static str = Pg::RIVAL_BALLAST;
    const LOCK_BOB_IMPATIENTLY: &'static str = Pg::LOCK_BOB_IMPATIENTLY;

    fn prepared(c: &mut PgConnection, sql: &str) -> QueryResult<usize> {
        Pg::prepared(c, sql)
    }
}

impl Collide for My {
    const RIVAL_SESSION: &'static str = "SELECT 1";
    // InnoDB rolls back the transaction that changed fewer rows.
    const RIVAL_BALLAST: &'static str = "INSERT INTO ballast (n) SELECT seq FROM seq_1_to_500";
    const LOCK_BOB_IMPATIENTLY: &'static str = "SET SESSION innodb_lock_wait_timeout = 1;
         UPDATE accounts SET balance = balance + 1 WHERE id = 'bob'";

    fn prepared(c: &mut diesel::MysqlConnection, sql: &str) -> QueryResult<usize> {
        diesel::sql_query(sql).execute(c)
    }
}

/// Which diesel path the handler's conflicting statement takes.
#[derive(Debug, Clone, Copy)]
enum Via {
    Simple,
    Prepared,
}

fn run<B: Collide>(c: &mut B::Conn, via: Via, sql: &str) -> QueryResult<()> {
    match via {
        Via::Simple => c.batch_execute(sql),
        Via::Prepared => B::prepared(c, sql).map(drop),
    }
}

/// The rival's plan.
#[derive(Debug, Clone, Copy)]
enum Plan {
    /// Locks bob, then (on `go`) alice, which the handler holds: a deadlock.
    Deadlock,
    /// Locks bob and holds it until `go`.
    Hold,
    /// On `go`, updates bob and commits, under the handler's open snapshot.
    CommitBob,
}

/// The second connection, on its own thread.
struct Rival {
    ready: Receiver<()>,
    go: Sender<()>,
    thread: Option<JoinHandle<Result<(), String>>>,
}

impl Rival {
    fn start<B: Collide>(db: &TestDb, plan: Plan) -> Self {
        let (ready_tx, ready) = channel();
        let (go, go_rx) = channel::<()>();
        let mut c = B::connect(db);
        let thread = std::thread::spawn(move || {
            let step = |c: &mut B::Conn, sql: &str| c.batch_execute(sql).map_err(|e| e.to_string());
            match plan {
                Plan::Deadlock | Plan::Hold => {
                    step(&mut c, B::RIVAL_SESSION)?;
                    step(&mut c, "BEGIN")?;
                    step(&mut c, B::RIVAL_BALLAST)?;
                    step(
                        &mut c,
                        "UPDATE accounts SET balance = balance + 10 WHERE id = 'bob'",
                    )?;
                    ready_tx.send(()).unwrap();
                    go_rx.recv().map_err(|e| e.to_string())?;
                    if let Plan::Deadlock = plan {
                        // Waits for the handler's lock on alice until the database
                        // breaks the cycle by rolling the handler back.
                        step(
                            &mut c,
                            "UPDATE accounts SET balance = balance + 10 WHERE id = 'alice'",
                        )
                        .map_err(|e| format!("the rival was the deadlock victim: {e}"))?;
                    }
                    step(&mut c, "ROLLBACK")
                }
                Plan::CommitBob => {
                    ready_tx.send(()).unwrap();
                    go_rx.recv().map_err(|e| e.to_string())?;
                    step(
                        &mut c,
                        "UPDATE accounts SET balance = balance + 10 WHERE id = 'bob'",
                    )?;
                    ready_tx.send(()).unwrap();
                    Ok(())
                }
            }
        });
        Self {
            ready,
            go,
            thread: Some(thread),
        }
    }

    fn ready(&self) {
        self.ready.recv().expect("the rival stopped early");
    }

    fn go(&self) {
        // The rival may be gone already if it failed; `finish` reports why.
        let _ = self.go.send(());
    }

    /// Waits for the rival and fails the test if it did not do its part.
    fn finish(mut self) {
        let _ = self.go.send(());
        let thread = self.thread.take().unwrap();
        thread.join().expect("rival panicked").expect("rival");
    }
}

/// What the handler does in the collision.
#[derive(Debug, Clone, Copy)]
enum How {
    /// Locks alice, then bob, which the rival holds while it waits for alice.
    Deadlock { via: Via, swallow: bool },
    /// Gives up on bob's lock, which the rival holds.
    Impatient,
    /// Updates bob after the rival committed its own update of bob (REPEATABLE READ).
    Stale,
}

/// Runs the handler's part of the collision with `rival`. A swallowed error is followed
/// by one more write, as a handler that "goes on" would do.
fn collide<B: Collide>(
    c: &mut B::Conn,
    rival: &Rival,
    msg: &str,
    how: How,
) -> Result<(), HandlerError> {
    write(c, msg)?;
    match how {
        How::Deadlock { via, swallow } => {
            rival.ready();
            run::<B>(
                c,
                via,
                "UPDATE accounts SET balance = balance + 1 WHERE id = 'alice'",
            )?;
            rival.go();
            let conflict = run::<B>(
                c,
                via,
                "UPDATE accounts SET balance = balance + 1 WHERE id = 'bob'",
            );
            assert!(conflict.is_err(), "the handler was not the deadlock victim");
            if swallow {
                let _ =
                    c.batch_execute(&format!("INSERT INTO applied (msg) VALUES ('{msg}-after')"));
                return Ok(());
            }
            conflict?;
        }
        How::Impatient => {
            rival.ready();
            let conflict = c.batch_execute(B::LOCK_BOB_IMPATIENTLY);
            rival.go();
            conflict?;
        }
        How::Stale => {
            rival.ready();
            rival.go();
            rival.ready(); // the rival committed
            run::<B>(
                c,
                Via::Prepared,
                "UPDATE accounts SET balance = balance + 1 WHERE id = 'bob'",
            )?;
        }
    }
    Ok(())
}

fn write<C: diesel::connection::SimpleConnection>(
    c: &mut C,
    msg: &str,
) -> Result<(), HandlerError> {
    c.batch_execute(&format!("INSERT INTO applied (msg) VALUES ('{msg}')"))?;
    Ok(())
}

struct Setup<B: Backend> {
    db: TestDb,
    inbox: DieselInbox<B::Conn>,
}

/// A fresh database with `applied (msg)` and `ballast (n)`, and an inbox over a pool of
/// ONE connection, so that a retry reuses (or replaces) the connection of the conflict.
fn setup<B: Collide>() -> Setup<B> {
    let db = B::create();
    exec(
        &mut B::connect(&db),
        "CREATE TABLE applied (msg VARCHAR(64) PRIMARY KEY);
         CREATE TABLE ballast (n BIGINT);",
    );
    let inbox = DieselInbox::new(B::pool(&db, 1));
    Setup { db, inbox }
}

fn id(s: &str) -> MsgId {
    MsgId::from_parts(s, "Credit").unwrap()
}

/// Committed state: applied messages (from `a`, `b`, `c`), dedup rows, bob, alice.
fn state<B: Collide>(db: &TestDb) -> (Vec<String>, i64, i64, i64) {
    let mut c = B::connect(db);
    let mut applied = Vec::new();
    for m in ["a", "b", "c"] {
        let n = B::scalar(
            &mut c,
            &format!("SELECT COUNT(*) AS n FROM applied WHERE msg = '{m}'"),
        );
        if n == 1 {
            applied.push(m.to_owned());
        }
    }
    let dedup = B::scalar(&mut c, "SELECT COUNT(*) AS n FROM consumed_msg");
    let bob = B::scalar(&mut c, "SELECT balance AS n FROM accounts WHERE id = 'bob'");
    let alice = B::scalar(
        &mut c,
        "SELECT balance AS n FROM accounts WHERE id = 'alice'",
    );
    (applied, dedup, bob, alice)
}

fn is_transient(e: &Error) -> bool {
    e.is_transient() && !e.is_outage() && !e.is_poison() && !matches!(e, Error::Handler(_))
}

fn kinds(outcomes: &[Result<Processed, Error>]) -> Vec<String> {
    outcomes
        .iter()
        .map(|o| match o {
            Ok(p) => format!("{p:?}"),
            Err(e) if is_transient(e) => "Transient".to_owned(),
            Err(e) => format!("Err({})", outbox_core::error_chain(e)),
        })
        .collect()
}

fn nothing_committed() -> (Vec<String>, i64, i64, i64) {
    (vec![], 0, 0, 1000)
}

fn single_mode_deadlock_is_transient<B: Collide>() {
    single_mode_deadlock_is_transient_via::<B>(Via::Simple);
}

fn single_mode_deadlock_in_a_prepared_statement_is_transient<B: Collide>() {
    single_mode_deadlock_is_transient_via::<B>(Via::Prepared);
}

/// Single mode: a handler that returns the deadlock error.
fn single_mode_deadlock_is_transient_via<B: Collide>(via: Via) {
    let s = setup::<B>();
    let rival = Rival::start::<B>(&s.db, Plan::Deadlock);
    let how = How::Deadlock {
        via,
        swallow: false,
    };
    let err = s
        .inbox
        .process("g", &id("a"), |c| collide::<B>(c, &rival, "a", how))
        .unwrap_err();
    rival.finish();
    assert!(is_transient(&err), "{err:?}");
    assert_eq!(state::<B>(&s.db), nothing_committed());
    // The retry applies it, on the pool's one connection.
    let again = s.inbox.process("g", &id("a"), |c| write(c, "a")).unwrap();
    assert_eq!(again, Processed::Applied);
    assert_eq!(state::<B>(&s.db), (vec!["a".into()], 1, 0, 1000));
}

/// Single mode: a handler that catches the deadlock and goes on must never be reported
/// `Applied`: the transaction that held the dedup row is gone (MariaDB rolled it back) or
/// can only roll back (PostgreSQL).
fn single_mode_swallowed_deadlock_is_never_applied<B: Collide>() {
    let s = setup::<B>();
    let rival = Rival::start::<B>(&s.db, Plan::Deadlock);
    let how = How::Deadlock {
        via: Via::Simple,
        swallow: true,
    };
    let outcome = s
        .inbox
        .process("g", &id("a"), |c| collide::<B>(c, &rival, "a", how));
    rival.finish();
    let err = outcome.unwrap_err();
    if B::NAME == "MariaDB" {
        assert!(is_transient(&err), "{err:?}");
    } else {
        // PostgreSQL cannot tell why the transaction aborted: a handler that ignores a
        // failed statement is a handler error.
        assert!(
            outbox_core::error_chain(&err)
                .to_string()
                .contains("could not be kept"),
            "{err:?}"
        );
    }
    let (applied, dedup, _, alice) = state::<B>(&s.db);
    assert_eq!(
        (applied, dedup, alice),
        (vec![], 0, 1000),
        "no dedup row: it is retried"
    );
    let again = s.inbox.process("g", &id("a"), |c| write(c, "a")).unwrap();
    assert_eq!(again, Processed::Applied);
}

fn batch_mode_deadlock<B: Collide>() {
    batch_mode_deadlock_via::<B>(Via::Simple);
}

fn batch_mode_deadlock_in_a_prepared_statement<B: Collide>() {
    batch_mode_deadlock_via::<B>(Via::Prepared);
}

/// Batch mode: a, then b deadlocks (its handler returns the error), then c.
fn batch_mode_deadlock_via<B: Collide>(via: Via) {
    let s = setup::<B>();
    let ids = [id("a"), id("b"), id("c")];
    let rival = Rival::start::<B>(&s.db, Plan::Deadlock);
    let how = How::Deadlock {
        via,
        swallow: false,
    };
    let outcome = s.inbox.process_batch("g", &ids, |i, c| match i {
        1 => collide::<B>(c, &rival, "b", how),
        _ => write(c, ["a", "b", "c"][i]),
    });
    rival.finish();
    if B::NAME == "MariaDB" {
        // InnoDB rolled back the whole transaction, a's work and the savepoints with it.
        let err = outcome.unwrap_err();
        assert!(is_transient(&err), "{err:?}");
        assert!(
            matches!(&err, Error::TransientBatch { msg_id, .. } if msg_id.as_ref() == Some(&ids[1])),
            "{err:?}"
        );
        let shown = outbox_core::error_chain(&err).to_string();
        assert!(!shown.contains("SAVEPOINT"), "{shown}");
        assert_eq!(state::<B>(&s.db), nothing_committed());
    } else {
        // PostgreSQL rolls back to b's savepoint; a and c commit.
        let outcomes = outcome.unwrap();
        assert_eq!(kinds(&outcomes), ["Applied", "Transient", "Applied"]);
        assert_eq!(
            state::<B>(&s.db),
            (vec!["a".into(), "c".into()], 2, 0, 1000)
        );
    }
    // The retry of the batch applies what is left, on the pool's one connection.
    let outcomes = s
        .inbox
        .process_batch("g", &ids, |i, c| write(c, ["a", "b", "c"][i]))
        .unwrap();
    let expected: &[&str] = if B::NAME == "MariaDB" {
        &["Applied", "Applied", "Applied"]
    } else {
        &["Duplicate", "Applied", "Duplicate"]
    };
    assert_eq!(kinds(&outcomes), expected);
    assert_eq!(
        state::<B>(&s.db),
        (vec!["a".into(), "b".into(), "c".into()], 3, 0, 1000)
    );
}

/// Batch mode: b's handler swallows the deadlock and goes on.
fn batch_mode_swallowed_deadlock<B: Collide>() {
    let s = setup::<B>();
    let ids = [id("a"), id("b"), id("c")];
    let rival = Rival::start::<B>(&s.db, Plan::Deadlock);
    let how = How::Deadlock {
        via: Via::Prepared,
        swallow: true,
    };
    let outcome = s.inbox.process_batch("g", &ids, |i, c| match i {
        1 => collide::<B>(c, &rival, "b", how),
        _ => write(c, ["a", "b", "c"][i]),
    });
    rival.finish();
    if B::NAME == "MariaDB" {
        let err = outcome.unwrap_err();
        assert!(is_transient(&err), "{err:?}");
        let (applied, dedup, _, alice) = state::<B>(&s.db);
        assert_eq!((applied, dedup, alice), (vec![], 0, 1000));
    } else {
        let outcomes = outcome.unwrap();
        let k = kinds(&outcomes);
        assert!(k[1].contains("could not be kept"), "{k:?}");
        assert_eq!((k[0].as_str(), k[2].as_str()), ("Applied", "Applied"));
        assert_eq!(
            state::<B>(&s.db),
            (vec!["a".into(), "c".into()], 2, 0, 1000)
        );
    }
}

/// A lock wait that gives up (MariaDB 1205 after `innodb_lock_wait_timeout`, PostgreSQL
/// 55P03 with `NOWAIT`) ends only the statement: single mode reports it transient, batch
/// mode as that message's transient outcome, and the others commit.
fn lock_wait_timeout_is_transient<B: Collide>() {
    let s = setup::<B>();
    let rival = Rival::start::<B>(&s.db, Plan::Hold);
    let err = s
        .inbox
        .process("g", &id("a"), |c| {
            collide::<B>(c, &rival, "a", How::Impatient)
        })
        .unwrap_err();
    rival.finish();
    assert!(is_transient(&err), "{err:?}");
    assert_eq!(state::<B>(&s.db), nothing_committed());

    let ids = [id("a"), id("b"), id("c")];
    let rival = Rival::start::<B>(&s.db, Plan::Hold);
    let outcomes = s
        .inbox
        .process_batch("g", &ids, |i, c| match i {
            1 => collide::<B>(c, &rival, "b", How::Impatient),
            _ => write(c, ["a", "b", "c"][i]),
        })
        .unwrap();
    rival.finish();
    assert_eq!(kinds(&outcomes), ["Applied", "Transient", "Applied"]);
    assert_eq!(
        state::<B>(&s.db),
        (vec!["a".into(), "c".into()], 2, 0, 1000)
    );
}

outbox_tests::on_every_backend! {
    postgres => Pg, postgres_partitioned => PgParted, mariadb => My;
    single_mode_deadlock_is_transient,
    single_mode_deadlock_in_a_prepared_statement_is_transient,
    single_mode_swallowed_deadlock_is_never_applied,
    batch_mode_deadlock,
    batch_mode_deadlock_in_a_prepared_statement,
    batch_mode_swallowed_deadlock,
    lock_wait_timeout_is_transient,
}

/// PostgreSQL's serialization failure (40001) under REPEATABLE READ: the handler updates
/// a row that another transaction changed after the handler's snapshot.
mod pg_serialization {
    use super::*;

    #[derive(Debug)]
    struct RepeatableRead;

    impl CustomizeConnection<PgConnection, diesel::r2d2::Error> for RepeatableRead {
        fn on_acquire(&self, c: &mut PgConnection) -> Result<(), diesel::r2d2::Error> {
            c.batch_execute(
                "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ",
            )
            .map_err(diesel::r2d2::Error::QueryError)
        }
    }

    #[test]
    fn serialization_failure_is_transient() {
        let s = setup::<Pg>();
        let pool = Pool::builder()
            .max_size(1)
            .connection_customizer(Box::new(RepeatableRead))
            .build(ConnectionManager::new(s.db.url.clone()))
            .unwrap();
        let inbox = DieselInbox::new(pool);

        let rival = Rival::start::<Pg>(&s.db, Plan::CommitBob);
        let err = inbox
            .process("g", &id("a"), |c| collide::<Pg>(c, &rival, "a", How::Stale))
            .unwrap_err();
        rival.finish();
        assert!(is_transient(&err), "{err:?}");
        assert_eq!(state::<Pg>(&s.db), (vec![], 0, 10, 1000));

        let ids = [id("a"), id("b"), id("c")];
        let rival = Rival::start::<Pg>(&s.db, Plan::CommitBob);
        let outcomes = inbox
            .process_batch("g", &ids, |i, c| match i {
                1 => collide::<Pg>(c, &rival, "b", How::Stale),
                _ => write(c, ["a", "b", "c"][i]),
            })
            .unwrap();
        rival.finish();
        assert_eq!(kinds(&outcomes), ["Applied", "Transient", "Applied"]);
        assert_eq!(
            state::<Pg>(&s.db),
            (vec!["a".into(), "c".into()], 2, 20, 1000)
        );
    }
}
