//! `outbox relay --admin-addr`: the relay's HTTP endpoint for Prometheus and Kubernetes.
//!
//! - `/metrics`: the Prometheus text format (what the relay records through `metrics`).
//! - `/healthz`: 200 when the database and the broker (Redis or NATS) both answer, 503
//!   otherwise; the JSON body says which is down and why. A liveness probe on it restarts a relay cut off
//!   from either; a readiness or startup probe on it keeps it out of rotation instead.
//! - `/readyz`: 200 while the oldest due message is younger than `--ready-max-age`, 503
//!   once it is older (the relays are not keeping up or cannot publish) or when the
//!   database does not answer. In CDC mode (`outbox migrate --cdc`) the age is the oldest
//!   commit the slot has not confirmed, and a lost slot is a 503 saying how to recover.
//!
//! Each probe opens its own database connection, so it neither waits behind the relay's
//! pool nor reports a pooled connection the server already dropped as healthy.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use outbox_redis::redis;
use serde_json::json;

use crate::backend::{Conn, Database, with_conn};
use crate::broker::{Broker, BrokerKind, Timeouts};
use crate::cdc::CdcStatus;
use crate::error::CliError;

/// The longest a probe's checks may take. Kubernetes gives a probe one second by
/// default (`timeoutSeconds: 1`); an answer within that is a 503 the kubelet can read,
/// rather than a timeout it cannot tell from a hung process.
const PROBE_TIMEOUT: Duration = Duration::from_millis(800);
/// A probe's own Redis connection: within the probe's time.
const PROBE_TIMEOUTS: Timeouts = Timeouts {
    connect: PROBE_TIMEOUT,
    response: PROBE_TIMEOUT,
};
/// How often the histograms' old samples are dropped: a recorder installed without the
/// exporter's own listener needs this upkeep from its owner.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// What the handlers share.
struct Admin {
    metrics: PrometheusHandle,
    db: Database,
    broker: Broker,
    ready_max_age: Duration,
}

/// Installs the Prometheus recorder and serves the admin endpoint on `addr` until the
/// runtime stops. Must run before the relay starts, so its first metrics are recorded.
/// Fails if the address cannot be bound.
pub(crate) async fn serve(
    addr: SocketAddr,
    db: Database,
    broker: Broker,
    ready_max_age: Duration,
) -> Result<(), CliError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| CliError::Admin { addr, source })?;
    let metrics = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|source| CliError::Metrics { addr, source })?;
    let upkeep = metrics.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(UPKEEP_INTERVAL);
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    let state = Arc::new(Admin {
        metrics,
        db,
        broker,
        ready_max_age,
    });
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(state);
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "the admin endpoint stopped");
        }
    });
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    Ok(())
}

async fn metrics_text(State(admin): State<Arc<Admin>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        admin.metrics.render(),
    )
        .into_response()
}

async fn healthz(State(admin): State<Arc<Admin>>) -> Response {
    let (db, broker) = tokio::join!(admin.backlog(), admin.ping_broker());
    let up = db.is_ok() && broker.is_ok();
    let name = match admin.broker.kind() {
        BrokerKind::Redis(_) => "redis",
        BrokerKind::Nats(_) => "nats",
    };
    let body = json!({
        "status": if up { "ok" } else { "unavailable" },
        "database": state(db.map(drop)),
        name: state(broker),
    });
    respond(up, &body)
}

async fn readyz(State(admin): State<Arc<Admin>>) -> Response {
    let max_age = admin.ready_max_age.as_secs_f64();
    match admin.backlog().await {
        Err(e) => respond(
            false,
            &json!({"status": "unavailable", "database": format!("down: {e}")}),
        ),
        // CDC mode: the rows stay NEW; what is behind is what the slot has not confirmed.
        Ok((_, Some(cdc))) => {
            let ready = cdc.ready(admin.ready_max_age);
            let status = match (ready, cdc.lost) {
                (_, true) => "slot lost",
                (true, false) => "ready",
                (false, false) => "lagging",
            };
            let body = json!({
                "status": status,
                "cdc": cdc,
                "max_age_seconds": max_age,
            });
            respond(ready, &body)
        }
        Ok((backlog, None)) => {
            let age = backlog.oldest_due_age.unwrap_or_default();
            let ready = age <= admin.ready_max_age;
            let body = json!({
                "status": if ready { "ready" } else { "lagging" },
                "due": backlog.due,
                "oldest_due_age_seconds": age.as_secs_f64(),
                "max_age_seconds": max_age,
            });
            respond(ready, &body)
        }
    }
}

/// `"up"`, or `"down: <why>"`.
fn state(check: Result<(), String>) -> String {
    match check {
        Ok(()) => "up".to_owned(),
        Err(e) => format!("down: {e}"),
    }
}

/// 200 or 503 with a JSON body.
fn respond(ok: bool, body: &serde_json::Value) -> Response {
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut text = body.to_string();
    text.push('\n');
    (status, [(header::CONTENT_TYPE, "application/json")], text).into_response()
}

impl Admin {
    /// The backlog, read on a new connection: proves the database answers queries on
    /// the outbox table, not only connections; on PostgreSQL in CDC mode, also the
    /// slot's state.
    async fn backlog(&self) -> Result<(outbox_core::Backlog, Option<CdcStatus>), String> {
        let db = self.db.clone();
        let read = tokio::task::spawn_blocking(move || {
            let mut conn = db.connect(false).map_err(|e| root_cause(&e))?;
            let backlog = with_conn!(&mut conn, c => outbox_diesel::backlog(c))
                .map_err(|e| root_cause(&e))?;
            let cdc = match &mut conn {
                Conn::Pg(c) => crate::cdc::status(c).map_err(|e| root_cause(&e))?,
                Conn::Mysql(c) => {
                    crate::cdc::binlog_status(c, &db.target).map_err(|e| root_cause(&e))?
                }
                _ => None,
            };
            Ok((backlog, cdc))
        });
        match tokio::time::timeout(PROBE_TIMEOUT, read).await {
            Ok(Ok(result)) => result,
            Ok(Err(join)) => Err(join.to_string()),
            Err(_) => Err(format!("no answer within {PROBE_TIMEOUT:?}")),
        }
    }

    /// A `PING` on a new connection (to the primary Sentinel names now; to any node of
    /// a cluster); on NATS, a new connection and a round trip (`flush`).
    async fn ping_broker(&self) -> Result<(), String> {
        if let BrokerKind::Nats(servers) = self.broker.kind() {
            let ping = async {
                let client = servers.connect(PROBE_TIMEOUT).await?;
                client.flush().await.map_err(|e| e.to_string())
            };
            return match tokio::time::timeout(PROBE_TIMEOUT, ping).await {
                Ok(result) => result,
                Err(_) => Err(format!("no answer within {PROBE_TIMEOUT:?}")),
            };
        }
        let ping = async {
            let mut conn = self.broker.connect(PROBE_TIMEOUTS).await?;
            redis::cmd("PING").query_async::<String>(&mut conn).await
        };
        match tokio::time::timeout(PROBE_TIMEOUT, ping).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {PROBE_TIMEOUT:?}")),
        }
    }
}

/// The innermost cause's first line: the driver's words, without the URL (which may
/// carry a password) that the outer errors add.
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = e;
    while let Some(c) = cause.source() {
        cause = c;
    }
    cause
        .to_string()
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned()
}
