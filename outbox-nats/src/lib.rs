#![doc = include_str!("../README.md")]
#![doc(test(attr(deny(warnings))))]

mod config;
mod consumer;
mod dead_letters;
mod entry;
mod error;
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
pub use naming::{DEFAULT_STREAM_PREFIX, DEFAULT_SUBJECT_PREFIX, Naming};
pub use outbox_core::{AsyncStore, ConsumerStore};
pub use publisher::NatsPublisher;
pub use streams::StreamSettings;

/// The async-nats crate, for the types this API names.
pub use async_nats;
pub use async_nats::jetstream::stream::{RetentionPolicy, StorageType};
