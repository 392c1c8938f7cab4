//! [`SentinelConfig`]: a primary found through Redis Sentinel, and the shared state
//! that makes every connection to it follow a failover.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use outbox_core::InvalidConfig;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{AsyncConnectionConfig, ConnectionInfo, IntoConnectionInfo, RedisResult};

use crate::Result;
use crate::conn::Conn;

/// The sentinel channel on which a failover is announced:
/// `<master name> <old ip> <old port> <new ip> <new port>`.
const SWITCH_MASTER: &str = "+switch-master";

/// Where to find the primary of a Redis deployment monitored by Redis Sentinel: the
/// sentinels' addresses and the name they monitor it under (`sentinel monitor <name>
/// ...`). Give it to [`RedisPublisher::sentinel`](crate::RedisPublisher::sentinel) or
/// [`Consumer::builder_sentinel`](crate::Consumer::builder_sentinel) (feature
/// `sentinel`).
///
/// The publisher and the consumer ask the sentinels for the primary when they first
/// connect, and again, on a fresh connection, whenever the one they hold fails (a
/// lost connection, a timeout), replies `READONLY` (the server they reach was demoted
/// to a replica), or when a sentinel announces a failover on `+switch-master` (with
/// [`watch_failovers`](Self::watch_failovers), on by default). Between a primary's
/// death and the promotion of a replica (Sentinel's `down-after-milliseconds` plus the
/// failover itself) every command fails as an outage: the relay backs off without
/// spending retries and the consumer waits, as for any Redis outage. A master name the
/// sentinels do not know is such an outage too, retried (it looks like a failover in
/// progress); addresses that are not sentinels are a
/// [configuration error](crate::Error::is_config).
///
/// Streams are named as on a single server (`outbox:order.paid`), since the data
/// lives on one primary at a time; a publisher built with
/// [`RedisPublisher::new`](crate::RedisPublisher::new) on the same primary writes the
/// same streams.
///
/// ```
/// use outbox_redis::redis::RedisConnectionInfo;
/// use outbox_redis::redis::sentinel::SentinelNodeConnectionInfo;
/// use outbox_redis::{RedisPublisher, SentinelConfig};
///
/// let sentinels = [
///     "redis://10.0.0.1:26379",
///     "redis://10.0.0.2:26379",
///     "redis://10.0.0.3:26379",
/// ];
/// // The primary (and its replicas) require a password; the sentinels do not.
/// let primary = SentinelNodeConnectionInfo::default()
///     .set_redis_connection_info(RedisConnectionInfo::default().set_password("s3cret"));
/// let config = SentinelConfig::new(sentinels, "mymaster")?.with_master_connection(primary);
/// let publisher = RedisPublisher::sentinel(config)?;
/// assert_eq!(publisher.stream_for("order.paid"), "outbox:order.paid");
/// # Ok::<_, outbox_redis::Error>(())
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SentinelConfig {
    /// The sentinels, as URLs such as `redis://10.0.0.1:26379` (a sentinel's own
    /// password, if it has one, goes in its URL). At least one; list them all, so that
    /// the primary can be found while some are down.
    pub sentinels: Vec<ConnectionInfo>,
    /// The name under which the sentinels monitor the primary (`mymaster` in Redis's
    /// sample configuration); one they do not know is an outage ([`SentinelConfig`]).
    pub master_name: String,
    /// How to connect to the primary once a sentinel named it: its username and
    /// password, database and TLS (default: no credentials, database 0, plain TCP).
    pub master: SentinelNodeConnectionInfo,
    /// Reconnect as soon as a sentinel announces a failover on `+switch-master`
    /// (default `true`); without it a connection moves at its first error or `READONLY`
    /// reply, and a blocking read on a demoted primary that still answers waits in vain.
    pub watch_failovers: bool,
}

impl SentinelConfig {
    /// The primary monitored as `master_name` by `sentinels` (URLs such as
    /// `redis://10.0.0.1:26379`). Only the syntax is checked here: at least one
    /// sentinel, each a valid address, and a master name that is not empty and has no
    /// whitespace; nothing connects yet.
    pub fn new<T: IntoConnectionInfo>(
        sentinels: impl IntoIterator<Item = T>,
        master_name: impl Into<String>,
    ) -> Result<Self> {
        let sentinels = sentinels
            .into_iter()
            .map(IntoConnectionInfo::into_connection_info)
            .collect::<RedisResult<Vec<_>>>()?;
        let config = Self {
            sentinels,
            master_name: master_name.into(),
            master: SentinelNodeConnectionInfo::default(),
            watch_failovers: true,
        };
        config.validate()?;
        Ok(config)
    }

    /// Sets [`master`](Self::master): credentials, database or TLS of the primary.
    #[must_use]
    pub fn with_master_connection(mut self, master: SentinelNodeConnectionInfo) -> Self {
        self.master = master;
        self
    }

    /// Sets [`watch_failovers`](Self::watch_failovers).
    #[must_use]
    pub fn with_watch_failovers(mut self, watch: bool) -> Self {
        self.watch_failovers = watch;
        self
    }

    /// Checks the rules of [`new`](Self::new) (the fields are public, so they can be
    /// changed after it): an empty sentinel list or a bad master name is
    /// [`Error::Config`](crate::Error::Config).
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        if self.sentinels.is_empty() {
            return Err(InvalidConfig::new(
                "sentinels",
                "must name at least one sentinel",
            ));
        }
        if self.master_name.is_empty() || self.master_name.contains(char::is_whitespace) {
            return Err(InvalidConfig::new(
                "master_name",
                format!(
                    "must be the name the sentinels monitor, not empty and without \
                     whitespace; got {:?}",
                    self.master_name
                ),
            ));
        }
        Ok(())
    }
}

/// What every connection of one publisher or consumer to a Sentinel-monitored primary
/// shares: the sentinel client that looks the primary up, and the failover epoch.
pub(crate) struct SentinelShared {
    config: SentinelConfig,
    /// Asks the sentinels for the primary (it caches its connections to them).
    client: tokio::sync::Mutex<SentinelClient>,
    /// One more at each failover announced on `+switch-master`: a connection opened in
    /// an older epoch is replaced at its next use.
    epoch: AtomicU64,
    /// The `+switch-master` subscriber, started at the first connection (it needs the
    /// runtime) and stopped when the last connector is dropped.
    watcher: Mutex<Option<tokio::task::AbortHandle>>,
}

impl std::fmt::Debug for SentinelShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sentinel")
            .field("master_name", &self.config.master_name)
            .field(
                "sentinels",
                &self
                    .config
                    .sentinels
                    .iter()
                    .map(|s| s.addr())
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Drop for SentinelShared {
    fn drop(&mut self) {
        if let Some(watcher) = self
            .watcher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            watcher.abort();
        }
    }
}

impl SentinelShared {
    pub(crate) fn new(config: SentinelConfig) -> Result<Arc<Self>> {
        config.validate()?;
        let client = SentinelClient::build(
            config.sentinels.clone(),
            config.master_name.clone(),
            Some(config.master.clone()),
            SentinelServerType::Master,
        )?;
        Ok(Arc::new(Self {
            config,
            client: tokio::sync::Mutex::new(client),
            epoch: AtomicU64::new(0),
            watcher: Mutex::new(None),
        }))
    }

    pub(crate) fn master_name(&self) -> &str {
        &self.config.master_name
    }

    /// The failover epoch: a connection opened in an older one is stale.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Asks the sentinels for the primary (checking that it calls itself one) and
    /// connects to it, all within `connect_timeout` (a sentinel or a primary that
    /// accepts connections but does not answer must not hold the caller longer);
    /// returns the connection and the epoch it belongs to.
    pub(crate) async fn connect(
        self: &Arc<Self>,
        config: &AsyncConnectionConfig,
        connect_timeout: Duration,
    ) -> RedisResult<(Conn, u64)> {
        self.start_watcher();
        let epoch = self.epoch();
        let lookup = async {
            let mut client = self.client.lock().await;
            client.get_async_connection_with_config(config).await
        };
        match tokio::time::timeout(connect_timeout, lookup).await {
            Ok(conn) => Ok((Conn::Single(conn?), epoch)),
            Err(_) => Err(redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "no connection to the primary `{}` through the sentinels within {connect_timeout:?}",
                    self.config.master_name
                ),
            ))),
        }
    }

    /// Starts the `+switch-master` subscriber once, if asked for.
    fn start_watcher(self: &Arc<Self>) {
        if !self.config.watch_failovers {
            return;
        }
        // Connections are opened on a Tokio runtime; without one there is nothing to
        // spawn on, and errors and `READONLY` replies still move the connections.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut watcher = self.watcher.lock().unwrap_or_else(|e| e.into_inner());
        if watcher.is_none() {
            let task = runtime.spawn(watch(
                Arc::downgrade(self),
                self.config.sentinels.clone(),
                self.config.master_name.clone(),
            ));
            *watcher = Some(task.abort_handle());
        }
    }
}

/// Subscribes to `+switch-master` on one sentinel after another (the next one when a
/// subscription fails or ends) and moves the epoch on at each failover of
/// `master_name`. Ends when the shared state is gone (it is also aborted then).
async fn watch(shared: Weak<SentinelShared>, sentinels: Vec<ConnectionInfo>, master_name: String) {
    const PAUSE: Duration = Duration::from_secs(1);
    for sentinel in sentinels.iter().cycle() {
        if shared.strong_count() == 0 {
            return;
        }
        match subscribe(sentinel).await {
            Ok(mut pubsub) => {
                let mut messages = pubsub.on_message();
                while let Some(message) = messages.next().await {
                    let Ok(payload) = message.get_payload::<String>() else {
                        continue;
                    };
                    if payload.split_whitespace().next() != Some(master_name.as_str()) {
                        continue;
                    }
                    let Some(shared) = shared.upgrade() else {
                        return;
                    };
                    shared.epoch.fetch_add(1, Ordering::AcqRel);
                    tracing::info!(master = %master_name, switch = %payload, "sentinel announced a failover; reconnecting to the new primary");
                }
                tracing::debug!(sentinel = ?sentinel.addr(), "sentinel subscription ended; trying the next sentinel");
            }
            Err(e) => {
                tracing::debug!(sentinel = ?sentinel.addr(), error = %e, "cannot subscribe to a sentinel's +switch-master");
            }
        }
        tokio::time::sleep(PAUSE).await;
    }
}

async fn subscribe(sentinel: &ConnectionInfo) -> RedisResult<redis::aio::PubSub> {
    const TIMEOUT: Duration = Duration::from_secs(5);
    let subscribed = async {
        let mut pubsub = redis::Client::open(sentinel.clone())?
            .get_async_pubsub()
            .await?;
        pubsub.subscribe(SWITCH_MASTER).await?;
        Ok(pubsub)
    };
    match tokio::time::timeout(TIMEOUT, subscribed).await {
        Ok(result) => result,
        Err(_) => Err(redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "subscribing to a sentinel timed out",
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_checks_its_syntax_without_connecting() {
        let config = SentinelConfig::new(["redis://127.0.0.1:1"], "mymaster").unwrap();
        assert_eq!(config.master_name, "mymaster");
        assert!(config.watch_failovers);
        let none: [&str; 0] = [];
        let e = SentinelConfig::new(none, "mymaster").unwrap_err();
        assert!(e.is_config(), "{e}");
        for bad in ["", "my master"] {
            let e = SentinelConfig::new(["redis://127.0.0.1:1"], bad).unwrap_err();
            assert!(e.is_config(), "{bad:?}: {e}");
        }
        let e = SentinelConfig::new(["not a url"], "mymaster").unwrap_err();
        assert!(e.is_config(), "{e}");
    }

    #[test]
    fn debug_output_hides_the_passwords() {
        let master = SentinelNodeConnectionInfo::default().set_redis_connection_info(
            redis::RedisConnectionInfo::default().set_password("master-secret"),
        );
        let config = SentinelConfig::new(["redis://:sentinel-secret@127.0.0.1:1"], "mymaster")
            .unwrap()
            .with_master_connection(master);
        let publisher = crate::RedisPublisher::sentinel(config.clone()).unwrap();
        for shown in [format!("{config:?}"), format!("{publisher:?}")] {
            assert!(!shown.contains("secret"), "{shown}");
        }
    }
}
