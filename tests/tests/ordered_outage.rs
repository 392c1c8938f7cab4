//! An ordered consumer whose Redis loses its data (`FLUSHALL`; a restart without
//! persistence or a failover to an empty replica does the same) while a handler of its
//! runs, with the PostgreSQL inbox: every lease, epoch counter, group and stream is gone.
//! The consumer takes the partition again (under the same epoch number, the counter
//! having started over) only once the work of its lost holding has ended: two steps of
//! one key never run at once, and they commit in order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel::connection::SimpleConnection as _;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use outbox_core::{Delivery, Envelope, Handler, HandlerError, OutageBackoff, OutboxEvent};
use outbox_diesel::{PgInbox, PgPool};
use outbox_redis::{Consumer, ConsumerConfig, OrderedConfig, entry_fields};
use outbox_tests::{Isolated, ScratchRedis, eventually, unique_prefix};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "outage.step", key = key, id = "{key}/{seq}")]
struct Step {
    key: String,
    seq: i64,
}

/// What the handlers of one process are doing, and every time two steps of one key ran
/// at once.
#[derive(Clone, Default)]
struct Watch {
    running: Arc<Mutex<HashMap<String, Vec<i64>>>>,
    overlaps: Arc<Mutex<Vec<String>>>,
    started: Arc<Mutex<Vec<i64>>>,
}

/// Records each step in `applied` (in commit order, by its serial id). Step 1 takes 3 s
/// (longer than the lease TTL), the others 300 ms.
struct Apply(Watch);

impl Handler<Step> for Apply {
    type Conn = PgConnection;

    fn handle(&self, e: Step, conn: &mut PgConnection, _: &Delivery) -> Result<(), HandlerError> {
        let watch = &self.0;
        {
            let mut running = watch.running.lock().unwrap();
            let others = running.entry(e.key.clone()).or_default();
            if others.iter().any(|&seq| seq != e.seq) {
                watch
                    .overlaps
                    .lock()
                    .unwrap()
                    .push(format!("{}/{} started while {others:?} ran", e.key, e.seq));
            }
            others.push(e.seq);
            watch.started.lock().unwrap().push(e.seq);
        }
        let pause = if e.seq == 1 { 3000 } else { 300 };
        std::thread::sleep(Duration::from_millis(pause));
        {
            let mut running = watch.running.lock().unwrap();
            let others = running.entry(e.key.clone()).or_default();
            if let Some(i) = others.iter().position(|&seq| seq == e.seq) {
                others.remove(i);
            }
        }
        diesel::sql_query("INSERT INTO applied (k, seq) VALUES ($1, $2)")
            .bind::<diesel::sql_types::Text, _>(&e.key)
            .bind::<diesel::sql_types::BigInt, _>(e.seq)
            .execute(conn)?;
        Ok(())
    }
}

#[derive(QueryableByName)]
struct Seq {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    seq: i64,
}

fn applied(pool: &PgPool) -> Vec<i64> {
    diesel::sql_query("SELECT seq FROM applied ORDER BY id")
        .load::<Seq>(&mut *pool.get().unwrap())
        .unwrap()
        .into_iter()
        .map(|s| s.seq)
        .collect()
}

async fn produce(url: &str, stream: &str, seqs: std::ops::RangeInclusive<i64>) {
    let mut conn = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    for seq in seqs {
        let step = Step {
            key: "k".into(),
            seq,
        };
        let envelope = Envelope::from_event(&step, 1 << 20).unwrap();
        let mut xadd = redis::cmd("XADD");
        xadd.arg(stream).arg("*");
        for (field, value) in entry_fields(&envelope) {
            xadd.arg(field).arg(&*value);
        }
        let _: String = xadd.query_async(&mut conn).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_partition_is_not_taken_again_while_work_of_its_lost_lease_runs() {
    let schema = Isolated::postgres("ordered_outage");
    let pool: PgPool = Pool::builder()
        .max_size(4)
        .build(ConnectionManager::<PgConnection>::new(&schema.url))
        .unwrap();
    {
        let mut conn = pool.get().unwrap();
        outbox_diesel::migrate(&mut *conn).unwrap();
        conn.batch_execute(
            "CREATE TABLE applied (id BIGSERIAL PRIMARY KEY, k TEXT NOT NULL, seq BIGINT NOT NULL)",
        )
        .unwrap();
    }
    let redis = ScratchRedis::start();
    let prefix = unique_prefix("ordered_outage");
    let stream = format!("{prefix}outage.step");
    let watch = Watch::default();
    let config = ConsumerConfig::default()
        .with_stream_prefix(prefix.clone())
        .with_block(Duration::from_millis(200))
        .with_max_in_flight(4)
        .with_outage_backoff(
            OutageBackoff::default()
                .with_min(Duration::from_millis(10))
                .with_max(Duration::from_millis(100)),
        )
        .with_ordered(OrderedConfig::default().with_lease_ttl(Duration::from_secs(1)));
    let consumer = Consumer::builder(redis.url(), "g")
        .with_config(config)
        .handle::<Step, _>(Apply(watch.clone()))
        .idempotency(PgInbox::new(pool.clone()))
        .build()
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn({
        let consumer = consumer.clone();
        async move {
            consumer
                .run_until(async {
                    stopped.await.ok();
                })
                .await
        }
    });
    produce(&redis.url(), &stream, 1..=1).await;
    eventually("step 1 running", || {
        watch.started.lock().unwrap().contains(&1)
    })
    .await;
    // Redis loses everything while step 1 runs; the next steps come at once.
    let mut conn = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    produce(&redis.url(), &stream, 2..=5).await;
    eventually("every step applied", || applied(&pool).len() == 5).await;
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the consumer stops")
        .unwrap()
        .unwrap();
    let overlaps = watch.overlaps.lock().unwrap().clone();
    assert!(overlaps.is_empty(), "{overlaps:?}");
    assert_eq!(applied(&pool), [1, 2, 3, 4, 5]);
}
