//! Every way to register a handler reads the streams the relay writes for the event type,
//! partitioned types included, written as a user of the facade would: the derive, emit
//! in a diesel transaction, the relay, and consumers on the sync and the async inbox
//! against the real PostgreSQL and Redis.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use diesel::{Connection as _, PgConnection};
use diesel_async::AsyncPgConnection;
use outbox::diesel::{AsyncPgInbox, Emit as _, PgInbox, PgRelayStore};
use outbox::redis::{Consumer, ConsumerConfig, ConsumerStore, PublisherConfig, RedisPublisher};
use outbox::{AsyncHandler, AsyncTxHandler, Delivery, Handler, HandlerError, OutboxEvent, Relay};
use outbox_tests::{Isolated, redis_url, unique_prefix};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "order.shipped", partitions = 4)]
struct OrderShipped {
    #[outbox(id)]
    order_id: String,
}

/// Counts its calls; every registration method gets one.
#[derive(Clone, Default)]
struct Count(Arc<AtomicU32>);

impl Count {
    fn get(&self) -> u32 {
        self.0.load(Ordering::SeqCst)
    }
}

impl Handler<OrderShipped> for Count {
    type Conn = PgConnection;

    fn handle(
        &self,
        _: OrderShipped,
        _: &mut PgConnection,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl AsyncHandler<OrderShipped> for Count {
    async fn handle(&self, _: OrderShipped, _: &Delivery) -> Result<(), HandlerError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl AsyncTxHandler<OrderShipped> for Count {
    type Conn = AsyncPgConnection;

    async fn handle(
        &self,
        _: OrderShipped,
        _: &mut AsyncPgConnection,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

const ORDERS: u32 = 12;

struct Fixture {
    schema: Isolated,
    prefix: String,
}

impl Fixture {
    /// `ORDERS` shipments emitted and relayed to their partition streams.
    async fn relayed() -> Self {
        let schema = Isolated::postgres("registration");
        let prefix = unique_prefix("registration");
        let mut conn = PgConnection::establish(&schema.url).unwrap();
        outbox::diesel::migrate(&mut conn).unwrap();
        conn.transaction(|c| {
            for i in 0..ORDERS {
                c.emit(OrderShipped {
                    order_id: format!("order-{i}"),
                })?;
            }
            Ok::<_, outbox::diesel::Error>(())
        })
        .unwrap();
        let publisher = RedisPublisher::new(redis_url().as_str())
            .unwrap()
            .with_config(
                PublisherConfig::default()
                    .with_stream_prefix(prefix.clone())
                    .with_partitions_of::<OrderShipped>(),
            )
            .unwrap();
        let store = PgRelayStore::connect(&schema.url, 2).unwrap();
        let report = Relay::new(store, publisher).run_once().await.unwrap();
        assert_eq!(report.sent, ORDERS as usize, "{report:?}");
        Self { schema, prefix }
    }

    fn config(&self) -> ConsumerConfig {
        ConsumerConfig::default()
            .with_stream_prefix(self.prefix.clone())
            .with_block(Duration::from_millis(100))
    }

    fn partition_streams(&self) -> Vec<String> {
        (0..4)
            .map(|p| format!("{}order.shipped:{p}", self.prefix))
            .collect()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        outbox_tests::delete_redis_keys(&self.prefix);
    }
}

/// Resolves once `count` reached `ORDERS`.
async fn all_applied(count: Count) {
    while count.get() < ORDERS {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `consumer` reads the four partition streams and applies all `ORDERS` (at most 30 s).
async fn reads_the_partitions_and_applies_all<I, C>(
    f: &Fixture,
    count: &Count,
    consumer: Consumer<I, C>,
) where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    assert_eq!(
        consumer.streams().collect::<Vec<_>>(),
        f.partition_streams()
    );
    tokio::time::timeout(
        Duration::from_secs(30),
        consumer.run_until(all_applied(count.clone())),
    )
    .await
    .unwrap_or_else(|_| panic!("{} of {ORDERS} applied in 30 s", count.get()))
    .unwrap();
    assert_eq!(count.get(), ORDERS);
}

#[tokio::test(flavor = "multi_thread")]
async fn handle_reads_the_partition_streams() {
    let f = Fixture::relayed().await;
    let count = Count::default();
    let consumer = Consumer::builder(redis_url(), "sync")
        .with_config(f.config())
        .handle::<OrderShipped, _>(count.clone())
        .idempotency(PgInbox::connect(&f.schema.url, 2).unwrap())
        .build()
        .unwrap();
    reads_the_partitions_and_applies_all(&f, &count, consumer).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn handle_async_reads_the_partition_streams() {
    let f = Fixture::relayed().await;
    let count = Count::default();
    let consumer = Consumer::builder(redis_url(), "effects")
        .with_config(f.config())
        .handle_async::<OrderShipped, _>(count.clone())
        .idempotency(PgInbox::connect(&f.schema.url, 2).unwrap())
        .build()
        .unwrap();
    reads_the_partitions_and_applies_all(&f, &count, consumer).await;
}

/// The hole this file was written for: `handle_tx` once read `outbox:order.shipped`
/// while the relay wrote `outbox:order.shipped:0..3`, and applied nothing.
#[tokio::test(flavor = "multi_thread")]
async fn handle_tx_on_the_async_inbox_reads_the_partition_streams() {
    let f = Fixture::relayed().await;
    let count = Count::default();
    let consumer = Consumer::builder(redis_url(), "async")
        .with_config(f.config())
        .handle_tx::<OrderShipped, _>(count.clone())
        .idempotency_async(AsyncPgInbox::connect(&f.schema.url, 2).unwrap())
        .build()
        .unwrap();
    reads_the_partitions_and_applies_all(&f, &count, consumer).await;
}
