//! The replication connection's settings, read from the database URL the SQL pool uses.

use pgwire_replication::{ReplicationConfig, SslMode, TlsConfig};

use crate::{CdcError, Result};

/// Where the replication connection goes: host, port, user, password, database and TLS,
/// parsed from a `postgres://user:password@host:port/database?sslmode=..` URL.
///
/// `sslmode` takes libpq's values: `disable` (the default), `prefer`, `require`,
/// `verify-ca`, `verify-full`; `sslrootcert=<path>` names the CA file for the verifying
/// modes (without it, the Mozilla roots). `user`, `password`, `dbname`, `host` and
/// `port` in the query override the URL's parts, as in libpq. Other parameters are
/// ignored.
///
/// A Unix-domain socket is chosen as libpq chooses it, so that the replication
/// connection goes where the SQL pool's connections go: a host that is a directory
/// (`?host=/var/run/postgresql`, or `postgres://%2Fvar%2Frun%2Fpostgresql/app`), or no
/// host at all (`postgres:///app`: the socket in `/var/run/postgresql` or `/tmp`,
/// whichever has one for the port, else `localhost`). TLS does not apply to a socket
/// (libpq ignores `sslmode` there too).
#[derive(Clone, PartialEq, Eq)]
pub struct ReplicationTarget {
    host: String,
    port: u16,
    user: String,
    password: String,
    database: String,
    tls: TlsConfig,
}

impl std::fmt::Debug for ReplicationTarget {
    // Never the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicationTarget")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("database", &self.database)
            .field("sslmode", &self.tls.mode)
            .finish_non_exhaustive()
    }
}

impl ReplicationTarget {
    /// Parses `database_url` (see [`ReplicationTarget`]).
    pub fn from_url(database_url: &str) -> Result<Self> {
        let bad = |why: &str| CdcError::Url(why.to_owned());
        let (url, host_given) = parse(database_url).map_err(|e| bad(&e.to_string()))?;
        if !matches!(url.scheme(), "postgres" | "postgresql") {
            return Err(bad("the scheme must be postgres:// or postgresql://"));
        }
        // Percent-decoding only, as libpq reads a URL (`+` stays a plus).
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        };
        let mut host = match url.host() {
            // Without its brackets, as a socket address takes it.
            Some(url::Host::Ipv6(address)) => Some(address.to_string()),
            _ => url
                .host_str()
                .filter(|h| host_given && !h.is_empty())
                .map(decode),
        };
        let mut port = url.port();
        let mut user = Some(url.username()).filter(|u| !u.is_empty()).map(decode);
        let mut password = url.password().map(decode);
        let mut database = Some(url.path().trim_start_matches('/'))
            .filter(|d| !d.is_empty())
            .map(decode);
        let mut mode = SslMode::Disable;
        let mut root = None;
        for (k, v) in url.query_pairs() {
            match &*k {
                "sslmode" => {
                    mode = match &*v {
                        "disable" | "allow" => SslMode::Disable,
                        "prefer" => SslMode::Prefer,
                        "require" => SslMode::Require,
                        "verify-ca" => SslMode::VerifyCa,
                        "verify-full" => SslMode::VerifyFull,
                        other => return Err(bad(&format!("unknown sslmode `{other}`"))),
                    }
                }
                "sslrootcert" => root = Some(std::path::PathBuf::from(&*v)),
                "host" if !v.is_empty() => host = Some(v.into_owned()),
                "user" => user = Some(v.into_owned()),
                "password" => password = Some(v.into_owned()),
                "dbname" => database = Some(v.into_owned()),
                "port" => {
                    port = Some(
                        v.parse()
                            .map_err(|_| bad(&format!("the port `{v}` is not a port number")))?,
                    )
                }
                _ => {}
            }
        }
        let user = user.unwrap_or_else(|| "postgres".to_owned());
        let database = database.unwrap_or_else(|| user.clone());
        let password = password.unwrap_or_default();
        let port = port.unwrap_or(5432);
        let host = host.unwrap_or_else(|| default_host(port));
        if host.starts_with('/') {
            mode = SslMode::Disable;
        }
        let tls = match mode {
            SslMode::Disable => TlsConfig::disabled(),
            SslMode::Prefer => TlsConfig {
                mode: SslMode::Prefer,
                ..TlsConfig::disabled()
            },
            SslMode::Require => TlsConfig::require(),
            SslMode::VerifyCa => TlsConfig::verify_ca(root),
            SslMode::VerifyFull => TlsConfig::verify_full(root),
        };
        Ok(Self {
            host,
            port,
            user,
            password,
            database,
            tls,
        })
    }

    /// The replication session's settings for `slot` and `publication`.
    pub(crate) fn config(&self, slot: &str, publication: &str) -> ReplicationConfig {
        ReplicationConfig::new(
            self.host.clone(),
            self.user.clone(),
            self.password.clone(),
            self.database.clone(),
            slot,
            publication,
        )
        .with_port(self.port)
        .with_tls(self.tls.clone())
        // The decoder reads created_at in this form (see decode.rs).
        .with_options("-c datestyle=ISO -c timezone=UTC")
    }
}

/// `database_url` parsed, and whether it names a host: libpq takes `user@/db` and
/// `user:pw@:5433/db` (no host, often with `?host=`), which the URL standard refuses, so
/// they are read with a stand-in host.
fn parse(database_url: &str) -> std::result::Result<(url::Url, bool), url::ParseError> {
    match url::Url::parse(database_url) {
        Err(url::ParseError::EmptyHost) => {
            let (scheme, rest) = database_url.split_once("://").unwrap_or(("", database_url));
            let end = rest.find(['/', '?']).unwrap_or(rest.len());
            let (authority, tail) = rest.split_at(end);
            let at = authority.rfind('@').map_or(0, |i| i + 1);
            let (user, port) = authority.split_at(at);
            Ok((
                url::Url::parse(&format!("{scheme}://{user}localhost{port}{tail}"))?,
                false,
            ))
        }
        parsed => Ok((parsed?, true)),
    }
}

/// libpq's choice for a URL without a host: the server's socket in the directories
/// PostgreSQL's packages put it in, else `localhost`.
fn default_host(port: u16) -> String {
    ["/var/run/postgresql", "/tmp"]
        .into_iter()
        .find(|dir| {
            std::path::Path::new(dir)
                .join(format!(".s.PGSQL.{port}"))
                .exists()
        })
        .unwrap_or("localhost")
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_gives_its_parts_and_hides_the_password() {
        let t = ReplicationTarget::from_url(
            "postgres://app%40x:p%2Fss@db.example:6432/shop?sslmode=verify-full&application_name=a",
        )
        .unwrap();
        assert_eq!(t.host, "db.example");
        assert_eq!(t.port, 6432);
        assert_eq!(t.user, "app@x");
        assert_eq!(t.password, "p/ss");
        assert_eq!(t.database, "shop");
        assert_eq!(t.tls.mode, SslMode::VerifyFull);
        assert!(!format!("{t:?}").contains("p/ss"));
    }

    #[test]
    fn defaults_and_refusals() {
        let t = ReplicationTarget::from_url("postgres://127.0.0.1").unwrap();
        assert_eq!(
            (t.port, t.user.as_str(), t.database.as_str()),
            (5432, "postgres", "postgres")
        );
        assert_eq!(t.tls.mode, SslMode::Disable);
        assert!(ReplicationTarget::from_url("mysql://x/y").is_err());
        assert!(ReplicationTarget::from_url("postgres://x/y?sslmode=sometimes").is_err());
        assert!(ReplicationTarget::from_url("not a url").is_err());
        assert!(ReplicationTarget::from_url("postgres://x/y?port=fifty").is_err());
    }

    #[test]
    fn a_socket_directory_is_taken_from_the_url_as_libpq_takes_it() {
        let t = ReplicationTarget::from_url(
            "postgres://app@/shop?host=/run/pg&port=5433&sslmode=require",
        )
        .unwrap();
        assert_eq!((t.host.as_str(), t.port), ("/run/pg", 5433));
        // libpq ignores sslmode on a socket: no TLS asked of it.
        assert_eq!(t.tls.mode, SslMode::Disable);
        assert!(t.config("s", "p").is_unix_socket());
        let t = ReplicationTarget::from_url("postgres://app:pw@:5433/shop?host=/run/pg").unwrap();
        assert_eq!(
            (
                t.host.as_str(),
                t.port,
                t.user.as_str(),
                t.password.as_str()
            ),
            ("/run/pg", 5433, "app", "pw")
        );
        let t = ReplicationTarget::from_url("postgres://a+b:p+w%40@[::1]:6000/my+db").unwrap();
        assert_eq!(
            (
                t.host.as_str(),
                t.port,
                t.user.as_str(),
                t.password.as_str(),
                t.database.as_str()
            ),
            ("::1", 6000, "a+b", "p+w@", "my+db")
        );
        let t = ReplicationTarget::from_url(
            "postgres://h/shop?user=relay&password=s%26cret&dbname=orders",
        )
        .unwrap();
        assert_eq!(
            (t.user.as_str(), t.password.as_str(), t.database.as_str()),
            ("relay", "s&cret", "orders")
        );
        let t = ReplicationTarget::from_url("postgres://%2Frun%2Fpg/shop").unwrap();
        assert_eq!(t.host, "/run/pg");
        let t = ReplicationTarget::from_url("postgres://db.example/shop?host=db2.example").unwrap();
        assert_eq!(t.host, "db2.example");
    }
}
