//! The replication connection's settings, read from the database URL the SQL pool uses.

use pgwire_replication::{ReplicationConfig, SslMode, TlsConfig};

use crate::{CdcError, Result};

/// Where the replication connection goes: host, port, user, password, database and TLS,
/// parsed from a `postgres://user:password@host:port/database?sslmode=..` URL.
///
/// `sslmode` takes libpq's values: `disable` (the default), `prefer`, `require`,
/// `verify-ca`, `verify-full`; `sslrootcert=<path>` names the CA file for the verifying
/// modes (without it, the Mozilla roots). Other parameters are ignored.
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
        let url = url::Url::parse(database_url).map_err(|e| bad(&e.to_string()))?;
        if !matches!(url.scheme(), "postgres" | "postgresql") {
            return Err(bad("the scheme must be postgres:// or postgresql://"));
        }
        let decode = |s: &str| {
            url::form_urlencoded::parse(format!("v={s}").as_bytes())
                .next()
                .map(|(_, v)| v.into_owned())
                .unwrap_or_default()
        };
        let host = url.host_str().unwrap_or("localhost").to_owned();
        let user = match url.username() {
            "" => "postgres".to_owned(),
            u => decode(u),
        };
        let password = url.password().map(decode).unwrap_or_default();
        let database = match url.path().trim_start_matches('/') {
            "" => user.clone(),
            db => decode(db),
        };
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
                _ => {}
            }
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
            port: url.port().unwrap_or(5432),
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
    }
}
