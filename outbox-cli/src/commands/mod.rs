//! One module per command group; [`run`] dispatches.

mod dead;
mod migrate;
mod partitions;
mod purge;
mod relay;
mod status;
mod streams;
mod trim;

use std::io::Write;

use crate::args::{BrokerArg, Cli, Command};
use crate::backend::Database;
use crate::broker::Broker;
use crate::error::CliError;

/// Runs the parsed command line, writing results to `out`.
pub(crate) fn run(cli: Cli, out: &mut impl Write) -> Result<(), CliError> {
    let url = cli.database_url.as_deref();
    match cli.command {
        Command::Migrate(args) => migrate::run(url, &args, out),
        Command::Status(args) => status::run(&database(url)?, &args, out),
        Command::Relay(args) => {
            // Both are checked before anything connects: a wrong URL is a usage error.
            let db = database(url)?;
            relay::run(&db, &broker(&args.broker)?, &args)
        }
        Command::Dead(cmd) => dead::run(&database(url)?, cmd, out),
        Command::Purge(cmd) => purge::run(&database(url)?, cmd, out),
        Command::Partitions(cmd) => partitions::run(&database(url)?, &cmd, out),
        Command::Trim(args) => trim::run(&broker(&args.broker)?, &args, out),
        Command::Streams(args) => streams::run(&broker(&args.broker)?, &args, out),
        #[cfg(feature = "serve")]
        Command::Serve(args) => crate::serve::run(database(url)?, args),
    }
}

/// The broker named by `--broker` (or its fallbacks, see [`BrokerArg::given`]).
pub(crate) fn broker(arg: &BrokerArg) -> Result<Broker, CliError> {
    let url = arg.given().ok_or(CliError::MissingBroker)?;
    Broker::parse(&url).map_err(|source| CliError::BrokerUrl {
        url: crate::broker::redact(&url),
        source,
    })
}

/// The database named by `--database-url` / `DATABASE_URL`.
fn database(url: Option<&str>) -> Result<Database, CliError> {
    Database::parse(url.ok_or(CliError::MissingDatabaseUrl)?)
}
