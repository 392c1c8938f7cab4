//! What the pages and the API show, read from the database and the broker (Redis, or
//! NATS in [`nats`]), and the redrive
//! and purge they do. Everything here is plain data (serialized as the API's JSON); the
//! pages render the same values.

mod actions;
mod dead_letters;
mod groups;
mod nats;
mod overview;

use std::time::Duration;

use axum::http::StatusCode;
use outbox_redis::redis;

use super::App;
use crate::broker::{BrokerConn, Timeouts};

pub(crate) use actions::{Action, apply};
pub(crate) use dead_letters::{
    ConsumerDead, Filter, Item, OutboxDead, consumer_entry, dead_page, outbox_item, outbox_row,
};
pub(crate) use groups::groups;
pub(crate) use nats::NatsSide;
pub(crate) use overview::{CHART_MINUTES, Minute, overview};

/// How long connecting to Redis may take.
const REDIS_TIMEOUT: Duration = Duration::from_secs(5);

/// A failure the page shows and the API returns with `{"error": …}`: its HTTP status
/// (500 unless the request itself was wrong) and the innermost cause, never a URL (which
/// may carry a password).
#[derive(Debug)]
pub(crate) struct Failure {
    /// The status to answer with.
    pub(crate) status: StatusCode,
    /// What went wrong.
    pub(crate) message: String,
}

impl Failure {
    /// A failure of the server or of a service behind it: 500.
    pub(crate) fn server(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
        }
    }

    /// A request that cannot be served as asked: 400.
    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    fn of(e: &(dyn std::error::Error + 'static)) -> Self {
        let mut cause = e;
        while let Some(c) = cause.source() {
            cause = c;
        }
        Self::server(cause.to_string().lines().next().unwrap_or_default())
    }
}

impl From<crate::error::CliError> for Failure {
    fn from(e: crate::error::CliError) -> Self {
        Self::of(&e)
    }
}
impl From<outbox_diesel::Error> for Failure {
    fn from(e: outbox_diesel::Error) -> Self {
        match e {
            // The selection holds a row that cannot be re-driven as it is: 409.
            outbox_diesel::Error::UnreadableRow { .. } => Self {
                status: StatusCode::CONFLICT,
                message: e.to_string(),
            },
            e => Self::of(&e),
        }
    }
}
impl From<diesel::result::Error> for Failure {
    fn from(e: diesel::result::Error) -> Self {
        Self::of(&e)
    }
}
impl From<redis::RedisError> for Failure {
    fn from(e: redis::RedisError) -> Self {
        Self::of(&e)
    }
}

/// The millisecond time of a stream entry id `<ms>-<seq>`.
fn entry_ms(id: &str) -> Option<i64> {
    let (ms, seq) = id.split_once('-')?;
    seq.parse::<u64>().ok()?;
    ms.parse().ok()
}

/// A connection to the broker, if `--broker` was given (and names a Redis: the callers
/// ask [`App::nats`] first).
async fn redis_conn(app: &App) -> Result<Option<BrokerConn>, Failure> {
    let Some(broker) = &app.broker else {
        return Ok(None);
    };
    let timeouts = Timeouts {
        connect: REDIS_TIMEOUT,
        response: REDIS_TIMEOUT,
    };
    Ok(Some(broker.connect(timeouts).await?))
}

/// The streams named `<prefix>…`, sorted, dead-letter streams and the others apart.
async fn streams(app: &App, conn: &mut BrokerConn) -> Result<(Vec<String>, Vec<String>), Failure> {
    Ok(crate::scan::streams(conn, &app.prefix)
        .await?
        .into_iter()
        .partition(|s| s.ends_with(&app.dead_suffix)))
}
