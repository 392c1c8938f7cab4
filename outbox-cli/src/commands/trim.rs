//! `outbox trim`: [`outbox_redis::trim_acknowledged`] on every stream of a prefix.

use std::collections::BTreeSet;
use std::io::Write;
use std::time::Duration;

use outbox_redis::Client;
use outbox_redis::redis::aio::MultiplexedConnection;
use outbox_redis::redis::{self, AsyncConnectionConfig};

use crate::args::TrimArgs;
use crate::backend::redact;
use crate::error::CliError;
use crate::output;

/// How long connecting to Redis may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one command may take.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);
/// Keys SCAN looks at per call.
const SCAN_COUNT: usize = 1000;

/// Finds the prefix's streams and trims each to what some consumer group still needs.
pub(super) fn run(args: &TrimArgs, out: &mut impl Write) -> Result<(), CliError> {
    let url = redact(&args.redis_url);
    let client = Client::open(args.redis_url.as_str()).map_err(|e| CliError::RedisUrl {
        url: url.clone(),
        source: e.into(),
    })?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    let reports = runtime.block_on(async {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT));
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|e| CliError::RedisConnect {
                url,
                source: e.into(),
            })?;
        let streams = streams(&mut conn, &args.stream_prefix)
            .await
            .map_err(|e| CliError::Redis(e.into()))?;
        let mut reports = Vec::with_capacity(streams.len());
        for stream in streams
            .iter()
            .filter(|s| !s.ends_with(&args.dead_letter_suffix))
        {
            let report = outbox_redis::trim_acknowledged(&mut conn, stream)
                .await
                .map_err(CliError::Redis)?;
            tracing::debug!(stream, removed = report.removed, min_id = ?report.min_id, "trimmed");
            reports.push(report);
        }
        Ok::<_, CliError>(reports)
    })?;
    if args.json {
        let json: Vec<_> = reports.iter().map(output::TrimJson::from).collect();
        output::json(out, &json)?;
    } else {
        output::trim_reports(out, &reports, &args.stream_prefix)?;
    }
    Ok(())
}

/// The streams whose names start with `prefix`, sorted (`SCAN ... TYPE stream`, Redis 6+).
async fn streams(
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
