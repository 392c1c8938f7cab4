#![doc = include_str!("../README.md")]

#[cfg(feature = "admin")]
mod admin;
mod args;
mod backend;
mod commands;
mod error;
mod output;
mod scan;
#[cfg(feature = "serve")]
mod serve;

use std::io::{IsTerminal as _, Write as _};
use std::process::ExitCode;

use clap::Parser as _;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = args::Cli::parse();
    init_logging(cli.command.is_long_running());
    let result = commands::run(cli, &mut std::io::stdout().lock());
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_broken_pipe() => ExitCode::SUCCESS,
        Err(e) => {
            let _ = std::io::stdout().flush();
            let _ = e.report(&mut std::io::stderr().lock());
            ExitCode::from(e.exit_code())
        }
    }
}

/// Logs to stderr, filtered by `RUST_LOG`; by default `info` for the relay and the server
/// and `warn` for the one-shot commands.
fn init_logging(long_running: bool) {
    let default = if long_running { "info" } else { "warn" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}
