//! A consumer's probes over HTTP (feature `http`): [`health_router`].

use axum::Router;

use crate::{Consumer, ConsumerStore};

/// `/healthz` (liveness) and `/readyz` (readiness) of `consumer`, as an axum [`Router`] to
/// merge into the service's own (or serve on an admin port). Each answers `200` or
/// `503` with the [`ConsumerHealth`](crate::ConsumerHealth) as JSON (`ok`, `broker`,
/// `running`, `last_round_ms_ago`, `last_broker_answer_ms_ago`, `broker_failures`,
/// `store_failures`, `last_error`), as Kubernetes probes expect, and as
/// `outbox_redis::health_router` does:
///
/// - `/healthz`: [`ConsumerHealth::is_live`](crate::ConsumerHealth::is_live), a reader
///   began a pull within the stall limit; a restart is due only when it hangs, not
///   during an outage of NATS or the database;
/// - `/readyz`: [`ConsumerHealth::is_ready`](crate::ConsumerHealth::is_ready), also
///   false while pulls from NATS or the idempotency store fail.
///
/// ```
/// # #![allow(dead_code)]
/// fn app(consumer: outbox_nats::Consumer<outbox_core::MemoryDb<()>>) -> axum::Router {
///     axum::Router::new()
///         // .route("/orders", ..): the service's own routes
///         .merge(outbox_nats::health_router(consumer))
/// }
/// ```
pub fn health_router<I, C>(consumer: Consumer<I, C>) -> Router
where
    I: ConsumerStore<Conn = C> + 'static,
    C: 'static,
    Consumer<I, C>: Send + Sync,
{
    outbox_core::__private::consumer::health_router("nats", move || consumer.health())
}
