//! Traces end to end (the `opentelemetry` features): a request span emits in a
//! PostgreSQL transaction, the relay publishes to Redis, a consumer runs the handler;
//! the relay's publish span, the consumer's span and the handler's span all belong to
//! the request's trace, each with its parent chain back to the request span.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox_core::{Delivery, Handler, HandlerError, Headers, Relay, TRACEPARENT};
use outbox_diesel::{Emit as _, EmitOptions, PgInbox, PgPool, PgRelayStore};
use outbox_examples::AccountTransferred;
use outbox_redis::{Consumer, ConsumerConfig, PublisherConfig, RedisPublisher};
use outbox_tests::{Isolated, redis_url, unique, unique_prefix};
use tracing_subscriber::layer::SubscriberExt as _;

/// A trace context a foreign caller set on the message itself.
const FOREIGN_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const FOREIGN_PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Opens a `handler.apply` span per message (a user's own span) and keeps the headers.
#[derive(Clone, Default)]
struct Traced {
    headers: Arc<Mutex<Vec<Headers>>>,
}

impl Handler<AccountTransferred> for Traced {
    type Conn = PgConnection;

    fn handle(
        &self,
        e: AccountTransferred,
        _conn: &mut PgConnection,
        d: &Delivery,
    ) -> Result<(), HandlerError> {
        let _apply = tracing::info_span!("handler.apply", transfer = %e.transfer_id).entered();
        self.headers
            .lock()
            .unwrap()
            .push(d.envelope.headers.clone());
        Ok(())
    }
}

/// Every span of this test binary goes to the returned exporter.
fn install_exporter() -> (InMemorySpanExporter, SdkTracerProvider) {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-tests"));
    // Global: the relay, the consumer and the handler run on other threads.
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
        .expect("the only subscriber of this test binary");
    (exporter, provider)
}

fn pool(schema: &Isolated) -> PgPool {
    let pool = Pool::builder()
        .max_size(4)
        .build(ConnectionManager::<PgConnection>::new(&schema.url))
        .unwrap();
    outbox_diesel::migrate(&mut *pool.get().unwrap()).unwrap();
    pool
}

/// The spans named `name` that belong to `msg_id` (their `msg_id` attribute).
fn spans_of<'a>(spans: &'a [SpanData], name: &str, msg_id: &str) -> Vec<&'a SpanData> {
    spans
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            s.attributes
                .iter()
                .any(|kv| kv.key.as_str() == "msg_id" && kv.value.as_str() == msg_id)
        })
        .collect()
}

fn one<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
    let found: Vec<_> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "one `{name}` span: {found:#?}");
    found[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_emit_relay_and_handler_share_one_trace() {
    let (exporter, provider) = install_exporter();
    let schema = Isolated::postgres("traces");
    let pool = pool(&schema);
    let prefix = unique_prefix("traces");

    // The request: emits one transfer in its trace, and one whose caller set a
    // traceparent of its own, which emit keeps.
    let request = tracing::info_span!("request");
    let (traced_id, foreign_id) = request.in_scope(|| {
        let mut conn = pool.get().unwrap();
        conn.transaction(|c| {
            let traced = c.emit(AccountTransferred::new("t-1", "alice", "bob", 5))?;
            let options = EmitOptions::default().with_header(TRACEPARENT, FOREIGN_PARENT);
            let foreign =
                c.emit_with(&options, AccountTransferred::new("t-2", "alice", "bob", 7))?;
            diesel::QueryResult::Ok((traced, foreign))
        })
        .unwrap()
    });
    drop(request);

    let publisher = RedisPublisher::new(redis_url().as_str())
        .unwrap()
        .with_config(PublisherConfig::default().with_stream_prefix(prefix.clone()))
        .unwrap();
    let relay = Relay::new(PgRelayStore::new(pool.clone()), publisher);
    assert_eq!(relay.run_once().await.unwrap().sent, 2);

    let handler = Traced::default();
    let consumer = Consumer::builder(redis_url(), unique("traces"))
        .with_config(
            ConsumerConfig::default()
                .with_stream_prefix(prefix.clone())
                .with_block(Duration::from_millis(200)),
        )
        .handle::<AccountTransferred, _>(handler.clone())
        .idempotency(PgInbox::new(pool.clone()))
        .build()
        .unwrap();
    let watcher = consumer.clone();
    let done = async move {
        while watcher.stats().consumed < 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), consumer.run_until(done))
        .await
        .expect("both messages consumed within 60 s")
        .unwrap();
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();

    let request = one(&spans, "request");
    let trace = request.span_context.trace_id();
    assert_ne!(trace, TraceId::INVALID);
    let expected = format!("00-{trace}-{}-01", request.span_context.span_id());
    let mut seen: Vec<Option<String>> = handler
        .headers
        .lock()
        .unwrap()
        .iter()
        .map(|h| h.get(TRACEPARENT).cloned())
        .collect();
    seen.sort();
    let mut wanted = vec![Some(expected), Some(FOREIGN_PARENT.to_owned())];
    wanted.sort();
    assert_eq!(
        seen, wanted,
        "emit adds the request's traceparent, keeps the caller's"
    );

    // request → outbox.relay.publish, linked to its outbox.relay.batch.
    let publish = spans_of(&spans, "outbox.relay.publish", traced_id.as_str());
    assert_eq!(publish.len(), 1, "{spans:#?}");
    assert_eq!(publish[0].span_context.trace_id(), trace);
    assert_eq!(publish[0].parent_span_id, request.span_context.span_id());
    let batch = spans
        .iter()
        .find(|s| {
            s.name == "outbox.relay.batch"
                && s.attributes
                    .iter()
                    .any(|kv| kv.key.as_str() == "claimed" && kv.value.as_str() == "2")
        })
        .expect("the batch span that claimed both messages");
    assert!(
        publish[0]
            .links
            .links
            .iter()
            .any(|l| l.span_context == batch.span_context),
        "the publish span links to its batch"
    );

    // request → outbox.consume → handler.apply
    let consume = spans_of(&spans, "outbox.consume", traced_id.as_str());
    assert_eq!(consume.len(), 1, "{spans:#?}");
    assert_eq!(consume[0].span_context.trace_id(), trace);
    assert_eq!(consume[0].parent_span_id, request.span_context.span_id());
    let applies: Vec<_> = spans
        .iter()
        .filter(|s| {
            s.name == "handler.apply" && s.parent_span_id == consume[0].span_context.span_id()
        })
        .collect();
    assert_eq!(
        applies.len(),
        1,
        "the handler's span is a child of outbox.consume"
    );
    assert_eq!(applies[0].span_context.trace_id(), trace);

    // The caller's own trace context wins over the current span's.
    let foreign = spans_of(&spans, "outbox.consume", foreign_id.as_str());
    assert_eq!(foreign.len(), 1);
    assert_eq!(
        foreign[0].span_context.trace_id().to_string(),
        FOREIGN_TRACE
    );
    assert_eq!(
        foreign[0].parent_span_id,
        SpanId::from_hex("00f067aa0ba902b7").unwrap()
    );

    outbox_tests::delete_redis_keys(&prefix);
}
