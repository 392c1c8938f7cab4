//! W3C trace context across the outbox: the `traceparent` header.
//!
//! With the `opentelemetry` feature, emit (outbox-diesel's `Emit` and
//! [`MemoryTx::emit`](crate::MemoryTx::emit)) adds the current `tracing` span's
//! OpenTelemetry context as a [`TRACEPARENT`] header, unless the caller set one, so the
//! message carries the trace of the request that emitted it. The relay starts one
//! `outbox.relay.publish` span per message inside that trace (linked to its
//! `outbox.relay.batch` span), and outbox-redis's consumer (its own `opentelemetry`
//! feature) makes the header the parent of its `outbox.consume` span. One trace then
//! shows request → emit → relay → handler.
//!
//! Only the `traceparent` header is carried, always in W3C Trace Context format whatever
//! propagator the application installed globally: it is the contract with foreign
//! producers and consumers. Without the feature, [`add_current`] does nothing.

use crate::{Headers, TRACEPARENT};

/// Adds the current span's `traceparent` to `headers`, unless it holds one already or
/// the current span has no valid OpenTelemetry context (no `tracing-opentelemetry` layer,
/// or no span). Does nothing without the `opentelemetry` feature.
pub fn add_current(headers: &mut Headers) {
    #[cfg(feature = "opentelemetry")]
    if !headers.contains_key(TRACEPARENT)
        && let Some(parent) = current_traceparent()
    {
        headers.insert(TRACEPARENT.to_owned(), parent);
    }
    #[cfg(not(feature = "opentelemetry"))]
    let _ = (headers, TRACEPARENT);
}

#[cfg(feature = "opentelemetry")]
pub use otel::{context_of, current_traceparent, set_parent};

/// Spans that last while the relay publishes a batch: one `outbox.relay.publish` per
/// message that carries a trace, in that trace, linked to the current
/// `outbox.relay.batch` span. A batch publishes many traces at once, so the batch span
/// itself belongs to none of them. Nothing without the `opentelemetry` feature.
pub(crate) fn publish_spans(messages: &[crate::StoredMessage]) -> Vec<tracing::Span> {
    #[cfg(feature = "opentelemetry")]
    {
        otel::publish_spans(messages)
    }
    #[cfg(not(feature = "opentelemetry"))]
    {
        let _ = messages;
        Vec::new()
    }
}

#[cfg(feature = "opentelemetry")]
mod otel {
    use std::collections::HashMap;

    use opentelemetry::Context;
    use opentelemetry::propagation::TextMapPropagator as _;
    use opentelemetry::trace::TraceContextExt as _;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    use crate::{Headers, TRACEPARENT};

    /// The W3C `traceparent` of the current `tracing` span, if it has a valid
    /// OpenTelemetry span context.
    pub fn current_traceparent() -> Option<String> {
        let cx = tracing::Span::current().context();
        if !cx.span().span_context().is_valid() {
            return None;
        }
        let mut carrier = HashMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut carrier);
        carrier.remove(TRACEPARENT)
    }

    /// The remote OpenTelemetry context of a message's `traceparent` header, if it has a
    /// valid one.
    pub fn context_of(headers: &Headers) -> Option<Context> {
        let parent = headers.get(TRACEPARENT)?;
        let carrier = HashMap::from([(TRACEPARENT.to_owned(), parent.clone())]);
        let cx = TraceContextPropagator::new().extract(&carrier);
        cx.span().span_context().is_valid().then_some(cx)
    }

    /// Makes the message's trace (its `traceparent` header) the parent of `span`, which
    /// must not have been entered yet. Returns whether it did: not without a valid
    /// header, a `tracing-opentelemetry` layer, or once the span has started.
    pub fn set_parent(span: &tracing::Span, headers: &Headers) -> bool {
        context_of(headers).is_some_and(|cx| span.set_parent(cx).is_ok())
    }

    pub(super) fn publish_spans(messages: &[crate::StoredMessage]) -> Vec<tracing::Span> {
        let batch = tracing::Span::current();
        let batch_cx = batch.context().span().span_context().clone();
        messages
            .iter()
            .filter_map(|m| {
                let cx = context_of(&m.envelope.headers)?;
                let span = tracing::debug_span!(
                    "outbox.relay.publish",
                    msg_id = m.envelope.msg_id.as_str(),
                    topic = m.envelope.topic.as_str(),
                );
                span.set_parent(cx).ok()?;
                span.add_link(batch_cx.clone());
                Some(span)
            })
            .collect()
    }
}

#[cfg(all(test, feature = "opentelemetry"))]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_gives_its_remote_context() {
        use opentelemetry::trace::TraceContextExt as _;
        let headers = Headers::from([(TRACEPARENT.to_owned(), PARENT.to_owned())]);
        let cx = context_of(&headers).expect("a valid traceparent");
        let span = cx.span();
        let sc = span.span_context();
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(sc.is_remote() && sc.is_sampled());
    }

    #[test]
    fn a_missing_or_malformed_traceparent_gives_none() {
        assert!(context_of(&Headers::new()).is_none());
        for bad in [
            "",
            "00-abc",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        ] {
            let headers = Headers::from([(TRACEPARENT.to_owned(), bad.to_owned())]);
            assert!(context_of(&headers).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn without_an_opentelemetry_span_emit_adds_nothing_and_keeps_the_callers_header() {
        let mut headers = Headers::new();
        add_current(&mut headers);
        assert!(headers.is_empty());
        let mut headers = Headers::from([(TRACEPARENT.to_owned(), PARENT.to_owned())]);
        add_current(&mut headers);
        assert_eq!(headers[TRACEPARENT], PARENT);
    }
}
