//! Retention of the consumer's streams against the real Redis: dead-letter streams are
//! capped, and the runner can trim acknowledged entries periodically.

mod fixtures;

use std::time::{Duration, Instant};

use fixtures::*;
use outbox_core::MemoryDb;
use outbox_redis::redis::{self, aio::MultiplexedConnection};
use outbox_redis::{Consumer, ConsumerConfig};

async fn xlen(conn: &mut MultiplexedConnection, stream: &str) -> usize {
    redis::cmd("XLEN")
        .arg(stream)
        .query_async(conn)
        .await
        .unwrap()
}

#[test]
fn retention_defaults() {
    let config = ConsumerConfig::default();
    assert_eq!(config.dead_letter_max_len, Some(100_000));
    assert_eq!(config.trim_interval, None);
}

#[tokio::test]
async fn retention_settings_are_validated() {
    let db = MemoryDb::new(Applied::new());
    for config in [
        ConsumerConfig::default().with_dead_letter_max_len(0),
        ConsumerConfig::default().with_trim_interval(Some(Duration::ZERO)),
    ] {
        let built = Consumer::builder(redis_url(), "g")
            .handle::<OrderPaid, _>(Recorder::ok())
            .idempotency(db.clone())
            .with_config(config)
            .build();
        assert!(built.unwrap_err().is_config());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_stream_keeps_at_most_dead_letter_max_len_entries() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    let mut conn = conn().await;
    for n in 0..50 {
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg("msg_id")
            .arg(format!("order-{n}:OrderPaid"))
            .arg("type")
            .arg("OrderPaid")
            .arg("version")
            .arg("1")
            .arg("payload")
            .arg("this is not json")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let db = MemoryDb::new(Applied::new());
    let config = fast_config(&prefix).with_dead_letter_max_len(10);
    let c = consumer(config, &unique("capped"), &db, Recorder::ok());
    let running = Running::start(&c);
    eventually("all 50 dead-lettered", || c.stats().dead_lettered == 50).await;
    running.stop().await;
    // MAXLEN is exact: not one entry more than the cap.
    let dead = c.dead_letter_stream(&stream);
    assert_eq!(xlen(&mut conn, &dead).await, 10);
    let kept = xrange(&mut conn, &dead).await;
    assert!(
        kept.ids
            .iter()
            .all(|e| field(e, "reason").contains("cannot decode")),
        "{kept:?}"
    );
    assert_eq!(pending_count(&mut conn, &stream, c.group()).await, 0);
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_cap_every_dead_letter_is_kept() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    let mut conn = conn().await;
    for _ in 0..15 {
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg("type")
            .arg("OrderPaid")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let db = MemoryDb::new(Applied::new());
    let config = fast_config(&prefix).with_dead_letter_max_len(None);
    let c = consumer(config, &unique("uncapped"), &db, Recorder::ok());
    let running = Running::start(&c);
    eventually("all 15 dead-lettered", || c.stats().dead_lettered == 15).await;
    running.stop().await;
    assert_eq!(xlen(&mut conn, &c.dead_letter_stream(&stream)).await, 15);
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trim_interval_removes_acknowledged_entries_while_running() {
    let prefix = unique_prefix("test");
    let stream = format!("{prefix}order.paid");
    let mut conn = conn().await;
    publish(&prefix, (1..=20).map(paid)).await;
    let db = MemoryDb::new(Applied::new());
    let config = fast_config(&prefix).with_trim_interval(Some(Duration::from_millis(100)));
    let c = consumer(config, &unique("trimming"), &db, Recorder::ok());
    let running = Running::start(&c);
    eventually("all 20 consumed", || c.stats().consumed == 20).await;
    wait_for_len(&mut conn, &stream, 0).await;

    // Entries another group has not read yet stay, while this one's are acked.
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg("lagging")
        .arg("$")
        .query_async(&mut conn)
        .await
        .unwrap();
    publish(&prefix, (21..=25).map(paid)).await;
    eventually("all 25 consumed", || c.stats().consumed == 25).await;
    // Several trim intervals pass: the lagging group's unread entries are kept.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(xlen(&mut conn, &stream).await, 5);
    running.stop().await;
    assert_eq!(c.stats().redis_errors, 0);
    cleanup(&prefix).await;
}

/// Waits until `stream` has `len` entries; fails after a generous bound.
async fn wait_for_len(conn: &mut MultiplexedConnection, stream: &str, len: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = xlen(conn, stream).await;
        if now == len {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{stream} still has {now} entries, waiting for {len}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
