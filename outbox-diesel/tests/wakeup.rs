//! PostgreSQL wake-up with several relays: each parked relay has its own idle mark, a
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

fn idle_marks(db: &fixtures::TestDb) -> i64 {
    Pg::scalar(
        &mut Pg::connect(db),
        "SELECT COUNT(*) AS n FROM outbox_relay_idle WHERE idle_until > now()",
    )
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

#[test]
fn a_woken_relay_leaves_the_other_relays_mark_in_place() {
    let db = Pg::create();
    runtime().block_on(async {
        let (a, b) = (Pg::store(&db), Pg::store(&db));
        let wait_a = tokio::spawn(async move { a.wait_for_work(Duration::from_secs(2)).await });
        let wait_b = tokio::spawn(async move { b.wait_for_work(Duration::from_secs(20)).await });
        until("both relays park", || idle_marks(&db) == 2).await;
        // a times out and is busy again; b is still parked and still reachable.
        wait_a.await.unwrap();
        // a's mark expires a second after its wait (NOTIFY_IDLE_SLACK).
        until("a's mark expires", || idle_marks(&db) == 1).await;
        let started = Instant::now();
        let mut c = Pg::connect(&db);
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
        wait_b.await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "b was woken by NOTIFY, not by its 20 s timeout"
        );
        // The end of the mark (an UPDATE) goes on in the background while the relay claims.
        until("a woken relay removes its own mark", || {
            idle_marks(&db) == 0
        })
        .await;
    });
}

#[test]
fn a_relay_parks_behind_held_back_rows_instead_of_spinning() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    c.emit_all((1..=3).map(|n| Moved {
        n,
        account: "a".into(),
    }))
    .unwrap();
    // The key's first message waits for its retry: the other two are due but held back.
    exec(
        &mut c,
        "UPDATE outbox SET next_retry_at = now() + interval '1 hour' WHERE msg_id = '1:Moved'",
    );
    runtime().block_on(async {
        let store = Pg::store(&db);
        // The relay's loop: an empty claim, a wait, an empty claim (now knowing what it
        // saw), a wait that must park.
        assert!(store.claim(10).await.unwrap().messages().is_empty());
        store.wait_for_work(Duration::from_millis(300)).await;
        assert!(store.claim(10).await.unwrap().messages().is_empty());
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

/// A wait that times out leaves the relay's mark in place (it expires a second later),
/// so that an idle relay re-parks without churn. Once the relay claims rows it is busy:
/// the mark goes at once, or every emit would send a NOTIFY (serialising their commits)
/// for up to a second while the relay needs none.
#[test]
fn a_relay_back_to_work_after_a_timed_out_wait_removes_its_mark() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    runtime().block_on(async {
        let store = Pg::store(&db);
        assert!(store.claim(10).await.unwrap().messages().is_empty());
        store.wait_for_work(Duration::from_millis(200)).await;
        assert_eq!(idle_marks(&db), 1, "the timed-out wait left its mark");
        // A row that wakes nobody: the relay finds it by polling.
        emit_waking_nobody(&mut c);
        let batch = store.claim(10).await.unwrap();
        assert_eq!(batch.messages().len(), 1);
        // Well before the mark would expire (a second after the 200 ms wait).
        outbox_tests::eventually_within(
            "the busy relay's mark removed",
            Duration::from_millis(900),
            || idle_marks(&db) == 0,
        )
        .await;
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
        assert_eq!(idle_marks(&db), 1, "the timed-out wait left its mark");
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
/// about to park, goes back to work without marking itself idle: emitters meanwhile
/// would otherwise each send a NOTIFY, which serialises their commits.
#[test]
fn a_relay_with_new_rows_goes_back_to_work_without_marking_itself_idle() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    exec(
        &mut c,
        "CREATE TABLE marks (n INT);
         CREATE FUNCTION note_mark() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN INSERT INTO marks VALUES (1); RETURN NEW; END $$;
         CREATE TRIGGER note_mark AFTER INSERT OR UPDATE ON outbox_relay_idle
           FOR EACH ROW EXECUTE FUNCTION note_mark();",
    );
    runtime().block_on(async {
        let store = Pg::store(&db);
        assert!(store.claim(10).await.unwrap().messages().is_empty());
        c.emit(Moved {
            n: 1,
            account: "a".into(),
        })
        .unwrap();
        let started = Instant::now();
        store.wait_for_work(Duration::from_secs(10)).await;
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "back to work at once"
        );
        assert_eq!(
            Pg::scalar(&mut c, "SELECT count(*) AS n FROM marks"),
            0,
            "no idle mark was written"
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
        // With nothing to do, it parks with its mark as before.
        let waiting =
            tokio::spawn(async move { store.wait_for_work(Duration::from_secs(1)).await });
        until("the idle relay marks itself", || idle_marks(&db) == 1).await;
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
            idle_marks(&db) == 0
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
        let parked = store.clone();
        let waiting = tokio::spawn(async move {
            let started = Instant::now();
            parked.wait_for_work(Duration::from_millis(1500)).await;
            started.elapsed()
        });
        until("the relay parks", || idle_marks(&db) == 1).await;
        let mut c = Pg::connect(&db);
        assert_eq!(Pg::scalar(&mut c, &listeners), 1, "its LISTEN connection");
        // Without its connection the wait sleeps out its timeout.
        let waited = waiting.await.unwrap();
        assert!(waited >= Duration::from_millis(1400), "{waited:?}");
        exec(&mut c, "DELETE FROM outbox_relay_idle");

        // The next wait reconnects, parks, and is woken by NOTIFY again.
        let parked = store.clone();
        let waiting = tokio::spawn(async move {
            let started = Instant::now();
            parked.wait_for_work(Duration::from_secs(20)).await;
            started.elapsed()
        });
        until("the relay parks again", || idle_marks(&db) == 1).await;
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
        let waited = waiting.await.unwrap();
        assert!(waited < Duration::from_secs(10), "{waited:?}");
    });
}

/// Every parked relay woken (or stopped) ends its mark, hundreds of times a second
/// under load, and every `WhenRelayIdle` emit scans `outbox_relay_idle`. Where nothing
/// vacuums the table (autovacuum off, as on this project's machines, or lagging), a
/// DELETE per wake-up and an INSERT per park left a dead row version and line pointer
/// per turn, which emits then walked: 11 pages after 3,000 turns, 0.04 ms per emit
/// instead of 0.003. A mark that only ever updates its own row (a HOT update, pruned in
/// place) keeps the table at one page.
#[test]
fn park_and_wake_churn_leaves_the_idle_table_one_page() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    exec(
        &mut c,
        "ALTER TABLE outbox_relay_idle SET (autovacuum_enabled = false)",
    );
    runtime().block_on(async {
        let store = Pg::store(&db);
        let mut marks = |parked: i64, turn: usize| {
            let deadline = Instant::now() + Duration::from_secs(20);
            while Pg::scalar(
                &mut c,
                "SELECT COUNT(*) AS n FROM outbox_relay_idle WHERE idle_until > now()",
            ) != parked
            {
                assert!(Instant::now() < deadline, "turn {turn}: {parked} marks");
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        for turn in 0..600 {
            let parked = store.clone();
            let waiting =
                tokio::spawn(async move { parked.wait_for_work(Duration::from_secs(60)).await });
            marks(1, turn);
            // Stopped while parked: the relay ends its mark, as when it is woken.
            waiting.abort();
            let _ = waiting.await;
            marks(0, turn);
        }
    });
    let pages = Pg::scalar(
        &mut c,
        "SELECT (pg_relation_size('outbox_relay_idle') / current_setting('block_size')::int8) AS n",
    );
    assert!(pages <= 1, "outbox_relay_idle grew to {pages} pages");
}
