//! The `async_service` example as CI runs it: one request through the axum endpoint, the
//! relay and the consumer on the async inbox, on the local PostgreSQL and Redis; it exits
//! 0 once the shipment is written.
#![cfg(feature = "async-service")]

use std::process::Command;

#[test]
fn the_demo_request_is_paid_relayed_and_shipped() {
    let out = Command::new(env!("CARGO_BIN_EXE_async_service"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("-> HTTP/1.1 202 Accepted"), "{stdout}");
    assert!(stdout.contains(": paid, relayed, shipped"), "{stdout}");
    assert!(stdout.contains("consumed: 1"), "{stdout}");
}
