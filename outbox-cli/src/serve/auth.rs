//! Who may change state: the token (`--token` / `OUTBOX_SERVE_TOKEN`) and the forms'
//! CSRF token.
//!
//! Every POST needs the token: the page's forms carry it in a password field the operator
//! fills in at the confirmation step, the API in an `Authorization: Bearer` header. The
//! forms also carry a CSRF token, a random secret of this process that only pages served
//! by it contain, so another site cannot make the operator's browser post a form. The API
//! needs none: a browser sends a cross-site `Authorization` header only after a CORS
//! preflight, which this server never grants. Both are compared in constant time.

use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;

/// The token and the CSRF secret.
pub(crate) struct Auth {
    token: Option<String>,
    csrf: String,
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
}

impl Denied {
    /// What the 403 says.
    pub(crate) fn message(self) -> &'static str {
        match self {
            Self::ReadOnly => "read-only: the server was started without --token",
            Self::BadToken => "missing or wrong token",
            Self::BadCsrf => "missing or wrong CSRF token: reload the page and try again",
        }
    }
}

impl Auth {
    /// The token (an empty one counts as none) and a new random CSRF secret.
    pub(crate) fn new(token: Option<String>) -> Self {
        Self {
            token: token.filter(|t| !t.is_empty()),
            csrf: random_hex(32),
        }
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
        let auth = Auth::new(Some("s3cret".into()));
        let csrf = auth.csrf().to_owned();
        assert_eq!(csrf.len(), 64);
        assert_eq!(auth.check_form(&csrf, "s3cret"), Ok(()));
        assert_eq!(auth.check_form(&csrf, "s3cre"), Err(Denied::BadToken));
        assert_eq!(auth.check_form("", "s3cret"), Err(Denied::BadCsrf));
        assert_ne!(Auth::new(None).csrf(), csrf);
    }

    #[test]
    fn without_a_token_nothing_changes() {
        let auth = Auth::new(Some(String::new()));
        assert!(!auth.has_token());
        let csrf = auth.csrf().to_owned();
        assert_eq!(auth.check_form(&csrf, ""), Err(Denied::ReadOnly));
    }

    #[test]
    fn the_api_takes_a_bearer_token() {
        let auth = Auth::new(Some("s3cret".into()));
        let mut headers = HeaderMap::new();
        assert_eq!(auth.check_api(&headers), Err(Denied::BadToken));
        headers.insert(AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert_eq!(auth.check_api(&headers), Ok(()));
    }
}
