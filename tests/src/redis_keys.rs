//! Cleaning up after a test on the shared Redis.

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
