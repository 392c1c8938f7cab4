//! Batch-mode consumers whose handlers update one row per ordering key, against real
//! Redis and PostgreSQL: batches running side by side, in one consumer and in two, do
//! not deadlock each other, and every message is applied once.

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection as _;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::{BigInt, Text};
use outbox_core::{
    Delivery, Envelope, Handler, HandlerError, OutboxEvent, Publisher as _, StoredMessage,
};
use outbox_diesel::PgInbox;
use outbox_redis::{Consumer, ConsumerConfig, PublisherConfig, RedisPublisher};
use outbox_tests::{Isolated, redis_url, unique_prefix};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(key = account)]
struct Credited {
    #[outbox(id)]
    n: String,
    account: String,
}

/// Adds one to the account's row: the handler shape of an aggregate per key.
struct Credit;

impl Handler<Credited> for Credit {
    type Conn = PgConnection;

    fn handle(
        &self,
        e: Credited,
        conn: &mut PgConnection,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        diesel::sql_query("UPDATE accounts SET n = n + 1 WHERE id = $1")
            .bind::<Text, _>(&e.account)
            .execute(conn)?;
        // Holds the row a little, as real work does, so that batches overlap.
        std::thread::sleep(Duration::from_micros(300));
        Ok(())
    }
}

#[derive(QueryableByName)]
struct Total {
    #[diesel(sql_type = BigInt)]
    total: i64,
    #[diesel(sql_type = BigInt)]
    consumed: i64,
}

/// Two consumers of one group in batch mode, 8 batches of 50 in flight each, over 16
/// accounts written in interleaved order: before batches were formed per key, nearly
/// every pair of batches updated the same rows in different orders and PostgreSQL broke
/// deadlocks after its `deadlock_timeout` (1 s each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_sharing_keys_do_not_deadlock() {
    const MESSAGES: usize = 1200;
    const ACCOUNTS: usize = 16;
    let schema = Isolated::postgres("e2e");
    let mut conn = PgConnection::establish(&schema.url).unwrap();
    outbox_diesel::migrate(&mut conn).unwrap();
    conn.batch_execute(&format!(
        "CREATE TABLE accounts (id TEXT PRIMARY KEY, n BIGINT NOT NULL);
         INSERT INTO accounts SELECT 'acct-' || g, 0 FROM generate_series(0, {}) g;",
        ACCOUNTS - 1
    ))
    .unwrap();
    let prefix = unique_prefix("contention");
    let publisher = RedisPublisher::new(redis_url().as_str())
        .unwrap()
        .with_config(PublisherConfig::default().with_stream_prefix(prefix.clone()))
        .unwrap();
    let batch: Vec<StoredMessage> = (0..MESSAGES)
        .map(|i| StoredMessage {
            id: i as i64 + 1,
            retries: 0,
            envelope: Envelope::from_event(
                &Credited {
                    n: format!("c{i}"),
                    account: format!("acct-{}", i % ACCOUNTS),
                },
                1 << 20,
            )
            .unwrap(),
        })
        .collect();
    assert!(
        publisher
            .publish(&batch)
            .await
            .unwrap()
            .iter()
            .all(Result::is_ok)
    );

    let consumers: Vec<Consumer<PgInbox>> = (0..2)
        .map(|_| {
            let pool = Pool::builder()
                .max_size(8)
                .build(ConnectionManager::<PgConnection>::new(&schema.url))
                .unwrap();
            Consumer::builder(redis_url(), "credit")
                .with_config(
                    ConsumerConfig::default()
                        .with_stream_prefix(prefix.clone())
                        .with_batch_size(50)
                        .with_max_in_flight(8)
                        .with_block(Duration::from_millis(100)),
                )
                .handle::<Credited, _>(Credit)
                .idempotency(PgInbox::new(pool))
                .build()
                .unwrap()
        })
        .collect();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let runs: Vec<_> = consumers
        .iter()
        .map(|c| {
            let c = c.clone();
            let mut stopped = stopped.clone();
            tokio::spawn(async move {
                c.run_until(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    while consumers.iter().map(|c| c.stats().consumed).sum::<u64>() < MESSAGES as u64 {
        assert!(
            Instant::now() < deadline,
            "not drained: {:?}",
            consumers.iter().map(Consumer::stats).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(true).unwrap();
    for run in runs {
        run.await.unwrap().unwrap();
    }

    let stats: Vec<_> = consumers.iter().map(Consumer::stats).collect();
    let t: Total = diesel::sql_query(
        "SELECT (SELECT sum(n) FROM accounts)::BIGINT AS total, \
                (SELECT count(*) FROM consumed_msg) AS consumed",
    )
    .get_result(&mut conn)
    .unwrap();
    assert_eq!(
        (t.total, t.consumed),
        (MESSAGES as i64, MESSAGES as i64),
        "each message applied once: {stats:?}"
    );
    assert!(
        stats.iter().all(|s| s.conflicts == 0 && s.failures == 0),
        "batches deadlocked or failed: {stats:?}"
    );

    let mut redis = redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let () = redis::cmd("DEL")
        .arg(format!("{prefix}credited"))
        .query_async(&mut redis)
        .await
        .unwrap();
}
