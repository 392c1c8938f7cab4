//! Free loopback ports for private servers, and waiting until a server listens.

use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use crate::wait::wait_until_within;

/// A loopback port that was free a moment ago (the OS picks it; the listener is closed
/// before returning, so the caller's server can bind it).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// Waits until something accepts connections on `127.0.0.1:port`; panics naming `what`
/// after `timeout`.
pub fn wait_for_port(port: u16, what: &str, timeout: Duration) {
    wait_until_within(&format!("{what} to listen on port {port}"), timeout, || {
        TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
}
