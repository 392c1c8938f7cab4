//! Which `Host` a request may name: the defence against DNS rebinding.
//!
//! A page on another site can point its own name at 127.0.0.1 (DNS rebinding) and then
//! read this server's pages as same-origin: the browser still sends that name in `Host`.
//! So every request must name this server: an IP address it listens on (any address when
//! it listens on all of them: an address is never a rebound name), `localhost` (or a
//! name under `.localhost`, which resolves to loopback only), or a name given with
//! `--allowed-host` (the name a proxy or DNS gives it). Others are answered 421
//! (Misdirected Request), a request without a host 400.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::http::header::HOST;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The hosts a request may name.
#[derive(Debug, Clone)]
pub(crate) struct AllowedHosts {
    /// The address the server listens on.
    addr: SocketAddr,
    /// Further names (`--allowed-host`), lowercase.
    names: Vec<String>,
}

impl AllowedHosts {
    /// The hosts of a server listening on `addr`, and `names`.
    pub(crate) fn new(addr: SocketAddr, names: &[String]) -> Self {
        Self {
            addr,
            names: names.iter().map(|n| n.to_ascii_lowercase()).collect(),
        }
    }

    /// Whether `host` (a `Host` header's value: a name or address, maybe with a port)
    /// names this server.
    pub(crate) fn allows(&self, host: &str) -> bool {
        let name = host_name(host).to_ascii_lowercase();
        let name = name.trim_end_matches('.');
        let bare = name
            .strip_prefix('[')
            .and_then(|n| n.strip_suffix(']'))
            .unwrap_or(name);
        if let Ok(ip) = bare.parse::<IpAddr>() {
            let bound = self.addr.ip();
            return bound.is_unspecified()
                || ip == bound
                || (ip.is_loopback() && bound.is_loopback());
        }
        name == "localhost" || name.ends_with(".localhost") || self.names.iter().any(|n| n == name)
    }
}

/// The name or address of a `Host` value, without its port (`[::1]:8080` → `[::1]`).
fn host_name(host: &str) -> &str {
    if host.starts_with('[') {
        return host.find(']').map_or(host, |end| &host[..=end]);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// Middleware: answers 421 to a request whose host is not this server's, 400 to one
/// without a host; passes the others on.
pub(crate) async fn check(
    State(allowed): State<Arc<AllowedHosts>>,
    request: Request,
    next: Next,
) -> Response {
    // HTTP/2 puts the host in the URI (`:authority`), HTTP/1.1 in the header.
    let host = request
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| {
            request
                .headers()
                .get(HOST)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        });
    match host {
        None => (StatusCode::BAD_REQUEST, "no Host header\n").into_response(),
        Some(host) if !allowed.allows(&host) => {
            tracing::warn!(%host, "request for another host refused (DNS rebinding?)");
            (
                StatusCode::MISDIRECTED_REQUEST,
                format!(
                    "this server does not serve host `{host}`: use http://{}/ or start it with \
                     --allowed-host {}\n",
                    allowed.addr,
                    host_name(&host)
                ),
            )
                .into_response()
        }
        Some(_) => next.run(request).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_servers_take_their_address_and_localhost_only() {
        let hosts = AllowedHosts::new("127.0.0.1:8080".parse().unwrap(), &[]);
        for ok in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "localhost:8080",
            "LOCALHOST",
            "localhost.",
            "app.localhost:8080",
            "[::1]:8080",
        ] {
            assert!(hosts.allows(ok), "{ok}");
        }
        for bad in [
            "evil.example:8080",
            "evil.example",
            "localhost.evil.example",
            "10.0.0.5:8080",
            "",
            "127.0.0.1.nip.io:8080",
        ] {
            assert!(!hosts.allows(bad), "{bad}");
        }
    }

    #[test]
    fn servers_on_every_address_take_any_address_and_the_allowed_names() {
        let hosts = AllowedHosts::new("0.0.0.0:8080".parse().unwrap(), &["Ops.Example".into()]);
        for ok in [
            "10.0.0.5:8080",
            "[fe80::1]:8080",
            "ops.example:8080",
            "localhost",
        ] {
            assert!(hosts.allows(ok), "{ok}");
        }
        assert!(!hosts.allows("evil.example:8080"));
        let one = AllowedHosts::new("10.0.0.5:8080".parse().unwrap(), &[]);
        assert!(one.allows("10.0.0.5:8080"));
        assert!(!one.allows("10.0.0.6:8080"));
    }
}
