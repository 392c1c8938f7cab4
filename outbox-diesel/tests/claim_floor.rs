//! The PostgreSQL claim's floor (`PgRelayStore::claim_floor`), on both layouts: it
//! rises over the rows sent while a read-only transaction holds the xmin horizon back
//! (what it is for), never past a row whose transaction is still open (a late commit is
//! claimed), and a row made NEW again below it is claimed once the floor is computed
//! from 0 again. It is held by no transaction of another database; it comes down at once
//! when ids go backwards (`setval`) or the table is restored; a redriven row is claimed
//! at the next claim; and a key's row below it goes out before the key's later rows.

mod fixtures;

use std::time::{Duration, Instant};

use diesel::connection::{AnsiTransactionManager, TransactionManager as _};
use diesel::{Connection as _, PgConnection};
use fixtures::{Backend, Pg, PgParted, exec, runtime};
use outbox_core::{ClaimedBatch as _, OutboxEvent, RelayBatchOutcome, RelayStore as _};
use outbox_diesel::{Emit as _, PgRelayStore};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
struct Moved {
    #[outbox(id)]
    n: u32,
}

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(key = account)]
struct Keyed {
    #[outbox(id)]
    n: u32,
    account: String,
}

fn emit(c: &mut PgConnection, ns: std::ops::Range<u32>) {
    c.transaction(|c| c.emit_all(ns.map(|n| Moved { n })))
        .unwrap();
}

fn id_of(c: &mut PgConnection, n: u32) -> i64 {
    Pg::scalar(
        c,
        &format!("SELECT id AS n FROM outbox WHERE msg_id = '{n}:Moved'"),
    )
}

/// Claims and marks SENT whatever is due, once; the msg_ids sent.
async fn send_due(store: &PgRelayStore) -> Vec<String> {
    let batch = store.claim(1000).await.unwrap();
    let ids: Vec<i64> = batch.messages().iter().map(|m| m.id).collect();
    let names = batch
        .messages()
        .iter()
        .map(|m| m.envelope.msg_id.to_string())
        .collect();
    batch
        .complete(RelayBatchOutcome {
            sent: ids,
            ..Default::default()
        })
        .await
        .unwrap();
    names
}

/// Claims every few hundred ms until `done(floor, sent so far)`, or panics after `within`.
async fn claim_until(
    store: &PgRelayStore,
    within: Duration,
    mut done: impl FnMut(i64, &[String]) -> bool,
) -> Vec<String> {
    let deadline = Instant::now() + within;
    let mut sent = Vec::new();
    loop {
        sent.extend(send_due(store).await);
        if done(store.claim_floor(), &sent) {
            return sent;
        }
        assert!(
            Instant::now() < deadline,
            "not reached in {within:?}: floor {}, sent {sent:?}",
            store.claim_floor()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The horizon held back by a read-only `REPEATABLE READ` transaction (as `pg_dump`):
/// the floor rises over every row sent, and the claims still find the next rows.
fn the_floor_rises_while_a_reader_holds_the_horizon_back<B>()
where
    B: Backend<Conn = PgConnection, Store = PgRelayStore>,
{
    let db = B::create();
    let mut c = B::connect(&db);
    let mut reader = B::connect(&db);
    exec(
        &mut reader,
        "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM outbox",
    );
    emit(&mut c, 0..50);
    let last = id_of(&mut c, 49);
    runtime().block_on(async {
        let store = B::store(&db);
        claim_until(&store, Duration::from_secs(20), |floor, sent| {
            sent.len() == 50 && floor > last
        })
        .await;
        emit(&mut c, 50..60);
        let sent = claim_until(&store, Duration::from_secs(10), |_, sent| sent.len() == 10).await;
        assert!(sent.iter().all(|m| m.ends_with(":Moved")), "{sent:?}");
    });
    exec(&mut reader, "COMMIT");
}

/// A transaction that emitted a row and is still open holds the floor at or below that
/// row's id however many later rows are sent; once it commits, its row is claimed.
fn a_late_commit_below_the_sent_rows_is_claimed<B>()
where
    B: Backend<Conn = PgConnection, Store = PgRelayStore>,
{
    let db = B::create();
    let mut c = B::connect(&db);
    let mut late = B::connect(&db);
    AnsiTransactionManager::begin_transaction(&mut late).unwrap();
    late.emit(Moved { n: 1000 }).unwrap();
    let late_id = Pg::scalar(
        &mut late,
        "SELECT id AS n FROM outbox WHERE msg_id = '1000:Moved'",
    );
    emit(&mut c, 0..20);
    runtime().block_on(async {
        let store = B::store(&db);
        claim_until(&store, Duration::from_secs(10), |_, sent| sent.len() == 20).await;
        // Steps every second: give it several to pass the late row, were it wrong.
        let until = Instant::now() + Duration::from_secs(4);
        while Instant::now() < until {
            assert!(send_due(&store).await.is_empty());
            assert!(
                store.claim_floor() <= late_id,
                "the floor {} passed the open transaction's row {late_id}",
                store.claim_floor()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        AnsiTransactionManager::commit_transaction(&mut late).unwrap();
        let sent = claim_until(&store, Duration::from_secs(10), |_, sent| !sent.is_empty()).await;
        assert_eq!(sent, ["1000:Moved"]);
    });
}

/// A sent row made NEW again by hand, below a floor that has passed it, is claimed once
/// the floor is computed from 0 again (within 30 s, `RESET_EVERY`).
fn a_row_made_new_below_the_floor_is_claimed_after_the_reset<B>()
where
    B: Backend<Conn = PgConnection, Store = PgRelayStore>,
{
    let db = B::create();
    let mut c = B::connect(&db);
    emit(&mut c, 0..10);
    let first = id_of(&mut c, 0);
    let last = id_of(&mut c, 9);
    runtime().block_on(async {
        let store = B::store(&db);
        claim_until(&store, Duration::from_secs(20), |floor, sent| {
            sent.len() == 10 && floor > last
        })
        .await;
        exec(
            &mut c,
            &format!("UPDATE outbox SET status = 0, sent_at = NULL WHERE id = {first}"),
        );
        let sent = claim_until(&store, Duration::from_secs(45), |_, sent| !sent.is_empty()).await;
        assert_eq!(sent, ["0:Moved"]);
        assert!(store.claim_floor() <= last + 1);
    });
}

#[test]
fn pg_the_floor_rises_while_a_reader_holds_the_horizon_back() {
    the_floor_rises_while_a_reader_holds_the_horizon_back::<Pg>();
}

#[test]
fn pg_partitioned_the_floor_rises_while_a_reader_holds_the_horizon_back() {
    the_floor_rises_while_a_reader_holds_the_horizon_back::<PgParted>();
}

#[test]
fn pg_a_late_commit_below_the_sent_rows_is_claimed() {
    a_late_commit_below_the_sent_rows_is_claimed::<Pg>();
}

#[test]
fn pg_partitioned_a_late_commit_below_the_sent_rows_is_claimed() {
    a_late_commit_below_the_sent_rows_is_claimed::<PgParted>();
}

#[test]
fn pg_a_row_made_new_below_the_floor_is_claimed_after_the_reset() {
    a_row_made_new_below_the_floor_is_claimed_after_the_reset::<Pg>();
}

/// Emits and sends rows `ns` and waits until the floor has passed them all: the floor,
/// then.
async fn floor_over_sent(
    c: &mut PgConnection,
    store: &PgRelayStore,
    ns: std::ops::Range<u32>,
) -> i64 {
    emit(c, ns.clone());
    let last = id_of(c, ns.end - 1);
    claim_until(store, Duration::from_secs(20), |floor, sent| {
        sent.len() == ns.len() && floor > last
    })
    .await;
    store.claim_floor()
}

/// `setval` on the outbox's id sequence: the next id drawn is `last + 1`.
fn set_sequence(c: &mut PgConnection, last: i64) {
    exec(
        c,
        &format!("SELECT setval(pg_get_serial_sequence('outbox', 'id'), {last})"),
    );
}

/// A transaction holding a transaction id in the database `postgres` (another database
/// of the same cluster) neither holds the floor back nor delays a redriven row: the row,
/// made DEAD and redriven below the floor, goes out at the next claim.
fn a_transaction_in_another_database_holds_nothing_back<B>()
where
    B: Backend<Conn = PgConnection, Store = PgRelayStore>,
{
    let db = B::create();
    let mut c = B::connect(&db);
    let elsewhere = outbox_tests::database_url().replace("/test", "/postgres");
    let mut other = PgConnection::establish(&elsewhere).unwrap();
    exec(&mut other, "BEGIN; SELECT txid_current()");
    runtime().block_on(async {
        let store = B::store(&db);
        let floor = floor_over_sent(&mut c, &store, 0..10).await;
        let first = id_of(&mut c, 0);
        assert!(first < floor);
        exec(
            &mut c,
            &format!("UPDATE outbox SET status = 2, last_error = 'poison' WHERE id = {first}"),
        );
        assert_eq!(outbox_diesel::redrive(&mut c, &[first]).unwrap(), 1);
        assert_eq!(send_due(&store).await, ["0:Moved"]);
    });
    exec(&mut other, "COMMIT");
}

/// The id sequence set back below the floor (as a failover to a standby behind, or a
/// restore, would): the rows emitted then are claimed at once, not after a reset.
fn ids_moved_back_below_the_floor_are_claimed_at_once<B>()
where
    B: Backend<Conn = PgConnection, Store = PgRelayStore>,
{
    let db = B::create();
    let mut c = B::connect(&db);
    runtime().block_on(async {
        let store = B::store(&db);
        let floor = floor_over_sent(&mut c, &store, 0..20).await;
        exec(&mut c, "DELETE FROM outbox");
        set_sequence(&mut c, floor - 11);
        emit(&mut c, 100..101);
        assert!(id_of(&mut c, 100) < floor);
        // The next claim steps (at most every 100 ms), sees the sequence below the floor
        // and walks from 0.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(send_due(&store).await, ["100:Moved"]);
    });
}

/// Restores the rows saved in `saved` by a new table, the sequence left as it is.
const NEW_TABLE: &str = "ALTER TABLE outbox RENAME TO outbox_before; \
     CREATE TABLE outbox (LIKE outbox_before INCLUDING ALL); \
     ALTER SEQUENCE outbox_id_seq OWNED BY outbox.id; DROP TABLE outbox_before; \
     INSERT INTO outbox SELECT * FROM saved";

/// Restores the rows saved in `saved` by a partition attached back (as maintenance does
/// with a detached partition that still holds NEW rows).
const PARTITION_BACK: &str = "DELETE FROM outbox WHERE id IN (SELECT id FROM saved); \
     CREATE TABLE outbox_back (LIKE outbox INCLUDING DEFAULTS); \
     INSERT INTO outbox_back SELECT * FROM saved; \
     UPDATE outbox_back SET created_at = '2000-01-01 12:00+00'; \
     ALTER TABLE outbox ATTACH PARTITION outbox_back \
       FOR VALUES FROM ('2000-01-01 00:00+00') TO ('2000-01-02 00:00+00')";

/// Rows 0..10 saved while NEW, then sent, and the floor past them and rows 10..20:
/// once `restore` brings them back NEW, the next claim takes them.
fn rows_restored_below_the_floor_are_claimed_at_once<B>(restore: &str)
where
    B: Backend<Conn = PgConnection, Store = PgRelayStore>,
{
    let db = B::create();
    let mut c = B::connect(&db);
    emit(&mut c, 0..10);
    exec(&mut c, "CREATE TABLE saved AS SELECT * FROM outbox");
    let last = id_of(&mut c, 9);
    runtime().block_on(async {
        let store = B::store(&db);
        claim_until(&store, Duration::from_secs(20), |floor, sent| {
            sent.len() == 10 && floor > last
        })
        .await;
        let floor = floor_over_sent(&mut c, &store, 10..20).await;
        exec(&mut c, restore);
        assert!(id_of(&mut c, 9) < floor);
        // The floor steps at most every 100 ms: the next claim carries a step, which
        // sees the table changed, and walks from the floor it brings down.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(send_due(&store).await.len(), 10);
    });
}

/// Ids moved back by one, past what the sequence shows: a key's first row lands below the
/// floor and its second at it. The second waits for the first, whatever the floor.
fn a_key_s_row_below_the_floor_goes_out_before_its_later_row<B>()
where
    B: Backend<Conn = PgConnection, Store = PgRelayStore>,
{
    let db = B::create();
    let mut c = B::connect(&db);
    runtime().block_on(async {
        let store = B::store(&db);
        let floor = floor_over_sent(&mut c, &store, 0..10).await;
        exec(&mut c, "DELETE FROM outbox");
        // A claim that steps now, so that the next one, right after the emits, does not:
        // it walks from the floor, and only its look below the floor holds 2 back.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(send_due(&store).await.is_empty());
        set_sequence(&mut c, floor - 2);
        c.transaction(|c| {
            c.emit_all((1..=2).map(|n| Keyed {
                n,
                account: "a".into(),
            }))
        })
        .unwrap();
        let sent = claim_until(&store, Duration::from_secs(5), |_, sent| sent.len() == 2).await;
        assert_eq!(sent, ["1:Keyed", "2:Keyed"]);
    });
}

#[test]
fn pg_a_transaction_in_another_database_holds_nothing_back() {
    a_transaction_in_another_database_holds_nothing_back::<Pg>();
}

#[test]
fn pg_partitioned_a_transaction_in_another_database_holds_nothing_back() {
    a_transaction_in_another_database_holds_nothing_back::<PgParted>();
}

#[test]
fn pg_ids_moved_back_below_the_floor_are_claimed_at_once() {
    ids_moved_back_below_the_floor_are_claimed_at_once::<Pg>();
}

#[test]
fn pg_rows_restored_below_the_floor_are_claimed_at_once() {
    rows_restored_below_the_floor_are_claimed_at_once::<Pg>(NEW_TABLE);
}

#[test]
fn pg_partitioned_rows_attached_back_below_the_floor_are_claimed_at_once() {
    rows_restored_below_the_floor_are_claimed_at_once::<PgParted>(PARTITION_BACK);
}

#[test]
fn pg_a_key_s_row_below_the_floor_goes_out_before_its_later_row() {
    a_key_s_row_below_the_floor_goes_out_before_its_later_row::<Pg>();
}

/// A prepared transaction (two-phase commit) that emitted a row holds the floor below it
/// however many later rows are sent, though it has no session any more; once committed,
/// its row is claimed. On a private server: the shared one allows no prepared
/// transactions.
#[test]
fn pg_a_prepared_transaction_holds_the_floor_below_its_row() {
    let server = outbox_tests::ScratchPostgres::start_with(&[("max_prepared_transactions", "4")]);
    let db = fixtures::TestDb {
        engine: outbox_tests::Engine::Postgres,
        name: outbox_tests::unique("prepared"),
        url: server.url(),
    };
    let mut c = Pg::connect(&db);
    outbox_diesel::migrate(&mut c).unwrap();
    let mut late = Pg::connect(&db);
    exec(&mut late, "BEGIN");
    late.emit(Moved { n: 1000 }).unwrap();
    let late_id = Pg::scalar(
        &mut late,
        "SELECT id AS n FROM outbox WHERE msg_id = '1000:Moved'",
    );
    exec(&mut late, "PREPARE TRANSACTION 'outbox_late'");
    drop(late);
    emit(&mut c, 0..20);
    runtime().block_on(async {
        let store = Pg::store(&db);
        claim_until(&store, Duration::from_secs(10), |_, sent| sent.len() == 20).await;
        let until = Instant::now() + Duration::from_secs(3);
        while Instant::now() < until {
            assert!(send_due(&store).await.is_empty());
            assert!(
                store.claim_floor() <= late_id,
                "the floor {} passed the prepared transaction's row {late_id}",
                store.claim_floor()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        exec(&mut c, "COMMIT PREPARED 'outbox_late'");
        let sent = claim_until(&store, Duration::from_secs(10), |_, sent| !sent.is_empty()).await;
        assert_eq!(sent, ["1000:Moved"]);
    });
}
