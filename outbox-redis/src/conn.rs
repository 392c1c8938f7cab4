use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, RedisError, RedisResult};

use crate::error::breaks_connection;

/// A lazily opened multiplexed connection that is replaced after a connection-level
/// error. Opening it never blocks construction, so a publisher or consumer can be built
/// while Redis is down; the first command reports the outage instead.
pub(crate) struct Connector {
    client: Client,
    config: AsyncConnectionConfig,
    cached: tokio::sync::Mutex<Option<MultiplexedConnection>>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("server", &self.client.get_connection_info().addr())
            .finish_non_exhaustive()
    }
}

impl Connector {
    /// `response_timeout` bounds every command on this connection; a blocking read needs
    /// one longer than its BLOCK time.
    pub(crate) fn new(
        client: Client,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Self {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(Some(response_timeout));
        Self {
            client,
            config,
            cached: tokio::sync::Mutex::new(None),
        }
    }

    /// The connection, opened if there is none.
    pub(crate) async fn get(&self) -> RedisResult<MultiplexedConnection> {
        let mut cached = self.cached.lock().await;
        if let Some(conn) = &*cached {
            return Ok(conn.clone());
        }
        let conn = self
            .client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        *cached = Some(conn.clone());
        Ok(conn)
    }

    /// Forgets the connection if `e` means it is broken, so the next [`get`](Self::get)
    /// opens a new one.
    pub(crate) async fn check(&self, e: &RedisError) {
        if breaks_connection(e) {
            *self.cached.lock().await = None;
        }
    }
}
