//! Cleaning up after a test on the shared Redis, and an async connection for a test's
//! own reads of it.

use std::time::Duration;

use crate::redis_url;

/// Deletes every key of the shared Redis ([`redis_url`]) whose name starts with `prefix`:
/// the streams, dead letters, leases and records a test made under its unique prefix
/// ([`unique_prefix`](crate::unique_prefix)). Blocking, and brief: fine at the end of an
/// async test too.
pub fn delete_redis_keys(prefix: &str) {
    let mut conn = redis::Client::open(redis_url())
        .and_then(|client| client.get_connection())
        .unwrap_or_else(|e| panic!("Redis at {} for the clean-up: {e}", redis_url()));
    // KEYS, not SCAN: the prefix is a test's own, and the test Redis is small.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query(&mut conn)
        .expect("KEYS");
    if !keys.is_empty() {
        let _: usize = redis::cmd("DEL").arg(keys).query(&mut conn).expect("DEL");
    }
}

/// Deletes `keys` on the Redis at `url`, best effort: for a test's `Drop`, which must
/// not panic (the server may be a scratch one already gone).
pub fn delete_keys_quietly(url: &str, keys: &[String]) {
    let Ok(mut conn) = redis::Client::open(url).and_then(|client| client.get_connection()) else {
        return;
    };
    for key in keys {
        let _: Result<(), _> = redis::cmd("DEL").arg(key).query(&mut conn);
    }
}

/// An async connection to the Redis at `url` with generous timeouts (10 s to connect
/// and per response): many tests share the machine. Panics, naming the URL, when Redis
/// is unreachable.
pub async fn redis_conn(url: &str) -> redis::aio::MultiplexedConnection {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(10)))
        .set_response_timeout(Some(Duration::from_secs(10)));
    redis::Client::open(url)
        .unwrap_or_else(|e| panic!("a bad Redis URL {url}: {e}"))
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap_or_else(|e| panic!("Redis unreachable at {url}: {e}"))
}
