//! Redis Streams for the transactional outbox: a pipelined publisher for the relay, and
//! consumer groups that apply each message exactly once in effect through typed handlers.
//!
//! - [`RedisPublisher`] implements [`outbox_core::Publisher`]: each topic is a stream
//!   (`outbox:<topic>`), a relay batch is one pipelined round trip of `XADD`s, and an
//!   outage backs the relay off without spending any message's retries.
//! - [`Consumer`] reads a consumer group with `XREADGROUP ... BLOCK`, routes each entry by
//!   event type to a [`Handler`](outbox_core::Handler), records `(group, msg_id)` in the
//!   handler's own transaction through an [`Inbox`](outbox_core::Inbox), and acknowledges
//!   after the commit. Failures are retried via `XAUTOCLAIM` and end in a dead-letter
//!   stream after a delivery limit.
//! - [`trim_acknowledged`] bounds a stream without ever removing an entry some group still
//!   needs; a consumer can run it periodically
//!   ([`trim_interval`](ConsumerConfig::trim_interval)), and `outbox trim` runs it on
//!   every stream of a prefix. Dead-letter streams keep at most
//!   [`dead_letter_max_len`](ConsumerConfig::dead_letter_max_len) entries.
//!
//! # Example
//!
//! The publisher goes to the relay; the consumer runs handlers in the idempotency
//! store's transactions. With `outbox-diesel` the store is its inbox over a connection
//! pool and `Conn` is e.g. `PgConnection`; here the in-memory database of `outbox-core`
//! stands in.
//!
//! ```no_run
//! use outbox_core::{Delivery, Handler, HandlerError, MemoryDb, MemoryTx, OutboxEvent, Relay};
//! use outbox_redis::{Consumer, RedisPublisher};
//!
//! #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
//! struct OrderPaid { #[outbox(id)] order_id: String, amount_cents: i64 }
//!
//! #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
//! struct OrderRefunded { #[outbox(id)] order_id: String }
//!
//! type Points = std::collections::BTreeMap<String, i64>;
//!
//! struct AwardPoints;
//! impl Handler<OrderPaid> for AwardPoints {
//!     type Conn = MemoryTx<Points>; // with outbox-diesel: `PgConnection`
//!     fn handle(&self, e: OrderPaid, tx: &mut Self::Conn, _: &Delivery) -> Result<(), HandlerError> {
//!         *tx.data().entry(e.order_id).or_default() += e.amount_cents / 100;
//!         Ok(())
//!     }
//! }
//!
//! struct RevokePoints;
//! impl Handler<OrderRefunded> for RevokePoints {
//!     type Conn = MemoryTx<Points>;
//!     fn handle(&self, e: OrderRefunded, tx: &mut Self::Conn, _: &Delivery) -> Result<(), HandlerError> {
//!         tx.data().remove(&e.order_id);
//!         Ok(())
//!     }
//! }
//!
//! # tokio::runtime::Runtime::new()?.block_on(async {
//! let redis_url = "redis://127.0.0.1:6379";
//!
//! // Publishing side: the relay moves committed outbox rows to the streams.
//! let outbox = MemoryDb::new(());
//! let relay = Relay::new(outbox, RedisPublisher::new(redis_url)?);
//! relay.run_once().await?;
//!
//! // Consuming side.
//! let store = MemoryDb::new(Points::new());
//! let consumer = Consumer::builder(redis_url, "points") // consumer group
//!     .handle::<OrderPaid, _>(AwardPoints)
//!     .handle::<OrderRefunded, _>(RevokePoints)
//!     .idempotency(store)
//!     .build()?;
//! // Typically `tokio::signal::ctrl_c()`; here a channel.
//! let (_stop, stopped) = tokio::sync::oneshot::channel::<()>();
//! let shutdown_signal = async { stopped.await.ok(); };
//! consumer.run_until(shutdown_signal).await?;
//! # Ok::<_, Box<dyn std::error::Error>>(()) })?;
//! # Ok::<_, Box<dyn std::error::Error>>(())
//! ```
//!
//! # Stream entries
//!
//! One entry per message, with the fields of [`ENTRY_FIELDS`]: `msg_id`, `topic`, `type`,
//! `version`, `key`, `payload` (the event's JSON), `headers` (a JSON object) and
//! `created_at`. Dead-letter entries (`<stream>:dead`) add `reason`, `delivery_count`,
//! `group`, `stream` and `entry_id` in front of the original fields (an original field
//! with one of those names is not copied).
//!
//! # Redis versions
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
//! # Redis Cluster
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
//!   constructor refuse one.
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
//! # Features
//!
//! | feature   | default | what it gives |
//! |-----------|---------|---------------|
//! | `cluster` | no      | Redis Cluster support: `RedisPublisher::cluster` and `Consumer::builder_cluster`, with hash-tagged stream names (enables the redis crate's `cluster-async`) |
//!
//! Without features the crate talks to one Redis server; it runs on tokio either way.
//!
//! # Metrics
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
mod entry;
mod error;
mod publisher;
mod trim;

pub use consumer::{Consumer, ConsumerBuilder, ConsumerConfig, ConsumerStats, NoInbox, StartFrom};
pub use entry::{ENTRY_FIELDS, entry_fields, envelope_from_fields};
pub use error::{Error, Result};
pub use publisher::{
    DEFAULT_MAX_PIPELINE_BYTES, DEFAULT_STREAM_PREFIX, Durability, PublisherConfig, RedisPublisher,
};
pub use trim::{TrimReport, trim_acknowledged};

/// The redis crate, for the types this API names.
pub use redis;
pub use redis::{Client, RedisError};
