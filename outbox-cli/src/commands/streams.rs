//! `outbox streams`: each topic's streams under a prefix, its partitions, consumer groups
//! and the holders of the partitions' leases.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::time::Duration;

use outbox_redis::redis;

use crate::args::StreamsArgs;
use crate::broker::{Broker, BrokerConn, BrokerKind};
use crate::error::CliError;
use crate::output::{self, GroupReport, LeaseReport, StreamReport, TopicStreams};
use crate::scan;

mod nats;

/// How long connecting to NATS and each JetStream request may take.
const TIMEOUT: Duration = Duration::from_secs(5);

/// Reads the prefix's streams and prints them.
pub(super) fn run(
    broker: &Broker,
    args: &StreamsArgs,
    out: &mut impl Write,
) -> Result<(), CliError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    let (topics, prefix) = match broker.kind() {
        BrokerKind::Redis(_) => {
            let prefix = args
                .stream_prefix
                .as_deref()
                .unwrap_or(outbox_redis::DEFAULT_STREAM_PREFIX);
            (runtime.block_on(read(broker, prefix, args))?, prefix)
        }
        BrokerKind::Nats(servers) => {
            let prefix = args
                .stream_prefix
                .as_deref()
                .unwrap_or(outbox_nats::DEFAULT_STREAM_PREFIX);
            (
                runtime.block_on(nats::read(servers, broker, prefix))?,
                prefix,
            )
        }
    };
    if args.json {
        output::json(out, &topics)?;
    } else {
        output::streams(out, &topics, prefix)?;
    }
    Ok(())
}

/// Every topic with a stream under the prefix or a recorded partition count, sorted.
async fn read(
    broker: &Broker,
    prefix: &str,
    args: &StreamsArgs,
) -> Result<Vec<TopicStreams>, CliError> {
    let mut conn = scan::connect(broker).await?;
    let all = scan::streams(&mut conn, prefix)
        .await
        .map_err(redis_error)?;
    let recorded = outbox_redis::recorded_partitions(&mut conn, prefix)
        .await
        .map_err(CliError::Redis)?;
    let mut topics: BTreeMap<String, TopicStreams> = BTreeMap::new();
    for (topic, count) in recorded {
        topics.insert(topic.clone(), topic_streams(topic, Some(count)));
    }
    for stream in all
        .iter()
        .filter(|s| !s.ends_with(&args.dead_letter_suffix))
    {
        let Some(name) = outbox_redis::stream_topic(stream, prefix) else {
            continue;
        };
        let report = stream_report(&mut conn, stream, name.partition, &all, args).await?;
        topics
            .entry(name.topic.to_owned())
            .or_insert_with(|| topic_streams(name.topic.to_owned(), None))
            .streams
            .push(report);
    }
    let mut topics: Vec<TopicStreams> = topics.into_values().collect();
    for t in &mut topics {
        // Names sort `:10` before `:2`; people read partitions in number order.
        t.streams.sort_by_key(|s| s.partition);
    }
    Ok(topics)
}

fn topic_streams(topic: String, recorded_partitions: Option<u32>) -> TopicStreams {
    TopicStreams {
        topic,
        recorded_partitions,
        streams: Vec::new(),
    }
}

/// One stream's length, dead letters and groups (with the lease of each group that an
/// ordered consumer holds).
async fn stream_report(
    conn: &mut BrokerConn,
    stream: &str,
    partition: Option<u32>,
    all: &BTreeSet<String>,
    args: &StreamsArgs,
) -> Result<StreamReport, CliError> {
    let length = xlen(conn, stream).await?;
    let dead = format!("{stream}{}", args.dead_letter_suffix);
    let dead_letters = if all.contains(&dead) {
        xlen(conn, &dead).await?
    } else {
        0
    };
    let mut groups = Vec::new();
    for g in outbox_redis::consumer_groups(conn, stream)
        .await
        .map_err(CliError::Redis)?
    {
        // Ordered consumers hold leases on unpartitioned streams too.
        let lease = outbox_redis::partition_lease(conn, stream, &g.name)
            .await
            .map_err(CliError::Redis)?
            .map(|l| LeaseReport {
                holder: l.holder,
                epoch: l.epoch,
                ttl_ms: l
                    .ttl
                    .map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
            });
        groups.push(GroupReport {
            group: g.name,
            pending: g.pending,
            lag: g.lag,
            consumers: g.consumers.len(),
            lease,
        });
    }
    Ok(StreamReport {
        stream: stream.to_owned(),
        partition,
        length,
        dead_letters,
        groups,
    })
}

async fn xlen(conn: &mut BrokerConn, stream: &str) -> Result<u64, CliError> {
    redis::cmd("XLEN")
        .arg(stream)
        .query_async(conn)
        .await
        .map_err(redis_error)
}

fn redis_error(e: redis::RedisError) -> CliError {
    CliError::Redis(e.into())
}
