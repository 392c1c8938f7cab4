//! The consumer's check of a topic's partition count at start (`ensure_groups`), against
//! the real Redis: what publishers recorded in `<prefix>partitions` differs from what it
//! reads, or nothing is recorded while the topic's unpartitioned stream, which it does
//! not read, fills up (a relay without `--partitions`). Each is a warning in the logs,
//! captured here.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use outbox_core::{Delivery, Envelope, Handler, HandlerError, MemoryDb, MemoryTx, OutboxEvent};
use outbox_redis::{Consumer, ConsumerConfig, entry_fields};
use outbox_tests::{redis_url, unique_prefix};
use tracing_subscriber::layer::SubscriberExt as _;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "checks.step", key = key, partitions = 4)]
struct Step {
    #[outbox(id)]
    id: String,
    key: String,
}

struct Nothing;

impl Handler<Step> for Nothing {
    type Conn = MemoryTx<()>;

    fn handle(&self, _: Step, _: &mut MemoryTx<()>, _: &Delivery) -> Result<(), HandlerError> {
        Ok(())
    }
}

/// Every event's fields, one line each.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Line(String);
        impl tracing::field::Visit for Line {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                let _ = write!(self.0, "{}={value:?} ", field.name());
            }
        }
        let mut line = Line(String::new());
        event.record(&mut line);
        self.0.lock().unwrap().push(line.0);
    }
}

/// The warnings of a consumer of `prefix` creating its groups.
async fn warnings(prefix: &str) -> Vec<String> {
    let capture = Capture::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(capture.clone()));
    let consumer = Consumer::builder(redis_url(), "g")
        .handle::<Step, _>(Nothing)
        .idempotency(MemoryDb::new(()))
        .with_config(ConsumerConfig::default().with_stream_prefix(prefix))
        .build()
        .unwrap();
    consumer.ensure_groups().await.unwrap();
    let lines = capture.0.lock().unwrap().clone();
    lines
        .into_iter()
        .filter(|l| l.contains("partition"))
        .collect()
}

async fn redis() -> redis::aio::MultiplexedConnection {
    redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn cleanup(conn: &mut redis::aio::MultiplexedConnection, prefix: &str) {
    let _: () = redis::cmd("EVAL")
        .arg("for _, k in ipairs(redis.call('KEYS', ARGV[1])) do redis.call('DEL', k) end")
        .arg(0)
        .arg(format!("{prefix}*"))
        .query_async(conn)
        .await
        .unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn entries_in_the_unpartitioned_stream_of_a_topic_read_as_partitions_are_a_warning() {
    let prefix = unique_prefix("checks");
    let mut conn = redis().await;
    assert_eq!(warnings(&prefix).await, Vec::<String>::new(), "nothing yet");
    // A relay without --partitions: the topic's one stream, and no record.
    let step = Step {
        id: "s1".into(),
        key: "k".into(),
    };
    let envelope = Envelope::from_event(&step, 1 << 20).unwrap();
    let mut xadd = redis::cmd("XADD");
    xadd.arg(format!("{prefix}checks.step")).arg("*");
    for (field, value) in entry_fields(&envelope) {
        xadd.arg(field).arg(&*value);
    }
    let _: String = xadd.query_async(&mut conn).await.unwrap();
    let found = warnings(&prefix).await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].contains("its unpartitioned stream") && found[0].contains("entries=1"),
        "{found:?}"
    );
    cleanup(&mut conn, &prefix).await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_recorded_count_other_than_the_one_read_is_a_warning() {
    let prefix = unique_prefix("checks");
    let mut conn = redis().await;
    let _: () = redis::cmd("HSET")
        .arg(format!("{prefix}partitions"))
        .arg("checks.step")
        .arg(8)
        .query_async(&mut conn)
        .await
        .unwrap();
    let found = warnings(&prefix).await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].contains("published=8") && found[0].contains("read=4"),
        "{found:?}"
    );
    cleanup(&mut conn, &prefix).await;
}
