//! A consumer's probes over HTTP (feature `http`): [`health_router`].

use crate::ConsumerStore;
use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::{Consumer, ConsumerHealth};

/// `/healthz` (liveness) and `/readyz` (readiness) of `consumer`, as an axum [`Router`] to
/// merge into the service's own (or serve on an admin port). Each answers `200` or
/// `503` with the [`ConsumerHealth`] as JSON, as Kubernetes probes expect:
///
/// - `/healthz`: [`ConsumerHealth::is_live`], the run loop turns; a restart is due only
///   when it hangs, not during an outage of Redis or the database;
/// - `/readyz`: [`ConsumerHealth::is_ready`], also false while Redis or the idempotency
///   store fails.
///
/// ```
/// # #![allow(dead_code)]
/// fn app(consumer: outbox_redis::Consumer<outbox_core::MemoryDb<()>>) -> axum::Router {
///     axum::Router::new()
///         // .route("/orders", ..): the service's own routes
///         .merge(outbox_redis::health_router(consumer))
/// }
/// ```
pub fn health_router<I, C>(consumer: Consumer<I, C>) -> Router
where
    I: ConsumerStore<Conn = C> + 'static,
    C: 'static,
    Consumer<I, C>: Send + Sync,
{
    let ready = consumer.clone();
    Router::new()
        .route(
            "/healthz",
            get(move || {
                let health = consumer.health();
                async move { respond(health.is_live(), &health) }
            }),
        )
        .route(
            "/readyz",
            get(move || {
                let health = ready.health();
                async move { respond(health.is_ready(), &health) }
            }),
        )
}

fn respond(ok: bool, health: &ConsumerHealth) -> impl IntoResponse + use<> {
    let ms = |d: Option<std::time::Duration>| d.map(|d| d.as_millis() as u64);
    let body = serde_json::json!({
        "ok": ok,
        "running": health.running,
        "last_round_ms_ago": ms(health.last_round),
        "last_redis_answer_ms_ago": ms(health.last_redis_answer),
        "redis_failures": health.redis_failures,
        "store_failures": health.store_failures,
        "last_error": health.last_error,
    });
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
}
