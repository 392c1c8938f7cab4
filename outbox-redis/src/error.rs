use redis::RedisError;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `outbox-redis`.
///
/// Its `Display` says only what failed at this layer; the cause, if any, is its
/// [`source`](std::error::Error::source). Show both with [`outbox_core::error_chain`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Redis failed: connection refused or dropped, a timeout, or an error reply.
    #[error("redis")]
    Redis(#[from] RedisError),
    /// An `outbox-core` error: a duplicate handler registration, the idempotency store
    /// failing, and the like.
    #[error(transparent)]
    Core(#[from] outbox_core::Error),
    /// A configuration value breaks its rule: the field and the rule (see
    /// [`InvalidConfig`](outbox_core::InvalidConfig)).
    #[error(transparent)]
    Config(#[from] outbox_core::InvalidConfig),
    /// A consumer was built without any handler: it would read nothing.
    #[error("no handler registered: register at least one with `handle` or `handle_async`")]
    NoHandler,
    /// A stream entry lacks a field the envelope needs, or a field does not parse.
    #[error("malformed stream entry: {0}")]
    MalformedEntry(String),
}

impl Error {
    /// Whether Redis (or the idempotency store) was unreachable or timed out, rather
    /// than refusing something: retry later, as a whole.
    pub fn is_outage(&self) -> bool {
        match self {
            Self::Redis(e) => is_outage(e),
            Self::Core(e) => e.is_outage(),
            _ => false,
        }
    }

    /// Whether this is a configuration mistake (fix the code or settings, do not retry):
    /// a setting out of range, a consumer without handlers, a Redis address the client
    /// refuses.
    pub fn is_config(&self) -> bool {
        matches!(self, Self::Config(_) | Self::NoHandler)
            || matches!(self, Self::Redis(e) if e.kind() == redis::ErrorKind::InvalidClientConfig)
    }

    /// Whether this is a malformed stream entry.
    pub fn is_malformed_entry(&self) -> bool {
        matches!(self, Self::MalformedEntry(_))
    }
}

/// Server error codes that mean "this server cannot take writes right now", whatever
/// the command: they are outages, never a message's own failure.
const OUTAGE_CODES: &[&str] = &[
    "OOM",
    "LOADING",
    "READONLY",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "TRYAGAIN",
    "MISCONF",
    "BUSY",
    "NOREPLICAS",
    // A cluster slot that moved (or is moving) to another node: the cluster connection
    // follows it for single commands, but a pipeline that ignores errors reports it per
    // command. Retrying later, on a fresh slot map, succeeds.
    "MOVED",
    "ASK",
    // Credentials or permissions: every write fails until an operator fixes them (a
    // rotated password, an ACL change). Spending retries on them would dead-letter the
    // whole backlog during the fix.
    "NOAUTH",
    "NOPERM",
    "WRONGPASS",
];

/// A `-ERR Protocol error: …` reply: the server closes the connection after it. Redis
/// sends one to a client that has not authenticated yet and sends a long command (a
/// pipelined `XADD`: `unauthenticated multibulk length`), so without this a missing
/// password would look like a fault of each message and spend their retries.
fn is_protocol_error(e: &RedisError) -> bool {
    e.code() == Some("ERR") && e.detail().is_some_and(|d| d.starts_with("Protocol error"))
}

/// Whether `e` is a failure of the connection or of the server as a whole.
pub(crate) fn is_outage(e: &RedisError) -> bool {
    is_protocol_error(e)
        || e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
        || e.kind() == redis::ErrorKind::ClusterConnectionNotFound
        || e.kind() == redis::ErrorKind::AuthenticationFailed
        // Sentinel knows no healthy primary right now (a failover is under way).
        || e.kind() == redis::ErrorKind::MasterNameNotFoundBySentinel
        || e.code().is_some_and(|c| OUTAGE_CODES.contains(&c))
}

/// Whether the connection that produced `e` should be replaced (a cluster connection
/// also when its slot map proved stale). A `READONLY` reply means the server was
/// demoted to a replica: through Sentinel (or a DNS name that moves with the primary,
/// as managed services do) a new connection reaches the new primary; to a fixed
/// address it costs one reconnect.
pub(crate) fn breaks_connection(e: &RedisError) -> bool {
    is_protocol_error(e)
        || e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
        || e.kind() == redis::ErrorKind::ClusterConnectionNotFound
        || e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("MOVED" | "ASK" | "READONLY"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(bytes: &[u8]) -> RedisError {
        redis::parse_redis_value(bytes)
            .and_then(redis::Value::extract_error)
            .expect_err("an error reply")
    }

    #[test]
    fn a_demoted_primary_is_an_outage_and_a_reason_to_reconnect() {
        let readonly = reply(b"-READONLY You can't write against a read only replica.\r\n");
        assert_eq!(readonly.code(), Some("READONLY"));
        assert!(is_outage(&readonly));
        assert!(
            breaks_connection(&readonly),
            "a new connection finds the new primary"
        );
        let wrongtype =
            reply(b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n");
        assert!(!is_outage(&wrongtype));
        assert!(!breaks_connection(&wrongtype));
    }

    #[test]
    fn sentinel_knowing_no_primary_is_an_outage() {
        let e = RedisError::from((
            redis::ErrorKind::MasterNameNotFoundBySentinel,
            "Master with given name not found in sentinel",
        ));
        assert!(is_outage(&e));
        assert!(Error::from(e).is_outage());
    }
}
