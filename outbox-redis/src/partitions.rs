//! The operator's view of partitioned topics: which stream is which partition, the
//! counts publishers recorded, and who holds each partition's lease.

use std::collections::BTreeMap;
use std::time::Duration;

use redis::aio::ConnectionLike;

use crate::Result;
use crate::conn::{lease_key, partitions_key};

/// What a stream's name says about it: its topic, and its partition if it is one of a
/// partitioned topic's streams. See [`stream_topic`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamTopic<'a> {
    /// The topic (`order.paid`).
    pub topic: &'a str,
    /// The partition (`3` for `outbox:order.paid:3`), `None` for a topic's one stream.
    pub partition: Option<u32>,
}

/// The topic and partition of `stream`, a stream named by a publisher with `prefix`:
/// `<prefix><topic>` or `<prefix><topic>:<p>`, and their cluster forms
/// `<prefix>{<topic>}` and `<prefix>{<topic>:<p>}`. `None` when `stream` does not start
/// with `prefix`. Topics hold no `:`, so the name is read back without ambiguity.
///
/// ```
/// use outbox_redis::stream_topic;
///
/// let s = stream_topic("outbox:{order.paid:3}", "outbox:").unwrap();
/// assert_eq!((s.topic, s.partition), ("order.paid", Some(3)));
/// let s = stream_topic("outbox:order.paid", "outbox:").unwrap();
/// assert_eq!((s.topic, s.partition), ("order.paid", None));
/// assert!(stream_topic("other:order.paid", "outbox:").is_none());
/// ```
pub fn stream_topic<'a>(stream: &'a str, prefix: &str) -> Option<StreamTopic<'a>> {
    let rest = stream.strip_prefix(prefix)?;
    let rest = rest
        .strip_prefix('{')
        .and_then(|r| r.strip_suffix('}'))
        .unwrap_or(rest);
    let partition = match rest.rsplit_once(':') {
        Some((topic, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => {
            p.parse().ok().map(|p| (topic, p))
        }
        _ => None,
    };
    Some(match partition {
        Some((topic, p)) => StreamTopic {
            topic,
            partition: Some(p),
        },
        None => StreamTopic {
            topic: rest,
            partition: None,
        },
    })
}

/// The partition counts publishers with `prefix` recorded, by topic (the hash
/// `<prefix>partitions`; empty when none did). A value that is not a number is left out.
pub async fn recorded_partitions<C>(conn: &mut C, prefix: &str) -> Result<BTreeMap<String, u32>>
where
    C: ConnectionLike + Send,
{
    let all: BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg(partitions_key(prefix))
        .query_async(conn)
        .await?;
    Ok(all
        .into_iter()
        .filter_map(|(topic, n)| Some((topic, n.parse().ok()?)))
        .collect())
}

/// The lease by which one consumer of a group holds a partition stream, as
/// [`partition_lease`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionLease {
    /// The consumer holding it.
    pub holder: String,
    /// The lease's epoch, one more at each acquisition (`None` if the value carries
    /// none).
    pub epoch: Option<u64>,
    /// How long it lasts unless renewed (`None`: no expiry set).
    pub ttl: Option<Duration>,
}

impl PartitionLease {
    /// Reads a lease value, `<epoch>:<consumer name>`; anything else is all holder.
    fn parse(value: String, ttl: Option<Duration>) -> Self {
        match value.split_once(':') {
            Some((epoch, holder)) if epoch.parse::<u64>().is_ok() => Self {
                holder: holder.to_owned(),
                epoch: epoch.parse().ok(),
                ttl,
            },
            _ => Self {
                holder: value,
                epoch: None,
                ttl,
            },
        }
    }
}

/// Who in `group` holds partition `stream` now: the lease at `<stream>:lease:<group>`
/// (value `<epoch>:<consumer name>`, with a TTL), or `None` when no consumer does.
pub async fn partition_lease<C>(
    conn: &mut C,
    stream: &str,
    group: &str,
) -> Result<Option<PartitionLease>>
where
    C: ConnectionLike + Send,
{
    let key = lease_key(stream, group);
    // One round trip; the two replies may straddle an expiry, which reads as a lease
    // without TTL for an instant: harmless for a report.
    let (value, pttl): (Option<String>, i64) = redis::pipe()
        .cmd("GET")
        .arg(&key)
        .cmd("PTTL")
        .arg(&key)
        .query_async(conn)
        .await?;
    let ttl = u64::try_from(pttl).ok().map(Duration::from_millis);
    Ok(value.map(|v| PartitionLease::parse(v, ttl)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::{partition_stream_name, stream_name};

    #[test]
    fn stream_names_parse_back_to_topic_and_partition() {
        for cluster in [false, true] {
            let stream = partition_stream_name("app:1:", "order.paid", 12, cluster);
            let s = stream_topic(&stream, "app:1:").unwrap();
            assert_eq!((s.topic, s.partition), ("order.paid", Some(12)));
            let stream = stream_name("app:1:", "order.paid", cluster);
            let s = stream_topic(&stream, "app:1:").unwrap();
            assert_eq!((s.topic, s.partition), ("order.paid", None));
        }
        let s = stream_topic("outbox:order.paid:", "outbox:").unwrap();
        assert_eq!((s.topic, s.partition), ("order.paid:", None));
        let s = stream_topic("outbox:a:99999999999", "outbox:").unwrap();
        assert_eq!(s.partition, None, "not a u32: not a partition");
    }

    #[test]
    fn lease_values_name_epoch_and_holder() {
        let ttl = Some(Duration::from_secs(3));
        let lease = PartitionLease::parse("7:host-1:4242".into(), ttl);
        assert_eq!(lease.holder, "host-1:4242");
        assert_eq!(lease.epoch, Some(7));
        assert_eq!(lease.ttl, ttl);
        let lease = PartitionLease::parse("someone".into(), None);
        assert_eq!((lease.holder.as_str(), lease.epoch), ("someone", None));
    }
}
