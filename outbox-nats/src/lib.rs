#![doc = include_str!("../README.md")]
//!
//! ## Messages
//!
//! The payload is the event's JSON; the envelope's other fields are headers
//! ([`MESSAGE_HEADERS`]): `Nats-Msg-Id`, `Outbox-Msg-Id`, `Outbox-Topic`, `Outbox-Type`,
//! `Outbox-Version`, `Outbox-Key`, `Outbox-Headers` (a JSON object) and
//! `Outbox-Created-At`. A dead letter adds the `Outbox-Dead-*` headers
//! ([`DEAD_REASON_HEADER`] and its siblings); a redriven message adds
//! [`REDRIVE_GROUP_HEADER`].
//!
//! ## Features
//!
//! - `http`: [`health_router`], a consumer's `/healthz` and `/readyz` as an axum
//!   `Router` (as outbox-redis's feature of the same name).
//!
//! The crate uses async-nats with JetStream and without its `server_2_10`+ features, so
//! that it works against NATS 2.9.
//!
//! ## Metrics
//!
//! Through the [`metrics`](https://docs.rs/metrics) facade:
//! `outbox_nats_publish_rejected_total`, `outbox_nats_publish_duplicates_total`, and the
//! consumer's `outbox_consumer_*_total` labelled `group` and `broker = "nats"` (the same
//! counts as [`Consumer::stats`]).
#![doc(test(attr(deny(warnings))))]

mod config;
mod consumer;
mod dead_letters;
mod entry;
mod error;
#[cfg(feature = "http")]
mod http;
mod naming;
mod publisher;
mod streams;

pub use config::{DEFAULT_ACK_TIMEOUT, PublisherConfig};
pub use consumer::{
    Consumer, ConsumerBuilder, ConsumerConfig, ConsumerHealth, ConsumerStats, NoInbox, StartFrom,
};
pub use dead_letters::{
    DEAD_DELIVERIES_HEADER, DEAD_GROUP_HEADER, DEAD_REASON_HEADER, DEAD_SEQUENCE_HEADER,
    DEAD_STREAM_HEADER, DEAD_SUBJECT_HEADER, DeadLetter, dead_letter, dead_letters,
    purge_dead_letter, redrive_dead_letter,
};
pub use entry::{MESSAGE_HEADERS, REDRIVE_GROUP_HEADER, envelope_from_message, message_headers};
pub use error::{Error, Result};
#[cfg(feature = "http")]
pub use http::health_router;
pub use naming::{DEFAULT_STREAM_PREFIX, DEFAULT_SUBJECT_PREFIX, Naming};
pub use outbox_core::{AsyncStore, ConsumerStore};
pub use publisher::NatsPublisher;
pub use streams::StreamSettings;

/// The async-nats crate, for the types this API names.
pub use async_nats;
pub use async_nats::jetstream::stream::{RetentionPolicy, StorageType};
