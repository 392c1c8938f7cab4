use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{
    AsyncConnectionConfig, Client, Cmd, FromRedisValue, IntoConnectionInfo, Pipeline, RedisError,
    RedisFuture, RedisResult, Value,
};

use crate::error::breaks_connection;
use outbox_core::InvalidConfig;

use crate::Result;

/// Where the streams live: one Redis server, or a Redis Cluster. It decides how streams
/// are named (see [`stream_name`]) and how commands are grouped, so that a publisher and
/// a consumer of the same deployment always agree.
#[derive(Clone)]
pub(crate) enum Target {
    Single(Client),
    #[cfg(feature = "cluster")]
    Cluster(Vec<redis::ConnectionInfo>),
    /// The primary that Redis Sentinel names; one server at a time, so streams are
    /// named as on [`Single`](Self::Single).
    #[cfg(feature = "sentinel")]
    Sentinel(std::sync::Arc<crate::sentinel::SentinelShared>),
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Single(client) => f
                .debug_tuple("Single")
                .field(client.get_connection_info().addr())
                .finish(),
            #[cfg(feature = "cluster")]
            Self::Cluster(nodes) => f
                .debug_tuple("Cluster")
                .field(&nodes.iter().map(|n| n.addr()).collect::<Vec<_>>())
                .finish(),
            #[cfg(feature = "sentinel")]
            Self::Sentinel(shared) => f.debug_tuple("Sentinel").field(shared).finish(),
        }
    }
}

impl Target {
    /// One server; only the address's syntax is checked.
    pub(crate) fn single(redis: impl IntoConnectionInfo) -> RedisResult<Self> {
        Client::open(redis).map(Self::Single)
    }

    /// A cluster reached through any of `nodes`; the list is checked (not empty, same
    /// credentials) without connecting.
    #[cfg(feature = "cluster")]
    pub(crate) fn cluster<T: IntoConnectionInfo>(
        nodes: impl IntoIterator<Item = T>,
    ) -> RedisResult<Self> {
        let nodes = nodes
            .into_iter()
            .map(IntoConnectionInfo::into_connection_info)
            .collect::<RedisResult<Vec<_>>>()?;
        redis::cluster::ClusterClient::new(nodes.clone())?;
        Ok(Self::Cluster(nodes))
    }

    /// The primary that the sentinels of `config` name; the config is checked, nothing
    /// connects.
    #[cfg(feature = "sentinel")]
    pub(crate) fn sentinel(config: crate::SentinelConfig) -> Result<Self> {
        crate::sentinel::SentinelShared::new(config).map(Self::Sentinel)
    }

    pub(crate) fn is_cluster(&self) -> bool {
        match self {
            Self::Single(_) => false,
            #[cfg(feature = "cluster")]
            Self::Cluster(_) => true,
            #[cfg(feature = "sentinel")]
            Self::Sentinel(_) => false,
        }
    }

    /// A lazily opened connection whose commands time out after `response_timeout`.
    pub(crate) fn connector(
        &self,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> RedisResult<Connector> {
        let kind = match self {
            Self::Single(client) => Kind::Single {
                client: client.clone(),
                config: AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(connect_timeout))
                    .set_response_timeout(Some(response_timeout)),
            },
            #[cfg(feature = "cluster")]
            Self::Cluster(nodes) => Kind::Cluster(
                redis::cluster::ClusterClient::builder(nodes.clone())
                    .connection_timeout(connect_timeout)
                    // Per attempt and overall (redirects and retries included).
                    .response_timeout(response_timeout)
                    .build()?,
            ),
            #[cfg(feature = "sentinel")]
            Self::Sentinel(shared) => Kind::Sentinel {
                shared: std::sync::Arc::clone(shared),
                config: AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(connect_timeout))
                    .set_response_timeout(Some(response_timeout)),
                connect_timeout,
            },
        };
        Ok(Connector {
            kind,
            cached: tokio::sync::Mutex::new(None),
        })
    }
}

/// The stream of `topic`. On a cluster the topic is a hash tag (`outbox:{order.paid}`),
/// so the stream and every key derived from it by a suffix (its dead-letter stream
/// `outbox:{order.paid}:dead`) share one hash slot.
pub(crate) fn stream_name(prefix: &str, topic: &str, cluster: bool) -> String {
    if cluster {
        format!("{prefix}{{{topic}}}")
    } else {
        format!("{prefix}{topic}")
    }
}

/// The stream of partition `partition` of a partitioned `topic`: `<prefix><topic>:<p>`, or
/// `<prefix>{<topic>:<p>}` on a cluster, where each partition is its own hash tag (so the
/// partitions of one topic spread over the cluster's nodes, and a partition's dead-letter
/// stream and lease keys, named by suffix, share its slot). Topics never hold `:`, so the
/// name parses back unambiguously ([`topic_of`]).
pub(crate) fn partition_stream_name(
    prefix: &str,
    topic: &str,
    partition: u32,
    cluster: bool,
) -> String {
    stream_name(prefix, &format!("{topic}:{partition}"), cluster)
}

/// The key of the lease by which one consumer of `group` holds a partition `stream` (the
/// ordered consumers'): `<stream>:lease:<group>`, in the stream's slot on a cluster. Its
/// value is `<epoch>:<consumer name>`, set with a TTL; the epoch, one more at each
/// acquisition, is counted at `<lease key>:epoch`.
pub(crate) fn lease_key(stream: &str, group: &str) -> String {
    format!("{stream}:lease:{group}")
}

/// The sorted set of the live ordered consumers of `group` (member: consumer name,
/// score: when its membership expires, in Redis's clock's milliseconds):
/// `<prefix>members:<group>`. Ordered consumers share their streams' leases by its size.
pub(crate) fn members_key(prefix: &str, group: &str) -> String {
    format!("{prefix}members:{group}")
}

/// The hash of the keys an ordered consumer of `group` keeps blocked on `stream` after
/// a dead letter (field: the key, value: the dead-lettered entry's id):
/// `<stream>:blocked:<group>`, in the stream's slot on a cluster.
pub(crate) fn blocked_key(stream: &str, group: &str) -> String {
    format!("{stream}:blocked:{group}")
}

/// The hash in which publishers record the partition count of each partitioned topic
/// (field: topic, value: count), so that consumers can check theirs: `<prefix>partitions`.
pub(crate) fn partitions_key(prefix: &str) -> String {
    format!("{prefix}partitions")
}

/// The topic of a stream named by [`stream_name`] or [`partition_stream_name`] (without
/// the partition).
pub(crate) fn topic_of<'a>(stream: &'a str, prefix: &str, cluster: bool) -> &'a str {
    let rest = stream.strip_prefix(prefix).unwrap_or(stream);
    let rest = if cluster {
        rest.strip_prefix('{')
            .and_then(|r| r.strip_suffix('}'))
            .unwrap_or(rest)
    } else {
        rest
    };
    match rest.rsplit_once(':') {
        Some((topic, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => topic,
        _ => rest,
    }
}

/// On a cluster the prefix must not hold a brace: Redis hashes the first `{...}` of a
/// key, which must be the topic's.
pub(crate) fn check_prefix(prefix: &str, cluster: bool) -> Result<()> {
    if cluster && prefix.contains(['{', '}']) {
        return Err(InvalidConfig::new(
            "stream_prefix",
            format!(
                "must not contain `{{` or `}}` on a Redis Cluster (the topic is the hash \
                 tag); got {prefix:?}"
            ),
        )
        .into());
    }
    Ok(())
}

/// Splits `items` into groups that one pipeline (or `MULTI`, or multi-key command) may
/// carry: a single group on one server, one group per hash slot on a cluster. Items keep
/// their order within a group, and groups are in order of first appearance.
pub(crate) fn by_slot<T>(
    cluster: bool,
    items: impl IntoIterator<Item = T>,
    key: impl Fn(&T) -> &str,
) -> Vec<Vec<T>> {
    if !cluster {
        let all: Vec<T> = items.into_iter().collect();
        return if all.is_empty() {
            Vec::new()
        } else {
            vec![all]
        };
    }
    #[cfg(feature = "cluster")]
    {
        use redis::cluster_routing::Slot;
        let mut slots: Vec<Slot> = Vec::new();
        let mut groups: Vec<Vec<T>> = Vec::new();
        for item in items {
            let slot = Slot::for_key(key(&item));
            match slots.iter().position(|s| *s == slot) {
                Some(i) => groups[i].push(item),
                None => {
                    slots.push(slot);
                    groups.push(vec![item]);
                }
            }
        }
        groups
    }
    #[cfg(not(feature = "cluster"))]
    {
        let _ = key;
        unreachable!("cluster targets need the `cluster` feature")
    }
}

/// A connection to one server or to a cluster.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(MultiplexedConnection),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            #[cfg(feature = "cluster")]
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "cluster")]
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            #[cfg(feature = "cluster")]
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// Sends `pipes` (on a cluster, each within one slot; see [`by_slot`]) and returns their
/// results in order. One pipeline is sent as is; several are sent concurrently.
pub(crate) async fn query_all<T>(conn: &mut Conn, mut pipes: Vec<Pipeline>) -> Vec<RedisResult<T>>
where
    T: FromRedisValue + Send + 'static,
{
    if pipes.len() <= 1 {
        return match pipes.pop() {
            Some(pipe) => vec![pipe.query_async(conn).await],
            None => Vec::new(),
        };
    }
    let n = pipes.len();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, pipe) in pipes.into_iter().enumerate() {
        let mut conn = conn.clone();
        tasks.spawn(async move { (i, pipe.query_async::<T>(&mut conn).await) });
    }
    let mut results: Vec<Option<RedisResult<T>>> = (0..n).map(|_| None).collect();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((i, result)) => results[i] = Some(result),
            Err(e) => match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(e) => unreachable!("pipeline task cancelled: {e}"),
            },
        }
    }
    results
        .into_iter()
        .map(|r| r.expect("every pipeline task reports"))
        .collect()
}

enum Kind {
    Single {
        client: Client,
        config: AsyncConnectionConfig,
    },
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster::ClusterClient),
    #[cfg(feature = "sentinel")]
    Sentinel {
        shared: std::sync::Arc<crate::sentinel::SentinelShared>,
        config: AsyncConnectionConfig,
        connect_timeout: Duration,
    },
}

/// A lazily opened connection (multiplexed, or a cluster connection) that is replaced
/// after a connection-level error. Opening it never blocks construction, so a publisher
/// or consumer can be built while Redis is down; the first command reports the outage
/// instead.
///
/// Through Sentinel, opening it asks the sentinels for the primary; the connection is
/// also replaced after a `READONLY` reply (see [`breaks_connection`]) and, when a
/// sentinel announces a failover, at its next use (the failover epoch it was opened in
/// is kept beside it).
pub(crate) struct Connector {
    kind: Kind,
    cached: tokio::sync::Mutex<Option<(Conn, u64)>>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = f.debug_struct("Connector");
        match &self.kind {
            Kind::Single { client, .. } => s.field("server", client.get_connection_info().addr()),
            #[cfg(feature = "cluster")]
            Kind::Cluster(_) => s.field("server", &"cluster"),
            #[cfg(feature = "sentinel")]
            Kind::Sentinel { shared, .. } => s.field("sentinel master", &shared.master_name()),
        };
        s.finish_non_exhaustive()
    }
}

impl Connector {
    /// The connection, opened if there is none.
    pub(crate) async fn get(&self) -> RedisResult<Conn> {
        let mut cached = self.cached.lock().await;
        if let Some((conn, epoch)) = &*cached
            && *epoch == self.epoch()
        {
            return Ok(conn.clone());
        }
        *cached = None;
        let (conn, epoch) = match &self.kind {
            Kind::Single { client, config } => (
                Conn::Single(
                    client
                        .get_multiplexed_async_connection_with_config(config)
                        .await?,
                ),
                0,
            ),
            #[cfg(feature = "cluster")]
            Kind::Cluster(client) => (Conn::Cluster(client.get_async_connection().await?), 0),
            #[cfg(feature = "sentinel")]
            Kind::Sentinel {
                shared,
                config,
                connect_timeout,
            } => shared.connect(config, *connect_timeout).await?,
        };
        *cached = Some((conn.clone(), epoch));
        Ok(conn)
    }

    /// The failover epoch of the deployment: always 0 but through Sentinel.
    fn epoch(&self) -> u64 {
        match &self.kind {
            #[cfg(feature = "sentinel")]
            Kind::Sentinel { shared, .. } => shared.epoch(),
            _ => 0,
        }
    }

    /// Forgets the connection if `e` means it is broken (or, on a cluster, that its slot
    /// map is stale), so the next [`get`](Self::get) opens a new one.
    pub(crate) async fn check(&self, e: &RedisError) {
        if breaks_connection(e) {
            self.forget().await;
        }
    }

    /// Forgets the connection, so the next [`get`](Self::get) opens a new one.
    pub(crate) async fn forget(&self) {
        *self.cached.lock().await = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_server_streams_are_plain_and_in_one_group() {
        assert_eq!(
            stream_name("outbox:", "order.paid", false),
            "outbox:order.paid"
        );
        assert_eq!(
            topic_of("outbox:order.paid", "outbox:", false),
            "order.paid"
        );
        let groups = by_slot(false, ["outbox:a", "outbox:b"], |s| s);
        assert_eq!(groups, vec![vec!["outbox:a", "outbox:b"]]);
        assert!(by_slot(false, Vec::<&str>::new(), |s| s).is_empty());
        assert!(check_prefix("app{x}:", false).is_ok());
    }

    #[test]
    fn partition_streams_name_their_partition_and_parse_back() {
        for cluster in [false, true] {
            let stream = partition_stream_name("outbox:", "order.paid", 7, cluster);
            let expected = if cluster {
                "outbox:{order.paid:7}"
            } else {
                "outbox:order.paid:7"
            };
            assert_eq!(stream, expected);
            assert_eq!(topic_of(&stream, "outbox:", cluster), "order.paid");
        }
        // A prefix that ends in digits after a colon is not mistaken for a partition.
        assert_eq!(topic_of("app:1:order.paid", "app:1:", false), "order.paid");
        assert_eq!(
            topic_of("outbox:order.paid:", "outbox:", false),
            "order.paid:"
        );
    }

    #[cfg(feature = "cluster")]
    #[test]
    fn cluster_streams_are_hash_tagged_and_grouped_per_slot() {
        use redis::cluster_routing::Slot;
        let stream = stream_name("outbox:", "order.paid", true);
        assert_eq!(stream, "outbox:{order.paid}");
        assert_eq!(topic_of(&stream, "outbox:", true), "order.paid");
        // The dead-letter stream shares the slot.
        assert_eq!(
            Slot::for_key(&stream),
            Slot::for_key(format!("{stream}:dead"))
        );
        let a = stream_name("outbox:", "a", true);
        let b = stream_name("outbox:", "b", true);
        assert_ne!(Slot::for_key(&a), Slot::for_key(&b));
        let groups = by_slot(true, [&a, &b, &a], |s| s.as_str());
        assert_eq!(groups, vec![vec![&a, &a], vec![&b]]);
        assert!(check_prefix("app{x}:", true).is_err());
        assert!(check_prefix("outbox:", true).is_ok());
    }
}
