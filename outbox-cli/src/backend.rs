//! The database URL: which backend it names, and connecting to it.

use std::fmt;
use std::path::Path;

use diesel::connection::SimpleConnection as _;
use diesel::{Connection as _, MysqlConnection, PgConnection, SqliteConnection};

use crate::error::CliError;

/// A database backend the outbox runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum BackendKind {
    /// PostgreSQL (`postgres://`, `postgresql://`).
    Postgres,
    /// MySQL or MariaDB (`mysql://`).
    Mysql,
    /// SQLite (`sqlite://PATH`, `sqlite:PATH`, `PATH.db`, `PATH.sqlite`).
    Sqlite,
}

impl BackendKind {
    /// The outbox migration of this backend.
    pub(crate) fn migration(self) -> outbox_diesel::Migration {
        match self {
            Self::Postgres => outbox_diesel::POSTGRES_MIGRATION,
            Self::Mysql => outbox_diesel::MYSQL_MIGRATION,
            Self::Sqlite => outbox_diesel::SQLITE_MIGRATION,
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Postgres => "PostgreSQL",
            Self::Mysql => "MySQL",
            Self::Sqlite => "SQLite",
        })
    }
}

/// A parsed `--database-url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Database {
    /// The backend, from the URL's scheme.
    pub(crate) kind: BackendKind,
    /// What the driver gets: the URL itself, or the file path for SQLite.
    pub(crate) target: String,
}

impl Database {
    /// Picks the backend from the URL's scheme.
    pub(crate) fn parse(url: &str) -> Result<Self, CliError> {
        let unsupported = || CliError::UnsupportedUrl(redact(url));
        let (kind, target) = if has_scheme(url, "postgres://") || has_scheme(url, "postgresql://") {
            (BackendKind::Postgres, url)
        } else if has_scheme(url, "mysql://") {
            (BackendKind::Mysql, url)
        } else if has_scheme(url, "sqlite://") {
            (BackendKind::Sqlite, &url["sqlite://".len()..])
        } else if has_scheme(url, "sqlite:") {
            (BackendKind::Sqlite, &url["sqlite:".len()..])
        } else if !url.contains("://") && is_sqlite_file(url) {
            (BackendKind::Sqlite, url)
        } else {
            return Err(unsupported());
        };
        if target.is_empty() {
            return Err(unsupported());
        }
        Ok(Self {
            kind,
            target: target.to_owned(),
        })
    }

    /// The URL with any password hidden, for messages and logs.
    pub(crate) fn display(&self) -> String {
        redact(&self.target)
    }

    /// Opens a connection. A SQLite file must exist already, unless `create`.
    pub(crate) fn connect(&self, create: bool) -> Result<Conn, CliError> {
        let connect_error = |source| CliError::Connect {
            backend: self.kind,
            url: self.display(),
            source,
        };
        match self.kind {
            BackendKind::Postgres => PgConnection::establish(&self.target)
                .map(Conn::Pg)
                .map_err(connect_error),
            BackendKind::Mysql => MysqlConnection::establish(&self.target)
                .map(Conn::Mysql)
                .map_err(connect_error),
            BackendKind::Sqlite => {
                if !create && !Path::new(&self.target).exists() {
                    return Err(CliError::NoSqliteFile(self.target.clone()));
                }
                let mut conn = SqliteConnection::establish(&self.target).map_err(connect_error)?;
                // The relay may be writing at the same time: wait for its lock, do not fail.
                conn.batch_execute("PRAGMA busy_timeout = 5000")
                    .map_err(|e| CliError::Database(e.into()))?;
                Ok(Conn::Sqlite(conn))
            }
        }
    }
}

/// An open connection of one of the backends. Run generic `outbox_diesel` functions on
/// it with [`with_conn!`].
pub(crate) enum Conn {
    /// PostgreSQL.
    Pg(PgConnection),
    /// MySQL / MariaDB.
    Mysql(MysqlConnection),
    /// SQLite.
    Sqlite(SqliteConnection),
}

/// Evaluates `$body` with `$c` bound to the `&mut` connection inside a [`Conn`], whatever
/// its backend: `with_conn!(conn, c => outbox_diesel::backlog(c))`. The body is compiled
/// once per backend, so it may call functions generic over `OutboxConnection`.
macro_rules! with_conn {
    ($conn:expr, $c:ident => $body:expr) => {
        match $conn {
            $crate::backend::Conn::Pg($c) => $body,
            $crate::backend::Conn::Mysql($c) => $body,
            $crate::backend::Conn::Sqlite($c) => $body,
        }
    };
}
pub(crate) use with_conn;

fn has_scheme(url: &str, scheme: &str) -> bool {
    url.get(..scheme.len())
        .is_some_and(|s| s.eq_ignore_ascii_case(scheme))
}

fn is_sqlite_file(path: &str) -> bool {
    let lower = path.to_ascii_lowercase();
    [".db", ".sqlite", ".sqlite3"]
        .iter()
        .any(|ext| lower.ends_with(ext))
}

pub(crate) use outbox_core::redact_url as redact;

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(url: &str) -> Option<(BackendKind, String)> {
        Database::parse(url).ok().map(|d| (d.kind, d.target))
    }

    #[test]
    fn the_scheme_picks_the_backend() {
        use BackendKind::*;
        let pg = "postgres://u@h/db?options=-c%20search_path%3Dx";
        assert_eq!(kind(pg), Some((Postgres, pg.into())));
        assert_eq!(kind("PostgreSQL://h/db").unwrap().0, Postgres);
        assert_eq!(kind("mysql://root@h:3306/test").unwrap().0, Mysql);
        assert_eq!(
            kind("sqlite:///tmp/a.db"),
            Some((Sqlite, "/tmp/a.db".into()))
        );
        assert_eq!(kind("sqlite://rel/a"), Some((Sqlite, "rel/a".into())));
        assert_eq!(kind("sqlite:a.sqlite"), Some((Sqlite, "a.sqlite".into())));
        assert_eq!(
            kind("/var/lib/app.db"),
            Some((Sqlite, "/var/lib/app.db".into()))
        );
        assert_eq!(kind("data.SQLITE3"), Some((Sqlite, "data.SQLITE3".into())));
    }

    #[test]
    fn unknown_schemes_are_errors() {
        for url in [
            "redis://h",
            "mongodb://h/db",
            "app.txt",
            "sqlite:",
            "sqlite://",
            "",
            "http://x.db",
        ] {
            let err = Database::parse(url).unwrap_err();
            assert!(matches!(err, CliError::UnsupportedUrl(_)), "{url}: {err}");
        }
    }
}
