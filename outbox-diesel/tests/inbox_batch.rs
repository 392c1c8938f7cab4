//! The inbox's batch mode (`Inbox::process_batch`: one transaction, a savepoint per
//! message) against each backend: PostgreSQL and MariaDB on this machine, SQLite in a
//! temp file.

mod fixtures;

use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use diesel::Connection;
use diesel::connection::SimpleConnection as _;
use fixtures::{Backend, Lite, My, Pg, PgParted, exec};
use outbox_core::{
    Delivery, Dispatcher, Envelope, Handler, HandlerError, Inbox, MsgId, OutboxEvent, Processed,
};
use outbox_diesel::DieselInbox;
use serde::{Deserialize, Serialize};

/// How the test handler behaves after its writes.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
enum How {
    Ok,
    Fail,
    /// A statement fails (on PostgreSQL this aborts the transaction) and the handler
    /// returns its error.
    BadSql,
    /// A statement fails and the handler ignores it.
    IgnoredBadSql,
    Panic,
    /// Panics inside a nested transaction of its own, leaving it open.
    PanicInNested,
    /// Opens a nested transaction of its own and returns `Ok` without closing it.
    LeaveNestedOpen,
    /// Ends its message's savepoint itself (diesel's commit one level down).
    ReleaseOwnSavepoint,
    /// Sends a `COMMIT` of its own: the batch's whole transaction ends.
    RawCommit,
}

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
struct Credit {
    #[outbox(id)]
    id: String,
    how: How,
}

/// Records the message in `applied`, credits bob 1, then behaves as told.
struct Apply<C> {
    calls: Arc<AtomicUsize>,
    conn: PhantomData<fn() -> C>,
}

fn write<C: Connection>(c: &mut C, id: &str) -> Result<(), HandlerError> {
    c.batch_execute(&format!(
        "INSERT INTO applied (msg) VALUES ('{id}');
         UPDATE accounts SET balance = balance + 1 WHERE id = 'bob';"
    ))?;
    Ok(())
}

impl<C: Connection + 'static> Handler<Credit> for Apply<C> {
    type Conn = C;

    fn handle(&self, e: Credit, c: &mut C, _: &Delivery) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        write(c, &e.id)?;
        match e.how {
            How::Ok => Ok(()),
            How::Fail => Err(HandlerError::msg("refused")),
            How::BadSql => {
                c.batch_execute("INSERT INTO no_such_table (x) VALUES (1)")?;
                Ok(())
            }
            How::IgnoredBadSql => {
                let _ = c.batch_execute("INSERT INTO no_such_table (x) VALUES (1)");
                Ok(())
            }
            How::Panic => panic!("handler bug"),
            How::LeaveNestedOpen => {
                <C::TransactionManager as diesel::connection::TransactionManager<C>>::begin_transaction(c)?;
                Ok(())
            }
            How::ReleaseOwnSavepoint => {
                <C::TransactionManager as diesel::connection::TransactionManager<C>>::commit_transaction(c)?;
                Ok(())
            }
            How::RawCommit => {
                c.batch_execute("COMMIT")?;
                Ok(())
            }
            How::PanicInNested => {
                c.transaction::<(), diesel::result::Error, _>(|c| {
                    c.batch_execute(
                        "UPDATE accounts SET balance = balance + 100 WHERE id = 'alice'",
                    )?;
                    panic!("handler bug in a nested transaction")
                })?;
                Ok(())
            }
        }
    }
}

struct Setup<B: Backend> {
    db: fixtures::TestDb,
    inbox: DieselInbox<B::Conn>,
}

/// A fresh database with an `applied (msg)` table, and an inbox over a pool of ONE
/// connection, so that every batch reuses (or replaces) the previous one's.
fn setup<B: Backend>() -> Setup<B> {
    let db = B::create();
    exec(
        &mut B::connect(&db),
        "CREATE TABLE applied (msg VARCHAR(64) PRIMARY KEY)",
    );
    let inbox = DieselInbox::new(B::pool(&db, 1));
    Setup { db, inbox }
}

fn dispatcher<C: Connection + 'static>() -> (Dispatcher<C>, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let mut d = Dispatcher::new();
    d.register::<Credit, _>(Apply {
        calls: Arc::clone(&calls),
        conn: PhantomData,
    })
    .unwrap();
    (d, calls)
}

fn credit(id: &str, how: How) -> Delivery {
    let e = Credit { id: id.into(), how };
    Delivery {
        envelope: Envelope::from_event(&e, 1024).unwrap(),
        delivery_count: 1,
        entry_id: None,
    }
}

fn id(s: &str) -> MsgId {
    MsgId::from_parts(s, "Credit").unwrap()
}

/// The committed state: applied messages, dedup rows of `group`, bob's and alice's
/// balances.
fn state<B: Backend>(db: &fixtures::TestDb, group: &str) -> (Vec<String>, i64, i64, i64) {
    let mut c = B::connect(db);
    let mut applied = Vec::new();
    for m in ["a", "b", "c", "d", "e", "f", "g"] {
        if B::scalar(
            &mut c,
            &format!("SELECT COUNT(*) AS n FROM applied WHERE msg = '{m}'"),
        ) == 1
        {
            applied.push(m.to_owned());
        }
    }
    let dedup = B::scalar(
        &mut c,
        &format!("SELECT COUNT(*) AS n FROM consumed_msg WHERE consumer_group = '{group}'"),
    );
    let bob = B::scalar(&mut c, "SELECT balance AS n FROM accounts WHERE id = 'bob'");
    let alice = B::scalar(
        &mut c,
        "SELECT balance AS n FROM accounts WHERE id = 'alice'",
    );
    (applied, dedup, bob, alice)
}

fn kinds(outcomes: &[Result<Processed, outbox_core::Error>]) -> Vec<String> {
    outcomes
        .iter()
        .map(|o| match o {
            Ok(p) => format!("{p:?}"),
            Err(outbox_core::Error::Handler(e)) => {
                format!("Handler({})", outbox_core::error_chain(&**e))
            }
            Err(e) => format!("Err({})", outbox_core::error_chain(e)),
        })
        .collect()
}

fn failing_handlers_roll_back_only_their_own_message<B: Backend>() {
    let s = setup::<B>();
    let (d, calls) = dispatcher::<B::Conn>();
    let batch = [
        credit("a", How::Ok),
        credit("b", How::Fail),
        credit("c", How::BadSql),
        credit("d", How::Panic),
        credit("e", How::PanicInNested),
        credit("f", How::Ok),
    ];
    let outcomes = d.consume_batch(&s.inbox, "g1", &batch).unwrap();
    let k = kinds(&outcomes);
    assert_eq!(k[0], "Applied");
    assert_eq!(k[1], "Handler(refused)");
    assert!(
        k[2].starts_with("Handler(") && k[2].contains("no_such_table"),
        "{k:?}"
    );
    assert_eq!(k[3], "Handler(handler panicked: handler bug)");
    assert_eq!(
        k[4],
        "Handler(handler panicked: handler bug in a nested transaction)"
    );
    assert_eq!(k[5], "Applied");
    assert_eq!(calls.load(Ordering::SeqCst), 6);
    // Only a and f: neither the failing ones' writes (nor the nested transaction's
    // credit to alice) nor their dedup rows.
    assert_eq!(
        state::<B>(&s.db, "g1"),
        (vec!["a".to_owned(), "f".to_owned()], 2, 2, 1000)
    );
    // The failed ones are retried on redelivery, and the connection is still healthy.
    let retry = [
        credit("b", How::Ok),
        credit("c", How::Ok),
        credit("a", How::Ok),
    ];
    let outcomes = d.consume_batch(&s.inbox, "g1", &retry).unwrap();
    assert_eq!(kinds(&outcomes), ["Applied", "Applied", "Duplicate"]);
    assert_eq!(state::<B>(&s.db, "g1").1, 4);
}

fn an_ignored_failed_statement_fails_only_its_message<B: Backend>() {
    let s = setup::<B>();
    let (d, _) = dispatcher::<B::Conn>();
    let batch = [
        credit("a", How::Ok),
        credit("b", How::IgnoredBadSql),
        credit("c", How::Ok),
    ];
    let outcomes = d.consume_batch(&s.inbox, "g1", &batch).unwrap();
    let k = kinds(&outcomes);
    let (applied, dedup, bob, _) = state::<B>(&s.db, "g1");
    if B::NAME.starts_with("PostgreSQL") {
        // The failed statement aborted the transaction; only rolling back to the
        // message's savepoint saves the others.
        assert!(k[1].contains("could not be kept"), "{k:?}");
        assert_eq!((applied, dedup, bob), (vec!["a".into(), "c".into()], 2, 2));
    } else {
        // MySQL and SQLite roll back only the failing statement.
        assert_eq!(k[1], "Applied");
        assert_eq!(dedup, 3);
        assert_eq!(bob, 3);
    }
    assert_eq!((k[0].as_str(), k[2].as_str()), ("Applied", "Applied"));
}

/// Single mode (`Inbox::process`, one transaction per message) must never report
/// `Applied` for writes that did not commit: the runner would acknowledge a message
/// whose effect is lost.
fn single_mode_never_acks_writes_that_did_not_commit<B: Backend>() {
    let s = setup::<B>();
    let (d, _) = dispatcher::<B::Conn>();
    let open = d.consume(&s.inbox, "g1", &credit("a", How::LeaveNestedOpen));
    assert!(
        open.as_ref().is_err_and(|e| outbox_core::error_chain(e)
            .to_string()
            .contains("still open")),
        "{open:?}"
    );
    assert_eq!(
        state::<B>(&s.db, "g1").1,
        0,
        "no dedup row: it will be retried"
    );

    let ignored = d.consume(&s.inbox, "g1", &credit("b", How::IgnoredBadSql));
    if B::NAME.starts_with("PostgreSQL") {
        assert!(
            ignored.as_ref().is_err_and(|e| outbox_core::error_chain(e)
                .to_string()
                .contains("could not be kept")),
            "{ignored:?}"
        );
        assert_eq!(state::<B>(&s.db, "g1"), (vec![], 0, 0, 1000));
    } else {
        // MySQL and SQLite roll back only the failing statement: the rest commits.
        assert_eq!(ignored.unwrap(), Processed::Applied);
        assert_eq!(state::<B>(&s.db, "g1").0, ["b"]);
    }
    // The pool's one connection is usable again.
    assert_eq!(
        d.consume(&s.inbox, "g1", &credit("c", How::Ok)).unwrap(),
        Processed::Applied
    );
}

fn duplicates_do_not_run_the_handler<B: Backend>() {
    let s = setup::<B>();
    assert_eq!(
        s.inbox.process("g1", &id("a"), |c| write(c, "a")).unwrap(),
        Processed::Applied
    );
    let ids = [id("a"), id("b"), id("b"), id("c")];
    let mut ran = Vec::new();
    let outcomes = s
        .inbox
        .process_batch("g1", &ids, |i, c| {
            ran.push(i);
            write(c, ["a", "b", "b", "c"][i])
        })
        .unwrap();
    assert_eq!(
        kinds(&outcomes),
        ["Duplicate", "Applied", "Duplicate", "Applied"]
    );
    assert_eq!(ran, [1, 3], "earlier and in-batch duplicates do not run");
    assert_eq!(
        state::<B>(&s.db, "g1"),
        (vec!["a".into(), "b".into(), "c".into()], 3, 3, 1000)
    );
    // Another group has its own dedup rows.
    let outcomes = s
        .inbox
        .process_batch("g2", &ids[..1], |_, _| Ok(()))
        .unwrap();
    assert_eq!(kinds(&outcomes), ["Applied"]);
    // An empty batch does nothing.
    assert!(
        s.inbox
            .process_batch("g1", &[], |_, _| Ok(()))
            .unwrap()
            .is_empty()
    );
}

/// Breaks the store in the middle of a batch: the connection is killed (PostgreSQL,
/// MariaDB) or the dedup table is dropped inside the transaction (SQLite), so that the
/// next statement fails.
trait Sabotage: Backend {
    fn sabotage(c: &mut Self::Conn) -> Result<(), HandlerError>;
}

impl Sabotage for Pg {
    fn sabotage(c: &mut Self::Conn) -> Result<(), HandlerError> {
        c.batch_execute("SELECT pg_terminate_backend(pg_backend_pid())")?;
        Ok(())
    }
}

impl Sabotage for PgParted {
    fn sabotage(c: &mut Self::Conn) -> Result<(), HandlerError> {
        Pg::sabotage(c)
    }
}

impl Sabotage for My {
    fn sabotage(c: &mut Self::Conn) -> Result<(), HandlerError> {
        let me = My::scalar(c, "SELECT CAST(CONNECTION_ID() AS SIGNED) AS n");
        c.batch_execute(&format!("KILL {me}"))?;
        Ok(())
    }
}

impl Sabotage for Lite {
    fn sabotage(c: &mut Self::Conn) -> Result<(), HandlerError> {
        c.batch_execute("DROP TABLE consumed_msg")?;
        Ok(())
    }
}

fn a_store_failure_commits_nothing<B: Sabotage>() {
    let s = setup::<B>();
    let ids = [id("a"), id("b"), id("c")];
    let err = s
        .inbox
        .process_batch("g1", &ids, |i, c| {
            write(c, ["a", "b", "c"][i])?;
            if i == 1 { B::sabotage(c) } else { Ok(()) }
        })
        .unwrap_err();
    assert!(err.is_outage(), "{err:?}");
    assert_eq!(state::<B>(&s.db, "g1"), (vec![], 0, 0, 1000));
    // The pool replaced or repaired the connection: the same batch now applies in full.
    let outcomes = s
        .inbox
        .process_batch("g1", &ids, |i, c| write(c, ["a", "b", "c"][i]))
        .unwrap();
    assert_eq!(kinds(&outcomes), ["Applied", "Applied", "Applied"]);
}

fn a_panic_through_process_batch_commits_nothing<B: Backend>() {
    let s = setup::<B>();
    let ids = [id("a"), id("b"), id("c")];
    let unwound = std::panic::catch_unwind(AssertUnwindSafe(|| {
        s.inbox.process_batch("g1", &ids, |i, c| {
            write(c, ["a", "b", "c"][i])?;
            assert!(i < 1, "a bug in the caller's closure");
            Ok(())
        })
    }));
    assert!(unwound.is_err());
    assert_eq!(state::<B>(&s.db, "g1"), (vec![], 0, 0, 1000));
    // The pool discarded the connection left in the transaction.
    let outcomes = s
        .inbox
        .process_batch("g1", &ids, |i, c| write(c, ["a", "b", "c"][i]))
        .unwrap();
    assert_eq!(kinds(&outcomes), ["Applied", "Applied", "Applied"]);
    assert_eq!(state::<B>(&s.db, "g1").1, 3);
}

fn an_invalid_group_is_an_error_before_any_transaction<B: Backend>() {
    let s = setup::<B>();
    let long = "g".repeat(65);
    let err = s
        .inbox
        .process_batch(&long, &[id("a")], |_, _| panic!("must not run"))
        .unwrap_err();
    let shown = outbox_core::error_chain(&err).to_string();
    assert!(shown.contains("consumer_group"), "{shown}");
}

/// A failing handler in the middle of new and already consumed messages: exactly the
/// others commit, and nothing of it, not even its dedup row (PostgreSQL inserts the
/// batch's dedup rows ahead of the handlers and must give the row back), so that its
/// redelivery applies it, once.
fn a_failed_message_among_duplicates_is_redelivered_and_applied_once<B: Backend>() {
    let s = setup::<B>();
    let (d, calls) = dispatcher::<B::Conn>();
    let before = [credit("a", How::Ok), credit("c", How::Ok)];
    let outcomes = d.consume_batch(&s.inbox, "g1", &before).unwrap();
    assert_eq!(kinds(&outcomes), ["Applied", "Applied"]);
    let batch = [
        credit("a", How::Ok),
        credit("b", How::Ok),
        credit("c", How::Ok),
        credit("d", How::Fail),
        credit("e", How::Ok),
    ];
    let outcomes = d.consume_batch(&s.inbox, "g1", &batch).unwrap();
    assert_eq!(
        kinds(&outcomes),
        [
            "Duplicate",
            "Applied",
            "Duplicate",
            "Handler(refused)",
            "Applied"
        ]
    );
    assert_eq!(calls.load(Ordering::SeqCst), 5, "duplicates do not run");
    assert_eq!(
        state::<B>(&s.db, "g1"),
        (
            vec!["a".into(), "b".into(), "c".into(), "e".into()],
            4,
            4,
            1000
        )
    );
    // Redelivered (with one that is now a duplicate): d applies, once.
    let again = [credit("d", How::Ok), credit("e", How::Ok)];
    let outcomes = d.consume_batch(&s.inbox, "g1", &again).unwrap();
    assert_eq!(kinds(&outcomes), ["Applied", "Duplicate"]);
    let again = [credit("d", How::Ok)];
    let outcomes = d.consume_batch(&s.inbox, "g1", &again).unwrap();
    assert_eq!(kinds(&outcomes), ["Duplicate"]);
    assert_eq!(
        state::<B>(&s.db, "g1"),
        (
            vec!["a".into(), "b".into(), "c".into(), "d".into(), "e".into()],
            5,
            5,
            1000
        )
    );
}

/// The first and the last message of a batch fail alone too: the first before any
/// savepoint was released, the last where the fast path releases its savepoint in the
/// same round trip as the `COMMIT` (an ignored failed statement makes that `RELEASE`
/// fail on PostgreSQL, and the `COMMIT` must then not run).
fn failures_at_either_end_of_a_batch_fail_only_their_message<B: Backend>() {
    let s = setup::<B>();
    let (d, _) = dispatcher::<B::Conn>();
    let batch = [
        credit("a", How::Fail),
        credit("b", How::Ok),
        credit("c", How::IgnoredBadSql),
    ];
    let outcomes = d.consume_batch(&s.inbox, "g1", &batch).unwrap();
    let k = kinds(&outcomes);
    assert_eq!(k[..2], ["Handler(refused)", "Applied"]);
    let redelivered = [credit("a", How::Ok), credit("c", How::Ok)];
    let outcomes = d.consume_batch(&s.inbox, "g1", &redelivered).unwrap();
    if B::NAME.starts_with("PostgreSQL") {
        assert!(k[2].contains("could not be kept"), "{k:?}");
        assert_eq!(kinds(&outcomes), ["Applied", "Applied"]);
    } else {
        // MySQL and SQLite roll back only the failing statement.
        assert_eq!(k[2], "Applied");
        assert_eq!(kinds(&outcomes), ["Applied", "Duplicate"]);
    }
    assert_eq!(
        state::<B>(&s.db, "g1"),
        (vec!["a".into(), "b".into(), "c".into()], 3, 3, 1000)
    );
    // A batch whose only message fails commits nothing of it.
    let outcomes = d
        .consume_batch(&s.inbox, "g1", &[credit("d", How::Fail)])
        .unwrap();
    assert_eq!(kinds(&outcomes), ["Handler(refused)"]);
    assert_eq!(state::<B>(&s.db, "g1").1, 3);
}

/// A message that comes twice in one batch (re-published, read together) after its
/// first occurrence failed: the second applies it, and the next is a duplicate. A
/// failure right after the repeat does not take the repeat's writes with it.
fn a_repeat_in_the_batch_after_a_failure_applies_once<B: Backend>() {
    let s = setup::<B>();
    let (d, calls) = dispatcher::<B::Conn>();
    let batch = [
        credit("a", How::Fail),
        credit("b", How::Ok),
        credit("a", How::Ok),
        credit("c", How::Fail),
        credit("a", How::Ok),
        credit("b", How::Ok),
    ];
    let outcomes = d.consume_batch(&s.inbox, "g1", &batch).unwrap();
    assert_eq!(
        kinds(&outcomes),
        [
            "Handler(refused)",
            "Applied",
            "Applied",
            "Handler(refused)",
            "Duplicate",
            "Duplicate"
        ]
    );
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    assert_eq!(
        state::<B>(&s.db, "g1"),
        (vec!["a".into(), "b".into()], 2, 2, 1000)
    );
}

/// A handler that ends more than it began (releases its message's savepoint, or commits
/// the batch's transaction) must not make a message applied twice or lost: whatever the
/// batch reports, every message delivered again one by one (as the consumer does after a
/// failed batch, and as redelivery does) is applied exactly once in all.
fn a_handler_ending_the_batch_transaction_loses_and_doubles_nothing<B: Backend>() {
    for how in [How::ReleaseOwnSavepoint, How::RawCommit] {
        let s = setup::<B>();
        let (d, _) = dispatcher::<B::Conn>();
        let batch = [credit("a", How::Ok), credit("b", how), credit("c", How::Ok)];
        let _ = d.consume_batch(&s.inbox, "g1", &batch);
        for m in ["a", "b", "c"] {
            let again = d.consume(&s.inbox, "g1", &credit(m, How::Ok));
            assert!(
                matches!(again, Ok(Processed::Applied | Processed::Duplicate)),
                "{how:?}: {m} delivered again: {again:?}"
            );
        }
        assert_eq!(
            state::<B>(&s.db, "g1"),
            (vec!["a".into(), "b".into(), "c".into()], 3, 3, 1000),
            "{how:?}"
        );
    }
}

outbox_tests::on_every_backend! {
    postgres => Pg, postgres_partitioned => PgParted, mariadb => My, sqlite => Lite;
    failing_handlers_roll_back_only_their_own_message,
    an_ignored_failed_statement_fails_only_its_message,
    single_mode_never_acks_writes_that_did_not_commit,
    duplicates_do_not_run_the_handler,
    a_store_failure_commits_nothing,
    a_panic_through_process_batch_commits_nothing,
    an_invalid_group_is_an_error_before_any_transaction,
    a_failed_message_among_duplicates_is_redelivered_and_applied_once,
    failures_at_either_end_of_a_batch_fail_only_their_message,
    a_repeat_in_the_batch_after_a_failure_applies_once,
    a_handler_ending_the_batch_transaction_loses_and_doubles_nothing,
}

/// PostgreSQL's batch mode costs one round trip per message beyond its handler's: the
/// batch's dedup rows go in one statement ahead of the handlers, and a message's
/// `RELEASE SAVEPOINT` travels with the next one's `SAVEPOINT` (or the `COMMIT`). The
/// per-message path cost four with a one-statement handler (savepoint, dedup insert,
/// the handler's statement, release): 82 for this batch of 20.
#[test]
fn postgres_batches_cost_one_round_trip_per_message_beyond_the_handler() {
    use diesel::connection::InstrumentationEvent;
    use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool};

    #[derive(Debug)]
    struct Count(Arc<AtomicUsize>);
    impl CustomizeConnection<diesel::PgConnection, diesel::r2d2::Error> for Count {
        fn on_acquire(&self, c: &mut diesel::PgConnection) -> Result<(), diesel::r2d2::Error> {
            let n = Arc::clone(&self.0);
            c.set_instrumentation(move |e: InstrumentationEvent<'_>| {
                if matches!(e, InstrumentationEvent::StartQuery { .. }) {
                    n.fetch_add(1, Ordering::SeqCst);
                }
            });
            Ok(())
        }
    }

    let db = Pg::create();
    exec(
        &mut Pg::connect(&db),
        "CREATE TABLE applied (msg VARCHAR(64) PRIMARY KEY)",
    );
    let statements = Arc::new(AtomicUsize::new(0));
    let pool = Pool::builder()
        .max_size(1)
        .test_on_check_out(false)
        .connection_customizer(Box::new(Count(Arc::clone(&statements))))
        .build(ConnectionManager::new(db.url.clone()))
        .unwrap();
    let inbox = DieselInbox::new(pool);
    let names: Vec<String> = (0..20).map(|i| format!("m{i}")).collect();
    let ids: Vec<MsgId> = names.iter().map(|n| id(n)).collect();
    let update = |_: usize, c: &mut diesel::PgConnection| {
        c.batch_execute("UPDATE accounts SET balance = balance + 1 WHERE id = 'bob'")?;
        Ok(())
    };
    // A first batch in another group prepares the statements on the connection.
    inbox.process_batch("warm", &ids, update).unwrap();
    let ran = |group: &str| {
        let before = statements.load(Ordering::SeqCst);
        let outcomes = inbox.process_batch(group, &ids, update).unwrap();
        (kinds(&outcomes), statements.load(Ordering::SeqCst) - before)
    };
    let (k, n) = ran("g1");
    assert!(k.iter().all(|k| k == "Applied"), "{k:?}");
    // BEGIN, the dedup insert, SAVEPOINT, 20 × (UPDATE, RELEASE + SAVEPOINT or COMMIT).
    assert_eq!(n, 43, "statements for a batch of 20 new messages");
    let (k, n) = ran("g1");
    assert!(k.iter().all(|k| k == "Duplicate"), "{k:?}");
    // BEGIN, the dedup insert, COMMIT.
    assert_eq!(n, 3, "statements for a batch of 20 duplicates");
    assert_eq!(
        Pg::scalar(
            &mut Pg::connect(&db),
            "SELECT balance AS n FROM accounts WHERE id = 'bob'"
        ),
        40
    );
}
