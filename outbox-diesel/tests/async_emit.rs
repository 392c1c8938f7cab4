//! Emit on diesel-async connections (`AsyncEmit`, features `async-postgres` and
//! `async-mysql`): what the blocking emit guarantees, on the real servers. A committed
//! emit is relayed by the blocking relay stores, a rolled-back one leaves nothing, a
//! duplicate msg_id is the same error and leaves a PostgreSQL transaction usable,
//! `emit_all` is all or nothing, the options are checked, and on PostgreSQL the emit's
//! NOTIFY wakes a parked relay.
#![cfg(any(feature = "async-postgres", feature = "async-mysql"))]

mod fixtures;

use std::time::{Duration, Instant};

use diesel_async::{AsyncConnection, SimpleAsyncConnection};
use fixtures::{Backend, runtime};
use outbox_core::{MemoryBroker, OutboxEvent, Relay, RelayStore as _};
use outbox_diesel::{AsyncEmit, EmitOptions};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(topic = "orders", key = order)]
struct OrderPaid {
    #[outbox(id)]
    order: String,
    cents: i64,
}

fn paid(order: &str) -> OrderPaid {
    OrderPaid {
        order: order.into(),
        cents: 100,
    }
}

/// The outbox rows, through a blocking connection.
fn rows<B: Backend>(db: &fixtures::TestDb) -> i64 {
    B::scalar(&mut B::connect(db), "SELECT COUNT(*) AS n FROM outbox")
}

fn balance<B: Backend>(db: &fixtures::TestDb, who: &str) -> i64 {
    let sql = format!("SELECT balance AS n FROM accounts WHERE id = '{who}'");
    B::scalar(&mut B::connect(db), &sql)
}

/// The business update of the tests' transactions.
async fn debit<C: SimpleAsyncConnection>(c: &mut C, cents: i64) -> diesel::QueryResult<()> {
    let sql = format!("UPDATE accounts SET balance = balance - {cents} WHERE id = 'alice'");
    c.batch_execute(&sql).await
}

/// A committed emit is in the outbox with the business update, and the blocking relay
/// store claims and publishes it.
async fn committed_is_relayed<B: Backend, C: AsyncConnection + AsyncEmit>(db: &fixtures::TestDb) {
    let mut conn = C::establish(&db.url).await.unwrap();
    let msg_id = conn
        .transaction(async |c| {
            debit(c, 100).await?;
            let id = c.emit(paid("o-1")).await?;
            Ok::<_, outbox_diesel::Error>(id)
        })
        .await
        .unwrap();
    assert_eq!(msg_id.as_str(), "o-1:OrderPaid");
    assert_eq!(balance::<B>(db, "alice"), 900);

    let broker = MemoryBroker::new();
    let relay = Relay::new(B::store(db), broker.clone());
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.claimed, report.sent), (1, 1));
    let published = broker.published("orders");
    assert_eq!(published.len(), 1);
    assert_eq!(published[0].msg_id, msg_id);
    assert_eq!(published[0].key, "o-1");
    let event: OrderPaid = serde_json::from_str(&published[0].payload).unwrap();
    assert_eq!(event.cents, 100);
}

/// A transaction that emits and then fails leaves neither the message nor the update.
async fn rolled_back_leaves_nothing<B: Backend, C: AsyncConnection + AsyncEmit>(
    db: &fixtures::TestDb,
) {
    let mut conn = C::establish(&db.url).await.unwrap();
    let failed = conn
        .transaction(async |c| {
            debit(c, 100).await?;
            c.emit(paid("o-1")).await?;
            Err::<(), _>(diesel::result::Error::RollbackTransaction)
        })
        .await;
    assert!(failed.is_err());
    assert_eq!(rows::<B>(db), 0);
    assert_eq!(balance::<B>(db, "alice"), 1000);
}

/// A duplicate msg_id is the blocking emit's error, before and after `?` made it a
/// diesel error; nothing was written, and the transaction goes on and commits (on
/// PostgreSQL too, where a failed statement would have aborted it).
async fn duplicate_keeps_the_transaction<B: Backend, C: AsyncConnection + AsyncEmit>(
    db: &fixtures::TestDb,
) {
    let mut conn = C::establish(&db.url).await.unwrap();
    conn.emit(paid("o-1")).await.unwrap();
    conn.transaction(async |c| {
        let e = c.emit(paid("o-1")).await.unwrap_err();
        assert!(e.is_duplicate(), "{e}");
        let e = c.emit_all([paid("o-2"), paid("o-1")]).await.unwrap_err();
        assert!(e.is_duplicate(), "{e}");
        assert!(e.to_string().contains("o-1:OrderPaid"), "{e}");
        // The transaction is still usable.
        debit(c, 100).await?;
        c.emit(paid("o-3")).await?;
        Ok::<_, outbox_diesel::Error>(())
    })
    .await
    .unwrap();
    assert_eq!(rows::<B>(db), 2, "o-1 and o-3; o-2 was taken back");
    assert_eq!(balance::<B>(db, "alice"), 900);

    let after_question_mark = conn
        .transaction(async |c| {
            c.emit(paid("o-3")).await?;
            Ok::<_, diesel::result::Error>(())
        })
        .await
        .unwrap_err();
    assert!(outbox_diesel::is_duplicate(&after_question_mark));
}

/// `emit_all` writes every event in one go; invalid options and oversized payloads are
/// refused before anything is written.
async fn emit_all_and_checks<B: Backend, C: AsyncConnection + AsyncEmit>(db: &fixtures::TestDb) {
    let mut conn = C::establish(&db.url).await.unwrap();
    let ids = conn
        .emit_all((1..=3).map(|n| paid(&format!("o-{n}"))))
        .await
        .unwrap();
    assert_eq!(ids.len(), 3);
    assert_eq!(rows::<B>(db), 3);

    let invalid = EmitOptions::new().with_max_payload_bytes(0);
    let e = conn.emit_with(&invalid, paid("o-4")).await.unwrap_err();
    assert!(
        matches!(e, outbox_diesel::Error::Core(outbox_core::Error::Config(_))),
        "{e:?}"
    );
    let small = EmitOptions::new().with_max_payload_bytes(8);
    let e = conn.emit_with(&small, paid("o-4")).await.unwrap_err();
    assert!(
        matches!(
            e,
            outbox_diesel::Error::Core(outbox_core::Error::PayloadTooLarge { .. })
        ),
        "{e:?}"
    );
    assert_eq!(rows::<B>(db), 3);
}

#[cfg(feature = "async-postgres")]
mod postgres {
    use diesel_async::AsyncPgConnection;
    use fixtures::Pg;

    use super::*;

    #[test]
    fn a_committed_emit_is_relayed() {
        let db = Pg::create();
        runtime().block_on(committed_is_relayed::<Pg, AsyncPgConnection>(&db));
    }

    #[test]
    fn a_rolled_back_emit_leaves_nothing() {
        let db = Pg::create();
        runtime().block_on(rolled_back_leaves_nothing::<Pg, AsyncPgConnection>(&db));
    }

    #[test]
    fn a_duplicate_leaves_the_transaction_usable() {
        let db = Pg::create();
        runtime().block_on(duplicate_keeps_the_transaction::<Pg, AsyncPgConnection>(
            &db,
        ));
    }

    #[test]
    fn emit_all_and_the_checks() {
        let db = Pg::create();
        runtime().block_on(emit_all_and_checks::<Pg, AsyncPgConnection>(&db));
    }

    /// The default `Notify::WhenRelayIdle` wakes a parked relay at commit.
    #[test]
    fn the_emit_wakes_a_parked_relay() {
        let db = Pg::create();
        runtime().block_on(async {
            let store = Pg::store(&db);
            let parked =
                tokio::spawn(async move { store.wait_for_work(Duration::from_secs(20)).await });
            let idle = || fixtures::parked_relays(&db) == 1;
            outbox_tests::eventually_within("the relay parks", Duration::from_secs(20), idle).await;
            let started = Instant::now();
            let mut conn = AsyncPgConnection::establish(&db.url).await.unwrap();
            let opts = EmitOptions::new().with_channel(db.name.clone());
            conn.transaction(async |c| {
                c.emit_with(&opts, paid("o-1")).await?;
                Ok::<_, outbox_diesel::Error>(())
            })
            .await
            .unwrap();
            parked.await.unwrap();
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "woken by NOTIFY, not by its 20 s timeout"
            );
        });
    }
}

#[cfg(feature = "async-mysql")]
mod mysql {
    use diesel_async::AsyncMysqlConnection;
    use fixtures::My;

    use super::*;

    #[test]
    fn a_committed_emit_is_relayed() {
        let db = My::create();
        runtime().block_on(committed_is_relayed::<My, AsyncMysqlConnection>(&db));
    }

    #[test]
    fn a_rolled_back_emit_leaves_nothing() {
        let db = My::create();
        runtime().block_on(rolled_back_leaves_nothing::<My, AsyncMysqlConnection>(&db));
    }

    #[test]
    fn a_duplicate_leaves_the_transaction_usable() {
        let db = My::create();
        runtime().block_on(duplicate_keeps_the_transaction::<My, AsyncMysqlConnection>(
            &db,
        ));
    }

    #[test]
    fn emit_all_and_the_checks() {
        let db = My::create();
        runtime().block_on(emit_all_and_checks::<My, AsyncMysqlConnection>(&db));
    }
}

/// The connections of diesel-async's pools emit too (they dereference to the
/// connection): a deadpool connection here.
#[cfg(feature = "async-postgres")]
#[test]
fn a_pooled_connection_emits() {
    use diesel_async::AsyncPgConnection;
    use diesel_async::pooled_connection::AsyncDieselConnectionManager;
    use diesel_async::pooled_connection::deadpool::Pool;
    use fixtures::Pg;

    let db = Pg::create();
    runtime().block_on(async {
        let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(db.url.clone());
        let pool = Pool::builder(manager).max_size(2).build().unwrap();
        let mut conn = pool.get().await.unwrap();
        conn.transaction(async |c| {
            c.emit(paid("o-1")).await?;
            Ok::<_, outbox_diesel::Error>(())
        })
        .await
        .unwrap();
        let e = conn.emit(paid("o-1")).await.unwrap_err();
        assert!(e.is_duplicate(), "{e}");
    });
    assert_eq!(rows::<Pg>(&db), 1);
}
