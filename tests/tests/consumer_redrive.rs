//! A redriven consumer dead letter against real Redis and PostgreSQL: two groups read one
//! stream, one applies a message, the other dead-letters it; the dedup rows are purged
//! (`outbox_diesel::purge_consumed`, as `outbox purge consumed` does) and the dead letter
//! redriven (`outbox_redis::redrive_dead_letter`, as `outbox serve` does). The group that
//! gave up applies it; the other, whose inbox no longer knows the message, must not apply
//! it again. Once per way of consuming: single, batch and ordered mode.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use diesel::connection::SimpleConnection as _;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use outbox_core::{Delivery, Envelope, Handler, HandlerError, Publisher as _, StoredMessage};
use outbox_diesel::{PgInbox, PgPool};
use outbox_examples::AccountTransferred;
use outbox_redis::{
    AfterDeadLetter, Consumer, ConsumerConfig, OrderedConfig, PublisherConfig, RedisPublisher,
};
use outbox_tests::{Isolated, redis_url, unique, unique_prefix};

const TOPIC: &str = "account.transferred";

/// Records each application with its group: a second one would show.
#[derive(Clone)]
struct Record {
    group: String,
    /// Fails every delivery while set.
    broken: Arc<AtomicBool>,
}

impl Handler<AccountTransferred> for Record {
    type Conn = PgConnection;

    fn handle(
        &self,
        _: AccountTransferred,
        conn: &mut PgConnection,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        diesel::sql_query("INSERT INTO applied (grp) VALUES ($1)")
            .bind::<diesel::sql_types::Text, _>(&self.group)
            .execute(conn)?;
        if self.broken.load(Ordering::SeqCst) {
            return Err(HandlerError::msg("ledger refused"));
        }
        Ok(())
    }
}

struct Fixture {
    _schema: Isolated,
    pool: PgPool,
    prefix: String,
}

impl Fixture {
    fn new() -> Self {
        let schema = Isolated::postgres("redrive");
        let pool = Pool::builder()
            .max_size(4)
            .build(ConnectionManager::<PgConnection>::new(&schema.url))
            .unwrap();
        let mut conn = pool.get().unwrap();
        outbox_diesel::migrate(&mut *conn).unwrap();
        conn.batch_execute("CREATE TABLE applied (grp TEXT NOT NULL)")
            .unwrap();
        Self {
            _schema: schema,
            pool,
            prefix: unique_prefix("redrive"),
        }
    }

    async fn publish(&self) {
        let config = PublisherConfig::default().with_stream_prefix(self.prefix.clone());
        let publisher = RedisPublisher::new(redis_url().as_str())
            .unwrap()
            .with_config(config)
            .unwrap();
        let envelope =
            Envelope::from_event(&AccountTransferred::new("t-1", "alice", "bob", 5), 1 << 20)
                .unwrap();
        let message = StoredMessage {
            id: 1,
            retries: 0,
            envelope,
        };
        let outcomes = publisher.publish(&[message]).await.unwrap();
        assert!(outcomes.iter().all(Result::is_ok));
    }

    fn consumer(&self, config: ConsumerConfig, handler: Record) -> Consumer<PgInbox> {
        Consumer::builder(redis_url(), handler.group.clone())
            .with_config(config.with_stream_prefix(self.prefix.clone()))
            .handle::<AccountTransferred, _>(handler)
            .idempotency(PgInbox::new(self.pool.clone()))
            .build()
            .unwrap()
    }

    fn applied_by(&self, group: &str) -> i64 {
        #[derive(QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        diesel::sql_query("SELECT count(*) AS n FROM applied WHERE grp = $1")
            .bind::<diesel::sql_types::Text, _>(group)
            .get_result::<N>(&mut *self.pool.get().unwrap())
            .unwrap()
            .n
    }
}

/// Runs `consumer` until `done` holds (at most 60 s), then shuts it down gracefully.
async fn run_until(
    consumer: &Consumer<PgInbox>,
    done: impl Fn(&Consumer<PgInbox>) -> bool + Send + 'static,
) {
    let watcher = consumer.clone();
    let stop = async move {
        while !done(&watcher) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), consumer.run_until(stop))
        .await
        .expect("condition reached within 60 s")
        .unwrap();
}

fn single() -> ConsumerConfig {
    ConsumerConfig::default()
        .with_block(Duration::from_millis(200))
        .with_min_idle(Duration::from_millis(300))
        .with_claim_interval(Duration::from_millis(100))
        .with_max_deliveries(2)
}

fn batch() -> ConsumerConfig {
    single().with_batch_size(10)
}

fn ordered() -> ConsumerConfig {
    single().with_ordered(OrderedConfig::default().with_lease_ttl(Duration::from_secs(2)))
}

/// `applier` applies the message; `failing` dead-letters it and, after the dedup rows
/// are purged and the dead letter redriven, applies it. `applier` must not apply it again.
async fn a_redrive_reaches_only_the_group_that_gave_up(
    applier_config: ConsumerConfig,
    failing_config: ConsumerConfig,
) {
    let f = Fixture::new();
    f.publish().await;
    let applier = Record {
        group: unique("billing"),
        broken: Arc::default(),
    };
    let failing = Record {
        group: unique("ledger"),
        broken: Arc::new(AtomicBool::new(true)),
    };
    let first = f.consumer(applier_config.clone(), applier.clone());
    run_until(&first, |c| c.stats().consumed == 1).await;
    let gave_up = f.consumer(failing_config.clone(), failing.clone());
    run_until(&gave_up, |c| c.stats().dead_lettered == 1).await;
    assert_eq!(f.applied_by(&failing.group), 0);

    let purged = outbox_diesel::purge_consumed(&mut *f.pool.get().unwrap(), Duration::ZERO, 100);
    assert_eq!(purged.unwrap(), 1, "the applier's dedup row is gone");
    let mut redis = redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let stream = format!("{}{TOPIC}", f.prefix);
    let dead_stream = gave_up.dead_letter_stream(&stream);
    let dead = outbox_redis::dead_letters(&mut redis, &dead_stream, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].group, failing.group);
    assert!(
        outbox_redis::redrive_dead_letter(&mut redis, &dead_stream, &dead[0].id)
            .await
            .unwrap()
    );

    // The applier reads the redriven entry: whatever it does with it ends the run.
    let again = f.consumer(applier_config, applier.clone());
    run_until(&again, |c| {
        let s = c.stats();
        s.consumed + s.duplicates + s.dead_lettered + s.redrives_for_others > 0
    })
    .await;
    failing.broken.store(false, Ordering::SeqCst);
    let retried = f.consumer(failing_config, failing.clone());
    run_until(&retried, |c| c.stats().consumed == 1).await;

    assert_eq!(f.applied_by(&applier.group), 1, "applied once, not again");
    assert_eq!(again.stats().redrives_for_others, 1);
    assert_eq!(
        f.applied_by(&failing.group),
        1,
        "the group that gave up applied the redrive (its failed deliveries rolled back)"
    );
    assert_eq!(retried.stats().redrives_for_others, 0);
    let groups = outbox_redis::consumer_groups(&mut redis, &stream)
        .await
        .unwrap();
    assert!(
        groups.iter().all(|g| g.pending == 0),
        "both groups acked the redriven entry: {groups:?}"
    );
    assert!(
        outbox_redis::dead_letters(&mut redis, &dead_stream, 10)
            .await
            .unwrap()
            .is_empty()
    );
    outbox_tests::delete_redis_keys(&f.prefix);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_is_applied_by_the_group_that_gave_up_and_no_other_single_mode() {
    a_redrive_reaches_only_the_group_that_gave_up(single(), single()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_is_skipped_by_an_ordered_consumer_and_applied_in_batch_mode() {
    a_redrive_reaches_only_the_group_that_gave_up(ordered(), batch()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_is_skipped_in_batch_mode_and_applied_by_an_ordered_consumer() {
    a_redrive_reaches_only_the_group_that_gave_up(batch(), ordered()).await;
}

/// An ordered group that blocks a key after a dead letter (`AfterDeadLetter::Block`)
/// still acknowledges another group's redrive of that key at once: the redrive is none of
/// its business, and must not wait behind the block for an operator (nor hold a pending
/// entry, and the read-ahead, meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_groups_redrive_does_not_wait_behind_a_key_this_ordered_group_blocked() {
    let f = Fixture::new();
    f.publish().await;
    let broken = Arc::new(AtomicBool::new(true));
    let blocker = Record {
        group: unique("blocker"),
        broken: Arc::clone(&broken),
    };
    let ledger = Record {
        group: unique("ledger"),
        broken,
    };
    let blocking = || {
        ordered().with_ordered(
            OrderedConfig::default()
                .with_lease_ttl(Duration::from_secs(2))
                .with_after_dead_letter(AfterDeadLetter::Block),
        )
    };
    let first = f.consumer(blocking(), blocker.clone());
    run_until(&first, |c| c.stats().dead_lettered == 1).await;
    let gave_up = f.consumer(single(), ledger.clone());
    run_until(&gave_up, |c| c.stats().dead_lettered == 1).await;

    let mut redis = redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let stream = format!("{}{TOPIC}", f.prefix);
    let blocked = outbox_redis::blocked_keys(&mut redis, &stream, &blocker.group)
        .await
        .unwrap();
    assert_eq!(blocked.len(), 1, "the blocker blocked the key: {blocked:?}");
    let dead_stream = gave_up.dead_letter_stream(&stream);
    let dead = outbox_redis::dead_letters(&mut redis, &dead_stream, 10)
        .await
        .unwrap();
    let ledgers: Vec<_> = dead.iter().filter(|d| d.group == ledger.group).collect();
    assert_eq!(ledgers.len(), 1);
    assert!(
        outbox_redis::redrive_dead_letter(&mut redis, &dead_stream, &ledgers[0].id)
            .await
            .unwrap()
    );

    let again = f.consumer(blocking(), blocker.clone());
    run_until(&again, |c| c.stats().redrives_for_others == 1).await;
    let groups = outbox_redis::consumer_groups(&mut redis, &stream)
        .await
        .unwrap();
    let blockers = groups.iter().find(|g| g.name == blocker.group).unwrap();
    assert_eq!(
        blockers.pending, 0,
        "the redrive acknowledged: {blockers:?}"
    );
    let still = outbox_redis::blocked_keys(&mut redis, &stream, &blocker.group)
        .await
        .unwrap();
    assert_eq!(still, blocked, "the key stays blocked for an operator");
    assert_eq!(f.applied_by(&blocker.group), 0);
    outbox_tests::delete_redis_keys(&f.prefix);
}
