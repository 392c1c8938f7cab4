//! A broker URL taken apart: scheme, credentials, host list, path and parameters; and
//! the same URL with its passwords hidden.

use outbox_nats::async_nats::ServerAddr;
use outbox_redis::SentinelConfig;
use outbox_redis::redis::sentinel::SentinelNodeConnectionInfo;
use outbox_redis::redis::{ConnectionInfo, IntoConnectionInfo as _, TlsMode};

use super::BrokerUrlError;

/// What the scheme names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scheme {
    /// One Redis server: a URL the redis crate parses itself.
    Single,
    /// `redis+cluster://` (`rediss+cluster://` with TLS).
    Cluster {
        /// TLS to every node.
        tls: bool,
    },
    /// `redis+sentinel://` (`rediss+sentinel://` with TLS).
    Sentinel {
        /// TLS to the sentinels and to the primary.
        tls: bool,
    },
    /// `nats://` (`nats+tls://` with TLS): NATS JetStream, one server or a cluster
    /// through these seeds.
    Nats {
        /// TLS to every server.
        tls: bool,
    },
}

impl Scheme {
    fn of(scheme: &str) -> Result<Self, BrokerUrlError> {
        Ok(match scheme.to_ascii_lowercase().as_str() {
            "redis" | "rediss" | "valkey" | "valkeys" | "redis+unix" | "valkey+unix" | "unix" => {
                Self::Single
            }
            "redis+cluster" => Self::Cluster { tls: false },
            "rediss+cluster" => Self::Cluster { tls: true },
            "redis+sentinel" => Self::Sentinel { tls: false },
            "rediss+sentinel" => Self::Sentinel { tls: true },
            "nats" => Self::Nats { tls: false },
            "nats+tls" => Self::Nats { tls: true },
            _ => return Err(BrokerUrlError::UnknownScheme(scheme.to_owned())),
        })
    }
}

/// The parameters the cluster scheme takes (passed on to each node).
const CLUSTER_PARAMETERS: &str = "`protocol`";
/// The parameters the sentinel scheme takes.
const SENTINEL_PARAMETERS: &str = "`protocol`, `sentinel_username` and `sentinel_password`";

/// The parts of a URL `SCHEME://[USERINFO@]HOSTS[PATH][?QUERY][#FRAGMENT]`, as written
/// (nothing decoded).
#[derive(Debug)]
pub(super) struct Split<'a> {
    pub(super) scheme: Scheme,
    userinfo: Option<&'a str>,
    hosts: &'a str,
    path: &'a str,
    query: Vec<(&'a str, &'a str)>,
    fragment: Option<&'a str>,
}

impl<'a> Split<'a> {
    pub(super) fn of(url: &'a str) -> Result<Self, BrokerUrlError> {
        let (scheme, rest) = url.split_once("://").ok_or(BrokerUrlError::NoScheme)?;
        if scheme.is_empty() {
            return Err(BrokerUrlError::NoScheme);
        }
        let scheme = Scheme::of(scheme)?;
        let (rest, fragment) = match rest.split_once('#') {
            Some((rest, fragment)) => (rest, Some(fragment)),
            None => (rest, None),
        };
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = rest.find('/').map_or((rest, ""), |i| rest.split_at(i));
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, authority),
        };
        let query = query
            .split('&')
            .filter(|pair| !pair.is_empty())
            .map(|pair| pair.split_once('=').unwrap_or((pair, "")))
            .collect();
        Ok(Self {
            scheme,
            userinfo,
            hosts,
            path,
            query,
            fragment,
        })
    }

    /// The seed nodes of a cluster URL, each with the URL's credentials.
    pub(super) fn cluster_nodes(&self, tls: bool) -> Result<Vec<ConnectionInfo>, BrokerUrlError> {
        if !matches!(self.path, "" | "/") {
            return Err(BrokerUrlError::ClusterPath(self.path.to_owned()));
        }
        let query = self.passed_on(&[], CLUSTER_PARAMETERS)?;
        self.hosts()?
            .into_iter()
            .map(|host| {
                let url = format!(
                    "{}://{}{host}/{query}{}",
                    redis_scheme(tls),
                    self.credentials(),
                    self.fragment()
                );
                node(&url, host)
            })
            .collect()
    }

    /// The servers of a NATS URL, each with the URL's credentials (`USER:PASS@` or a
    /// token `TOKEN@`); a NATS URL takes no path and no parameters.
    pub(super) fn nats_servers(&self, tls: bool) -> Result<Vec<ServerAddr>, BrokerUrlError> {
        if !matches!(self.path, "" | "/") {
            return Err(BrokerUrlError::NatsPath(self.path.to_owned()));
        }
        if let Some((name, _)) = self.query.first() {
            return Err(BrokerUrlError::UnknownParameter(
                (*name).to_owned(),
                "no parameters",
            ));
        }
        let scheme = if tls { "tls" } else { "nats" };
        self.hosts()?
            .into_iter()
            .map(|host| {
                format!("{scheme}://{}{host}", self.credentials())
                    .parse::<ServerAddr>()
                    .map_err(|source| BrokerUrlError::NatsServer {
                        host: host.to_owned(),
                        source,
                    })
            })
            .collect()
    }

    /// The sentinels, the master's name and how to reach the primary, from a sentinel
    /// URL: `/MASTER[/DB]` as the path, the credentials the primary's.
    pub(super) fn sentinel_config(&self, tls: bool) -> Result<SentinelConfig, BrokerUrlError> {
        let path = self.path.strip_prefix('/').unwrap_or(self.path);
        let (master, db) = path.split_once('/').unwrap_or((path, ""));
        if master.is_empty() {
            return Err(BrokerUrlError::NoMaster);
        }
        if !db.is_empty() && db.parse::<u32>().is_err() {
            return Err(BrokerUrlError::BadDatabase(db.to_owned()));
        }
        let query = self.passed_on(
            &["sentinel_username", "sentinel_password"],
            SENTINEL_PARAMETERS,
        )?;
        // The primary's address comes from the sentinels: a placeholder host carries the
        // credentials, database and protocol through the redis crate's own parser.
        let template = format!(
            "{}://{}placeholder/{db}{query}{}",
            redis_scheme(tls),
            self.credentials(),
            self.fragment()
        );
        let primary = template
            .into_connection_info()
            .map_err(|source| BrokerUrlError::Redis {
                what: "the redis crate refused the primary's credentials, database or \
                       parameters"
                    .to_owned(),
                source,
            })?;
        let mut primary_node = SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(primary.redis_settings().clone());
        if tls {
            primary_node = primary_node.set_tls_mode(TlsMode::Secure);
        }
        let sentinels = self
            .hosts()?
            .into_iter()
            .map(|host| self.sentinel(host, tls))
            .collect::<Result<Vec<_>, _>>()?;
        SentinelConfig::new(sentinels, master)
            .map(|c| c.with_master_connection(primary_node))
            .map_err(BrokerUrlError::Config)
    }

    /// One sentinel, with `sentinel_username` / `sentinel_password` if given.
    fn sentinel(&self, host: &str, tls: bool) -> Result<ConnectionInfo, BrokerUrlError> {
        let info = node(
            &format!("{}://{host}/{}", redis_scheme(tls), self.fragment()),
            host,
        )?;
        let mut settings = info.redis_settings().clone();
        if let Some(user) = self.parameter("sentinel_username") {
            settings = settings.set_username(percent_decode(user)?);
        }
        if let Some(password) = self.parameter("sentinel_password") {
            settings = settings.set_password(percent_decode(password)?);
        }
        Ok(info.set_redis_settings(settings))
    }

    /// The hosts of the list, none empty.
    fn hosts(&self) -> Result<Vec<&'a str>, BrokerUrlError> {
        if self.hosts.is_empty() {
            return Err(BrokerUrlError::NoHost);
        }
        let hosts: Vec<&str> = self.hosts.split(',').collect();
        if hosts.iter().any(|h| h.is_empty()) {
            return Err(BrokerUrlError::EmptyHost(self.hosts.to_owned()));
        }
        Ok(hosts)
    }

    /// `USERINFO@`, or nothing.
    fn credentials(&self) -> String {
        self.userinfo.map(|u| format!("{u}@")).unwrap_or_default()
    }

    /// `#FRAGMENT` (the redis crate's `#insecure` for TLS), or nothing.
    fn fragment(&self) -> String {
        self.fragment.map(|f| format!("#{f}")).unwrap_or_default()
    }

    fn parameter(&self, name: &str) -> Option<&'a str> {
        self.query.iter().find(|(k, _)| *k == name).map(|(_, v)| *v)
    }

    /// `?protocol=…` for the redis crate, or nothing; refuses any parameter that is
    /// neither `protocol` nor one of `ours`.
    fn passed_on(&self, ours: &[&str], allowed: &'static str) -> Result<String, BrokerUrlError> {
        let mut passed = String::new();
        for (name, value) in &self.query {
            if *name == "protocol" {
                passed = format!("?protocol={value}");
            } else if !ours.contains(name) {
                return Err(BrokerUrlError::UnknownParameter(
                    (*name).to_owned(),
                    allowed,
                ));
            }
        }
        Ok(passed)
    }
}

fn redis_scheme(tls: bool) -> &'static str {
    if tls { "rediss" } else { "redis" }
}

/// One node's URL through the redis crate's parser; errors name the host only.
fn node(url: &str, host: &str) -> Result<ConnectionInfo, BrokerUrlError> {
    url.into_connection_info()
        .map_err(|source| BrokerUrlError::Redis {
            what: format!("the redis crate refused the node `{host}` (HOST:PORT)"),
            source,
        })
}

/// `%XX` escapes decoded; anything that does not decode to UTF-8 is refused.
fn percent_decode(text: &str) -> Result<String, BrokerUrlError> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text.get(i + 1..i + 3).ok_or(BrokerUrlError::BadEscape)?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| BrokerUrlError::BadEscape)?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| BrokerUrlError::BadEscape)
}

/// Query parameters whose value is a secret.
const SECRET_PARAMETERS: [&str; 3] = ["password", "pass", "sentinel_password"];

/// `url` with every password hidden: the credentials before `@` (as
/// [`outbox_core::redact_url`] does, also when the scheme was forgotten) and the value of
/// every `password`, `pass` and `sentinel_password` parameter.
pub(crate) fn redact(url: &str) -> String {
    let mut out = if url.contains("://") {
        outbox_core::redact_url(url)
    } else {
        // `user:pw@host` without a scheme: still credentials.
        match (url.find(':'), url.rfind('@')) {
            (Some(colon), Some(at)) if colon < at => {
                format!("{}***{}", &url[..=colon], &url[at..])
            }
            _ => url.to_owned(),
        }
    };
    if let Some(q) = out.find('?') {
        let (head, query) = out.split_at(q + 1);
        let query: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((k, _)) if SECRET_PARAMETERS.contains(&k) => format!("{k}=***"),
                _ => pair.to_owned(),
            })
            .collect();
        out = format!("{head}{}", query.join("&"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_decode() {
        assert_eq!(percent_decode("a%40b%3A").unwrap(), "a@b:");
        assert!(percent_decode("%f").is_err());
        assert!(percent_decode("%zz").is_err());
        assert!(percent_decode("%ff").is_err());
    }

    #[test]
    fn credentials_without_a_scheme_are_hidden_too() {
        assert_eq!(redact("u:s3cret@h:6379"), "u:***@h:6379");
        assert_eq!(redact("h:6379"), "h:6379");
    }
}
