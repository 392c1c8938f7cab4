//! What each reader pulls from: its lane, a durable consumer of the group on a stream.
//!
//! By default one lane per handled topic: the durable consumer named after the group on
//! the topic's whole stream, shared by every process of the group, with many messages
//! in hand at once.
//!
//! In ordered mode one lane per partition subject (an unpartitioned topic's subject
//! counts as its one partition): the durable consumer `<group>~p<partition>`, filtered
//! to that subject, with `max_ack_pending = 1`. Every process of the group pulls from
//! every lane, and the server hands out a lane's next message only once the one in hand
//! is acknowledged, which the consumer does after the handler's transaction committed
//! or after the message was dead-lettered. A message whose acknowledgement does not
//! come within `ack_wait` is delivered again, before any later one. So at most one
//! process handles a partition at a time and its messages reach the handler in stream
//! order, which the publisher keeps per key.
//!
//! Why not a lease (as outbox-redis's ordered mode holds one per stream in Redis): here
//! the server already decides, per message, who has the partition, and it is the only
//! party that can redeliver; a lease beside it would be a second authority that must be
//! fenced against the server's redeliveries after `ack_wait` anyway. With the server's
//! limit there is nothing to hand over: a process that stops simply stops pulling, and
//! the next message goes to another process's waiting pull at once; the message in hand
//! of a process killed or frozen comes back to another process after `ack_wait`. The
//! cost is one message in hand per partition (no concurrency nor batching inside a
//! partition): ordered throughput grows with the partition count.

use std::sync::Arc;

use async_nats::jetstream::consumer::{self, AckPolicy, DeliverPolicy, PullConsumer, pull};
use outbox_core::ConsumerStore;

use super::{Consumer, StartFrom, Topic};
use crate::streams::{consumer_mismatch, refused};
use crate::{Error, Naming, Result};

/// A durable consumer a reader pulls from.
#[derive(Debug, Clone)]
pub(crate) struct Lane {
    /// The topic whose stream it is on.
    pub(crate) topic: Topic,
    /// The durable consumer's name.
    pub(crate) durable: Arc<str>,
    /// Ordered mode: the one subject it reads, one message at a time.
    pub(crate) ordered_subject: Option<String>,
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// `lane`'s durable pull consumer, created when missing: the group's on the
    /// topic's whole stream with many messages in hand, or an ordered lane's on its
    /// subject with one. The server's own delivery limit is off (`max_deliver` -1): the
    /// consumer decides when a message is dead, and writes it to the dead-letter stream
    /// with its reason.
    pub(super) async fn lane_consumer(&self, lane: &Lane) -> Result<PullConsumer> {
        let inner = &self.inner;
        let stream_name = &*lane.topic.stream;
        let (filter_subject, max_ack_pending) = match &lane.ordered_subject {
            Some(subject) => (subject.clone(), 1),
            None => (String::new(), UNORDERED_MAX_ACK_PENDING),
        };
        let config = pull::Config {
            durable_name: Some(lane.durable.to_string()),
            filter_subject,
            ack_policy: AckPolicy::Explicit,
            ack_wait: inner.config.ack_wait,
            max_deliver: -1,
            deliver_policy: match inner.config.start_from {
                StartFrom::Beginning => DeliverPolicy::All,
                StartFrom::New => DeliverPolicy::New,
            },
            max_ack_pending,
            ..Default::default()
        };
        let unavailable = |e: &dyn std::fmt::Display| {
            Error::Unavailable(format!("consumer {} on {stream_name}: {e}", lane.durable))
        };
        let stream =
            (inner.js.get_stream_no_info(stream_name).await).map_err(|e| unavailable(&e))?;
        let consumer: PullConsumer = stream
            .get_or_create_consumer(&lane.durable, config)
            .await
            .map_err(|e| match e.kind() {
                async_nats::jetstream::stream::ConsumerErrorKind::JetStream(js) => {
                    consumer_refused(
                        format!("create consumer {} on {stream_name}", lane.durable),
                        &js,
                    )
                }
                _ => unavailable(&e),
            })?;
        let found = &consumer.cached_info().config;
        if let Some(subject) = &lane.ordered_subject {
            check_ordered(lane, subject, found)?;
        }
        match consumer_mismatch(found, stream_name, inner.config.ack_wait) {
            Some(mismatch) => Err(mismatch),
            None => Ok(consumer),
        }
    }
}

/// The server's answer to a consumer's creation, as [`refused`] reads a stream
/// request's, with one more outage: the stream not found although the caller has just
/// found or created it. On a cluster a stream created a moment ago, or one whose leader
/// is being elected, may not yet be known to the node asked, and that passes (a
/// consumer started on a three-node cluster exited on it in CI's chaos run). Should the
/// stream really be gone, the set-up's next try creates it again.
fn consumer_refused(what: String, e: &async_nats::jetstream::Error) -> Error {
    if e.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND {
        return Error::Unavailable(format!("{what}: {e} (not yet known to this node)"));
    }
    refused(what, e)
}

/// The messages a durable consumer of the unordered mode may have in hand at once,
/// across every process of the group.
const UNORDERED_MAX_ACK_PENDING: i64 = 10_000;

/// An ordered lane's durable consumer must let one message at a time be in hand and
/// read its subject alone: one found with other settings (an operator's edit) would
/// hand out a key's later message before an earlier one is done, so it is refused
/// rather than read.
fn check_ordered(lane: &Lane, subject: &str, found: &consumer::Config) -> Result<()> {
    if found.max_ack_pending == 1 && found.filter_subject == subject {
        return Ok(());
    }
    Err(Error::Refused {
        what: format!(
            "read {subject} in order through the durable consumer {} on {}",
            lane.durable, lane.topic.stream
        ),
        reason: format!(
            "it exists with max_ack_pending = {} and filter_subject = {:?}; ordered mode needs 1 and {subject:?}: \
             delete it (`nats consumer rm {} {}`) to have it created again",
            found.max_ack_pending, found.filter_subject, lane.topic.stream, lane.durable
        ),
    })
}

/// The lanes of `group` over `topics`: one per topic, or in `ordered` mode one per
/// partition subject.
pub(crate) fn lanes(group: &str, topics: &[Topic], naming: &Naming, ordered: bool) -> Vec<Lane> {
    let mut lanes = Vec::new();
    for topic in topics {
        if !ordered {
            lanes.push(Lane {
                topic: topic.clone(),
                durable: Arc::from(group),
                ordered_subject: None,
            });
            continue;
        }
        let partitions = topic.partitions;
        lanes.extend((0..partitions.get()).map(|p| Lane {
            topic: topic.clone(),
            durable: Arc::from(ordered_durable(group, p)),
            ordered_subject: Some(if partitions.is_partitioned() {
                naming.partition_subject(&topic.name, p)
            } else {
                naming.subject(&topic.name)
            }),
        }));
    }
    lanes
}

/// The durable consumer of partition `p` in ordered mode: `<group>~p<p>`. A group name
/// has no `~` (letters, digits, `-`, `_`), so it is never another group's durable.
pub(crate) fn ordered_durable(group: &str, p: u32) -> String {
    format!("{group}~p{p}")
}

#[cfg(test)]
mod tests {
    use outbox_core::Partitions;

    use super::*;

    fn topic(name: &str, partitions: u32) -> Topic {
        Topic {
            name: Arc::from(name),
            stream: Arc::from(Naming::default().stream(name)),
            partitions: Partitions::new(partitions).unwrap(),
        }
    }

    #[test]
    fn ordered_mode_reads_each_partition_subject_through_its_own_durable() {
        let topics = [topic("order.paid", 3), topic("user.seen", 1)];
        let lanes = lanes("billing", &topics, &Naming::default(), true);
        let got: Vec<(&str, Option<&str>)> = (lanes.iter())
            .map(|l| (&*l.durable, l.ordered_subject.as_deref()))
            .collect();
        assert_eq!(
            got,
            [
                ("billing~p0", Some("outbox.order.paid.p0")),
                ("billing~p1", Some("outbox.order.paid.p1")),
                ("billing~p2", Some("outbox.order.paid.p2")),
                ("billing~p0", Some("outbox.user.seen")),
            ]
        );
    }

    #[test]
    fn by_default_each_stream_is_read_whole_through_the_group_durable() {
        let lanes = lanes(
            "billing",
            &[topic("order.paid", 3)],
            &Naming::default(),
            false,
        );
        assert_eq!(lanes.len(), 1);
        assert_eq!(&*lanes[0].durable, "billing");
        assert_eq!(lanes[0].ordered_subject, None);
    }

    fn answer(code: u64, text: &str) -> async_nats::jetstream::Error {
        serde_json::from_value(serde_json::json!({
            "code": 404, "err_code": code, "description": text
        }))
        .expect("a JetStream error")
    }

    #[test]
    fn a_stream_not_yet_known_to_the_node_is_an_outage_other_refusals_are_not() {
        let e = consumer_refused(
            "create consumer g".into(),
            &answer(10059, "stream not found"),
        );
        assert!(e.is_outage(), "{e:?}");
        let e = consumer_refused(
            "create consumer g".into(),
            &answer(10013, "consumer name already in use"),
        );
        assert!(!e.is_outage(), "{e:?}");
    }
}
