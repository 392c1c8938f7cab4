#![doc = include_str!("../README.md")]

#[cfg(feature = "admin")]
mod admin;
mod args;
mod backend;
mod broker;
mod cdc;
mod commands;
mod error;
mod output;
mod scan;
#[cfg(feature = "serve")]
mod serve;
#[cfg(feature = "opentelemetry")]
mod traces;

use std::io::{IsTerminal as _, Write as _};
use std::process::ExitCode;

use clap::Parser as _;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

fn main() -> ExitCode {
    let cli = args::Cli::parse();
    // Flushes the spans not yet exported when dropped, at the end of `main`.
    let _traces = match init_logging(cli.command.is_long_running()) {
        Ok(traces) => traces,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
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
/// and `warn` for the one-shot commands. With the `opentelemetry` feature, also exports
/// spans to an OTLP collector when one is configured ([`traces`]).
fn init_logging(long_running: bool) -> Result<Traces, String> {
    let default = if long_running { "info" } else { "warn" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let log = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_filter(filter);
    let registry = tracing_subscriber::registry().with(log);
    #[cfg(feature = "opentelemetry")]
    {
        let (layer, exporter) = traces::from_env()?.unzip();
        registry.with(layer).init();
        Ok(Traces {
            _exporter: exporter,
        })
    }
    #[cfg(not(feature = "opentelemetry"))]
    {
        registry.init();
        Ok(Traces {})
    }
}

/// Holds the trace exporter (feature `opentelemetry`, when configured) until `main`
/// returns; dropping it exports the spans not yet sent.
struct Traces {
    #[cfg(feature = "opentelemetry")]
    _exporter: Option<traces::Exporter>,
}
