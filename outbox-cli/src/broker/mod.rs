//! The broker URL (`--broker`, alias `--redis-url`): which broker, and which topology of
//! it, the relay and the stream commands reach.
//!
//! | URL | broker |
//! |---|---|
//! | `redis://[[USER]:PASS@]HOST[:PORT][/DB]`, `rediss://…` | one Redis server (any URL the redis crate takes: also `valkey://`, `redis+unix://`, `unix://`) |
//! | `redis+cluster://[[USER]:PASS@]HOST:PORT[,HOST:PORT…]`, `rediss+cluster://…` | a Redis Cluster, reached through any of these seed nodes |
//! | `redis+sentinel://[[USER]:PASS@]HOST:PORT[,HOST:PORT…]/MASTER[/DB]`, `rediss+sentinel://…` | the primary that these sentinels monitor as MASTER |
//!
//! The `+` scheme is the redis crate's own convention (`redis+unix://`); it parses no
//! cluster or sentinel URL itself, so each host of a list becomes a `redis://` URL of
//! its own that the crate then checks. The credentials are the data nodes' (the
//! cluster's nodes, the primary); sentinels that require a password of their own take
//! `?sentinel_password=…` (and `sentinel_username=…`).
//!
//! | `nats://[[USER:PASS|TOKEN]@]HOST:PORT[,HOST:PORT…]`, `nats+tls://…` | NATS JetStream, one server or a cluster through these seeds |
//!
//! NATS serves `outbox relay` and `outbox streams`; the commands that read or change
//! Redis streams (`trim`, `serve`) refuse it ([`Broker::redis`]).

mod conn;
mod durability;
mod nats;
mod url;

use std::time::Duration;

use outbox_redis::redis::{ConnectionInfo, IntoConnectionInfo as _, RedisError};
use outbox_redis::{PublisherConfig, RedisPublisher, SentinelConfig};

pub(crate) use self::conn::BrokerConn;
pub(crate) use self::durability::parse_durability;
pub(crate) use self::nats::NatsServers;
pub(crate) use self::url::redact;
use self::url::{Scheme, Split};

/// A parsed broker URL.
#[derive(Debug, Clone)]
pub(crate) struct Broker {
    /// The URL as given, passwords hidden: for messages and logs.
    display: String,
    /// Which broker and how to reach it.
    kind: BrokerKind,
}

/// The brokers the command reaches.
#[derive(Debug, Clone)]
pub(crate) enum BrokerKind {
    /// Redis, in one of its topologies.
    Redis(Topology),
    /// NATS JetStream.
    Nats(NatsServers),
}

/// How a Redis deployment is reached.
#[derive(Debug, Clone)]
pub(crate) enum Topology {
    /// One server.
    Single(ConnectionInfo),
    /// A Redis Cluster, through its seed nodes (the others are discovered).
    Cluster(Vec<ConnectionInfo>),
    /// The primary that Redis Sentinel names, followed through failovers.
    Sentinel(Box<SentinelConfig>),
}

/// Why a broker URL was refused. No variant holds the URL's password.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BrokerUrlError {
    /// No `scheme://`.
    #[error("not a URL: expected e.g. redis://HOST:PORT ({SCHEMES})")]
    NoScheme,
    /// A scheme no broker has.
    #[error("unknown scheme `{0}`: use {SCHEMES}")]
    UnknownScheme(String),
    /// A NATS URL with a path: NATS has no databases.
    #[error("a NATS URL names servers only: drop the path `{0}`")]
    NatsPath(String),
    /// The NATS client refused one server of the list (its words never quote the
    /// password).
    #[error("the NATS client refused the server `{host}` (HOST:PORT)")]
    NatsServer {
        /// The host as written.
        host: String,
        /// The client's error.
        source: std::io::Error,
    },
    /// A cluster or sentinel URL without any host.
    #[error("names no host: list them as HOST:PORT,HOST:PORT")]
    NoHost,
    /// An empty entry in the host list (`h1:1,,h2:2`).
    #[error("an empty host in the list `{0}`")]
    EmptyHost(String),
    /// A cluster URL with a path: a cluster has database 0 only.
    #[error("a Redis Cluster has database 0 only: drop the path `{0}`")]
    ClusterPath(String),
    /// A sentinel URL without the master's name.
    #[error(
        "names no master: give the name the sentinels monitor as the path, e.g. \
         redis+sentinel://HOST:26379,HOST:26379/mymaster"
    )]
    NoMaster,
    /// A sentinel URL whose database (after the master's name) is not a number.
    #[error("`{0}` is not a database number (redis+sentinel://HOSTS/MASTER/DB)")]
    BadDatabase(String),
    /// A query parameter the scheme does not take.
    #[error("unknown parameter `{0}` (this scheme takes {1})")]
    UnknownParameter(String, &'static str),
    /// A `%` escape that does not decode to UTF-8.
    #[error("a %-escape in sentinel_username or sentinel_password does not decode to UTF-8")]
    BadEscape,
    /// The redis crate refused an address (its words; they never quote the password).
    #[error("{what}")]
    Redis {
        /// Which part: the URL, or one host of the list.
        what: String,
        /// The redis crate's error.
        source: RedisError,
    },
    /// The outbox's own checks of a sentinel config (master name, sentinels).
    #[error(transparent)]
    Config(outbox_redis::Error),
}

/// The schemes, for messages.
const SCHEMES: &str = "redis://, rediss://, redis+cluster://, rediss+cluster://, \
                       redis+sentinel://, rediss+sentinel://, nats:// or nats+tls://";

/// What the relay's publisher and the stream commands' connections need to know about
/// their time limits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    /// How long connecting may take (through the sentinels too).
    pub(crate) connect: Duration,
    /// How long one command may take.
    pub(crate) response: Duration,
}

impl Broker {
    /// Parses `url`; only its syntax is checked, nothing connects.
    pub(crate) fn parse(url: &str) -> Result<Self, BrokerUrlError> {
        let split = Split::of(url)?;
        let kind = match split.scheme {
            Scheme::Single => Topology::Single(url.into_connection_info().map_err(|source| {
                BrokerUrlError::Redis {
                    what: "the redis crate refused the URL".to_owned(),
                    source,
                }
            })?),
            Scheme::Cluster { tls } => Topology::Cluster(split.cluster_nodes(tls)?),
            Scheme::Sentinel { tls } => Topology::Sentinel(Box::new(split.sentinel_config(tls)?)),
            Scheme::Nats { tls } => {
                return Ok(Self {
                    display: redact(url),
                    kind: BrokerKind::Nats(NatsServers::new(split.nats_servers(tls)?)),
                });
            }
        };
        Ok(Self {
            display: redact(url),
            kind: BrokerKind::Redis(kind),
        })
    }

    /// The URL with its passwords hidden.
    pub(crate) fn display(&self) -> &str {
        &self.display
    }

    /// Which broker this is.
    pub(crate) fn kind(&self) -> &BrokerKind {
        &self.kind
    }

    /// The Redis deployment this broker is; refuses a NATS broker, for the commands
    /// that reach Redis only.
    pub(crate) fn redis(&self) -> Result<&Topology, NotRedis> {
        match &self.kind {
            BrokerKind::Redis(topology) => Ok(topology),
            BrokerKind::Nats(_) => Err(NotRedis {
                url: self.display.clone(),
            }),
        }
    }

    /// `single`, `cluster` or `sentinel` (Redis), `nats`, for logs.
    pub(crate) fn topology_name(&self) -> &'static str {
        match &self.kind {
            BrokerKind::Redis(Topology::Single(_)) => "single",
            BrokerKind::Redis(Topology::Cluster(_)) => "cluster",
            BrokerKind::Redis(Topology::Sentinel(_)) => "sentinel",
            BrokerKind::Nats(_) => "nats",
        }
    }

    /// The relay's Redis publisher to this broker, with `config`. Refuses a config the
    /// deployment cannot take (a stream prefix with braces on a cluster), and a NATS
    /// broker.
    pub(crate) fn publisher(
        &self,
        config: PublisherConfig,
    ) -> outbox_redis::Result<RedisPublisher> {
        let topology = self.redis().map_err(|e| {
            outbox_redis::Error::from(outbox_core::InvalidConfig::new("broker", e.to_string()))
        })?;
        let publisher = match topology {
            Topology::Single(info) => RedisPublisher::new(info.clone()),
            Topology::Cluster(nodes) => RedisPublisher::cluster(nodes.clone()),
            Topology::Sentinel(config) => RedisPublisher::sentinel((**config).clone()),
        }?;
        publisher.with_config(config)
    }

    /// A connection for the stream commands and the pages, opened within
    /// `timeouts.connect`.
    /// A NATS broker is refused here as an invalid client configuration: the commands
    /// check [`Broker::redis`] before they connect.
    pub(crate) async fn connect(&self, timeouts: Timeouts) -> Result<BrokerConn, RedisError> {
        let topology = self.redis().map_err(|e| {
            RedisError::from((
                outbox_redis::redis::ErrorKind::InvalidClientConfig,
                "not a Redis broker",
                e.to_string(),
            ))
        })?;
        BrokerConn::open(topology, timeouts).await
    }
}

/// A NATS broker given to what reaches Redis only.
#[derive(Debug, thiserror::Error)]
#[error("`{url}` is a NATS broker; this reaches Redis only")]
pub(crate) struct NotRedis {
    /// The URL, passwords hidden.
    url: String,
}

#[cfg(test)]
mod tests {
    use outbox_redis::redis::ConnectionAddr;

    use super::*;

    fn parse(url: &str) -> Topology {
        match Broker::parse(url) {
            Ok(b) => b.redis().expect("a Redis broker").clone(),
            Err(e) => panic!("{url}: {e}"),
        }
    }

    fn refused(url: &str) -> String {
        match Broker::parse(url) {
            Ok(b) => panic!("{url} parsed as {b:?}"),
            Err(e) => outbox_core::error_chain(&e).texts().join(": "),
        }
    }

    fn tcp(info: &ConnectionInfo) -> (String, u16) {
        match info.addr() {
            ConnectionAddr::Tcp(host, port) => (host.clone(), *port),
            other => panic!("not TCP: {other:?}"),
        }
    }

    #[test]
    fn single_urls_are_the_redis_crates() {
        let Topology::Single(info) = parse("redis://u:p%40ss@h:6380/2") else {
            panic!("not single");
        };
        assert_eq!(tcp(&info), ("h".into(), 6380));
        assert_eq!(info.redis_settings().db(), 2);
        assert_eq!(info.redis_settings().password(), Some("p@ss"));
        assert!(matches!(
            parse("redis+unix:///run/redis.sock"),
            Topology::Single(_)
        ));
        assert!(matches!(parse("REDIS://h"), Topology::Single(_)));
    }

    #[test]
    fn cluster_urls_list_their_seeds_with_one_set_of_credentials() {
        let Topology::Cluster(nodes) = parse("redis+cluster://:s3cret@h1:7000,h2:7001,[::1]:7002")
        else {
            panic!("not a cluster");
        };
        let addrs: Vec<_> = nodes.iter().map(tcp).collect();
        assert_eq!(
            addrs,
            [
                ("h1".into(), 7000),
                ("h2".into(), 7001),
                ("::1".into(), 7002)
            ]
        );
        assert!(
            nodes
                .iter()
                .all(|n| n.redis_settings().password() == Some("s3cret"))
        );
        // The default port, a trailing slash and RESP3.
        let Topology::Cluster(nodes) = parse("redis+cluster://h1,h2/?protocol=resp3") else {
            panic!("not a cluster");
        };
        assert_eq!(tcp(&nodes[0]), ("h1".into(), 6379));
        assert_eq!(nodes.len(), 2);
    }

    #[test]
    fn sentinel_urls_name_the_master_and_the_primarys_credentials() {
        let Topology::Sentinel(config) =
            parse("redis+sentinel://app:pw@s1:26379,s2:26380/mymaster/3?sentinel_password=sp")
        else {
            panic!("not sentinel");
        };
        assert_eq!(config.master_name, "mymaster");
        let sentinels: Vec<_> = config.sentinels.iter().map(tcp).collect();
        assert_eq!(sentinels, [("s1".into(), 26379), ("s2".into(), 26380)]);
        assert!(
            config
                .sentinels
                .iter()
                .all(|s| s.redis_settings().password() == Some("sp")
                    && s.redis_settings().username().is_none())
        );
        // The primary's settings are opaque in the redis crate: seen through Debug.
        let master = format!("{:?}", config.master);
        assert!(master.contains("db: 3"), "{master}");
        assert!(master.contains("\"app\""), "{master}");
        assert!(matches!(
            parse("redis+sentinel://s1:26379/mymaster/"),
            Topology::Sentinel(_)
        ));
    }

    #[test]
    fn bad_urls_say_what_is_wrong_and_never_show_the_password() {
        for (url, says) in [
            ("not a url", "not a URL"),
            ("", "not a URL"),
            ("ftp://:s3cret@h", "unknown scheme `ftp`"),
            ("nats://:s3cret@h:notaport", "`h:notaport`"),
            ("nats://:s3cret@h:99999", "`h:99999`"),
            ("nats://:s3cret@h:4222/x", "drop the path `/x`"),
            ("nats://:s3cret@h:4222?x=1", "unknown parameter `x`"),
            ("nats://:s3cret@", "names no host"),
            ("nats://:s3cret@h1:1,,h2:2", "empty host"),
            ("redis://:s3cret@h:notaport", "refused the URL"),
            ("redis+cluster://:s3cret@", "names no host"),
            ("redis+cluster://:s3cret@h1:1,,h2:2", "empty host"),
            ("redis+cluster://:s3cret@h1:x", "`h1:x`"),
            ("redis+cluster://:s3cret@h1:1/2", "database 0 only"),
            (
                "redis+cluster://:s3cret@h1:1?db=2",
                "unknown parameter `db`",
            ),
            ("redis+sentinel://:s3cret@s1:26379", "names no master"),
            ("redis+sentinel://:s3cret@s1:26379/", "names no master"),
            (
                "redis+sentinel://:s3cret@s1:26379/m/x",
                "`x` is not a database",
            ),
            (
                "redis+sentinel://:s3cret@s1:26379/m/1/2",
                "`1/2` is not a database",
            ),
            (
                "redis+sentinel://:s3cret@s1:26379/m?pool=3",
                "unknown parameter `pool`",
            ),
            ("redis+sentinel://:s3cret@s1:99999/m", "`s1:99999`"),
            ("redis+sentinel://:%ff@s1:1/m", "not valid UTF-8"),
            (
                "redis+sentinel://s1:1/m?sentinel_password=s3cret%ff",
                "%-escape",
            ),
        ] {
            let text = refused(url);
            assert!(text.contains(says), "{url}: {text}");
            assert!(!text.contains("s3cret"), "{url}: {text}");
        }
    }

    #[test]
    fn nats_urls_list_servers_and_are_no_redis() {
        let broker = Broker::parse("nats://u:s3cret@h1:4222,[::1]:4223/").unwrap();
        let BrokerKind::Nats(servers) = broker.kind() else {
            panic!("not NATS: {broker:?}");
        };
        let addrs: Vec<_> = servers
            .addrs()
            .iter()
            .map(|a| {
                (
                    a.host().to_owned(),
                    a.port(),
                    a.password().map(str::to_owned),
                )
            })
            .collect();
        assert_eq!(
            addrs,
            [
                ("h1".into(), 4222, Some("s3cret".into())),
                ("::1".into(), 4223, Some("s3cret".into()))
            ]
        );
        assert_eq!(broker.display(), "nats://u:***@h1:4222,[::1]:4223/");
        assert_eq!(broker.topology_name(), "nats");
        let refused = broker.redis().unwrap_err().to_string();
        assert!(refused.contains("NATS broker"), "{refused}");
        assert!(!refused.contains("s3cret"), "{refused}");
        let Ok(tls) = Broker::parse("nats+tls://h:4222") else {
            panic!("nats+tls refused");
        };
        let BrokerKind::Nats(servers) = tls.kind() else {
            panic!("not NATS");
        };
        assert!(servers.addrs()[0].tls_required());
    }

    #[test]
    fn the_display_hides_every_password() {
        for (url, shown) in [
            ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
            (
                "redis+cluster://u:pw@h1:1,h2:2",
                "redis+cluster://u:***@h1:1,h2:2",
            ),
            (
                "redis+sentinel://:pw@s:1/m?sentinel_password=spw&sentinel_username=x",
                "redis+sentinel://:***@s:1/m?sentinel_password=***&sentinel_username=x",
            ),
            (
                "redis+unix:///s.sock?pass=pw&db=1",
                "redis+unix:///s.sock?pass=***&db=1",
            ),
            ("redis://h:1", "redis://h:1"),
        ] {
            assert_eq!(Broker::parse(url).unwrap().display(), shown, "{url}");
        }
    }
}
