//! The `outbox` command (in progress).
fn main() {}
