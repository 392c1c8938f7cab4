//! Who may read and who may change state: the token (`--token` / `OUTBOX_SERVE_TOKEN`),
//! the session cookie and the forms' CSRF token.
//!
//! A server with a token serves reads (pages and API) only to who shows it, unless it was
//! started with `--public-reads`: dead letters carry payloads and headers. The API takes
//! `Authorization: Bearer <token>`; a browser logs in once with a form that posts the
//! token and gets a session cookie (`HttpOnly`, `SameSite=Strict`) holding a random id of
//! that login, never the token. Sessions live in this process for 12 hours at most: a
//! logout (`POST /logout`) ends one, a restart ends every one. The cookie's name carries
//! the server's port (`outbox_session_9464`): browsers keep cookies per host, not per
//! port, so two servers on one host would otherwise overwrite each other's. Without a
//! token (loopback only) reads are open, as they always were.
//!
//! Wrong tokens are slowed down server-wide ([`super::throttle`]); the right one never is.
//!
//! Every POST needs the token: the page's forms carry it in a password field the operator
//! fills in at the confirmation step, the API in an `Authorization: Bearer` header. The
//! forms also carry a CSRF token, a random secret of this process that only pages served
//! by it contain, so another site cannot make the operator's browser post a form. The API
//! needs none: a browser sends a cross-site `Authorization` header only after a CORS
//! preflight, which this server never grants. Both are compared in constant time.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::header::{AUTHORIZATION, COOKIE};
use axum::http::{HeaderMap, StatusCode};

use super::throttle::Throttle;

/// How long a login lasts.
const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
/// Sessions kept at most: past it, a login ends the one closest to its end.
const MAX_SESSIONS: usize = 1000;

/// The token, the CSRF secret and the logged-in sessions.
pub(crate) struct Auth {
    token: Option<String>,
    csrf: String,
    /// The session cookie's name: `outbox_session_<port>`.
    cookie: String,
    /// The ids the logins gave (distinct from the CSRF secret, which pages show, to
    /// anyone with public reads), and when each ends.
    sessions: Mutex<HashMap<String, Instant>>,
    /// `--public-reads`: reads need no token even when the server has one.
    public_reads: bool,
    /// The pace of wrong tokens.
    throttle: Throttle,
}

/// Why a state-changing request was refused (answered with 403).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Denied {
    /// The server has no token: it is read-only.
    ReadOnly,
    /// No token, or the wrong one.
    BadToken,
    /// A form without this process's CSRF token.
    BadCsrf,
    /// A read without the token or the session cookie (answered with 401).
    NotLoggedIn,
    /// Too many wrong tokens are waiting their turn (answered with 429).
    Throttled,
}

impl Denied {
    /// What the 403 says.
    pub(crate) fn message(self) -> &'static str {
        match self {
            Self::ReadOnly => "read-only: the server was started without --token",
            Self::BadToken => "missing or wrong token",
            Self::BadCsrf => "missing or wrong CSRF token: reload the page and try again",
            Self::NotLoggedIn => {
                "log in with the token: the form at /login, or `Authorization: Bearer <token>` \
                 for the API"
            }
            Self::Throttled => "too many wrong tokens: try again in a minute",
        }
    }

    /// The status of the answer: 429 when throttled, else `refused` (401 or 403).
    pub(crate) fn status(self, refused: StatusCode) -> StatusCode {
        match self {
            Self::Throttled => StatusCode::TOO_MANY_REQUESTS,
            _ => refused,
        }
    }
}

impl Auth {
    /// The token (an empty one counts as none), a new random CSRF secret, no session;
    /// `port` names the session cookie.
    pub(crate) fn new(token: Option<String>, public_reads: bool, port: u16) -> Self {
        Self {
            token: token.filter(|t| !t.is_empty()),
            csrf: random_hex(32),
            cookie: format!("outbox_session_{port}"),
            sessions: Mutex::new(HashMap::new()),
            public_reads,
            throttle: Throttle::new(),
        }
    }

    /// Whether reads need the token: a token was set and reads were not made public.
    pub(crate) fn reads_need_token(&self) -> bool {
        self.has_token() && !self.public_reads
    }

    /// A read's check: open, or the bearer token, or the cookie of a live session.
    pub(crate) fn check_read(&self, headers: &HeaderMap) -> Result<(), Denied> {
        if !self.reads_need_token() || self.check_api(headers).is_ok() {
            return Ok(());
        }
        let now = Instant::now();
        let live = self
            .session_cookie(headers)
            .is_some_and(|id| self.sessions().get(id).is_some_and(|&ends| ends > now));
        if live {
            Ok(())
        } else {
            Err(Denied::NotLoggedIn)
        }
    }

    /// Whether a refused read tried a credential (a bearer token or a session cookie): a
    /// guess, slowed down as a wrong token is.
    pub(crate) fn tried(&self, headers: &HeaderMap) -> bool {
        headers.contains_key(AUTHORIZATION) || self.session_cookie(headers).is_some()
    }

    /// A login's check: the token, answered with the `Set-Cookie` value of a new
    /// session.
    pub(crate) fn login(&self, token: &str) -> Result<String, Denied> {
        self.check_token(token)?;
        let id = random_hex(32);
        let now = Instant::now();
        let mut sessions = self.sessions();
        sessions.retain(|_, ends| *ends > now);
        if sessions.len() >= MAX_SESSIONS
            && let Some(first) = sessions.iter().min_by_key(|(_, ends)| **ends)
        {
            let first = first.0.clone();
            sessions.remove(&first);
        }
        sessions.insert(id.clone(), now + SESSION_TTL);
        Ok(format!(
            "{}={id}; Path=/; Max-Age={}; HttpOnly; SameSite=Strict",
            self.cookie,
            SESSION_TTL.as_secs()
        ))
    }

    /// A logout: ends the request's session, if any, and answers with the `Set-Cookie`
    /// value that deletes the cookie.
    pub(crate) fn logout(&self, headers: &HeaderMap) -> String {
        if let Some(id) = self.session_cookie(headers) {
            self.sessions().remove(id);
        }
        format!(
            "{}=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict",
            self.cookie
        )
    }

    /// What a refusal answers after the throttle: a wrong token waits its turn, or is
    /// throttled when too many wait; other refusals pass at once.
    pub(crate) async fn refused(&self, denied: Denied) -> Denied {
        if denied != Denied::BadToken || self.throttle.wrong_token().await {
            return denied;
        }
        Denied::Throttled
    }

    /// Whether redrive and purge are possible at all.
    pub(crate) fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// The CSRF token the forms carry.
    pub(crate) fn csrf(&self) -> &str {
        &self.csrf
    }

    /// A form's check: its CSRF field, then its token field.
    pub(crate) fn check_form(&self, csrf: &str, token: &str) -> Result<(), Denied> {
        if !constant_time_eq(csrf.as_bytes(), self.csrf.as_bytes()) {
            return Err(Denied::BadCsrf);
        }
        self.check_token(token)
    }

    /// An API request's check: `Authorization: Bearer <token>`.
    pub(crate) fn check_api(&self, headers: &HeaderMap) -> Result<(), Denied> {
        let given = headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default();
        self.check_token(given)
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The value of this server's session cookie, if the request carries one.
    fn session_cookie<'h>(&self, headers: &'h HeaderMap) -> Option<&'h str> {
        headers
            .get_all(COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .find_map(|pair| pair.trim().strip_prefix(&self.cookie)?.strip_prefix('='))
    }

    fn check_token(&self, given: &str) -> Result<(), Denied> {
        let expected = self.token.as_deref().ok_or(Denied::ReadOnly)?;
        if constant_time_eq(given.as_bytes(), expected.as_bytes()) {
            Ok(())
        } else {
            Err(Denied::BadToken)
        }
    }
}

/// Compares without stopping at the first difference, so the time taken does not tell an
/// attacker how much of a guess was right (the length may show; the token's is no secret).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `bytes` random bytes from the operating system, in hex. Falls back to the clock and
/// the process id only if the OS has no randomness to give (then a warning is logged).
fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    if let Err(error) = getrandom::fill(&mut buf) {
        tracing::warn!(%error, "no OS randomness: the CSRF token is weaker");
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
            ^ u128::from(std::process::id());
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (seed >> ((i % 16) * 8)) as u8;
        }
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_need_the_csrf_token_and_the_token() {
        let auth = Auth::new(Some("s3cret".into()), false, 9464);
        let csrf = auth.csrf().to_owned();
        assert_eq!(csrf.len(), 64);
        assert_eq!(auth.check_form(&csrf, "s3cret"), Ok(()));
        assert_eq!(auth.check_form(&csrf, "s3cre"), Err(Denied::BadToken));
        assert_eq!(auth.check_form("", "s3cret"), Err(Denied::BadCsrf));
        assert_ne!(Auth::new(None, false, 9464).csrf(), csrf);
    }

    #[test]
    fn without_a_token_nothing_changes() {
        let auth = Auth::new(Some(String::new()), false, 9464);
        assert!(!auth.has_token());
        let csrf = auth.csrf().to_owned();
        assert_eq!(auth.check_form(&csrf, ""), Err(Denied::ReadOnly));
    }

    #[test]
    fn the_api_takes_a_bearer_token() {
        let auth = Auth::new(Some("s3cret".into()), false, 9464);
        let mut headers = HeaderMap::new();
        assert_eq!(auth.check_api(&headers), Err(Denied::BadToken));
        headers.insert(AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert_eq!(auth.check_api(&headers), Ok(()));
    }

    #[test]
    fn reads_need_the_bearer_token_or_the_session_cookie() {
        let auth = Auth::new(Some("s3cret".into()), false, 9464);
        let mut headers = HeaderMap::new();
        assert_eq!(auth.check_read(&headers), Err(Denied::NotLoggedIn));
        assert_eq!(auth.login("wrong"), Err(Denied::BadToken));
        let set_cookie = auth.login("s3cret").unwrap();
        assert!(!set_cookie.contains("s3cret"), "{set_cookie}");
        let session = set_cookie.split(';').next().unwrap();
        headers.insert(COOKIE, format!("a=b; {session}").parse().unwrap());
        assert_eq!(auth.check_read(&headers), Ok(()));
        headers.insert(COOKIE, "outbox_session_9464=forged".parse().unwrap());
        assert_eq!(auth.check_read(&headers), Err(Denied::NotLoggedIn));
        headers.insert(AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert_eq!(auth.check_read(&headers), Ok(()));
    }

    #[test]
    fn each_login_is_a_session_of_its_own_that_a_logout_ends() {
        let auth = Auth::new(Some("s3cret".into()), false, 9464);
        let cookie = |set_cookie: String| {
            let mut headers = HeaderMap::new();
            let pair = set_cookie.split(';').next().unwrap().to_owned();
            headers.insert(COOKIE, pair.parse().unwrap());
            headers
        };
        let (a, b) = (
            cookie(auth.login("s3cret").unwrap()),
            cookie(auth.login("s3cret").unwrap()),
        );
        assert_ne!(a.get(COOKIE), b.get(COOKIE));
        assert!(
            a.get(COOKIE)
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("outbox_session_9464=")
        );
        let cleared = auth.logout(&a);
        assert!(cleared.starts_with("outbox_session_9464=;") && cleared.contains("Max-Age=0"));
        assert_eq!(auth.check_read(&a), Err(Denied::NotLoggedIn), "logged out");
        assert_eq!(auth.check_read(&b), Ok(()), "the other session lives on");
        let other_port = Auth::new(Some("s3cret".into()), false, 9465);
        assert_eq!(other_port.check_read(&b), Err(Denied::NotLoggedIn));
    }

    #[test]
    fn reads_are_open_without_a_token_or_when_made_public() {
        let none = HeaderMap::new();
        assert_eq!(Auth::new(None, false, 9464).check_read(&none), Ok(()));
        assert_eq!(
            Auth::new(Some("s3cret".into()), true, 9464).check_read(&none),
            Ok(())
        );
    }
}
