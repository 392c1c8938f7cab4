//! A retry's `next_retry_at` is set on the database's clock, the one the claim compares
//! it with: a relay whose clock differs from the database's still waits the retry delay,
//! no more and no less. The database's clock is moved a day ahead of the relay's for
//! the store's connections (PostgreSQL: `now()` and the other clock functions in the
//! test's schema, ahead of `pg_catalog`'s; MariaDB: `SET timestamp`).

mod fixtures;

use std::time::Duration;

use chrono::Utc;
use diesel::connection::SimpleConnection as _;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool};
use diesel::{Connection as _, MysqlConnection, PgConnection};
use fixtures::{Backend, Lite, My, Pg, exec, runtime};
use outbox_core::{ClaimedBatch, OutboxEvent, RelayBatchOutcome, RelayStore, RetryRow};
use outbox_diesel::{Emit as _, MysqlRelayStore, PgRelayStore};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
struct Pinged {
    #[outbox(id)]
    n: u32,
}

/// The retry delay the tests schedule.
const DELAY: Duration = Duration::from_secs(600);

/// Claims the one row, schedules its retry `DELAY` from now on the relay's clock, and
/// checks that the claim no longer sees it (it is not due before its delay).
async fn retry_in_delay<S: RelayStore>(store: &S) {
    let batch = store.claim(10).await.unwrap();
    assert_eq!(batch.messages().len(), 1);
    let id = batch.messages()[0].id;
    let at = Utc::now() + chrono::Duration::from_std(DELAY).unwrap();
    batch
        .complete(RelayBatchOutcome {
            retry: vec![RetryRow {
                id,
                next_retry_at: at,
                error: "rejected".into(),
            }],
            ..RelayBatchOutcome::default()
        })
        .await
        .unwrap();
    let again = store.claim(10).await.unwrap();
    assert!(
        again.messages().is_empty(),
        "claimed again right away: the retry was scheduled on the relay's clock, a day \
         behind the database's"
    );
}

/// `secs` (next_retry_at minus the database's now) is the delay, less the few
/// seconds the test took.
fn assert_delay(secs: i64) {
    let delay = DELAY.as_secs() as i64;
    assert!(
        (delay - 30..=delay).contains(&secs),
        "next_retry_at is {secs} s from the database's now, not about {delay} s"
    );
}

#[test]
fn pg_retry_delay_runs_on_the_database_clock() {
    runtime().block_on(async {
        let db = Pg::create();
        let mut c = Pg::connect(&db);
        c.emit(Pinged { n: 1 }).unwrap();
        // Created in the test's schema; connections whose search_path puts it before
        // pg_catalog see clocks a day ahead.
        for (f, volatility) in [
            ("now", "STABLE"),
            ("transaction_timestamp", "STABLE"),
            ("statement_timestamp", "STABLE"),
            ("clock_timestamp", "VOLATILE"),
        ] {
            exec(
                &mut c,
                &format!(
                    "CREATE FUNCTION {f}() RETURNS timestamptz LANGUAGE sql {volatility} \
                     AS $$ SELECT pg_catalog.{f}() + interval '1 day' $$"
                ),
            );
        }
        let ahead = db.url.replace(
            &format!("search_path%3D{}", db.name),
            &format!("search_path%3D{}%2Cpg_catalog", db.name),
        );
        assert_ne!(ahead, db.url);
        let mut a = PgConnection::establish(&ahead).unwrap();
        assert_eq!(
            Pg::scalar(
                &mut a,
                "SELECT extract(epoch FROM now() - pg_catalog.now())::bigint AS n"
            ),
            86_400,
            "the store's database clock is a day ahead"
        );
        let pool = Pool::builder()
            .max_size(2)
            .build(ConnectionManager::<PgConnection>::new(ahead))
            .unwrap();
        retry_in_delay(&PgRelayStore::new(pool)).await;
        assert_delay(Pg::scalar(
            &mut a,
            "SELECT extract(epoch FROM next_retry_at - now())::bigint AS n FROM outbox",
        ));
    });
}

/// Moves each connection's clock a day ahead (MariaDB's `SET timestamp`).
#[derive(Debug)]
struct DayAhead;

impl CustomizeConnection<MysqlConnection, diesel::r2d2::Error> for DayAhead {
    fn on_acquire(&self, conn: &mut MysqlConnection) -> Result<(), diesel::r2d2::Error> {
        conn.batch_execute("SET timestamp = UNIX_TIMESTAMP() + 86400")
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

#[test]
fn mysql_retry_delay_runs_on_the_database_clock() {
    runtime().block_on(async {
        let db = My::create();
        My::connect(&db).emit(Pinged { n: 1 }).unwrap();
        let pool = Pool::builder()
            .max_size(2)
            .connection_customizer(Box::new(DayAhead))
            .build(ConnectionManager::<MysqlConnection>::new(db.url.clone()))
            .unwrap();
        retry_in_delay(&MysqlRelayStore::new(pool.clone())).await;
        let mut a = pool.get().unwrap();
        assert_delay(My::scalar(
            &mut a,
            "SELECT TIMESTAMPDIFF(SECOND, UTC_TIMESTAMP(6), next_retry_at) AS n FROM outbox",
        ));
    });
}

/// SQLite is always on the relay's host, on its clock; this checks the SQL that puts
/// the delay on the database's clock.
#[test]
fn sqlite_retry_delay_runs_on_the_database_clock() {
    runtime().block_on(async {
        let db = Lite::create();
        Lite::connect(&db).emit(Pinged { n: 1 }).unwrap();
        let store = Lite::store(&db);
        retry_in_delay(&store).await;
        assert_delay(Lite::scalar(
            &mut Lite::connect(&db),
            "SELECT CAST(round((julianday(next_retry_at) - julianday('now')) * 86400) AS INTEGER) \
             AS n FROM outbox",
        ));
    });
}
