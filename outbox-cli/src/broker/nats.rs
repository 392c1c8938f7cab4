//! [`NatsServers`]: a NATS JetStream broker (`nats://HOST:PORT[,HOST:PORT…]`), one server
//! or a cluster reached through any of these seeds.

use std::time::Duration;

use outbox_nats::async_nats::{self, ConnectOptions, ServerAddr};

/// The servers a `nats://` URL lists, with its credentials.
#[derive(Debug, Clone)]
pub(crate) struct NatsServers {
    servers: Vec<ServerAddr>,
}

impl NatsServers {
    pub(super) fn new(servers: Vec<ServerAddr>) -> Self {
        Self { servers }
    }

    /// The servers, as parsed.
    #[cfg(test)]
    pub(super) fn addrs(&self) -> &[ServerAddr] {
        &self.servers
    }

    /// A client for a long-running process (the relay): it returns at once and keeps
    /// (re)connecting for ever, so a server down at start is an outage of the first
    /// publishes, which the relay backs off from, not an error that ends it.
    pub(crate) async fn client(&self) -> Result<async_nats::Client, async_nats::ConnectError> {
        ConnectOptions::new()
            .retry_on_initial_connect()
            .connect(self.servers.clone())
            .await
    }

    /// A client for a one-shot command or a probe: connected within `timeout`, or an
    /// error.
    pub(crate) async fn connect(&self, timeout: Duration) -> Result<async_nats::Client, String> {
        let connect = ConnectOptions::new()
            .connection_timeout(timeout)
            .max_reconnects(Some(1))
            .connect(self.servers.clone());
        match tokio::time::timeout(timeout, connect).await {
            Ok(Ok(client)) => Ok(client),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no connection within {timeout:?} (timed out)")),
        }
    }
}
