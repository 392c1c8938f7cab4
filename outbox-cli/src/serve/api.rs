//! The JSON API: the pages' data under `/api/`. Reads answer 200 with JSON, failures
//! `{"error": "…"}` with 400 for bad input (a malformed item, a dead-letter stream of
//! another prefix, `older_than=banana`), 404 for a dead letter that is gone, 409 for a
//! redrive of a row that does not decode, 500 otherwise; redrive and purge take
//! `{"items": ["outbox:17", "consumer:<id>:<dead-letter stream>"]}` and need
//! `Authorization: Bearer <token>` (403 otherwise). On a server whose reads need the
//! token, a read without it (or the page's session cookie) answers 401.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use super::App;
use super::data::{self, Action, Failure, Filter, Item};

/// The failure's status, with `{"error": …}`.
impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        (self.status, Json(json!({"error": self.message}))).into_response()
    }
}

fn joined<T>(r: Result<Result<T, Failure>, tokio::task::JoinError>) -> Result<T, Failure> {
    r.map_err(|e| Failure::server(e.to_string()))?
}

/// `GET /api/overview`.
pub(super) async fn overview(State(app): State<Arc<App>>) -> Result<Response, Failure> {
    let overview = joined(tokio::task::spawn_blocking(move || data::overview(&app)).await)?;
    Ok(Json(overview).into_response())
}

/// `GET /api/dead?topic=&type=&error=&older_than=&page=&per_page=`.
pub(super) async fn dead_letters(
    State(app): State<Arc<App>>,
    Query(filter): Query<Filter>,
) -> Result<Response, Failure> {
    Ok(Json(data::dead_page(&app, &filter).await?).into_response())
}

/// `?item=…`.
#[derive(Debug, Deserialize)]
pub(super) struct ItemQuery {
    /// `outbox:<id>` or `consumer:<id>:<dead-letter stream>`.
    pub(super) item: String,
}

/// `GET /api/dead/show?item=…`: 404 when there is no such dead letter, 400 for an item
/// that names none this server serves.
pub(super) async fn dead_letter(
    State(app): State<Arc<App>>,
    Query(q): Query<ItemQuery>,
) -> Result<Response, Failure> {
    let found = match app.item(&q.item)? {
        Item::Outbox(id) => {
            let app = app.clone();
            joined(tokio::task::spawn_blocking(move || data::outbox_row(&app, id)).await)?
                .map(|r| serde_json::to_value(data::outbox_item(&r)))
        }
        Item::Consumer { dead_stream, id } => data::consumer_entry(&app, &dead_stream, &id)
            .await?
            .map(serde_json::to_value),
    };
    Ok(match found {
        Some(value) => Json(value.unwrap_or_default()).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no such dead letter"})),
        )
            .into_response(),
    })
}

/// The body of a redrive or purge.
#[derive(Debug, Deserialize)]
pub(super) struct Selection {
    /// The dead letters.
    items: Vec<String>,
}

/// `POST /api/dead/redrive`.
pub(super) async fn redrive(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Json(sel): Json<Selection>,
) -> Result<Response, Failure> {
    act(app, &headers, Action::Redrive, &sel).await
}

/// `POST /api/dead/purge`.
pub(super) async fn purge(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Json(sel): Json<Selection>,
) -> Result<Response, Failure> {
    act(app, &headers, Action::Purge, &sel).await
}

async fn act(
    app: Arc<App>,
    headers: &HeaderMap,
    action: Action,
    sel: &Selection,
) -> Result<Response, Failure> {
    if let Err(denied) = app.auth.check_api(headers) {
        let denied = app.auth.refused(denied).await;
        return Ok((
            denied.status(StatusCode::FORBIDDEN),
            Json(json!({"error": denied.message()})),
        )
            .into_response());
    }
    let items = sel
        .items
        .iter()
        .map(|i| Item::parse(i))
        .collect::<Result<Vec<_>, _>>();
    let items = match items {
        Ok(items) => items,
        Err(f) => return Ok(f.into_response()),
    };
    let done = data::apply(&app, action, &items).await?;
    tracing::info!(
        action = action.name(),
        outbox = done.outbox,
        consumers = done.consumers,
        skipped = done.skipped,
        "dead letters handled through the API"
    );
    Ok(Json(done).into_response())
}

/// `GET /api/groups`: `null` without `--broker`.
pub(super) async fn groups(State(app): State<Arc<App>>) -> Result<Response, Failure> {
    Ok(Json(data::groups(&app).await?).into_response())
}
