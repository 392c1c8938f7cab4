//! The gate in front of every read, and the login form that opens it for a browser.
//!
//! A read without the token or the session cookie (see [`super::auth`]) is answered 401:
//! the API with `{"error": …}` and `WWW-Authenticate: Bearer`, a page with the login form,
//! which posts the token (never in a URL) and is answered with the session cookie and a
//! redirect to the page asked for.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::header::{LOCATION, SET_COOKIE, WWW_AUTHENTICATE};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use maud::html;
use serde_json::json;

use super::App;
use super::auth::Denied;
use super::pages::page;

/// Middleware on the read routes: passes reads the server may serve, answers 401 to others.
pub(super) async fn require_reader(
    State(app): State<Arc<App>>,
    request: Request,
    next: Next,
) -> Response {
    let Err(denied) = app.auth.check_read(request.headers()) else {
        return next.run(request).await;
    };
    let denied = match app.auth.tried(request.headers()) {
        true => match app.auth.refused(Denied::BadToken).await {
            Denied::Throttled => Denied::Throttled,
            _ => denied,
        },
        false => denied,
    };
    let uri = request.uri();
    if denied == Denied::Throttled {
        let error = Json(json!({"error": denied.message()}));
        return (StatusCode::TOO_MANY_REQUESTS, error).into_response();
    }
    if uri.path().starts_with("/api/") {
        let error = Json(json!({"error": denied.message()}));
        return (
            StatusCode::UNAUTHORIZED,
            [(WWW_AUTHENTICATE, "Bearer")],
            error,
        )
            .into_response();
    }
    let asked = uri.path_and_query().map_or("/", |p| p.as_str());
    form(StatusCode::UNAUTHORIZED, asked, None)
}

/// `GET /login`: the form, back to the overview afterwards.
pub(super) async fn show() -> Response {
    form(StatusCode::OK, "/", None)
}

/// `POST /login` with `token` and `next`: 303 to `next` with the session cookie, or the
/// form again (401) for a wrong token.
pub(super) async fn login(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let pairs: Vec<(String, String)> = form_urlencoded::parse(&body).into_owned().collect();
    let value = |name: &str| {
        pairs
            .iter()
            .find(|(k, _)| k == name)
            .map_or("", |(_, v)| v.as_str())
    };
    let next = local_path(value("next"));
    match app.auth.login(value("token")) {
        Ok(cookie) => (
            StatusCode::SEE_OTHER,
            [(LOCATION, next.to_owned()), (SET_COOKIE, cookie)],
        )
            .into_response(),
        Err(denied) => {
            let denied = app.auth.refused(denied).await;
            tracing::warn!("login refused: {}", denied.message());
            form(
                denied.status(StatusCode::UNAUTHORIZED),
                next,
                Some(denied.message()),
            )
        }
    }
}

/// `POST /logout`: ends the session and sends the browser to the login form.
pub(super) async fn logout(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    let cleared = app.auth.logout(&headers);
    (
        StatusCode::SEE_OTHER,
        [(LOCATION, "/login".to_owned()), (SET_COOKIE, cleared)],
    )
        .into_response()
}

/// The login form, which comes back to `next`.
fn form(status: StatusCode, next: &str, error: Option<&str>) -> Response {
    let body = html! {
        @if let Some(error) = error { p.err #refused { (error) } }
        p { "This server shows dead letters' payloads to those who know its token." }
        form #login method="post" action="/login" {
            input type="hidden" name="next" value=(next);
            label { "Token " input #login-token type="password" name="token" autocomplete="current-password" required autofocus; }
            " "
            button #login-button type="submit" { "Log in" }
        }
    };
    page(status, "Log in", body)
}

/// `next` if it is a path of this server in plain ASCII, else `/`: a login must not
/// redirect to another site (`//evil.example` is one).
fn local_path(next: &str) -> &str {
    let plain = next.bytes().all(|b| b.is_ascii_graphic()) && !next.contains('\\');
    if plain && next.starts_with('/') && !next.starts_with("//") {
        next
    } else {
        "/"
    }
}

#[cfg(test)]
mod tests {
    use super::local_path;

    #[test]
    fn a_login_redirects_within_this_server_only() {
        for ok in ["/", "/dead?topic=a&page=2", "/dead/show?item=outbox%3A1"] {
            assert_eq!(local_path(ok), ok);
        }
        for bad in [
            "",
            "//evil.example/",
            "/\\evil.example",
            "https://evil.example/",
            "dead",
            "/dead\r\nSet-Cookie: x=1",
            "/déad",
        ] {
            assert_eq!(local_path(bad), "/", "{bad:?}");
        }
    }
}
