#![doc = include_str!("../README.md")]
#![doc(test(attr(deny(warnings))))]

mod config;
mod entry;
mod error;
mod naming;
mod publisher;
mod streams;

pub use config::{DEFAULT_ACK_TIMEOUT, PublisherConfig};
pub use entry::{MESSAGE_HEADERS, REDRIVE_GROUP_HEADER, envelope_from_message, message_headers};
pub use error::{Error, Result};
pub use naming::{DEFAULT_STREAM_PREFIX, DEFAULT_SUBJECT_PREFIX, Naming};
pub use publisher::NatsPublisher;
pub use streams::StreamSettings;

/// The async-nats crate, for the types this API names.
pub use async_nats;
pub use async_nats::jetstream::stream::{RetentionPolicy, StorageType};
