//! Run with: cargo run -p outbox-examples --bin transfer
fn main() {}
