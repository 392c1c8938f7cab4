//! The command's errors, and how they are reported.

use std::io::{self, Write};

use crate::backend::BackendKind;

/// Everything that makes a command fail.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CliError {
    /// Neither `--database-url` nor `DATABASE_URL` was given.
    #[error("no database URL: pass --database-url or set DATABASE_URL")]
    MissingDatabaseUrl,
    /// The URL names no supported backend.
    #[error(
        "unsupported database URL `{0}`: use postgres://, postgresql://, mysql://, \
         sqlite://PATH, sqlite:PATH or a file path ending in .db or .sqlite"
    )]
    UnsupportedUrl(String),
    /// A SQLite file that should exist does not.
    #[error("SQLite database `{0}` does not exist (`outbox migrate` creates it)")]
    NoSqliteFile(String),
    /// A PostgreSQL-only feature asked of another backend.
    #[error(
        "{0} is for PostgreSQL only: MySQL/MariaDB and SQLite keep the unpartitioned layout \
         (docs/table-partitions.md says why)"
    )]
    PostgresOnly(&'static str),
    /// `--cdc` (or `--to-polling`) asked of SQLite, which has no log to read.
    #[error(
        "--cdc reads PostgreSQL's WAL or MariaDB's binlog: SQLite has neither, use the \
         polling relay (`outbox relay` without --cdc)"
    )]
    CdcNotOnSqlite,
    /// `outbox partitions maintain` could not do every step.
    #[error("{0} partition maintenance step(s) failed (listed above); the next run tries again")]
    MaintenanceFailed(usize),
    /// `outbox relay --partitions` gave one topic twice.
    #[error("--partitions gives topic `{0}` twice: give each topic one count")]
    PartitionsTwice(String),
    /// The database refused or could not be reached.
    #[error("cannot connect to the {backend} database `{url}`")]
    Connect {
        /// The backend.
        backend: BackendKind,
        /// The URL, password hidden.
        url: String,
        /// The driver's error.
        source: diesel::ConnectionError,
    },
    /// The relay's connection pool could not be opened.
    #[error("cannot open a connection pool to the {backend} database `{url}`")]
    Pool {
        /// The backend.
        backend: BackendKind,
        /// The URL, password hidden.
        url: String,
        /// Why.
        source: outbox_diesel::Error,
    },
    /// A query failed.
    #[error("database operation failed")]
    Database(#[from] outbox_diesel::Error),
    /// A redrive selected a row that does not decode: nothing was re-driven.
    #[error("refused to redrive")]
    Refused(#[source] outbox_diesel::Error),
    /// No message has this id or msg_id.
    #[error("no outbox message with {0}")]
    NotFound(String),
    /// No broker URL from `--broker`, `--redis-url`, `OUTBOX_BROKER` or `REDIS_URL`.
    #[error("no broker URL: pass --broker (or --redis-url), or set OUTBOX_BROKER or REDIS_URL")]
    MissingBroker,
    /// The broker URL does not parse.
    #[error("invalid broker URL `{url}`")]
    BrokerUrl {
        /// The URL, passwords hidden.
        url: String,
        /// What is wrong with it.
        source: crate::broker::BrokerUrlError,
    },
    /// The relay's options do not suit the broker (a stream prefix with braces on a
    /// cluster).
    #[error("cannot publish to `{url}` with these options")]
    BrokerConfig {
        /// The URL, passwords hidden.
        url: String,
        /// The publisher's refusal.
        source: outbox_redis::Error,
    },
    /// An option of `outbox relay` that the broker of the URL does not take.
    #[error("{option} applies to {applies_to} brokers only, not to `{url}`")]
    BrokerOption {
        /// The option.
        option: &'static str,
        /// The URL, passwords hidden.
        url: String,
        /// The brokers that take it.
        applies_to: &'static str,
    },
    /// `outbox serve --broker nats://…` with a stream prefix NATS cannot take.
    #[cfg(feature = "serve")]
    #[error("--stream-prefix `{prefix}` cannot begin a NATS stream name")]
    NatsStreamPrefix {
        /// The prefix.
        prefix: String,
        /// Why not.
        source: outbox_core::InvalidConfig,
    },
    /// `outbox trim` on NATS: JetStream removes messages by the stream's retention, and
    /// a purge below the consumers' acknowledgements would take what a group created
    /// later from the beginning still has to read (see docs/nats.md).
    #[error(
        "`outbox trim` does not apply to NATS `{url}`: JetStream removes a stream's \
         messages itself, by its retention (limits, the outbox's default: once older than \
         the stream's max_age, 7 days unless set; interest: once every durable consumer \
         acknowledged them). To keep them for less time, lower max_age on the stream \
         (`nats stream edit <STREAM> --max-age 24h`) and give the same age to the relay \
         (`outbox relay --max-age 24h`) and the consumers (`StreamSettings::max_age`)"
    )]
    TrimOnNats {
        /// The URL, passwords hidden.
        url: String,
    },
    /// The NATS publisher refused the relay's options (a prefix, a stream setting), or
    /// its client could not be set up.
    #[error("cannot publish to `{url}` with these options")]
    NatsConfig {
        /// The URL, passwords hidden.
        url: String,
        /// The publisher's refusal.
        source: outbox_nats::Error,
    },
    /// NATS could not be reached.
    #[error("cannot connect to NATS `{url}`: {reason}")]
    NatsConnect {
        /// The URL, passwords hidden.
        url: String,
        /// The client's words.
        reason: String,
    },
    /// A NATS JetStream request failed.
    #[error("NATS JetStream request failed: {0}")]
    Nats(String),
    /// Redis could not be reached.
    #[error("cannot connect to Redis `{url}`")]
    RedisConnect {
        /// The URL, password hidden.
        url: String,
        /// The client's error.
        source: outbox_redis::Error,
    },
    /// A Redis command failed.
    #[error("Redis operation failed")]
    Redis(#[source] outbox_redis::Error),
    /// The relay could not start.
    #[error("cannot start the relay")]
    RelayStart(#[source] outbox_core::Error),
    /// The relay stopped on an error that is not an outage.
    #[error("the relay stopped on an error")]
    Relay(#[source] outbox_core::Error),
    /// The CDC relay's setup, start check or run failed (`--cdc`).
    #[error("the CDC relay (--cdc)")]
    Cdc(#[from] outbox_cdc::CdcError),
    /// The async runtime or the signal handlers could not be set up.
    #[error("cannot set up the runtime or the signal handlers")]
    Runtime(#[source] io::Error),
    /// The metrics recorder could not be installed.
    #[cfg(feature = "admin")]
    #[error("cannot record metrics for {addr}")]
    Metrics {
        /// The admin address asked for.
        addr: std::net::SocketAddr,
        /// Why.
        source: metrics_exporter_prometheus::BuildError,
    },
    /// The admin endpoint could not listen on its address.
    #[cfg(feature = "admin")]
    #[error("cannot serve the admin endpoint on {addr}")]
    Admin {
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// Why.
        source: io::Error,
    },
    /// `outbox serve` on an address other hosts reach, without a token.
    #[cfg(feature = "serve")]
    #[error(
        "refusing to serve on {addr} without a token: it is not a loopback address, so \
         anyone who reaches it could read every dead letter, redrive and purge; pass --token \
         or set OUTBOX_SERVE_TOKEN"
    )]
    ServeWithoutToken {
        /// The address asked for.
        addr: std::net::SocketAddr,
    },
    /// `outbox serve` could not listen on its address.
    #[cfg(feature = "serve")]
    #[error("cannot serve the operator's page on {addr}")]
    Serve {
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// Why.
        source: io::Error,
    },
    /// Writing to stdout failed.
    #[error("cannot write the output")]
    Output(#[from] io::Error),
}

/// The advice when SQLite's one relay per database is taken. A relay that died (even by
/// SIGKILL) holds nothing: its OS file lock went with its process, so there is no lease
/// time to wait out.
const RELAY_CONFLICT_HINT: &str = "stop the other relay: SQLite takes one per database file \
     (a relay that crashed or was killed holds nothing, so a restart needs no wait)";

/// The advice when a polling relay meets an outbox in CDC mode.
const CDC_MODE_HINT: &str = "this outbox is in CDC mode (`outbox migrate --cdc`): run \
     `outbox relay --cdc`, or stop the CDC relays and run `outbox migrate --to-polling` first \
     (docs/cdc.md, \"Switching between the relays\")";

impl CliError {
    /// The process exit code: 2 for usage errors (like clap's), 1 for everything else.
    pub(crate) fn exit_code(&self) -> u8 {
        match self {
            Self::MissingDatabaseUrl
            | Self::UnsupportedUrl(_)
            | Self::PartitionsTwice(_)
            | Self::MissingBroker
            | Self::BrokerUrl { .. }
            | Self::BrokerConfig { .. }
            | Self::BrokerOption { .. }
            | Self::TrimOnNats { .. }
            | Self::NatsConfig { .. } => 2,
            #[cfg(feature = "serve")]
            Self::ServeWithoutToken { .. } | Self::NatsStreamPrefix { .. } => 2,
            _ => 1,
        }
    }

    /// Whether stdout was closed by the reader (`outbox dead list | head`): not a failure.
    pub(crate) fn is_broken_pipe(&self) -> bool {
        matches!(self, Self::Output(e) if e.kind() == io::ErrorKind::BrokenPipe)
    }

    /// Advice for errors an operator can fix.
    fn hint(&self, chain: &str) -> Option<&'static str> {
        let lower = chain.to_ascii_lowercase();
        let missing_table = lower.contains("no such table: outbox")
            || lower.contains("no such table: consumed_msg")
            || (lower.contains("outbox") || lower.contains("consumed_msg"))
                && (lower.contains("does not exist") || lower.contains("doesn't exist"));
        match self {
            Self::Database(_) | Self::Pool { .. } | Self::Relay(_) if missing_table => {
                Some("the outbox tables are missing: run `outbox migrate` first")
            }
            // outbox-diesel's refusal of a polling relay on an outbox in CDC mode.
            Self::RelayStart(e) | Self::Relay(e)
                if e.is_relay_conflict() && lower.contains("cdc relay") =>
            {
                Some(CDC_MODE_HINT)
            }
            Self::RelayStart(e) | Self::Relay(e) if e.is_relay_conflict() => {
                Some(RELAY_CONFLICT_HINT)
            }
            Self::Cdc(e) => crate::cdc::hint(e),
            _ => None,
        }
    }

    /// A service that did not answer at all: its name, its address (password hidden),
    /// the compose.yaml service that provides it and the option that points elsewhere.
    fn unreachable(&self) -> Option<(String, &str, &'static str, &'static str)> {
        let (service, url, compose, option) = match self {
            Self::Connect { backend, url, .. } | Self::Pool { backend, url, .. } => {
                let compose = match backend {
                    BackendKind::Postgres => "postgres",
                    BackendKind::Mysql => "mariadb",
                    BackendKind::Sqlite => return None,
                };
                (backend.to_string(), url, compose, "--database-url")
            }
            Self::RedisConnect { url, .. } => ("Redis".to_owned(), url, "redis", "--broker"),
            _ => return None,
        };
        let chain = self.root_cause().to_ascii_lowercase();
        let unreachable = [
            "connection refused",
            "can't connect to",
            "could not translate host name",
            "name or service not known",
            "unknown server host",
            "no route to host",
            "network is unreachable",
            "timed out",
        ]
        .iter()
        .any(|sign| chain.contains(sign));
        unreachable.then_some((service, url.as_str(), compose, option))
    }

    /// The innermost cause's first line (the driver's own words).
    fn root_cause(&self) -> String {
        let mut cause: &dyn std::error::Error = self;
        while let Some(c) = cause.source() {
            cause = c;
        }
        let text = cause.to_string();
        text.lines().next().unwrap_or_default().trim().to_owned()
    }

    /// Writes `error: <message>`, one `caused by:` line per cause, and a hint if there is one.
    /// A service that does not answer takes two lines: which one, where, and how to start it.
    pub(crate) fn report(&self, w: &mut impl Write) -> io::Result<()> {
        if let Some((service, url, compose, option)) = self.unreachable() {
            writeln!(
                w,
                "error: {service} is not reachable at {url} ({})",
                self.root_cause()
            )?;
            return writeln!(
                w,
                "  hint: start it (from the outbox repository: `bash scripts/services.sh` on \
                 Debian/Ubuntu, `docker compose up -d {compose}` elsewhere) or fix {option}"
            );
        }
        // Each error says only its own layer; its causes follow, one line each.
        let texts = outbox_core::error_chain(self).texts();
        for (i, text) in texts.iter().enumerate() {
            let label = if i == 0 { "error" } else { "  caused by" };
            writeln!(w, "{label}: {}", text.trim_end().replace('\n', "\n    "))?;
        }
        if let Some(hint) = self.hint(&texts.join("\n")) {
            writeln!(w, "  hint: {hint}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(e: &CliError) -> String {
        let mut out = Vec::new();
        e.report(&mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn each_cause_gets_its_own_line() {
        let e = CliError::Database(outbox_diesel::Error::Database(
            diesel::result::Error::NotFound,
        ));
        assert_eq!(
            report(&e),
            "error: database operation failed\n  caused by: database error\n  caused by: Record not \
             found\n"
        );
    }

    #[test]
    fn a_missing_table_suggests_migrate() {
        let q = diesel::result::Error::QueryBuilderError("no such table: outbox".into());
        let text = report(&CliError::Database(q.into()));
        assert!(
            text.contains("hint: the outbox tables are missing: run `outbox migrate` first"),
            "{text}"
        );
    }

    #[test]
    fn a_relay_conflict_gets_the_one_relay_per_file_hint() {
        let conflict = || outbox_core::Error::RelayConflict("held".into());
        for e in [
            CliError::RelayStart(conflict()),
            CliError::Relay(conflict()),
        ] {
            assert!(report(&e).contains(RELAY_CONFLICT_HINT), "{e}");
        }
        let outage = CliError::Relay(outbox_core::Error::store("down"));
        assert!(!report(&outage).contains("hint:"));
    }

    #[test]
    fn usage_errors_exit_with_2() {
        assert_eq!(CliError::MissingDatabaseUrl.exit_code(), 2);
        assert_eq!(CliError::NotFound("id 1".into()).exit_code(), 1);
    }
}
