//! `outbox serve`: the operator's web page and its JSON API.
//!
//! Server-rendered HTML (maud) that works without JavaScript, and the same data as JSON
//! under `/api/`:
//!
//! | page | API | what |
//! |---|---|---|
//! | `GET /` | `GET /api/overview` | backlog, per-topic counts, publish rate and latency, relays |
//! | `GET /dead` | `GET /api/dead` | dead letters: the outbox's DEAD rows and the consumers' dead-letter streams (Redis) or stream (NATS), filtered and paged |
//! | `GET /dead/show?item=…` | `GET /api/dead/show?item=…` | one dead letter |
//! | `GET /dead/confirm` | | the confirmation step of a redrive or purge |
//! | `POST /dead/redrive`, `POST /dead/purge` | `POST /api/dead/redrive`, `POST /api/dead/purge` | act on a selection (token needed) |
//! | `GET /groups` | `GET /api/groups` | consumer groups (NATS: durable consumers): lag, pending, consumers, oldest pending |
//! | `GET /login`, `POST /login` | | the login form of a server whose reads need the token |
//! | `POST /logout` | | ends the browser's session |
//! | `GET /healthz` | | `ok`, for probes: open, it reads and shows nothing |
//!
//! With a token, every read needs it too (see [`auth`]) unless `--public-reads` is given.
//!
//! The database is read on a new connection per request, on the blocking pool, as the
//! admin endpoint's probes do. Every request must name this server in `Host` (see
//! [`host`]).

mod api;
mod auth;
mod data;
mod host;
mod login;
mod pages;
mod throttle;

use std::net::SocketAddr;
use std::sync::Arc;

use crate::args::ServeArgs;
use crate::backend::Database;
use crate::broker::{Broker, BrokerKind};
use crate::error::CliError;
use axum::Router;
use axum::routing::{get, post};

/// What the handlers share.
pub(crate) struct App {
    /// The outbox's database.
    db: Database,
    /// The broker (Redis or NATS), when `--broker` (or `--redis-url`) was given.
    broker: Option<Broker>,
    /// The broker's side when it is NATS (the consumers' dead letters and groups are
    /// read there rather than from Redis).
    nats: Option<data::NatsSide>,
    /// Prefix of the outbox's streams (the broker's default unless `--stream-prefix`).
    prefix: String,
    /// Suffix of the consumers' dead-letter streams.
    dead_suffix: String,
    /// The token and the CSRF secret.
    auth: auth::Auth,
}

/// Checks the arguments, binds the address and serves until SIGINT or SIGTERM.
pub(crate) fn run(db: Database, args: ServeArgs) -> Result<(), CliError> {
    check_exposure(args.addr, args.token.as_deref())?;
    let broker = match args.broker.given() {
        Some(_) => Some(crate::commands::broker(&args.broker)?),
        None => None,
    };
    let default_prefix = match broker.as_ref().map(Broker::kind) {
        Some(BrokerKind::Nats(_)) => outbox_nats::DEFAULT_STREAM_PREFIX,
        _ => outbox_redis::DEFAULT_STREAM_PREFIX,
    };
    let prefix = args
        .stream_prefix
        .unwrap_or_else(|| default_prefix.to_owned());
    let nats = match broker.as_ref().map(Broker::kind) {
        Some(BrokerKind::Nats(servers)) => Some(
            data::NatsSide::new(servers.clone(), &prefix).map_err(|source| {
                CliError::NatsStreamPrefix {
                    prefix: prefix.clone(),
                    source,
                }
            })?,
        ),
        _ => None,
    };
    let app = Arc::new(App {
        db,
        broker,
        nats,
        prefix,
        dead_suffix: args.dead_letter_suffix,
        auth: auth::Auth::new(args.token, args.public_reads, args.addr.port()),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    let hosts = host::AllowedHosts::new(args.addr, &args.allowed_hosts);
    runtime.block_on(serve(args.addr, app, hosts))
}

/// A server other hosts can reach must have a token: without one, anyone there could
/// redrive and purge.
fn check_exposure(addr: SocketAddr, token: Option<&str>) -> Result<(), CliError> {
    let has_token = token.is_some_and(|t| !t.is_empty());
    if !addr.ip().is_loopback() && !has_token {
        return Err(CliError::ServeWithoutToken { addr });
    }
    Ok(())
}

async fn serve(addr: SocketAddr, app: Arc<App>, hosts: host::AllowedHosts) -> Result<(), CliError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| CliError::Serve { addr, source })?;
    let access = match (app.auth.has_token(), app.auth.reads_need_token()) {
        (false, _) => "read-only: no token",
        (true, true) => "reads and changes need the token",
        (true, false) => "reads public (--public-reads), changes need the token",
    };
    // The token itself is never logged.
    tracing::info!(
        "serving the operator's page on http://{} ({access})",
        listener.local_addr().unwrap_or(addr)
    );
    if !app.auth.reads_need_token() && !addr.ip().is_loopback() {
        tracing::warn!("anyone who reaches {addr} can read every dead letter's payload");
    }
    axum::serve(listener, router(app, hosts))
        .with_graceful_shutdown(shutdown())
        .await
        .map_err(|source| CliError::Serve { addr, source })
}

/// The pages and the API, for requests that name one of `hosts`: the reads behind the
/// login gate, the changes checking the token themselves (403), the login and the probe
/// open.
fn router(app: Arc<App>, hosts: host::AllowedHosts) -> Router {
    Router::new()
        .route("/", get(pages::overview))
        .route("/dead", get(pages::dead_letters))
        .route("/dead/show", get(pages::dead_letter))
        .route("/dead/confirm", get(pages::confirm))
        .route("/groups", get(pages::groups))
        .route("/api/overview", get(api::overview))
        .route("/api/dead", get(api::dead_letters))
        .route("/api/dead/show", get(api::dead_letter))
        .route("/api/groups", get(api::groups))
        .route_layer(axum::middleware::from_fn_with_state(
            app.clone(),
            login::require_reader,
        ))
        .route("/dead/redrive", post(pages::redrive))
        .route("/dead/purge", post(pages::purge))
        .route("/api/dead/redrive", post(api::redrive))
        .route("/api/dead/purge", post(api::purge))
        .route("/login", get(login::show).post(login::login))
        .route("/logout", post(login::logout))
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(app)
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(hosts),
            host::check,
        ))
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_may_go_without_a_token() {
        let addr = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(check_exposure(addr("127.0.0.1:8080"), None).is_ok());
        assert!(check_exposure(addr("[::1]:8080"), None).is_ok());
        assert!(check_exposure(addr("0.0.0.0:8080"), None).is_err());
        assert!(check_exposure(addr("0.0.0.0:8080"), Some("")).is_err());
        assert!(check_exposure(addr("0.0.0.0:8080"), Some("s3cret")).is_ok());
    }
}
