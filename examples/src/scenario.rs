//! The reference scenario on real services, step by step, for the `transfer` example and
//! the end-to-end test that checks its outcome.

use std::time::Duration;

use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use outbox_core::{
    FailAs, FlakyPublisher, Publisher as _, Relay, RelayConfig, RelayStore, RetryPolicy, Status,
    StoredMessage,
};
use outbox_diesel::{DieselInbox, OutboxConnection};
use outbox_redis::{Consumer, ConsumerConfig, PublisherConfig, RedisPublisher};

use crate::AccountTransferred;
use crate::sql::{Bank, NoteTransfer};

/// A boxed error: the scenario reports whatever failed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the scenario ended with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Alice's and Bob's balances.
    pub balances: (i64, i64),
    /// The message's final status and failed attempts.
    pub message: (Status, u32),
    /// Messages in the outbox (the refused transfer must not have added one).
    pub messages: usize,
    /// Deliveries applied and recognised as duplicates by the consumer.
    pub applied: u64,
    /// Deliveries recognised as duplicates.
    pub duplicates: u64,
    /// The consumer's notes.
    pub notes: Vec<String>,
}

/// Runs the scenario on `pool` (business and consumer tables, already set up with
/// [`SETUP_SQL`](crate::sql::SETUP_SQL) and migrated), the relay store `store` and the
/// Redis at `redis_url` under `stream_prefix`, telling each step to `say`.
pub async fn run<C, S>(
    pool: Pool<ConnectionManager<C>>,
    store: S,
    redis_url: &str,
    stream_prefix: &str,
    mut say: impl FnMut(String),
) -> Result<Outcome, BoxError>
where
    C: Bank + OutboxConnection + R2D2Connection,
    S: RelayStore,
{
    let mut conn = pool.get()?;
    let msg_id = conn.transfer(AccountTransferred::new("m-1", "alice", "bob", 100))?;
    say(format!(
        "1. transfer m-1 committed: balances and message {msg_id} in one transaction"
    ));
    show(&mut *conn, &mut say)?;

    match conn.transfer(AccountTransferred::new("m-2", "bob", "alice", 5000)) {
        Err(e) => say(format!(
            "2. transfer m-2 refused ({e}): rolled back, no message"
        )),
        Ok(id) => return Err(format!("m-2 should have been refused, got {id}").into()),
    }
    show(&mut *conn, &mut say)?;

    say("3. relay: the broker fails the first two attempts".into());
    let config = PublisherConfig::default().with_stream_prefix(stream_prefix);
    let flaky = FlakyPublisher::new(
        RedisPublisher::new(redis_url)?.with_config(config.clone())?,
        FailAs::Rejection,
    )
    .fail_first(2);
    let retry = RetryPolicy::default()
        .with_max_attempts(3)
        .with_base_delay(Duration::ZERO)
        .with_jitter(0.0);
    let relay = Relay::new(store, flaky).with_config(RelayConfig::default().with_retry(retry))?;
    for round in 1..=4 {
        let r = relay.run_once().await?;
        say(format!(
            "   round {round}: claimed {}, published {}, retrying {}",
            r.claimed, r.sent, r.retried
        ));
    }
    let record =
        outbox_diesel::find_message(&mut *conn, msg_id.as_str())?.ok_or("message row is gone")?;
    say(format!(
        "   {msg_id}: {} after {} failed attempts",
        record.status, record.retries
    ));
    let message = (record.status, record.retries);

    say("4. the broker delivers it twice (as after a relay crash between XADD and SENT)".into());
    let again = StoredMessage {
        id: record.id,
        retries: record.retries,
        envelope: record.envelope,
    };
    RedisPublisher::new(redis_url)?
        .with_config(config)?
        .publish(&[again])
        .await?;
    let consumer = Consumer::builder(redis_url, "notes")
        .with_config(ConsumerConfig::default().with_stream_prefix(stream_prefix))
        .handle::<AccountTransferred, _>(NoteTransfer::<C>::new())
        .idempotency(DieselInbox::new(pool.clone()))
        .build()?;
    let watcher = consumer.clone();
    let both_seen = async move {
        while watcher.stats().consumed + watcher.stats().duplicates < 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), consumer.run_until(both_seen)).await??;
    let stats = consumer.stats();
    say(format!(
        "   consumer: applied {}, recognised as duplicate {}",
        stats.consumed, stats.duplicates
    ));

    say("5. the end".into());
    show(&mut *conn, &mut say)?;
    let notes = conn.notes()?;
    say(format!("   downstream notes: {notes:?}"));
    Ok(Outcome {
        balances: conn.balances()?,
        message,
        messages: outbox_diesel::list_messages(&mut *conn, None, 0, 100)?.len(),
        applied: stats.consumed,
        duplicates: stats.duplicates,
        notes,
    })
}

fn show<C: Bank + OutboxConnection>(
    conn: &mut C,
    say: &mut impl FnMut(String),
) -> Result<(), BoxError> {
    let (alice, bob) = conn.balances()?;
    say(format!("   balances: alice={alice} bob={bob}"));
    for m in outbox_diesel::list_messages(conn, None, 0, 10)? {
        say(format!(
            "   message {} status={} retries={}",
            m.envelope.msg_id, m.status, m.retries
        ));
    }
    Ok(())
}
