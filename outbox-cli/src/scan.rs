//! The Redis side every command that looks at streams shares: a connection with bounded
//! timeouts, and the streams under a prefix.

use std::collections::BTreeSet;
use std::time::Duration;

use outbox_redis::Client;
use outbox_redis::redis::aio::MultiplexedConnection;
use outbox_redis::redis::{self, AsyncConnectionConfig};

use crate::backend::redact;
use crate::error::CliError;

/// How long connecting to Redis may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one command may take.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);
/// Keys SCAN looks at per call.
const SCAN_COUNT: usize = 1000;

/// A connection to the Redis at `url`; errors name the URL with its password hidden.
pub(crate) async fn connect(url: &str) -> Result<MultiplexedConnection, CliError> {
    let client = Client::open(url).map_err(|e| CliError::RedisUrl {
        url: redact(url),
        source: e.into(),
    })?;
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(RESPONSE_TIMEOUT));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .map_err(|e| CliError::RedisConnect {
            url: redact(url),
            source: e.into(),
        })
}

/// The streams whose names start with `prefix`, sorted (`SCAN ... TYPE stream`, Redis
/// 6+). Keys of other types under the prefix (the partition counts' hash, lease and
/// epoch keys, blocked-key hashes) are never returned.
pub(crate) async fn streams(
    conn: &mut MultiplexedConnection,
    prefix: &str,
) -> redis::RedisResult<BTreeSet<String>> {
    let pattern = format!("{}*", glob_escape(prefix));
    // SCAN may return a key more than once: the set keeps each once.
    let mut found = BTreeSet::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT)
            .arg("TYPE")
            .arg("stream")
            .query_async(conn)
            .await?;
        found.extend(keys);
        if next == 0 {
            return Ok(found);
        }
        cursor = next;
    }
}

/// `text` with the glob characters of `SCAN MATCH` escaped, to match it literally.
fn glob_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::glob_escape;

    #[test]
    fn prefixes_match_literally() {
        assert_eq!(glob_escape("outbox:"), "outbox:");
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
