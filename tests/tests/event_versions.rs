//! Event schema versions through the real Redis and the real consumer: a foreign producer
//! still writing `OrderPaid` v1 and v2 entries by hand while the consumer's handler is at
//! v3. The consumer's upgrade steps bring the old payloads up to v3 before the handler
//! sees them; a v4 entry (from a newer service) and a v1 entry a step refuses are
//! dead-lettered on their first delivery, with the reason, never retried.

use std::collections::HashMap;
use std::time::Duration;

use outbox_core::{Delivery, Handler, HandlerError, MemoryDb, MemoryTx, OutboxEvent};
use outbox_redis::redis::{self, Value};
use outbox_redis::{Consumer, ConsumerConfig};
use outbox_tests::{redis_url, unique, unique_prefix};
use serde_json::json;

/// v1 was `{order_id, cents}`; v2 renamed `cents` to `amount_cents`; v3 added
/// `currency`.
#[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(version = 3)]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
    amount_cents: i64,
    currency: String,
}

/// The consumer's data: one line per applied order, as the handler saw it.
type Ledger = Vec<String>;

struct Book;

impl Handler<OrderPaid> for Book {
    type Conn = MemoryTx<Ledger>;
    fn handle(
        &self,
        e: OrderPaid,
        tx: &mut MemoryTx<Ledger>,
        d: &Delivery,
    ) -> Result<(), HandlerError> {
        tx.data().push(format!(
            "{} {} {} (sent as v{})",
            e.order_id, e.amount_cents, e.currency, d.envelope.schema_version
        ));
        Ok(())
    }
}

/// What another service's producer writes for `OrderPaid` at `version`, by hand.
async fn xadd(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    version: u32,
    payload: serde_json::Value,
) -> String {
    let order_id = payload["order_id"].as_str().unwrap().to_owned();
    redis::cmd("XADD")
        .arg(stream)
        .arg("*")
        .arg("msg_id")
        .arg(format!("{order_id}:OrderPaid"))
        .arg("type")
        .arg("OrderPaid")
        .arg("version")
        .arg(version.to_string())
        .arg("key")
        .arg(&order_id)
        .arg("payload")
        .arg(payload.to_string())
        .query_async(conn)
        .await
        .expect("XADD")
}

fn consumer(
    prefix: &str,
    group: &str,
    db: &MemoryDb<Ledger>,
    batch: bool,
) -> Consumer<MemoryDb<Ledger>> {
    let config = ConsumerConfig::default()
        .with_stream_prefix(prefix.to_owned())
        .with_block(Duration::from_millis(200))
        // Short, so that an entry left pending would be delivered again within the
        // test and show up as a second delivery.
        .with_min_idle(Duration::from_millis(300))
        .with_claim_interval(Duration::from_millis(100))
        .with_batch_size(batch.then_some(16));
    Consumer::builder(redis_url(), group)
        .with_config(config)
        .handle::<OrderPaid, _>(Book)
        .upgrade::<OrderPaid>(1, |mut v| {
            let cents = v
                .get_mut("cents")
                .map(serde_json::Value::take)
                .ok_or("a v1 payload without `cents`")?;
            v["amount_cents"] = cents;
            Ok(v)
        })
        .upgrade::<OrderPaid>(2, |mut v| {
            // Every order was in euros before v3.
            v["currency"] = json!("EUR");
            Ok(v)
        })
        .idempotency(db.clone())
        .build()
        .unwrap()
}

fn text(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        other => panic!("not a bulk string: {other:?}"),
    }
}

async fn run(batch: bool) {
    let prefix = unique_prefix("versions");
    let stream = format!("{prefix}order.paid");
    let group = unique("ledger");
    let client = redis::Client::open(redis_url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();

    xadd(
        &mut conn,
        &stream,
        1,
        json!({"order_id": "o-1", "cents": 100}),
    )
    .await;
    xadd(
        &mut conn,
        &stream,
        2,
        json!({"order_id": "o-2", "amount_cents": 200}),
    )
    .await;
    let newer = xadd(
        &mut conn,
        &stream,
        4,
        json!({"order_id": "o-4", "amount_cents": 400, "currency": "USD", "vat_cents": 76}),
    )
    .await;
    let refused = xadd(
        &mut conn,
        &stream,
        1,
        json!({"order_id": "o-5", "amount": 5}),
    )
    .await;
    xadd(
        &mut conn,
        &stream,
        3,
        json!({"order_id": "o-3", "amount_cents": 300, "currency": "USD"}),
    )
    .await;

    let db = MemoryDb::new(Ledger::new());
    let consumer = consumer(&prefix, &group, &db, batch);
    let watcher = consumer.clone();
    let stop = async move {
        while !(watcher.stats().consumed == 3 && watcher.stats().dead_lettered == 2) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Long enough for an entry left pending to be claimed and delivered again.
        tokio::time::sleep(Duration::from_millis(800)).await;
    };
    tokio::time::timeout(Duration::from_secs(60), consumer.run_until(stop))
        .await
        .expect("three applied and two dead-lettered within 60 s")
        .unwrap();

    let mut ledger = db.read(Clone::clone);
    ledger.sort();
    assert_eq!(
        ledger,
        [
            "o-1 100 EUR (sent as v1)",
            "o-2 200 EUR (sent as v2)",
            "o-3 300 USD (sent as v3)",
        ]
    );
    let stats = consumer.stats();
    assert_eq!((stats.consumed, stats.dead_lettered), (3, 2), "{stats:?}");

    let dead: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(consumer.dead_letter_stream(&stream))
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    let dead: HashMap<String, &HashMap<String, Value>> = dead
        .ids
        .iter()
        .map(|e| (text(&e.map["entry_id"]), &e.map))
        .collect();
    assert_eq!(dead.len(), 2, "{dead:?}");
    let reason = text(&dead[&newer]["reason"]);
    assert!(
        reason.ends_with("produced by a newer service (v4 > v3)"),
        "{reason}"
    );
    let reason = text(&dead[&refused]["reason"]);
    assert_eq!(
        reason,
        "cannot upgrade a `OrderPaid` payload from schema version 1 to 2: a v1 payload \
         without `cents`"
    );
    // Permanent failures: dead-lettered on the first delivery, not after
    // `max_deliveries` of them.
    for entry in dead.values() {
        assert_eq!(text(&entry["delivery_count"]), "1");
    }
    let pending: redis::streams::StreamPendingReply = redis::cmd("XPENDING")
        .arg(&stream)
        .arg(&group)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(pending.count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_at_v3_upgrades_v1_and_v2_entries_and_dead_letters_v4() {
    run(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_batch_mode_too() {
    run(true).await;
}
