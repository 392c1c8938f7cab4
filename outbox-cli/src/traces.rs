//! Traces out of `outbox relay` (feature `opentelemetry`): with
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) set, the
//! relay's spans go to that OTLP collector over HTTP (protobuf). A message that carries
//! a `traceparent` (emit adds the request's) gets an `outbox.relay.publish` span in its
//! trace, so one trace shows request → emit → relay → handler whether the relay runs
//! inside the application or as this command. The other `OTEL_*` variables of the
//! OpenTelemetry SDK apply (`OTEL_SERVICE_NAME`, `OTEL_EXPORTER_OTLP_HEADERS`, ...).

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::SpanExporter;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Level;
use tracing::level_filters::LevelFilter;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::registry::LookupSpan;

const ENDPOINTS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
];

/// The exporter; dropping it exports what is left (a batch goes every few seconds).
pub(crate) struct Exporter(SdkTracerProvider);

impl Drop for Exporter {
    fn drop(&mut self) {
        if let Err(e) = self.0.shutdown() {
            eprintln!("warning: traces not exported at exit: {e}");
        }
    }
}

/// The layer that exports spans and its exporter, if an endpoint is configured.
///
/// It takes outbox's spans (`debug`, so that they stay out of the log at the default
/// `info`) and every `info` span, whatever `RUST_LOG` says about the log.
pub(crate) fn from_env<S>() -> Result<Option<(impl Layer<S>, Exporter)>, String>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    if !ENDPOINTS.iter().any(|v| std::env::var_os(v).is_some()) {
        return Ok(None);
    }
    let exporter = SpanExporter::builder()
        .with_http()
        .build()
        .map_err(|e| format!("traces: the OTLP exporter ({}): {e}", ENDPOINTS.join(" / ")))?;
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("outbox");
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    let spans = Targets::new().with_default(LevelFilter::INFO).with_targets(
        ["outbox_core", "outbox_diesel", "outbox_redis", "outbox"].map(|t| (t, Level::DEBUG)),
    );
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("outbox"))
        .with_filter(spans);
    Ok(Some((layer, Exporter(provider))))
}
