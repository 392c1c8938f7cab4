#![doc = include_str!("../README.md")]
//!
//! ## Stream entries
//!
//! One entry per message, with the fields of [`ENTRY_FIELDS`]: `msg_id`, `topic`, `type`,
//! `version`, `key`, `payload` (the event's JSON), `headers` (a JSON object) and
//! `created_at`. Dead-letter entries (`<stream>:dead`) add `reason`, `delivery_count`,
//! `group`, `stream` and `entry_id` in front of the original fields (an original field
//! with one of those names is not copied). An entry a redrive put back
//! ([`redrive_dead_letter`]) adds [`REDRIVE_GROUP_FIELD`] (`redrive_group`), the group
//! it is for: every other group acknowledges it unapplied, so a producer of its own
//! must not write that field.
//!
//! ## Redis versions
//!
//! Redis 6.2 or later: `XAUTOCLAIM`, `XGROUP CREATECONSUMER` and `XTRIM ... MINID`
//! ([`trim_acknowledged`]) need 6.2, the other commands Redis 5. The tests run against
//! Redis 7.0, whose `XAUTOCLAIM` also drops pending entries whose stream entry is gone
//! (6.2 leaves them in the pending list). A Redis Cluster gets the same commands, each
//! within one hash slot.
//!
//! ## Partitioned topics
//!
//! A topic given a partition count ([`PublisherConfig::partitions`]) is published to N
//! streams `<prefix><topic>:<p>`, `p` being [`outbox_core::partition_of`] the message's
//! ordering key, so every message of a key lands on one stream in the order the relay
//! publishes it. Publishers record the counts in the hash `<prefix>partitions`
//! ([`recorded_partitions`]); ordered consumers hold each partition of a group by a
//! lease, `<stream>:lease:<group>` ([`partition_lease`]); [`stream_topic`] reads a
//! stream's topic and partition back from its name.
//!
#![doc = include_str!("../docs/deployments.md")]
//!
//! ## Metrics
//!
//! Through the [`metrics`](https://docs.rs/metrics) facade, labelled by `group` and
//! `stream`: `outbox_consumer_consumed_total`, `outbox_consumer_duplicates_total`,
//! `outbox_consumer_failures_total`, `outbox_consumer_dead_lettered_total`,
//! `outbox_consumer_ignored_total`, `outbox_consumer_redrives_for_others_total`,
//! `outbox_consumer_reclaimed_total`, `outbox_consumer_conflicts_total`,
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
pub use entry::{ENTRY_FIELDS, REDRIVE_GROUP_FIELD, entry_fields, envelope_from_fields};
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
