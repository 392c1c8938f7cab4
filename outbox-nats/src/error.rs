//! The crate's error type.

/// Errors of the NATS transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error of the outbox core (configuration, store, dispatch).
    #[error(transparent)]
    Core(#[from] outbox_core::Error),
    /// A configuration value out of range, naming the field and the rule.
    #[error(transparent)]
    Config(#[from] outbox_core::InvalidConfig),
    /// The server could not be reached or did not answer in time (connection refused,
    /// no responders, a timeout): an outage.
    #[error("nats unavailable: {0}")]
    Unavailable(String),
    /// A JetStream API request was refused by the server (it answered with an error).
    #[error("jetstream refused to {what}: {reason}")]
    Refused {
        /// What was asked (`create stream OUTBOX_order_paid`, ...).
        what: String,
        /// The server's answer.
        reason: String,
    },
    /// An existing stream's settings differ from the configured ones: the publisher and
    /// the consumers refuse it rather than change it under other applications.
    #[error(
        "stream `{stream}` exists with {field} = {found}, the configuration asks for {expected}; \
         edit the stream (`nats stream edit {stream}`) or the configuration"
    )]
    StreamMismatch {
        /// The stream.
        stream: String,
        /// The setting that differs (`num_replicas`, `duplicate_window`, ...).
        field: &'static str,
        /// The configured value.
        expected: String,
        /// The stream's value.
        found: String,
    },
    /// A group's durable consumer exists on a stream with another `ack_wait` than the
    /// consumer's configuration: the consumer refuses it rather than change it under the
    /// group's other processes.
    #[error(
        "durable consumer `{consumer}` on stream `{stream}` exists with ack_wait = \
         {found:?}, the configuration asks for {expected:?}; edit it (`nats consumer edit \
         {stream} {consumer}`) or the configuration"
    )]
    ConsumerMismatch {
        /// The stream.
        stream: String,
        /// The durable consumer: the group.
        consumer: String,
        /// The configured `ack_wait`.
        expected: std::time::Duration,
        /// The durable consumer's.
        found: std::time::Duration,
    },
    /// A stream is missing and the configuration does not let us create it
    /// ([`StreamSettings::create`](crate::StreamSettings::create)).
    #[error("stream `{0}` does not exist and `create` is off in its settings")]
    StreamMissing(String),
    /// A message that does not carry the outbox's headers as the publisher writes them
    /// (a missing or malformed header), naming the header.
    #[error("malformed outbox message: {0}")]
    MalformedMessage(String),
}

impl Error {
    /// Whether the server could not be reached or did not answer in time: the call may
    /// succeed later without any change.
    pub fn is_outage(&self) -> bool {
        match self {
            Self::Unavailable(_) => true,
            Self::Core(e) => e.is_outage(),
            _ => false,
        }
    }

    /// Whether a message was malformed ([`Error::MalformedMessage`]).
    pub fn is_malformed_message(&self) -> bool {
        matches!(self, Self::MalformedMessage(_))
    }

    /// Whether an existing stream differs from the configuration
    /// ([`Error::StreamMismatch`]).
    pub fn is_stream_mismatch(&self) -> bool {
        matches!(self, Self::StreamMismatch { .. })
    }

    /// Whether a group's existing durable consumer differs from the configuration
    /// ([`Error::ConsumerMismatch`]).
    pub fn is_consumer_mismatch(&self) -> bool {
        matches!(self, Self::ConsumerMismatch { .. })
    }
}

impl From<Error> for outbox_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Core(e) => e,
            Error::Config(e) => e.into(),
            e => outbox_core::Error::broker_unavailable(e),
        }
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
