//! [`BrokerConn`]: the connection the stream commands, the operator's page and the admin
//! probe use, to one server (also the primary Sentinel names) or to a cluster.

use outbox_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use outbox_redis::redis::cluster::ClusterClient;
use outbox_redis::redis::cluster_async::ClusterConnection;
use outbox_redis::redis::sentinel::{SentinelClient, SentinelServerType};
use outbox_redis::redis::{
    self, AsyncConnectionConfig, Client, Cmd, Pipeline, RedisError, RedisFuture, Value,
};

use super::{Timeouts, Topology};

/// A connection to one server (or the primary Sentinel named when it was opened), or to
/// a cluster, which routes each command by its key.
#[derive(Clone)]
pub(crate) enum BrokerConn {
    /// One server.
    Single(MultiplexedConnection),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl BrokerConn {
    /// Opens a connection to `topology` within `timeouts.connect` (the lookup through
    /// the sentinels included); its commands time out after `timeouts.response`.
    pub(super) async fn open(topology: &Topology, timeouts: Timeouts) -> Result<Self, RedisError> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeouts.connect))
            .set_response_timeout(Some(timeouts.response));
        let open = async {
            match topology {
                Topology::Single(info) => Client::open(info.clone())?
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .map(Self::Single),
                Topology::Cluster(nodes) => ClusterClient::builder(nodes.clone())
                    .connection_timeout(timeouts.connect)
                    .response_timeout(timeouts.response)
                    .build()?
                    .get_async_connection()
                    .await
                    .map(Self::Cluster),
                Topology::Sentinel(sentinel) => {
                    let mut client = SentinelClient::build(
                        sentinel.sentinels.clone(),
                        sentinel.master_name.clone(),
                        Some(sentinel.master.clone()),
                        SentinelServerType::Master,
                    )?;
                    client
                        .get_async_connection_with_config(&config)
                        .await
                        .map(Self::Single)
                }
            }
        };
        // A server (or sentinel) that accepts the connection and never answers must not
        // hold the command longer.
        tokio::time::timeout(timeouts.connect, open)
            .await
            .unwrap_or_else(|_| {
                Err(RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no connection within {:?} (timed out)", timeouts.connect),
                )))
            })
    }

    /// The primaries of a cluster (`CLUSTER SLOTS`), as `(host, port)`: where each key
    /// lives. `None` on one server.
    pub(crate) async fn primaries(&mut self) -> Result<Option<Vec<(String, u16)>>, RedisError> {
        let Self::Cluster(conn) = self else {
            return Ok(None);
        };
        // Each range: [start, end, [host, port, id, ...], replicas...]; newer servers
        // add fields, which are ignored.
        let ranges: Vec<Vec<Value>> = redis::cmd("CLUSTER").arg("SLOTS").query_async(conn).await?;
        let mut primaries: Vec<(String, u16)> = Vec::new();
        for range in ranges {
            let Some(Value::Array(node)) = range.get(2) else {
                continue;
            };
            let (Some(host), Some(port)) = (node.first(), node.get(1)) else {
                continue;
            };
            let node = (
                redis::from_redis_value_ref::<String>(host)?,
                redis::from_redis_value_ref::<u16>(port)?,
            );
            if !primaries.contains(&node) {
                primaries.push(node);
            }
        }
        Ok(Some(primaries))
    }

    /// `cmd` on the node at `node` of a cluster (`None`: routed by the connection, as
    /// on one server).
    pub(crate) async fn query_on<T: redis::FromRedisValue>(
        &mut self,
        cmd: &Cmd,
        node: Option<&(String, u16)>,
    ) -> Result<T, RedisError> {
        match (self, node) {
            (Self::Cluster(conn), Some((host, port))) => {
                use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                });
                Ok(redis::from_redis_value(
                    conn.route_command(cmd.clone(), routing).await?,
                )?)
            }
            (conn, _) => cmd.query_async(conn).await,
        }
    }
}

impl ConnectionLike for BrokerConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
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
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}
