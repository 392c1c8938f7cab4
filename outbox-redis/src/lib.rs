#![doc = include_str!("../README.md")]
//!
//! ## Stream entries
//!
//! One entry per message, with the fields of [`ENTRY_FIELDS`]: `msg_id`, `topic`, `type`,
//! `version`, `key`, `payload` (the event's JSON), `headers` (a JSON object) and
//! `created_at`. Dead-letter entries (`<stream>:dead`) add `reason`, `delivery_count`,
//! `group`, `stream` and `entry_id` in front of the original fields (an original field
//! with one of those names is not copied).
//!
//! ## Redis versions
//!
//! Redis 6.2 or later. New in 6.2 and used here: `XAUTOCLAIM` (reclaiming idle
//! entries), `XGROUP CREATECONSUMER` (registering the consumer at start) and
//! `XTRIM ... MINID` ([`trim_acknowledged`]). Everything else (`XADD`, `XREADGROUP`,
//! `XACK`, `XPENDING` with a range, `XCLAIM ... RETRYCOUNT`, `XINFO GROUPS`) is Redis 5.
//! The tests run against Redis 7.0; from 7.0 on `XAUTOCLAIM` also drops pending entries
//! whose stream entry was deleted, which 6.2 leaves in the pending list.
//!
//! On a Redis Cluster the same commands are used, within one hash slot each (see below).
//!
//! ## Partitioned topics
//!
//! A topic given a partition count in [`PublisherConfig::partitions`] (with
//! [`PublisherConfig::with_partitions`], or [`PublisherConfig::with_partitions_of`] from
//! an event's `#[outbox(partitions = N)]`) is published to N streams,
//! `<prefix><topic>:<p>`, where `p` is [`outbox_core::partition_of`] the message's
//! ordering key: every message of a key lands on one stream, in the order the relay
//! publishes it. Publishers record the counts in the hash `<prefix>partitions`
//! ([`recorded_partitions`]). The ordered consumers hold each partition of a group by a
//! lease, `<stream>:lease:<group>` ([`partition_lease`]); [`stream_topic`] reads a
//! stream's topic and partition back from its name. The repository's
//! `docs/partitions.md` covers the hash, choosing the count and changing it on a live
//! system.
//!
//! ## Redis Cluster
//!
//! With the `cluster` feature, `RedisPublisher::cluster(nodes)` (then
//! `.with_config(config)`, as on one server) and `Consumer::builder_cluster(nodes, group)`
//! talk to a Redis Cluster; `nodes` are one or more of its nodes' URLs, the others are
//! discovered. Everything else (configuration, handlers, the idempotency store, entry
//! fields, dead letters, metrics) is as on a single server.
//!
//! `Consumer::builder_cluster` shows a full example.
//!
//! - **Stream names are hash-tagged**: the stream of `order.paid` is
//!   `outbox:{order.paid}` and its dead-letter stream `outbox:{order.paid}:dead`, so
//!   Redis stores both in the slot of `order.paid`. The name follows from how the
//!   publisher or consumer was built, never from a separate setting: a cluster publisher
//!   and a cluster consumer always agree. (Streams written by a single-server publisher,
//!   `outbox:order.paid`, are other keys: moving from one server to a cluster starts
//!   new streams.) The prefix must not contain `{` or `}`; `build` and the publisher's
//!   constructor refuse one. Each partition of a partitioned topic is its own hash tag
//!   (`outbox:{order.paid:3}`), so a topic's partitions spread over the nodes.
//! - **Publisher**: a batch is split per slot (per topic) and each part is one
//!   pipeline (or several, past `max_pipeline_bytes`); the parts are sent concurrently,
//!   so a batch costs one round trip to each node it touches, at once, and keeps its
//!   order per topic. A part that fails as a whole (a node down, a timeout) is an outage
//!   for its messages, which stay NEW, while the parts already written are recorded as
//!   SENT. A slot that moved (`MOVED`/`ASK` replies) is also an outage: the connection
//!   is replaced and the next attempt uses the new slot map.
//! - **Consumer**: it reads each slot's streams (each topic's stream, in practice) with
//!   its own `XREADGROUP ... BLOCK`, on its own cluster connection, since a blocked read
//!   holds up its connection to that node; the reads run side by side and entries are
//!   processed as soon as any read returns. A consumer of `n` topics thus keeps up to
//!   `n` + 1 cluster connections (each with one connection per master). Acks are
//!   one pipeline per slot; a dead letter and its `XACK` stay one `MULTI`, valid because
//!   both keys share the slot. [`trim_acknowledged`] takes a cluster connection too.
//!
//! The tests start a real three-master cluster (`redis-server --cluster-enabled yes`,
//! `redis-cli --cluster create`) and run the publisher and consumers against it.
//!
//! ## Redis Sentinel
//!
//! With the `sentinel` feature, `RedisPublisher::sentinel(config)` and
//! `Consumer::builder_sentinel(config, group)` find the primary through Redis Sentinel:
//! `config` is a `SentinelConfig` (the sentinels' URLs and the name they monitor the
//! primary under, plus the primary's credentials if it has any). Streams are named as on
//! one server. redis-rs's `SentinelClient` looks the primary up (and checks that it calls
//! itself one); this crate keeps the connection and replaces it, asking the sentinels
//! again, after a connection error or timeout, after a `READONLY` reply (the server was
//! demoted), and at its next use after a sentinel announces a failover on
//! `+switch-master` (one subscriber per publisher or consumer, moving to the next
//! sentinel if its own goes away). During the failover itself every command is an
//! outage, backed off as any other.
//!
//! Replication is asynchronous: with the default [`Durability::Reply`] a failover can
//! lose entries the old primary acknowledged; [`Durability::Replicas`] keeps a row NEW
//! until a replica has its entry. After a failover the promoted replica's consumer group
//! can lag behind the old primary's (a last-delivered id further back, entries pending
//! that were acked): consumers get those entries again and skip them by `msg_id`. The
//! repository's `RELIABILITY.md` gives the figures of the failover tests.
//!
//! `SentinelConfig` shows an example.
//!
//! ## Metrics
//!
//! Through the [`metrics`](https://docs.rs/metrics) facade, labelled by `group` and
//! `stream`: `outbox_consumer_consumed_total`, `outbox_consumer_duplicates_total`,
//! `outbox_consumer_failures_total`, `outbox_consumer_dead_lettered_total`,
//! `outbox_consumer_ignored_total`, `outbox_consumer_reclaimed_total`,
//! `outbox_consumer_redis_errors_total`; and, unlabelled, `outbox_redis_publish_rejected_total`,
//! `outbox_redis_publish_timeouts_total` and `outbox_redis_durability_unmet_total`. The
//! same counts are available as [`Consumer::stats`]. Each message is handled in an
//! `outbox.consume` tracing span.
#![doc(test(attr(deny(warnings))))]

mod conn;
mod consumer;
mod dead_letters;
mod entry;
mod error;
#[cfg(feature = "http")]
mod http;
mod lease;
mod partitions;
mod publisher;
#[cfg(feature = "sentinel")]
mod sentinel;
mod trim;

pub use consumer::{
    AfterDeadLetter, AsyncStore, Consumer, ConsumerBuilder, ConsumerConfig, ConsumerHealth,
    ConsumerStats, ConsumerStore, NoInbox, OrderedConfig, StartFrom,
};
pub use dead_letters::{
    DeadLetter, GroupConsumer, GroupInfo, blocked_keys, consumer_groups, dead_letter, dead_letters,
    purge_dead_letter, redrive_dead_letter, unblock_key,
};
pub use entry::{ENTRY_FIELDS, entry_fields, envelope_from_fields};
pub use error::{Error, Result};
#[cfg(feature = "http")]
pub use http::health_router;
pub use partitions::{
    PartitionLease, StreamTopic, partition_lease, recorded_partitions, stream_topic,
};
pub use publisher::{
    DEFAULT_MAX_PIPELINE_BYTES, DEFAULT_STREAM_PREFIX, Durability, PublisherConfig, RedisPublisher,
};
#[cfg(feature = "sentinel")]
pub use sentinel::SentinelConfig;
pub use trim::{TrimReport, trim_acknowledged};

/// The redis crate, for the types this API names.
pub use redis;
pub use redis::{Client, RedisError};
