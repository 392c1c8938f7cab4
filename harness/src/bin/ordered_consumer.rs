//! Run with: cargo run -p outbox-harness --bin ordered_consumer -- --database-url URL --redis-url URL --stream-prefix PREFIX --partitions 8
//!
//! An ordered consumer process of `chaos.tick` over its partition streams (see
//! `outbox_harness::ordered`): it applies each key's ticks in sequence order in its
//! PostgreSQL inbox transaction and records any violation. It stops on SIGTERM or
//! SIGINT, finishing the messages in hand and releasing its leases, then exits with 0.

use std::process::ExitCode;

use clap::Parser;
use outbox_harness::ordered::{Args, run_until_signal};

fn main() -> ExitCode {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: no runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(run_until_signal(&args));
    match result {
        Ok(stats) => {
            eprintln!("ordered_consumer: stopped cleanly: {stats:?}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {}", outbox_core::error_chain(&*e));
            ExitCode::FAILURE
        }
    }
}
