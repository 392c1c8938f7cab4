//! `outbox`: the command operators use to run and watch a transactional outbox.
//!
//! ```text
//! outbox migrate [--print [--backend postgres|mysql|sqlite] [--down]]
//! outbox status [--json]
//! outbox relay --redis-url URL [--batch-size 500] [--poll-interval 1s] [--max-attempts 10]
//!              [--stream-prefix outbox:] [--pool-size 4] [--admin-addr 127.0.0.1:9464] [--migrate]
//! outbox dead list [--limit 50] [--after ID] [--json]
//! outbox dead show <ID|MSG_ID> [--json]
//! outbox dead redrive (<ID|MSG_ID>... | --all)
//! outbox dead purge (<ID|MSG_ID>... | --all)
//! outbox purge sent --older-than 7d [--batch-size 1000]
//! outbox purge consumed --older-than 30d [--batch-size 1000]
//! outbox trim --redis-url URL [--stream-prefix outbox:] [--dead-letter-suffix :dead] [--json]
//! ```
//!
//! Every command except `trim` takes `--database-url` (or `DATABASE_URL`); its scheme picks the
//! backend: `postgres://` or `postgresql://` for PostgreSQL, `mysql://` for MySQL and
//! MariaDB, `sqlite://PATH`, `sqlite:PATH` or a path ending in `.db` / `.sqlite` for SQLite.
//!
//! - `migrate` creates the outbox tables and indexes if they are missing (idempotent; the
//!   SQL of `outbox_diesel::migrate`); `--print` shows that SQL instead.
//! - `status` prints the two numbers to alert on, the due NEW messages and the age of the
//!   oldest of them, and the DEAD count.
//! - `relay` publishes committed messages to Redis Streams (`<prefix><topic>`) until
//!   SIGINT or SIGTERM, finishing the batch in hand; any number may run on PostgreSQL and
//!   MySQL, one per database on SQLite. `--admin-addr` serves Prometheus metrics at
//!   `/metrics` and the Kubernetes probes `/healthz` and `/readyz`.
//! - `dead` lists, shows, re-drives (back to NEW, retries reset) and purges DEAD messages.
//! - `purge` deletes SENT messages and consumer dedup records past a retention, in
//!   bounded batches.
//! - `trim` removes the stream entries every consumer group has acknowledged
//!   (`outbox_redis::trim_acknowledged` on each stream named `<prefix>…`, found with
//!   `SCAN ... TYPE stream`); streams without a group and dead-letter streams are left
//!   alone.
//!
//! Results go to stdout (`--json` where a script reads them), logs and errors to stderr.
//! Failures print `error: …` with their causes and exit with 1; usage errors exit with 2.
//! Logging follows `RUST_LOG` (default `info` for the relay, `warn` otherwise).

#[cfg(feature = "admin")]
mod admin;
mod args;
mod backend;
mod commands;
mod error;
mod output;

use std::io::{IsTerminal as _, Write as _};
use std::process::ExitCode;

use clap::Parser as _;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = args::Cli::parse();
    init_logging(matches!(cli.command, args::Command::Relay(_)));
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

/// Logs to stderr, filtered by `RUST_LOG`; by default `info` for the long-running relay
/// and `warn` for the one-shot commands.
fn init_logging(relay: bool) {
    let default = if relay { "info" } else { "warn" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}
