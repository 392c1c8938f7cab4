//! Run with: cargo run -p outbox-examples --features traces --bin traces
//!
//! One trace from the request to the handler, printed by OpenTelemetry's stdout
//! exporter: a `request` span emits a transfer in a SQLite transaction (emit adds the
//! span's `traceparent` header), the relay publishes it to Redis (its
//! `outbox.relay.publish` span joins the trace, linked to `outbox.relay.batch`), and the
//! consumer's `outbox.consume` span and the handler's `handler.apply` span join it too.
//! Every span printed with the request's trace id is part of that one trace.
//!
//! Needs the local Redis (`REDIS_URL` overrides it). Works in a temporary SQLite file and
//! its own streams (`outbox-traces-example:*`), which it resets on each run.

use std::process::ExitCode;
use std::time::Duration;

use diesel::prelude::*;
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_sdk::trace::SdkTracerProvider;
use outbox_core::{Delivery, Handler, HandlerError, Relay};
use outbox_diesel::{Emit as _, SqliteInbox, SqliteRelayStore};
use outbox_examples::AccountTransferred;
use outbox_examples::scenario::BoxError;
use outbox_examples::services;
use outbox_redis::{Consumer, ConsumerConfig, PublisherConfig, RedisPublisher};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;

const STREAM_PREFIX: &str = "outbox-traces-example:";

/// The consumer's handler: its own span, inside the message's trace.
struct Apply;

impl Handler<AccountTransferred> for Apply {
    type Conn = SqliteConnection;

    fn handle(
        &self,
        e: AccountTransferred,
        _conn: &mut SqliteConnection,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        let _apply = tracing::info_span!("handler.apply", transfer = %e.transfer_id).entered();
        tracing::info!(amount = e.amount, "applied");
        Ok(())
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", outbox_core::error_chain(&*e));
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), BoxError> {
    // Spans go to stdout as each one ends.
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(opentelemetry_stdout::SpanExporter::default())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("traces-example"));
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))?;

    let redis_url = services::redis_url();
    reset_streams(&redis_url).await?;
    let path = std::env::temp_dir().join("outbox-traces-example.db");
    let _ = std::fs::remove_file(&path);
    let pool = outbox_diesel::sqlite_pool(&path.to_string_lossy(), 4)?;
    outbox_diesel::migrate(&mut *pool.get()?)?;

    let request = tracing::info_span!("request", route = "POST /transfers");
    let trace_id = request.context().span().span_context().trace_id();
    request.in_scope(|| {
        pool.get()?.transaction(|c| {
            c.emit(AccountTransferred::new("t-1", "alice", "bob", 25))?;
            diesel::QueryResult::Ok(())
        })?;
        Ok::<_, BoxError>(())
    })?;
    drop(request);

    let publisher = RedisPublisher::new(redis_url.as_str())?
        .with_config(PublisherConfig::default().with_stream_prefix(STREAM_PREFIX))?;
    let relay = Relay::new(SqliteRelayStore::new(pool.clone())?, publisher);
    relay.run_once().await?;

    let consumer = Consumer::builder(redis_url.clone(), "traces-example")
        .with_config(
            ConsumerConfig::default()
                .with_stream_prefix(STREAM_PREFIX)
                .with_block(Duration::from_millis(200)),
        )
        .handle::<AccountTransferred, _>(Apply)
        .idempotency(SqliteInbox::new(pool.clone()))
        .build()?;
    let watcher = consumer.clone();
    let consumed = async move {
        while watcher.stats().consumed < 1 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), consumer.run_until(consumed))
        .await
        .map_err(|_| "the transfer was not consumed within 30 s")??;
    provider.force_flush()?;
    println!(
        "\nThe request's trace id is {trace_id}: the spans request, outbox.relay.publish, \
         outbox.consume and handler.apply above all carry it."
    );
    Ok(())
}

/// Deletes this example's streams, so each run starts empty.
async fn reset_streams(redis_url: &str) -> Result<(), BoxError> {
    let mut conn = services::redis(redis_url).await?;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{STREAM_PREFIX}*"))
        .query_async(&mut conn)
        .await?;
    if !keys.is_empty() {
        let () = redis::cmd("DEL").arg(keys).query_async(&mut conn).await?;
    }
    Ok(())
}
