//! A MariaDB connection whose server went away (crashed, restarted, or ended the
//! session) fails one claim, backlog or message, and the pool then connects again, on
//! pools that skip r2d2's `SELECT 1` on check-out, as `outbox relay` and
//! `DieselInbox::connect` build them. (diesel's `MysqlConnection` does not notice that its
//! server is gone, unlike `PgConnection`; the pool handed the dead connection out again
//! for every batch, and a relay never resumed after its server's restart.)

mod fixtures;

use std::time::Duration;

use diesel::RunQueryDsl as _;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::{MysqlConnection, QueryableByName};
use fixtures::{Backend, My, runtime};
use outbox_core::{Inbox, MsgId, Processed, RelayStore};
use outbox_diesel::{MysqlInbox, MysqlRelayStore};

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: i64,
}

/// Ends every session on `db` but the caller's own, as a server's crash would.
fn kill_other_sessions(admin: &mut MysqlConnection, db: &fixtures::TestDb) {
    let name = db
        .url
        .rsplit('/')
        .next()
        .unwrap()
        .split('?')
        .next()
        .unwrap();
    let ids: Vec<Id> = diesel::sql_query(format!(
        "SELECT CAST(id AS SIGNED) AS id FROM information_schema.processlist \
         WHERE db = '{name}' AND id <> CONNECTION_ID()"
    ))
    .load(admin)
    .unwrap();
    // A session that ended meanwhile (the setup's) is an "Unknown thread id".
    let killed = ids
        .iter()
        .filter(|Id { id }| {
            diesel::sql_query(format!("KILL CONNECTION {id}"))
                .execute(admin)
                .is_ok()
        })
        .count();
    assert!(killed > 0, "the pool holds a session");
    std::thread::sleep(Duration::from_millis(200));
}

/// A pool of one connection, not tested on check-out (as `outbox relay` builds it).
fn untested_pool(db: &fixtures::TestDb) -> Pool<ConnectionManager<MysqlConnection>> {
    Pool::builder()
        .max_size(1)
        .test_on_check_out(false)
        .connection_timeout(Duration::from_secs(10))
        .build(ConnectionManager::new(db.url.clone()))
        .unwrap()
}

#[test]
fn mysql_relay_store_connects_again_after_its_session_is_gone() {
    let db = My::create();
    let mut admin = My::connect(&db);
    let store = MysqlRelayStore::new(untested_pool(&db));
    runtime().block_on(async {
        store.claim(10).await.expect("a claim on a live server");
        kill_other_sessions(&mut admin, &db);
        let lost = store.claim(10).await;
        assert!(
            lost.as_ref().is_err_and(outbox_core::Error::is_outage),
            "the dead connection fails as an outage: {lost:?}"
        );
        store
            .claim(10)
            .await
            .expect("a new connection for the next claim");

        kill_other_sessions(&mut admin, &db);
        let lost = store.backlog().await;
        assert!(lost.is_err(), "the dead connection fails: {lost:?}");
        store
            .backlog()
            .await
            .expect("a new connection for the next backlog");
    });
}

#[test]
fn mysql_inbox_connects_again_after_its_session_is_gone() {
    let db = My::create();
    let mut admin = My::connect(&db);
    let inbox = MysqlInbox::connect(&db.url, 1).unwrap();
    let id = |s: &str| MsgId::new(s).unwrap();
    assert_eq!(
        inbox.process("g", &id("a:E"), |_| Ok(())).unwrap(),
        Processed::Applied
    );
    kill_other_sessions(&mut admin, &db);
    let mut ran = false;
    let lost = inbox.process("g", &id("b:E"), |_| {
        ran = true;
        Ok(())
    });
    assert!(lost.is_err(), "the dead connection fails: {lost:?}");
    assert!(!ran, "the handler never ran on the dead connection");
    assert_eq!(
        inbox.process("g", &id("b:E"), |_| Ok(())).unwrap(),
        Processed::Applied,
        "a new connection"
    );
    let recorded = My::scalar(
        &mut admin,
        "SELECT count(*) AS n FROM consumed_msg WHERE consumer_group = 'g'",
    );
    assert_eq!(recorded, 2);
}
