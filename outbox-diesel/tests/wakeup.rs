//! PostgreSQL wake-up: a parked relay holds its channel's wake-up lock (and several
//! relays take turns with it), a relay about to park waits for the emitting
//! transactions in flight, also for a row below the held-back ones it has seen, a
//! relay does not spin on rows the per-key claim holds back, and a parked wait ends
//! promptly when the relay stops.

mod fixtures;

use std::time::{Duration, Instant};

use diesel::Connection as _;
use fixtures::{Backend, Pg, exec, runtime};
use outbox_core::{ClaimedBatch as _, OutboxEvent, RelayStore};
use outbox_diesel::{Emit, EmitOptions};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(key = account)]
struct Moved {
    #[outbox(id)]
    n: u32,
    account: String,
}

fn holders(db: &fixtures::TestDb) -> i64 {
    fixtures::parked_relays(db)
}

/// Commits one row with `Notify::Never`: a parked relay finds it only by polling.
fn emit_waking_nobody(c: &mut diesel::PgConnection) {
    let never = EmitOptions::new().with_notify(outbox_diesel::Notify::Never);
    c.transaction(|c| {
        c.emit_with(
            &never,
            Moved {
                n: 1,
                account: "a".into(),
            },
        )
        .map(drop)
    })
    .unwrap();
}

/// Waits for `done`, failing after 20 s.
async fn until(what: &str, done: impl Fn() -> bool) {
    outbox_tests::eventually_within(what, Duration::from_secs(20), done).await;
}

/// Emits one row on the test's channel with the default `Notify::WhenRelayIdle`.
fn emit_waking(db: &fixtures::TestDb, c: &mut diesel::PgConnection, n: u32) {
    let opts = EmitOptions::new().with_channel(db.name.clone());
    c.transaction(|c| {
        c.emit_with(
            &opts,
            Moved {
                n,
                account: "x".into(),
            },
        )
        .map(drop)
    })
    .unwrap();
}

/// Two relays park: one holds the wake-up lock, the other waits in its queue. One emit
/// wakes both, well before their 20 s poll, and the lock is released.
#[test]
fn two_parked_relays_are_both_woken_by_one_emit() {
    let db = Pg::create();
    runtime().block_on(async {
        let park = |store| timed_wait(store, Duration::from_secs(20));
        let (a, b) = (park(Pg::store(&db)), park(Pg::store(&db)));
        until("a relay holds the lock", || holders(&db) == 1).await;
        // Both listeners connected and waiting (the second one in the lock's queue).
        tokio::time::sleep(Duration::from_millis(300)).await;
        emit_waking(&db, &mut Pg::connect(&db), 1);
        for (_, waited) in [a.await.unwrap(), b.await.unwrap()] {
            assert!(waited < Duration::from_secs(10), "woke after {waited:?}");
        }
        until("the woken relays release the lock", || holders(&db) == 0).await;
    });
}

/// `parked_relays` lists the sessions holding a wake-up lock, as a parked relay's LISTEN
/// session does, with their `application_name`, and no longer once the lock is released.
/// (MySQL and SQLite relays are not tracked: `None`, in `backends.rs`.) The tests share
/// a database and park on channels of their own, so only this test's session is looked at.
#[test]
fn parked_relays_lists_the_sessions_holding_the_wake_up_lock() {
    let db = Pg::create();
    let mut conn = Pg::connect(&db);
    let name = format!("relay-{}", std::process::id());
    let mut parked_here = || -> Vec<outbox_diesel::ParkedRelay> {
        let parked = outbox_diesel::parked_relays(&mut conn)
            .unwrap()
            .expect("tracked");
        parked
            .into_iter()
            .filter(|r| r.application_name.as_deref() == Some(name.as_str()))
            .collect()
    };
    assert_eq!(parked_here(), []);
    let mut relay = Pg::connect(&db);
    exec(&mut relay, &format!("SET application_name = '{name}'"));
    fixtures::park_as_a_relay(&mut relay, &db);
    let parked = parked_here();
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert!(
        parked[0].pid > 0 && parked[0].state_change.is_some(),
        "{parked:?}"
    );
    fixtures::unpark(&mut relay);
    assert_eq!(parked_here(), []);
}

/// A relay about to park waits for the emitting transactions in flight: a row emitted
/// while no relay was parked (so without a NOTIFY) and committed after the relay's first
/// look is found by its look after it takes the lock, not left to its poll.
#[test]
fn a_relay_about_to_park_waits_for_an_unannounced_emit_in_flight() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    runtime().block_on(async {
        let waiting = park_behind_an_open_emit(&db, &mut c).await;
        exec(&mut c, "COMMIT");
        let (_, waited) = waiting.await.unwrap();
        assert!(waited < Duration::from_secs(10), "found after {waited:?}");
    });
}

/// Emits in a transaction left open on `c` with no relay parked (so no NOTIFY is to
/// come), then parks a relay behind the emit's shared hold ([`queue_for_the_lock`]).
async fn park_behind_an_open_emit(db: &fixtures::TestDb, c: &mut diesel::PgConnection) -> Waiting {
    let store = Pg::store(db);
    assert!(store.claim(10).await.unwrap().messages().is_empty());
    emit_left_open(db, c, 1, "a");
    queue_for_the_lock(db, store).await
}

/// A relay's wait for work running in a task: its output is the store and how long the
/// wait took.
type Waiting = tokio::task::JoinHandle<(outbox_diesel::PgRelayStore, Duration)>;

/// Starts `store`'s wait for work of `timeout`.
fn timed_wait(store: outbox_diesel::PgRelayStore, timeout: Duration) -> Waiting {
    tokio::spawn(async move {
        let started = Instant::now();
        store.wait_for_work(timeout).await;
        (store, started.elapsed())
    })
}

/// Starts `store`'s wait for work (30 s: its poll) and returns once it has looked
/// (nothing due) and queues for the wake-up lock.
async fn queue_for_the_lock(db: &fixtures::TestDb, store: outbox_diesel::PgRelayStore) -> Waiting {
    let waiting = timed_wait(store, Duration::from_secs(30));
    until("the relay waits for the lock", || queued(db) == 1).await;
    waiting
}

/// Emits row `n` of `account` (default `WhenRelayIdle`) in a transaction left open on
/// `c`: its try of the wake-up lock is held to its commit.
fn emit_left_open(db: &fixtures::TestDb, c: &mut diesel::PgConnection, n: u32, account: &str) {
    exec(c, "BEGIN");
    c.emit_with(
        &EmitOptions::new().with_channel(db.name.clone()),
        Moved {
            n,
            account: account.into(),
        },
    )
    .unwrap();
}

/// Opens a transaction on `c` holding `db`'s wake-up lock shared, as an emit's try
/// does, with no xid yet (it has written nothing).
fn begin_holding_the_lock_shared(db: &fixtures::TestDb, c: &mut diesel::PgConnection) {
    let (class, key) = outbox_diesel::wake_lock_key(&db.name);
    exec(
        c,
        &format!("BEGIN; SELECT pg_advisory_xact_lock_shared({class}, {key})"),
    );
}

/// Requests for `db`'s wake-up lock not granted yet.
fn queued(db: &fixtures::TestDb) -> i64 {
    let (class, key) = outbox_diesel::wake_lock_key(&db.name);
    Pg::scalar(
        &mut Pg::connect(db),
        &format!(
            "SELECT COUNT(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND classid = {class} AND objid = {key} AND objsubid = 2 \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ),
    )
}

/// A relay waiting for the lock behind a long emitting transaction still hears
/// notifications: a session gets them only between statements, so the relay must not
/// sit in one long lock wait.
#[test]
fn a_relay_queued_for_the_lock_is_woken_by_a_notify() {
    let db = Pg::create();
    let mut long = Pg::connect(&db);
    runtime().block_on(async {
        // The emit's transaction stays open (its shared hold with it).
        let waiting = park_behind_an_open_emit(&db, &mut long).await;
        let always = EmitOptions::new()
            .with_channel(db.name.clone())
            .with_notify(outbox_diesel::Notify::Always);
        let mut c = Pg::connect(&db);
        c.transaction(|c| {
            c.emit_with(
                &always,
                Moved {
                    n: 2,
                    account: "b".into(),
                },
            )
            .map(drop)
        })
        .unwrap();
        let (_, waited) = waiting.await.unwrap();
        assert!(waited < Duration::from_secs(10), "woken after {waited:?}");
        exec(&mut long, "ROLLBACK");
    });
}

/// A poll interval longer than PostgreSQL's settings take (`i32::MAX` ms for
/// `lock_timeout` and `idle_session_timeout`) still parks on LISTEN and is woken.
#[test]
fn a_relay_parked_for_years_is_woken_by_an_emit() {
    let db = Pg::create();
    runtime().block_on(async {
        let store = Pg::store(&db);
        let waiting = tokio::spawn(async move {
            store
                .wait_for_work(Duration::from_secs(10 * 365 * 86_400))
                .await;
        });
        until("the relay holds the lock", || holders(&db) == 1).await;
        emit_waking(&db, &mut Pg::connect(&db), 1);
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("woken by the emit")
            .unwrap();
    });
}

/// Emits three rows of key `a` whose first waits for its retry: the other two are due
/// but held back by the per-key claim.
fn emit_held_back(c: &mut diesel::PgConnection) {
    c.emit_all((1..=3).map(|n| Moved {
        n,
        account: "a".into(),
    }))
    .unwrap();
    exec(
        c,
        "UPDATE outbox SET next_retry_at = now() + interval '1 hour' WHERE msg_id = '1:Moved'",
    );
}

/// The relay's loop up to the claim that knows what it left behind: an empty claim, a
/// wait (short: rows are due), an empty claim that notes the held-back rows as seen.
async fn idle_behind_held_back(store: &outbox_diesel::PgRelayStore) {
    assert!(store.claim(10).await.unwrap().messages().is_empty());
    store.wait_for_work(Duration::from_millis(300)).await;
    assert!(store.claim(10).await.unwrap().messages().is_empty());
}

/// Due rows the per-key claim holds back do not keep a relay awake, also while a
/// transaction older than those rows is open.
#[test]
fn a_relay_parks_behind_held_back_rows_instead_of_spinning() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    let mut old = Pg::connect(&db);
    exec(&mut old, "BEGIN; SELECT txid_current()");
    emit_held_back(&mut c);
    runtime().block_on(async {
        let store = Pg::store(&db);
        idle_behind_held_back(&store).await;
        let started = Instant::now();
        store.wait_for_work(Duration::from_millis(800)).await;
        assert!(
            started.elapsed() >= Duration::from_millis(750),
            "parked for its poll interval, though held-back rows are due"
        );
        // A new row still wakes it at once (the due check looks above what it saw).
        c.emit(Moved {
            n: 4,
            account: "b".into(),
        })
        .unwrap();
        let started = Instant::now();
        store.wait_for_work(Duration::from_secs(5)).await;
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(store.claim(10).await.unwrap().messages().len(), 1);
    });
}

/// A wait that times out keeps the wake-up lock, so that an idle relay re-parks without
/// churn. Once the relay claims rows it is busy: the lock goes at once, or every emit
/// would send a NOTIFY (serialising their commits) while the relay needs none.
#[test]
fn a_relay_back_to_work_after_a_timed_out_wait_releases_the_lock() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    runtime().block_on(async {
        let store = Pg::store(&db);
        assert!(store.claim(10).await.unwrap().messages().is_empty());
        store.wait_for_work(Duration::from_millis(200)).await;
        assert_eq!(holders(&db), 1, "the timed-out wait kept the lock");
        // A row that wakes nobody: the relay finds it by polling.
        emit_waking_nobody(&mut c);
        let batch = store.claim(10).await.unwrap();
        assert_eq!(batch.messages().len(), 1);
        until("the busy relay releases the lock", || holders(&db) == 0).await;
    });
}

/// The LISTEN connection can die without a word (a failover, a cut network path): the
/// relay's claims must not wait on it. Its server process stopped (SIGSTOP) after a wait
/// timed out and left the mark, the next claim still returns its rows at once.
#[test]
fn a_claim_does_not_wait_on_an_unresponsive_listen_connection() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    runtime().block_on(async {
        // The LISTEN connection under a name of its own, to find its server process.
        let sep = if db.url.contains('?') { '&' } else { '?' };
        let listener_url = format!("{}{sep}application_name={}", db.url, db.name);
        let store = Pg::store(&db).with_listener(listener_url);
        assert!(store.claim(10).await.unwrap().messages().is_empty());
        store.wait_for_work(Duration::from_millis(200)).await;
        assert_eq!(holders(&db), 1, "the timed-out wait kept the lock");
        let pid: i64 = Pg::scalar(
            &mut c,
            &format!(
                "SELECT pid::int8 AS n FROM pg_stat_activity WHERE application_name = '{}'",
                db.name
            ),
        );
        let _stopped = Stopped::new(pid);
        emit_waking_nobody(&mut c);
        let claimed = tokio::time::timeout(Duration::from_secs(10), store.claim(10))
            .await
            .expect("the claim waited on the stopped LISTEN connection")
            .unwrap();
        assert_eq!(claimed.messages().len(), 1);
    });
}

/// A PostgreSQL server process stopped with SIGSTOP, resumed when dropped.
struct Stopped(i64);

impl Stopped {
    fn new(pid: i64) -> Self {
        signal(pid, "-STOP");
        Self(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal(self.0, "-CONT");
    }
}

fn signal(pid: i64, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill {sig} {pid}");
}

/// A relay whose claim came back empty, but that finds rows committed since when it is
/// about to park, goes back to work without taking the wake-up lock: emitters meanwhile
/// would otherwise each send a NOTIFY, which serialises their commits.
#[test]
fn a_relay_with_new_rows_goes_back_to_work_without_the_lock() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    // An emitting transaction holds the lock shared: a relay that tried to take it
    // would wait for it until its deadline.
    let mut emitter = Pg::connect(&db);
    begin_holding_the_lock_shared(&db, &mut emitter);
    runtime().block_on(async {
        let store = Pg::store(&db);
        assert!(store.claim(10).await.unwrap().messages().is_empty());
        emit_waking_nobody(&mut c);
        let started = Instant::now();
        store.wait_for_work(Duration::from_secs(10)).await;
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "back to work at once, without queueing for the lock"
        );
        let batch = store.claim(10).await.unwrap();
        let ids: Vec<i64> = batch.messages().iter().map(|m| m.id).collect();
        assert_eq!(ids.len(), 1);
        batch
            .complete(outbox_core::RelayBatchOutcome {
                sent: ids,
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(store.claim(10).await.unwrap().messages().is_empty());
        // With nothing to do, it takes the lock once the emitter is done.
        exec(&mut emitter, "COMMIT");
        let waiting =
            tokio::spawn(async move { store.wait_for_work(Duration::from_secs(1)).await });
        until("the idle relay takes the lock", || holders(&db) == 1).await;
        waiting.await.unwrap();
    });
}

#[test]
fn a_parked_wait_ends_soon_after_it_is_dropped() {
    let db = Pg::create();
    runtime().block_on(async {
        let store = Pg::store(&db);
        let waiting = store.wait_for_work(Duration::from_secs(60));
        // Dropped by the timeout, as the relay's shutdown drops it.
        let _ = tokio::time::timeout(Duration::from_millis(500), waiting).await;
        until("the parked relay clears its mark when it stops", || {
            holders(&db) == 0
        })
        .await;
    });
    // The runtime above has shut down: its blocking park did not hold it for 60 s.
}

#[test]
fn a_lost_listen_connection_polls_then_reconnects() {
    let db = Pg::create();
    // The listener's own application_name, to find its backend.
    let url = format!("{}&application_name={}", db.url, db.name);
    let listeners = format!(
        "SELECT COUNT(pg_terminate_backend(pid)) AS n FROM pg_stat_activity \
         WHERE application_name = '{}'",
        db.name
    );
    runtime().block_on(async {
        let store = outbox_diesel::PgRelayStore::new(Pg::pool(&db, 2))
            .with_listener(url)
            .with_channel(db.name.clone());
        let waiting = timed_wait(store.clone(), Duration::from_millis(1500));
        until("the relay parks", || holders(&db) == 1).await;
        let mut c = Pg::connect(&db);
        assert_eq!(Pg::scalar(&mut c, &listeners), 1, "its LISTEN connection");
        // Without its connection the wait sleeps out its timeout.
        let (_, waited) = waiting.await.unwrap();
        assert!(waited >= Duration::from_millis(1400), "{waited:?}");

        // The next wait reconnects, parks, and is woken by NOTIFY again.
        let waiting = timed_wait(store.clone(), Duration::from_secs(20));
        until("the relay parks again", || holders(&db) == 1).await;
        let opts = EmitOptions::new().with_channel(db.name.clone());
        c.transaction(|c| {
            c.emit_with(
                &opts,
                Moved {
                    n: 1,
                    account: "x".into(),
                },
            )
            .map(drop)
        })
        .unwrap();
        let (_, waited) = waiting.await.unwrap();
        assert!(waited < Duration::from_secs(10), "{waited:?}");
    });
}

/// A relay that stops while it holds the lock (its process stopped, its runtime
/// starved) must not have every emit notify for good: the server ends its idle LISTEN
/// session a few seconds after the wait's timeout, and the lock with it.
#[test]
fn a_relay_that_stops_coming_back_loses_the_lock() {
    let db = Pg::create();
    runtime().block_on(async {
        let store = Pg::store(&db);
        store.wait_for_work(Duration::from_millis(500)).await;
        assert_eq!(holders(&db), 1, "the timed-out wait kept the lock");
        // The relay never comes back to wait or claim.
        until("the stalled relay's session ends", || holders(&db) == 0).await;
        drop(store);
    });
}
