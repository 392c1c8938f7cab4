//! One `mysql://` URL for the emit and the relay: diesel's TLS and socket parameters
//! taken into mysql_async's options (the table is in the module's docs, "One URL for
//! the emit and the relay").

use std::path::PathBuf;

use mysql_async::{ClientIdentity, Opts, OptsBuilder, SslOpts};
use url::Url;

use crate::{CdcError, Result};

/// The connection options of `database_url`, in diesel's dialect or mysql_async's.
pub(crate) fn opts(database_url: &str) -> Result<Opts> {
    let bad = |e: &dyn std::fmt::Display| CdcError::Url(e.to_string());
    let mut url = Url::parse(database_url).map_err(|e| bad(&e))?;
    let mut tls = Tls::default();
    let mut socket = None;
    let mut rest = Vec::new();
    for (key, value) in url.query_pairs() {
        match &*key {
            "ssl_mode" => tls.mode = Some(SslMode::parse(&value)?),
            "ssl_ca" => tls.ca = Some(PathBuf::from(&*value)),
            "ssl_cert" => tls.cert = Some(PathBuf::from(&*value)),
            "ssl_key" => tls.key = Some(PathBuf::from(&*value)),
            "unix_socket" => socket = Some(value.into_owned()),
            _ => rest.push((key.into_owned(), value.into_owned())),
        }
    }
    url.query_pairs_mut().clear().extend_pairs(rest);
    if url.query() == Some("") {
        url.set_query(None);
    }
    let opts = Opts::from_url(url.as_str()).map_err(|e| bad(&e))?;
    let mut builder = OptsBuilder::from_opts(opts);
    if let Some(ssl) = tls.ssl_opts()? {
        install_crypto_provider();
        builder = builder.ssl_opts(ssl);
    }
    if socket.is_some() {
        builder = builder.socket(socket);
    }
    Ok(builder.into())
}

/// libmysqlclient's `ssl_mode`, case-insensitive as there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SslMode {
    Disabled,
    Preferred,
    Required,
    VerifyCa,
    VerifyIdentity,
}

impl SslMode {
    fn parse(value: &str) -> Result<Self> {
        Ok(match value.to_ascii_lowercase().as_str() {
            "disabled" => Self::Disabled,
            "preferred" => Self::Preferred,
            "required" => Self::Required,
            "verify_ca" => Self::VerifyCa,
            "verify_identity" => Self::VerifyIdentity,
            _ => {
                return Err(CdcError::Url(format!(
                    "unknown ssl_mode {value:?}: one of DISABLED, PREFERRED, REQUIRED, \
                     VERIFY_CA, VERIFY_IDENTITY"
                )));
            }
        })
    }
}

/// The URL's TLS parameters.
#[derive(Debug, Default)]
struct Tls {
    mode: Option<SslMode>,
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
}

impl Tls {
    /// What mysql_async is to do, `None` for no TLS from these parameters (mysql_async's
    /// own `require_ssl` may still ask for it).
    fn ssl_opts(self) -> Result<Option<SslOpts>> {
        let mode = match (self.mode, &self.ca) {
            (Some(mode), _) => mode,
            (None, Some(_)) => SslMode::VerifyCa,
            (None, None) if self.cert.is_none() && self.key.is_none() => return Ok(None),
            (None, None) => SslMode::Required,
        };
        if matches!(mode, SslMode::Disabled | SslMode::Preferred) {
            return Ok(None);
        }
        let mut ssl = SslOpts::default()
            .with_danger_accept_invalid_certs(mode == SslMode::Required)
            .with_danger_skip_domain_validation(mode != SslMode::VerifyIdentity);
        if let Some(ca) = self.ca {
            ssl = ssl.with_root_certs(vec![ca.into()]);
        }
        match (self.cert, self.key) {
            (Some(cert), Some(key)) => {
                ssl = ssl.with_client_identity(Some(ClientIdentity::new(cert.into(), key.into())));
            }
            (None, None) => {}
            _ => {
                return Err(CdcError::Url(
                    "ssl_cert and ssl_key go together: the client certificate and its key".into(),
                ));
            }
        }
        Ok(Some(ssl))
    }
}

/// rustls needs one process-wide crypto provider to build a client, and cannot pick one
/// when the build holds two (this workspace's does: pgwire-replication asks for ring,
/// other crates for aws-lc-rs). aws-lc-rs, rustls's default; a provider the application
/// installed first stays.
fn install_crypto_provider() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diesel_s_tls_parameters_become_mysql_async_s() {
        let full =
            opts("mysql://u@db.example:3306/app?ssl_mode=VERIFY_IDENTITY&ssl_ca=/ca.pem").unwrap();
        let ssl = full.ssl_opts().expect("TLS on");
        assert!(!ssl.accept_invalid_certs());
        assert!(!ssl.skip_domain_validation());
        assert_eq!(ssl.root_certs().len(), 1);
        assert_eq!(full.db_name(), Some("app"));

        let ssl = opts_ssl("mysql://u@h/app?ssl_mode=required");
        assert!(ssl.accept_invalid_certs() && ssl.skip_domain_validation());
        let ssl = opts_ssl("mysql://u@h/app?ssl_ca=/ca.pem");
        assert!(!ssl.accept_invalid_certs() && ssl.skip_domain_validation());
        for off in ["ssl_mode=DISABLED", "ssl_mode=preferred&ssl_ca=/ca.pem", ""] {
            let url = format!("mysql://u@h/app?{off}");
            assert!(opts(&url).unwrap().ssl_opts().is_none(), "{url}");
        }
    }

    #[test]
    fn mysql_async_s_own_parameters_pass_through() {
        let own =
            opts("mysql://u@h/app?require_ssl=true&verify_ca=false&unix_socket=/s.sock").unwrap();
        assert!(own.ssl_opts().unwrap().accept_invalid_certs());
        assert_eq!(own.socket(), Some("/s.sock"));
    }

    #[test]
    fn a_bad_parameter_is_a_url_error_naming_it() {
        for (url, says) in [
            (
                "mysql://u@h/app?ssl_mode=strict",
                "unknown ssl_mode \"strict\"",
            ),
            (
                "mysql://u@h/app?ssl_cert=/c.pem",
                "ssl_cert and ssl_key go together",
            ),
            ("mysql://u@h/app?no_such=1", "no_such"),
            ("not a url", "relative URL"),
        ] {
            let err = opts(url).unwrap_err();
            assert!(matches!(err, CdcError::Url(_)), "{url}: {err:?}");
            assert!(err.to_string().contains(says), "{url}: {err}");
        }
    }

    fn opts_ssl(url: &str) -> SslOpts {
        opts(url).unwrap().ssl_opts().expect("TLS on").clone()
    }
}
