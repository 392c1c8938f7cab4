//! A plain HTTP/1.1 `GET`, enough for the tests of the relay's `/metrics`, `/healthz`
//! and `/readyz` endpoints without an HTTP client dependency.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A response: its status code and the whole text (status line, headers, body).
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// The status code.
    pub status: u16,
    /// Everything the server sent.
    pub text: String,
}

impl HttpResponse {
    /// The body: what follows the blank line after the headers.
    pub fn body(&self) -> &str {
        self.text.split("\r\n\r\n").nth(1).unwrap_or_default()
    }
}

/// `GET path` on `addr` with `Connection: close`, reading until the server closes;
/// each read waits at most `timeout`. Panics if the server does not accept or does not
/// answer HTTP.
pub fn http_get(addr: SocketAddr, path: &str, timeout: Duration) -> HttpResponse {
    let mut stream = TcpStream::connect(addr)
        .unwrap_or_else(|e| panic!("the endpoint at {addr} accepts connections: {e}"));
    stream.set_read_timeout(Some(timeout)).expect("timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut text = String::new();
    stream.read_to_string(&mut text).expect("response");
    let status = text
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {text}"));
    HttpResponse { status, text }
}
