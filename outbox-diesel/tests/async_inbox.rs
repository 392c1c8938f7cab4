//! The inbox on diesel-async (`AsyncPgInbox`, `AsyncMysqlInbox`; features `async-postgres`
//! and `async-mysql`) against PostgreSQL and MariaDB: the contract of the blocking inbox,
//! awaited. A new message is applied once and then a duplicate; a handler error rolls back
//! the dedup row with its writes; a deadlock is transient; a handler that swallowed a
//! failed statement (or a deadlock) is never reported `Applied`; a panicking handler is a
//! handler error that leaves the pool usable; batches have one outcome per message.
#![cfg(all(feature = "async-postgres", feature = "async-mysql"))]

mod fixtures;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use diesel::connection::SimpleConnection as _;
use diesel_async::SimpleAsyncConnection;
use fixtures::{Backend, My, Pg, TestDb, exec, runtime};
use outbox_core::{
    AsyncInbox, AsyncTxHandler, Delivery, Dispatcher, Envelope, Error, HandlerError, MsgId,
    OutboxEvent, Processed,
};
use outbox_diesel::{AsyncMysqlInbox, AsyncPgInbox};
use serde::{Deserialize, Serialize};

/// A backend with its async inbox.
trait AsyncBackend: Backend {
    type Inbox: AsyncInbox<Conn: SimpleAsyncConnection>;
    /// Run by the rival before its transaction, so that the handler is the deadlock
    /// victim (see tests/inbox_transient.rs).
    const RIVAL_SESSION: &'static str;
    const RIVAL_BALLAST: &'static str;
    /// The session's id on the server.
    const SESSION_ID: &'static str;

    fn inbox_at(url: &str, size: usize) -> Self::Inbox;
    /// The test database's URL with another port.
    fn url_at(port: u16) -> String;

    fn inbox(db: &TestDb, size: usize) -> Self::Inbox {
        Self::inbox_at(&db.url, size)
    }
}

impl AsyncBackend for Pg {
    type Inbox = AsyncPgInbox;
    const RIVAL_SESSION: &'static str = "SET deadlock_timeout = '60s'";
    const RIVAL_BALLAST: &'static str = "SELECT 1";
    const SESSION_ID: &'static str = "pg_backend_pid()";

    fn inbox_at(url: &str, size: usize) -> AsyncPgInbox {
        AsyncPgInbox::connect(url, size).unwrap()
    }

    fn url_at(port: u16) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/test")
    }
}

impl AsyncBackend for My {
    type Inbox = AsyncMysqlInbox;
    const RIVAL_SESSION: &'static str = "SELECT 1";
    // InnoDB rolls back the transaction that changed fewer rows.
    const RIVAL_BALLAST: &'static str = "INSERT INTO ballast (n) SELECT seq FROM seq_1_to_500";
    const SESSION_ID: &'static str = "CONNECTION_ID()";

    fn inbox_at(url: &str, size: usize) -> AsyncMysqlInbox {
        AsyncMysqlInbox::connect(url, size).unwrap()
    }

    fn url_at(port: u16) -> String {
        format!("mysql://root@127.0.0.1:{port}/test")
    }
}

/// A fresh database with `applied (msg)` and `ballast (n)`, and an inbox over a pool of
/// ONE connection, so that each test's next transaction reuses (or replaces) the
/// connection of the one before.
fn setup<B: AsyncBackend>() -> (TestDb, B::Inbox) {
    let db = B::create();
    exec(
        &mut B::connect(&db),
        "CREATE TABLE applied (msg VARCHAR(64) PRIMARY KEY);
         CREATE TABLE ballast (n BIGINT);",
    );
    let inbox = B::inbox(&db, 1);
    (db, inbox)
}

fn id(s: &str) -> MsgId {
    MsgId::from_parts(s, "Credit").unwrap()
}

async fn write<C: SimpleAsyncConnection>(c: &mut C, msg: &str) -> Result<(), HandlerError> {
    c.batch_execute(&format!(
        "INSERT INTO applied (msg) VALUES ('{msg}');
         UPDATE accounts SET balance = balance + 1 WHERE id = 'bob';"
    ))
    .await?;
    Ok(())
}

/// Records the message only (no lock on bob).
async fn insert<C: SimpleAsyncConnection>(c: &mut C, msg: &str) -> Result<(), HandlerError> {
    c.batch_execute(&format!("INSERT INTO applied (msg) VALUES ('{msg}')"))
        .await?;
    Ok(())
}

/// Committed state: the applied messages, the dedup rows, bob's balance.
fn state<B: Backend>(db: &TestDb) -> (Vec<String>, i64, i64) {
    let mut c = B::connect(db);
    let mut applied = Vec::new();
    for m in ["a", "b", "c", "d"] {
        let sql = format!("SELECT COUNT(*) AS n FROM applied WHERE msg = '{m}'");
        if B::scalar(&mut c, &sql) == 1 {
            applied.push(m.to_owned());
        }
    }
    let dedup = B::scalar(&mut c, "SELECT COUNT(*) AS n FROM consumed_msg");
    let bob = B::scalar(&mut c, "SELECT balance AS n FROM accounts WHERE id = 'bob'");
    (applied, dedup, bob)
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
            Err(Error::Handler(e)) => format!("Handler({e})"),
            Err(e) => format!("Err({})", outbox_core::error_chain(e)),
        })
        .collect()
}

/// A new message is applied with its writes; the same msg_id again is a duplicate and
/// does not run the handler; another group applies it on its own.
async fn applied_once_then_duplicate<B: AsyncBackend>() {
    let (db, inbox) = setup::<B>();
    let calls = AtomicUsize::new(0);
    let run = |group: &'static str| {
        let calls = &calls;
        inbox.process(group, &ID_A, move |c| {
            calls.fetch_add(1, Ordering::SeqCst);
            Box::pin(write(c, group))
        })
    };
    assert_eq!(run("a").await.unwrap(), Processed::Applied);
    assert_eq!(run("a").await.unwrap(), Processed::Duplicate);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "a duplicate runs no handler"
    );
    assert_eq!(state::<B>(&db), (vec!["a".into()], 1, 1));
    assert_eq!(run("b").await.unwrap(), Processed::Applied);
    assert_eq!(state::<B>(&db), (vec!["a".into(), "b".into()], 2, 2));
    assert_eq!(inbox.capacity(), Some(1));
}

/// Records the message and the server session it ran in (in `ballast`).
async fn insert_in_session<B: AsyncBackend, C: SimpleAsyncConnection>(
    c: &mut C,
    msg: &str,
) -> Result<(), HandlerError> {
    insert(c, msg).await?;
    c.batch_execute(&format!("INSERT INTO ballast (n) SELECT {}", B::SESSION_ID))
        .await?;
    Ok(())
}

/// The inbox commits without leaving diesel-async's transaction manager believing a
/// transaction is still open (which would make the pool drop the connection and open a
/// new one for every message): messages applied, refused and repeated in a row share
/// the pool's one session.
async fn commits_keep_the_pooled_connection<B: AsyncBackend>() {
    let (db, inbox) = setup::<B>();
    for (msg, expect) in [("a", true), ("b", true), ("a", false), ("c", true)] {
        let outcome = inbox
            .process("g", &id(msg), |c| {
                Box::pin(insert_in_session::<B, _>(c, msg))
            })
            .await
            .unwrap();
        let applied = outcome == Processed::Applied;
        assert_eq!(applied, expect, "{msg}: {outcome:?}");
    }
    let failed = inbox
        .process("g", &id("d"), |_| {
            Box::pin(async { Err(HandlerError::msg("refused")) })
        })
        .await;
    assert!(matches!(failed, Err(Error::Handler(_))), "{failed:?}");
    let outcome = inbox
        .process("g", &id("d"), |c| {
            Box::pin(insert_in_session::<B, _>(c, "d"))
        })
        .await;
    assert_eq!(outcome.unwrap(), Processed::Applied);
    assert_eq!(
        sessions::<B>(&db),
        (1, 4),
        "every transaction ran in one session"
    );
}

/// How many server sessions the recorded transactions ran in, and how many there were.
fn sessions<B: Backend>(db: &TestDb) -> (i64, i64) {
    let mut c = B::connect(db);
    let distinct = B::scalar(&mut c, "SELECT COUNT(DISTINCT n) AS n FROM ballast");
    (
        distinct,
        B::scalar(&mut c, "SELECT COUNT(*) AS n FROM ballast"),
    )
}

/// PostgreSQL: a `COMMIT` that fails by itself (a deferred constraint) ends the
/// transaction; the message is not applied, nothing of it commits, and the connection
/// goes on serving the next message.
async fn a_failing_commit_is_not_applied() {
    let (db, inbox) = setup::<Pg>();
    exec(
        &mut Pg::connect(&db),
        "CREATE TABLE once (n INT, CONSTRAINT once_n UNIQUE (n) DEFERRABLE INITIALLY DEFERRED)",
    );
    let outcome = inbox
        .process("g", &id("a"), |c| {
            Box::pin(async move {
                insert_in_session::<Pg, _>(c, "a").await?;
                c.batch_execute("INSERT INTO once VALUES (1); INSERT INTO once VALUES (1)")
                    .await?;
                Ok(())
            })
        })
        .await;
    assert!(outcome.is_err(), "{outcome:?}");
    assert_eq!(state::<Pg>(&db), (vec![], 0, 0), "nothing committed");
    let outcome = inbox
        .process("g", &id("a"), |c| {
            Box::pin(insert_in_session::<Pg, _>(c, "a"))
        })
        .await;
    assert_eq!(outcome.unwrap(), Processed::Applied);
    assert_eq!(sessions::<Pg>(&db).0, 1, "the connection was kept");
}

#[test]
fn pg_a_failing_commit_is_not_applied() {
    runtime().block_on(a_failing_commit_is_not_applied());
}

static ID_A: std::sync::LazyLock<MsgId> = std::sync::LazyLock::new(|| id("a"));

/// A handler error rolls back its writes and the dedup row: the retry applies it.
async fn handler_error_rolls_back_the_dedup_row<B: AsyncBackend>() {
    let (db, inbox) = setup::<B>();
    let err = inbox
        .process("g", &id("a"), |c| {
            Box::pin(async move {
                write(c, "a").await?;
                Err(HandlerError::msg("refused"))
            })
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Handler(e) if e.to_string() == "refused"),
        "{err:?}"
    );
    assert!(!err.is_outage() && !err.is_transient());
    assert_eq!(state::<B>(&db), (vec![], 0, 0));
    let again = inbox
        .process("g", &id("a"), |c| Box::pin(write(c, "a")))
        .await
        .unwrap();
    assert_eq!(again, Processed::Applied);
    assert_eq!(state::<B>(&db), (vec!["a".into()], 1, 1));
}

/// A handler that ignores a failed statement and returns `Ok` is not `Applied`: on
/// PostgreSQL the transaction is aborted (its COMMIT would be a silent rollback), a
/// handler failure. MySQL rolls back only the failed statement: the rest commits.
async fn swallowed_failed_statement_is_not_applied<B: AsyncBackend>() {
    let (db, inbox) = setup::<B>();
    let outcome = inbox
        .process("g", &id("a"), |c| {
            Box::pin(async move {
                write(c, "a").await?;
                let _ = c
                    .batch_execute("INSERT INTO no_such_table VALUES (1)")
                    .await;
                Ok(())
            })
        })
        .await;
    if B::NAME.starts_with("PostgreSQL") {
        let err = outcome.unwrap_err();
        let shown = outbox_core::error_chain(&err).to_string();
        assert!(matches!(err, Error::Handler(_)), "{shown}");
        assert!(shown.contains("could not be kept"), "{shown}");
        assert_eq!(state::<B>(&db), (vec![], 0, 0), "nothing committed");
        let again = inbox
            .process("g", &id("a"), |c| Box::pin(write(c, "a")))
            .await;
        assert_eq!(
            again.unwrap(),
            Processed::Applied,
            "the connection is usable"
        );
    } else {
        assert_eq!(outcome.unwrap(), Processed::Applied);
        assert_eq!(state::<B>(&db), (vec!["a".into()], 1, 1));
    }
}

/// The second connection of a deadlock, on its own thread with a blocking connection:
/// locks bob, then (on `go`) alice, which the handler holds.
struct Rival {
    ready: Mutex<Receiver<()>>,
    go: Mutex<Sender<()>>,
    thread: Mutex<Option<JoinHandle<Result<(), String>>>>,
}

impl Rival {
    fn start<B: AsyncBackend>(db: &TestDb) -> Arc<Self> {
        let (ready_tx, ready) = channel();
        let (go, go_rx) = channel::<()>();
        let mut c = B::connect(db);
        let thread = std::thread::spawn(move || {
            let mut step = |sql: &str| c.batch_execute(sql).map_err(|e| e.to_string());
            step(B::RIVAL_SESSION)?;
            step("BEGIN")?;
            step(B::RIVAL_BALLAST)?;
            step("UPDATE accounts SET balance = balance + 10 WHERE id = 'bob'")?;
            ready_tx.send(()).unwrap();
            go_rx.recv().map_err(|e| e.to_string())?;
            step("UPDATE accounts SET balance = balance + 10 WHERE id = 'alice'")
                .map_err(|e| format!("the rival was the deadlock victim: {e}"))?;
            step("ROLLBACK")
        });
        Arc::new(Self {
            ready: Mutex::new(ready),
            go: Mutex::new(go),
            thread: Mutex::new(Some(thread)),
        })
    }

    fn go(&self) {
        // The rival may be gone already if it failed; `finish` reports why.
        let _ = self.go.lock().unwrap().send(());
    }

    fn finish(&self) {
        self.go();
        let thread = self.thread.lock().unwrap().take().unwrap();
        thread.join().expect("rival panicked").expect("rival");
    }
}

/// The handler's part of the deadlock: writes, locks alice, then waits for bob, which the
/// rival holds while it waits for alice. `swallow`: ignores the deadlock and goes on.
async fn collide<C: SimpleAsyncConnection>(
    c: &mut C,
    rival: Arc<Rival>,
    swallow: bool,
) -> Result<(), HandlerError> {
    // Only a's row: bob is the rival's.
    insert(c, "a").await?;
    let ready = tokio::task::block_in_place(|| {
        rival
            .ready
            .lock()
            .unwrap()
            .recv_timeout(Duration::from_secs(30))
    });
    ready.expect("the rival locks bob (is bob locked by this transaction?)");
    c.batch_execute("UPDATE accounts SET balance = balance + 1 WHERE id = 'alice'")
        .await?;
    rival.go();
    let conflict = c
        .batch_execute("UPDATE accounts SET balance = balance + 1 WHERE id = 'bob'")
        .await;
    assert!(conflict.is_err(), "the handler was not the deadlock victim");
    if swallow {
        let _ = c
            .batch_execute("INSERT INTO applied (msg) VALUES ('d')")
            .await;
        return Ok(());
    }
    conflict?;
    Ok(())
}

/// A deadlock the handler returns is `Transient`: nothing committed, and the retry on the
/// pool's one connection applies the message.
async fn deadlock_is_transient<B: AsyncBackend>() {
    let (db, inbox) = setup::<B>();
    let rival = Rival::start::<B>(&db);
    let err = inbox
        .process("g", &id("a"), |c| {
            Box::pin(collide(c, Arc::clone(&rival), false))
        })
        .await
        .unwrap_err();
    rival.finish();
    assert!(is_transient(&err), "{err:?}");
    assert_eq!(state::<B>(&db), (vec![], 0, 0));
    let again = inbox
        .process("g", &id("a"), |c| Box::pin(write(c, "a")))
        .await
        .unwrap();
    assert_eq!(again, Processed::Applied);
}

/// A handler that swallows the deadlock and goes on is never `Applied`: MariaDB has
/// ended the transaction (transient), PostgreSQL can only roll it back (handler failure).
async fn swallowed_deadlock_is_never_applied<B: AsyncBackend>() {
    let (db, inbox) = setup::<B>();
    let rival = Rival::start::<B>(&db);
    let outcome = inbox
        .process("g", &id("a"), |c| {
            Box::pin(collide(c, Arc::clone(&rival), true))
        })
        .await;
    rival.finish();
    let err = outcome.unwrap_err();
    if B::NAME == "MariaDB" {
        assert!(is_transient(&err), "{err:?}");
    } else {
        assert!(
            outbox_core::error_chain(&err)
                .to_string()
                .contains("could not be kept"),
            "{err:?}"
        );
    }
    let (applied, dedup, _) = state::<B>(&db);
    assert!(!applied.contains(&"a".to_owned()), "{applied:?}");
    assert_eq!(dedup, 0, "no dedup row: it is retried");
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
enum How {
    Ok,
    Fail,
    Panic,
    IgnoredBadSql,
}

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
struct Credit {
    #[outbox(id)]
    id: String,
    how: How,
}

/// Writes the message, then behaves as told.
struct Apply<C>(std::marker::PhantomData<fn() -> C>);

impl<C: SimpleAsyncConnection + Send + 'static> AsyncTxHandler<Credit> for Apply<C> {
    type Conn = C;

    async fn handle(&self, e: Credit, c: &mut C, _: &Delivery) -> Result<(), HandlerError> {
        write(c, &e.id).await?;
        match e.how {
            How::Ok => Ok(()),
            How::Fail => Err(HandlerError::msg("refused")),
            How::Panic => panic!("handler bug"),
            How::IgnoredBadSql => {
                let _ = c
                    .batch_execute("INSERT INTO no_such_table VALUES (1)")
                    .await;
                Ok(())
            }
        }
    }
}

fn delivery(id: &str, how: How) -> Delivery {
    let e = Credit { id: id.into(), how };
    Delivery {
        envelope: Envelope::from_event(&e, 1024).unwrap(),
        delivery_count: 1,
        entry_id: None,
    }
}

fn dispatcher<B: AsyncBackend>() -> Dispatcher<<B::Inbox as AsyncInbox>::Conn> {
    let mut d = Dispatcher::new();
    d.register_tx::<Credit, _>(Apply(std::marker::PhantomData))
        .unwrap();
    d
}

/// Through the dispatcher: a panicking handler is a handler error naming the panic,
/// nothing of it commits, and the pool's one connection serves the next message.
async fn panic_is_a_handler_error<B: AsyncBackend>() {
    let (db, inbox) = setup::<B>();
    let d = dispatcher::<B>();
    let err = d
        .consume_async(&inbox, "g", &delivery("a", How::Panic))
        .await
        .unwrap_err();
    let shown = outbox_core::error_chain(&err).to_string();
    assert!(matches!(err, Error::Handler(_)), "{shown}");
    assert!(shown.contains("handler panicked: handler bug"), "{shown}");
    assert_eq!(state::<B>(&db), (vec![], 0, 0));
    let ok = d.consume_async(&inbox, "g", &delivery("a", How::Ok)).await;
    assert_eq!(ok.unwrap(), Processed::Applied);
    assert_eq!(state::<B>(&db), (vec!["a".into()], 1, 1));
}

/// A batch: one outcome per message, in order. A failing or panicking message leaves no
/// trace; a msg_id seen before (in the batch or committed) is a duplicate; the others
/// commit together.
async fn batch_outcomes<B: AsyncBackend>() {
    let (db, inbox) = setup::<B>();
    let d = dispatcher::<B>();
    let first = d
        .consume_async(&inbox, "g", &delivery("d", How::Ok))
        .await
        .unwrap();
    assert_eq!(first, Processed::Applied);
    let batch = [
        delivery("a", How::Ok),
        delivery("b", How::Fail),
        delivery("a", How::Ok),
        delivery("c", How::Panic),
        delivery("d", How::Ok),
        delivery("c", How::Ok),
    ];
    let outcomes = d.consume_batch_async(&inbox, "g", &batch).await.unwrap();
    let mut kinds = kinds(&outcomes);
    assert!(
        kinds[3].contains("handler panicked: handler bug"),
        "{kinds:?}"
    );
    kinds[3] = "Panicked".into();
    assert_eq!(
        kinds,
        [
            "Applied",
            "Handler(refused)",
            "Duplicate",
            "Panicked",
            "Duplicate",
            "Applied"
        ]
    );
    assert_eq!(
        state::<B>(&db),
        (vec!["a".into(), "c".into(), "d".into()], 3, 3)
    );
}

/// In a batch, a handler that ignored a failed statement fails alone on PostgreSQL (its
/// savepoint cannot be released), and the others commit.
async fn batch_swallowed_failed_statement_fails_alone<B: AsyncBackend>() {
    let (db, inbox) = setup::<B>();
    let d = dispatcher::<B>();
    let batch = [
        delivery("a", How::Ok),
        delivery("b", How::IgnoredBadSql),
        delivery("c", How::Ok),
    ];
    let outcomes = d.consume_batch_async(&inbox, "g", &batch).await.unwrap();
    let kinds = kinds(&outcomes);
    if B::NAME.starts_with("PostgreSQL") {
        assert_eq!(kinds[0], "Applied");
        assert!(kinds[1].contains("could not be kept"), "{kinds:?}");
        assert_eq!(kinds[2], "Applied");
        assert_eq!(state::<B>(&db), (vec!["a".into(), "c".into()], 2, 2));
    } else {
        assert_eq!(kinds, ["Applied", "Applied", "Applied"]);
        assert_eq!(state::<B>(&db).1, 3);
    }
}

/// A batch on MariaDB whose handler deadlocks is rolled back as a whole
/// (`TransientBatch`); on PostgreSQL only that message's savepoint (`Transient`).
async fn batch_deadlock<B: AsyncBackend>() {
    let (db, inbox) = setup::<B>();
    let rival = Rival::start::<B>(&db);
    let ids = [id("c"), id("a"), id("b")];
    let outcome = inbox
        .process_batch("g", &ids, |i, c| match i {
            1 => Box::pin(collide(c, Arc::clone(&rival), false)),
            // Only the messages' rows: bob is the rival's.
            _ => Box::pin(insert(c, ["c", "a", "b"][i])),
        })
        .await;
    rival.finish();
    if B::NAME == "MariaDB" {
        let err = outcome.unwrap_err();
        assert!(
            matches!(&err, Error::TransientBatch { msg_id, .. } if msg_id.as_ref() == Some(&ids[1])),
            "{err:?}"
        );
        assert_eq!(state::<B>(&db), (vec![], 0, 0));
    } else {
        let outcomes = outcome.unwrap();
        assert_eq!(kinds(&outcomes), ["Applied", "Transient", "Applied"]);
        assert_eq!(state::<B>(&db), (vec!["b".into(), "c".into()], 2, 0));
    }
}

/// A group name longer than its column is refused before any statement.
async fn a_too_long_group_is_refused<B: AsyncBackend>() {
    let (db, inbox) = setup::<B>();
    let group = "g".repeat(65);
    let err = inbox
        .process(&group, &id("a"), |c| Box::pin(write(c, "a")))
        .await
        .unwrap_err();
    let shown = outbox_core::error_chain(&err).to_string();
    assert!(shown.contains("consumer_group"), "{shown}");
    assert_eq!(state::<B>(&db), (vec![], 0, 0));
}

/// An unreachable database is an outage, not a handler failure.
async fn an_unreachable_database_is_an_outage<B: AsyncBackend>() {
    let port = outbox_tests::ports::free_port();
    let inbox = B::inbox_at(&B::url_at(port), 1);
    let err = inbox
        .process("g", &id("a"), |c| Box::pin(write(c, "a")))
        .await
        .unwrap_err();
    assert!(err.is_outage(), "{err:?}");
}

macro_rules! tests {
    ($($name:ident),* $(,)?) => {
        mod pg {
            $(#[test]
            fn $name() {
                super::runtime().block_on(super::$name::<super::Pg>());
            })*
        }
        mod mariadb {
            $(#[test]
            fn $name() {
                super::runtime().block_on(super::$name::<super::My>());
            })*
        }
    };
}

tests!(
    applied_once_then_duplicate,
    commits_keep_the_pooled_connection,
    handler_error_rolls_back_the_dedup_row,
    swallowed_failed_statement_is_not_applied,
    deadlock_is_transient,
    swallowed_deadlock_is_never_applied,
    panic_is_a_handler_error,
    batch_outcomes,
    batch_swallowed_failed_statement_fails_alone,
    batch_deadlock,
    a_too_long_group_is_refused,
    an_unreachable_database_is_an_outage,
);
