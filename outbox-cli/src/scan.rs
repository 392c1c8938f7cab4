//! The Redis side every command that looks at streams shares: a connection with bounded
//! timeouts to the broker, and the streams under a prefix (on every primary of a
//! cluster).

use std::collections::BTreeSet;
use std::time::Duration;

use outbox_redis::redis;

use crate::broker::{Broker, BrokerConn, Timeouts};
use crate::error::CliError;

/// How long connecting to Redis may take, and one command.
const TIMEOUTS: Timeouts = Timeouts {
    connect: Duration::from_secs(5),
    response: Duration::from_secs(30),
};
/// Keys SCAN looks at per call.
const SCAN_COUNT: usize = 1000;

/// A connection to `broker`; errors name its URL with the passwords hidden.
pub(crate) async fn connect(broker: &Broker) -> Result<BrokerConn, CliError> {
    broker
        .connect(TIMEOUTS)
        .await
        .map_err(|e| CliError::RedisConnect {
            url: broker.display().to_owned(),
            source: e.into(),
        })
}

/// The streams whose names start with `prefix`, sorted (`SCAN ... TYPE stream`, Redis
/// 6+), on every primary of a cluster. Keys of other types under the prefix (the
/// partition counts' hash, lease and epoch keys, blocked-key hashes) are never returned.
pub(crate) async fn streams(
    conn: &mut BrokerConn,
    prefix: &str,
) -> redis::RedisResult<BTreeSet<String>> {
    let pattern = format!("{}*", glob_escape(prefix));
    // SCAN may return a key more than once: the set keeps each once.
    let mut found = BTreeSet::new();
    // A cluster's SCAN walks one node's keys: each primary is walked in turn.
    let nodes = match conn.primaries().await? {
        Some(primaries) => primaries.into_iter().map(Some).collect(),
        None => vec![None],
    };
    for node in &nodes {
        let mut cursor: u64 = 0;
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .arg("TYPE")
                .arg("stream");
            let (next, keys): (u64, Vec<String>) = conn.query_on(&scan, node.as_ref()).await?;
            found.extend(keys);
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(found)
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
