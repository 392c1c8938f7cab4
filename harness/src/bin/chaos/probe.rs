//! The processes' HTTP probes, read as a supervisor reads them: the relay's
//! `--admin-addr` (`/healthz`, `/metrics`) and the consumer's `health_router`
//! (`/healthz`, `/readyz`).

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::time::Duration;

/// How long a probe may take: a kubelet's default is one second; a loaded machine gets
/// some slack.
const TIMEOUT: Duration = Duration::from_secs(2);

/// `GET path` on `127.0.0.1:port`: the status code and the body, or `None` if nothing
/// answered in time.
pub(crate) fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, TIMEOUT).ok()?;
    s.set_read_timeout(Some(TIMEOUT)).ok()?;
    s.set_write_timeout(Some(TIMEOUT)).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((code, body))
}

/// The status code of `GET path`, or `None`.
pub(crate) fn status(port: u16, path: &str) -> Option<u16> {
    get(port, path).map(|(code, _)| code)
}

/// A relay's counters: `(outbox_relay_published_total, outbox_relay_outages_total)`
/// (0 until counted), or `None` if `/metrics` does not answer.
pub(crate) fn relay_counters(port: u16) -> Option<(u64, u64)> {
    let (code, body) = get(port, "/metrics")?;
    if code != 200 {
        return None;
    }
    let counter = |name: &str| {
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map_or(0, |v| v as u64)
    };
    Some((
        counter("outbox_relay_published_total"),
        counter("outbox_relay_outages_total"),
    ))
}
