//! Redis memory per stream entry as the relay writes it (the real `RedisPublisher`,
//! default config, the reference event), and what the library's trim
//! ([`outbox_redis::trim_acknowledged`], which `outbox trim` and the consumer's
//! `trim_interval` run) leaves: about the tail not yet acknowledged, unless a group lags,
//! which holds every entry it has not acknowledged.
//!
//! Memory is `MEMORY USAGE <stream> SAMPLES 0` (every node counted; the consumer groups
//! and their pending lists included, the latter by Redis's estimate) and, beside it, the
//! change of `INFO memory`'s `used_memory` (the whole server: anything else writing to it
//! at the same time shows).

use outbox_core::{Envelope, Publisher as _, StoredMessage};
use outbox_examples::AccountTransferred;
use outbox_redis::{PublisherConfig, RedisPublisher, TrimReport};
use redis::aio::MultiplexedConnection;
use redis::streams::StreamReadReply;

use crate::stats::{Figure, Target};
use crate::{BoxError, Service, progress};

/// The sizes of the stream part.
pub(crate) struct StreamSize {
    /// Entries of the reference event published into one stream (and trimmed).
    pub(crate) entries: usize,
    /// Entries of the 1 KiB event.
    pub(crate) large_entries: usize,
    /// Entries left unacknowledged by the group(s): what the trim must keep.
    pub(crate) kept: usize,
}

/// Messages per `publish` call: the relay's default batch.
const BATCH: usize = 500;
/// Entries per `XREADGROUP` and per `XACK`.
const CHUNK: usize = 10_000;
/// The larger payload's padding, in the event's `from` field.
const LARGE: usize = 1024;

pub(crate) async fn part(
    size: &StreamSize,
    svc: &Service,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    let prefix = format!(
        "bench:stream:{}_{:08x}:",
        std::process::id(),
        fastrand::u32(..)
    );
    // Without redis-rs's 500 ms response timeout: an XREADGROUP of thousands of entries,
    // parsed by a debug build on a loaded machine, outlasts it (seen at a load of 13 on
    // 2 cores: "timed out").
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
    let mut conn = redis::Client::open(svc.redis_url.as_str())?
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    let result = run(size, svc, &mut conn, &prefix, figures).await;
    let cleaned = delete_keys(&mut conn, &prefix).await;
    result?;
    cleaned
}

async fn run(
    size: &StreamSize,
    svc: &Service,
    conn: &mut MultiplexedConnection,
    prefix: &str,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    let (n, k) = (size.entries, size.kept);
    println!(
        "stream: Redis memory per entry ({n} AccountTransferred, {} with a 1 KiB field, \
         RedisPublisher defaults), then the trim with {k} entries not yet read",
        size.large_entries
    );

    let (reference, per_entry) = per_entry(size, svc, conn, prefix, figures).await?;
    one_group(size, conn, &reference.stream, per_entry, figures).await?;
    let lag = fill(svc, conn, &format!("{prefix}lag:"), n, "alice").await?;
    lagging_group(size, conn, &lag.stream, figures).await?;
    emptied(k, conn, &lag.stream, figures).await
}

/// Step 1, memory per entry, the reference event and a 1 KiB one: the reference
/// stream, and its bytes per entry.
async fn per_entry(
    size: &StreamSize,
    svc: &Service,
    conn: &mut MultiplexedConnection,
    prefix: &str,
    figures: &mut Vec<Figure>,
) -> Result<(Filled, f64), BoxError> {
    let n = size.entries;
    let reference = fill(svc, conn, &format!("{prefix}ref:"), n, "alice").await?;
    let per_entry = reference.report("reference", figures);
    let large = fill(
        svc,
        conn,
        &format!("{prefix}large:"),
        size.large_entries,
        &"a".repeat(LARGE),
    )
    .await?;
    large.report("with a 1 KiB field", figures);
    del(conn, &large.stream).await?;
    Ok((reference, per_entry))
}

/// Step 2: one group has read and acknowledged all but the last k: the trim keeps k.
async fn one_group(
    size: &StreamSize,
    conn: &mut MultiplexedConnection,
    stream: &str,
    per_entry: f64,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    let (n, k) = (size.entries, size.kept);
    group(conn, stream, "g1").await?;
    let ids = read(conn, stream, "g1", n - k).await?;
    ack(conn, stream, "g1", &ids).await?;
    let before = (memory_usage(conn, stream).await?, used_memory(conn).await?);
    let report = trim(conn, stream, n - k).await?;
    let after = memory_usage(conn, stream).await?;
    let freed = before.1 - used_memory(conn).await?;
    println!(
        "  one group, {} of {n} read and acknowledged: trim removed {} (MINID {})",
        n - k,
        report.removed,
        report.min_id.as_deref().unwrap_or("-")
    );
    progress("stream before the trim (KiB)", kib(before.0), "KiB");
    progress(
        &format!("stream after the trim, {k} left (KiB)"),
        kib(after),
        "KiB",
    );
    progress("used_memory freed by the trim (KiB)", kib(freed), "KiB");
    let worth = k as f64 * per_entry;
    progress(
        &format!("after the trim / {k} entries' worth (%)"),
        after as f64 / worth * 100.0,
        "%",
    );
    absolute(
        figures,
        format!("stream after the trim, 1 group, {k} of {n} left unread"),
        "KiB",
        kib(after),
    );
    let mut ratio = Figure::ratio(
        "stream",
        format!("after the trim, 1 group, {k} left unread"),
        format!("bytes / {k} × bytes per entry"),
        Target::None,
    );
    ratio.values = vec![after as f64 / worth];
    figures.push(ratio);
    // What a delivered, unacknowledged entry adds (the group's and the consumer's PEL):
    // MEMORY USAGE only estimates it (a fixed guess per radix-tree node).
    let before = (after, used_memory(conn).await?);
    read(conn, stream, "g1", k).await?;
    let pel = (
        (memory_usage(conn, stream).await? - before.0) as f64 / k as f64,
        (used_memory(conn).await? - before.1) as f64 / k as f64,
    );
    progress(
        "pending entry: MEMORY USAGE growth each (estimate)",
        pel.0,
        "B",
    );
    progress("pending entry: used_memory growth each", pel.1, "B");
    absolute(
        figures,
        format!("used_memory per pending entry ({k} delivered, not acknowledged)"),
        "B",
        pel.1,
    );
    del(conn, stream).await?;
    Ok(())
}

/// Step 3: two groups, one lagging half the stream behind: it holds what it has not
/// acknowledged, until it catches up.
async fn lagging_group(
    size: &StreamSize,
    conn: &mut MultiplexedConnection,
    stream: &str,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    let (n, k) = (size.entries, size.kept);
    let half = n / 2;
    group(conn, stream, "fast").await?;
    group(conn, stream, "slow").await?;
    read_ack(conn, stream, "fast", n - k).await?;
    read_ack(conn, stream, "slow", half).await?;
    let report = trim(conn, stream, half).await?;
    let held = memory_usage(conn, stream).await?;
    println!(
        "  two groups, one {} of {n} acknowledged, the other {half}: trim removed {}",
        n - k,
        report.removed
    );
    progress(
        &format!("stream after the trim, {} left (KiB)", n - half),
        kib(held),
        "KiB",
    );
    let rest = read(conn, stream, "slow", n - half - k).await?;
    ack(conn, stream, "slow", &rest).await?;
    let report = trim(conn, stream, n - half - k).await?;
    let caught_up = memory_usage(conn, stream).await?;
    println!(
        "  the lagging group catches up to {} acknowledged: trim removed {}",
        n - k,
        report.removed
    );
    progress(
        &format!("stream after the trim, {k} left (KiB)"),
        kib(caught_up),
        "KiB",
    );
    absolute(
        figures,
        format!("stream after the trim, a 2nd group {half} behind"),
        "KiB",
        kib(held),
    );
    absolute(
        figures,
        "stream after the trim, the 2nd group caught up".to_owned(),
        "KiB",
        kib(caught_up),
    );
    Ok(())
}

/// Step 4: both groups read and acknowledge the rest: what an empty stream with two
/// groups costs.
async fn emptied(
    k: usize,
    conn: &mut MultiplexedConnection,
    stream: &str,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    for g in ["fast", "slow"] {
        read_ack(conn, stream, g, k).await?;
    }
    trim(conn, stream, k).await?;
    let empty = memory_usage(conn, stream).await?;
    progress(
        "stream emptied by the trim, 2 groups (B)",
        empty as f64,
        "B",
    );
    absolute(
        figures,
        "stream emptied by the trim, 2 groups".to_owned(),
        "B",
        empty as f64,
    );
    Ok(())
}

/// A stream filled by the publisher, and what it costs.
struct Filled {
    stream: String,
    entries: usize,
    /// `MEMORY USAGE <stream> SAMPLES 0`.
    usage: i64,
    /// `used_memory` after − before.
    server: i64,
    /// The event's JSON.
    payload: usize,
    /// The entry's field names and values, as the publisher writes them.
    fields: usize,
}

impl Filled {
    /// Prints and records the bytes per entry; returns them (by `MEMORY USAGE`).
    fn report(&self, what: &str, figures: &mut Vec<Figure>) -> f64 {
        let n = self.entries as f64;
        let (usage, server) = (self.usage as f64 / n, self.server as f64 / n);
        println!(
            "  AccountTransferred {what}: payload {} B, entry fields {} B (names and values); \
             {} entries",
            self.payload, self.fields, self.entries
        );
        progress(&format!("{what}: MEMORY USAGE per entry"), usage, "B");
        progress(
            &format!("{what}: used_memory growth per entry"),
            server,
            "B",
        );
        absolute(
            figures,
            format!(
                "Redis memory per entry, AccountTransferred {what} ({} B payload, {} B fields)",
                self.payload, self.fields
            ),
            "B",
            usage,
        );
        absolute(
            figures,
            format!("used_memory growth per entry, AccountTransferred {what}"),
            "B",
            server,
        );
        usage
    }
}

/// Publishes `n` `AccountTransferred` (debited account `from`) through a
/// `RedisPublisher` with the default config under `prefix`, into one stream.
async fn fill(
    svc: &Service,
    conn: &mut MultiplexedConnection,
    prefix: &str,
    n: usize,
    from: &str,
) -> Result<Filled, BoxError> {
    let publisher = RedisPublisher::new(svc.redis_url.as_str())?
        .with_config(PublisherConfig::default().with_stream_prefix(prefix))?;
    let event = |i: usize| AccountTransferred::new(&format!("stream-{i}"), from, "bob", 1);
    let sample = Envelope::from_event(&event(n), 1 << 20)?;
    let stream = publisher.stream_for(&sample.topic);
    let fields = outbox_redis::entry_fields(&sample)
        .iter()
        .map(|(name, value)| name.len() + value.len())
        .sum();
    let before = used_memory(conn).await?;
    for start in (0..n).step_by(BATCH) {
        let batch = (start..n.min(start + BATCH))
            .map(|i| {
                Ok(StoredMessage {
                    id: i as i64 + 1,
                    retries: 0,
                    envelope: Envelope::from_event(&event(i), 1 << 20)?,
                })
            })
            .collect::<Result<Vec<_>, BoxError>>()?;
        let outcomes = publisher.publish(&batch).await?;
        if let Some(Err(e)) = outcomes.into_iter().find(Result::is_err) {
            return Err(format!("publish rejected: {e:?}").into());
        }
    }
    drop(publisher);
    let server = used_memory(conn).await? - before;
    let len: usize = redis::cmd("XLEN").arg(&stream).query_async(conn).await?;
    if len != n {
        return Err(format!("{stream}: {len} entries, expected {n}").into());
    }
    Ok(Filled {
        usage: memory_usage(conn, &stream).await?,
        stream,
        entries: n,
        server,
        payload: sample.payload.len(),
        fields,
    })
}

/// The library's trim, which must remove exactly `expected` entries.
async fn trim(
    conn: &mut MultiplexedConnection,
    stream: &str,
    expected: usize,
) -> Result<TrimReport, BoxError> {
    let report = outbox_redis::trim_acknowledged(conn, stream).await?;
    if report.removed != expected {
        return Err(format!(
            "{stream}: the trim removed {} entries, expected {expected}",
            report.removed
        )
        .into());
    }
    Ok(report)
}

async fn group(conn: &mut MultiplexedConnection, stream: &str, name: &str) -> Result<(), BoxError> {
    let () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(name)
        .arg("0")
        .query_async(conn)
        .await?;
    Ok(())
}

/// The ids of the next `n` entries delivered to `group`.
async fn read(
    conn: &mut MultiplexedConnection,
    stream: &str,
    group: &str,
    n: usize,
) -> Result<Vec<String>, BoxError> {
    let mut ids = Vec::with_capacity(n);
    while ids.len() < n {
        let reply: StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(group)
            .arg("bench")
            .arg("COUNT")
            .arg(CHUNK.min(n - ids.len()))
            .arg("STREAMS")
            .arg(stream)
            .arg(">")
            .query_async(conn)
            .await?;
        let before = ids.len();
        ids.extend(
            reply
                .keys
                .into_iter()
                .flat_map(|k| k.ids)
                .map(|entry| entry.id),
        );
        if ids.len() == before {
            return Err(format!("{stream}: {group} read {before} entries, expected {n}").into());
        }
    }
    Ok(ids)
}

/// Reads the next `n` entries for `group` and acknowledges them.
async fn read_ack(
    conn: &mut MultiplexedConnection,
    stream: &str,
    group: &str,
    n: usize,
) -> Result<(), BoxError> {
    let ids = read(conn, stream, group, n).await?;
    ack(conn, stream, group, &ids).await
}

async fn ack(
    conn: &mut MultiplexedConnection,
    stream: &str,
    group: &str,
    ids: &[String],
) -> Result<(), BoxError> {
    for chunk in ids.chunks(CHUNK) {
        let acked: usize = redis::cmd("XACK")
            .arg(stream)
            .arg(group)
            .arg(chunk)
            .query_async(conn)
            .await?;
        if acked != chunk.len() {
            return Err(format!("{stream}: {acked} of {} acknowledged", chunk.len()).into());
        }
    }
    Ok(())
}

async fn memory_usage(conn: &mut MultiplexedConnection, key: &str) -> Result<i64, BoxError> {
    let bytes: Option<i64> = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .arg("SAMPLES")
        .arg(0)
        .query_async(conn)
        .await?;
    Ok(bytes.unwrap_or(0))
}

async fn used_memory(conn: &mut MultiplexedConnection) -> Result<i64, BoxError> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(conn).await?;
    info.lines()
        .find_map(|line| line.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| "INFO memory: no used_memory".into())
}

async fn del(conn: &mut MultiplexedConnection, key: &str) -> Result<(), BoxError> {
    let _: usize = redis::cmd("DEL").arg(key).query_async(conn).await?;
    Ok(())
}

/// Every key under `prefix`: the bench's streams (and anything the publisher added).
async fn delete_keys(conn: &mut MultiplexedConnection, prefix: &str) -> Result<(), BoxError> {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(conn)
        .await?;
    if !keys.is_empty() {
        let _: usize = redis::cmd("DEL").arg(keys).query_async(conn).await?;
    }
    Ok(())
}

fn kib(bytes: i64) -> f64 {
    bytes as f64 / 1024.0
}

fn absolute(figures: &mut Vec<Figure>, name: String, unit: &'static str, value: f64) {
    let mut f = Figure::absolute("stream", name, unit, Target::None);
    f.values = vec![value];
    figures.push(f);
}
