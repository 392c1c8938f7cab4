//! Run with: cargo run -p outbox-harness --bin ordered_consumer -- --database-url URL --redis-url URL --stream-prefix PREFIX --partitions 8
//!
//! An ordered consumer process of `chaos.tick` over its partition streams (see
//! `outbox_harness::ordered`): it applies each key's ticks in sequence order in its
//! PostgreSQL inbox transaction and records any violation. It stops on SIGTERM or
//! SIGINT, finishing the messages in hand and releasing its leases, then exits with 0.

use std::process::ExitCode;

use clap::Parser;
use outbox_harness::ordered::{Args, serve};
use outbox_harness::process;

fn main() -> ExitCode {
    let args = Args::parse();
    process::main("ordered_consumer", |stop| async move {
        serve(&args, stop).await
    })
}
