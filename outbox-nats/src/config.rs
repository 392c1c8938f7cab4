//! The publisher's configuration.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_core::{InvalidConfig, OutboxEvent, Partitions};

use crate::{Naming, StreamSettings};

/// How long the publisher waits for the server's acknowledgement of a publish by
/// default: past it the message counts as not taken (an outage; the relay publishes
/// it again and the duplicate window drops the copy).
pub const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_secs(10);

/// The configuration of a [`NatsPublisher`](crate::NatsPublisher). Start from
/// `Default` and change fields with the `with_*` setters, each of which keeps the
/// others; [`validate`](Self::validate) checks it in one place.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct PublisherConfig {
    /// The subject and stream prefixes (the consumers must use the same).
    pub naming: Naming,
    /// Topics spread over partitions: a subject per partition,
    /// `<subject_prefix>.<topic>.p<n>`, `n` being [`outbox_core::partition_of`] the
    /// message's ordering key. Topics not listed have one subject.
    pub partitions: BTreeMap<String, Partitions>,
    /// The settings of the streams created, and checked on those that exist.
    pub streams: StreamSettings,
    /// How long to wait for each publish's acknowledgement. Default
    /// [`DEFAULT_ACK_TIMEOUT`].
    pub ack_timeout: Duration,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            naming: Naming::default(),
            partitions: BTreeMap::new(),
            streams: StreamSettings::default(),
            ack_timeout: DEFAULT_ACK_TIMEOUT,
        }
    }
}

impl PublisherConfig {
    /// With these prefixes.
    pub fn with_naming(mut self, naming: Naming) -> Self {
        self.naming = naming;
        self
    }

    /// With these stream settings.
    pub fn with_streams(mut self, streams: StreamSettings) -> Self {
        self.streams = streams;
        self
    }

    /// With this acknowledgement timeout.
    pub fn with_ack_timeout(mut self, ack_timeout: Duration) -> Self {
        self.ack_timeout = ack_timeout;
        self
    }

    /// With `topic` spread over `partitions` (other topics keep theirs).
    pub fn with_partitions(mut self, topic: impl Into<String>, partitions: Partitions) -> Self {
        self.partitions.insert(topic.into(), partitions);
        self
    }

    /// With the topics of event type `E` spread over its
    /// [`OutboxEvent::PARTITIONS`].
    pub fn with_partitions_of<E: OutboxEvent>(mut self) -> Self {
        for topic in E::TOPICS {
            self.partitions
                .insert((*topic).to_owned(), Partitions::of_event::<E>());
        }
        self
    }

    /// Checks every field: the naming, the stream settings, an acknowledgement timeout
    /// above zero.
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        self.naming.validate()?;
        self.streams.validate()?;
        if self.ack_timeout.is_zero() {
            return Err(InvalidConfig::new("ack_timeout", "must be above zero"));
        }
        Ok(())
    }
}
