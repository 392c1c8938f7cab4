use crate::{InvalidMsgId, MsgId};

/// A boxed error from a backend (database driver, broker client).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `outbox-core` and the backends built on its traits.
///
/// Its `Display` says only what failed at this layer; the cause, if any, is its
/// [`source`](std::error::Error::source). Show both with [`error_chain`](crate::error_chain).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The event's id does not make a valid msg_id.
    #[error(transparent)]
    InvalidMsgId(#[from] InvalidMsgId),
    /// The event could not be serialized to JSON.
    #[error("cannot serialize event `{msg_id}`")]
    Serialize {
        /// The event's msg_id.
        msg_id: MsgId,
        /// serde's error.
        source: serde_json::Error,
    },
    /// The serialized payload is over the configured limit.
    #[error("event `{msg_id}` payload is {size} bytes; the limit is {limit}")]
    PayloadTooLarge {
        /// The event's msg_id.
        msg_id: MsgId,
        /// Serialized size in bytes.
        size: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// A message with this msg_id is already in the outbox: the same business fact was
    /// submitted twice. The first message is untouched.
    #[error("duplicate msg_id `{0}`: this event was already emitted")]
    Duplicate(MsgId),
    /// The payload could not be decoded into the handler's event type.
    #[error("cannot decode a `{event_type}` payload")]
    Decode {
        /// The message's event type.
        event_type: String,
        /// serde's error.
        source: serde_json::Error,
    },
    /// The message carries a newer schema version of its event type than the handler's
    /// type ([`OutboxEvent::SCHEMA_VERSION`](crate::OutboxEvent::SCHEMA_VERSION)): it
    /// was written by a newer producer, and decoding it could silently drop what the
    /// newer schema added. Deploy the newer consumer, then re-drive the message.
    #[error(
        "`{event_type}` payload has schema version {version}; this consumer handles versions up to {supported}: produced by a newer service (v{version} > v{supported})"
    )]
    UnsupportedSchemaVersion {
        /// The message's event type.
        event_type: String,
        /// The message's schema version.
        version: u32,
        /// The highest version the handler's event type knows.
        supported: u32,
    },
    /// An upgrade step registered with
    /// [`Dispatcher::upgrade`](crate::Dispatcher::upgrade) failed or panicked on this
    /// payload: the payload of version `from` cannot be turned into version `from + 1`.
    #[error("cannot upgrade a `{event_type}` payload from schema version {from} to {}", .from + 1)]
    Upgrade {
        /// The message's event type.
        event_type: String,
        /// The version the failing step starts from.
        from: u32,
        /// The step's error.
        source: BoxError,
    },
    /// No handler is registered for this event type.
    #[error("no handler for event type `{0}`")]
    UnknownEventType(String),
    /// Two handlers were registered for one event type.
    #[error("a handler for event type `{0}` is already registered")]
    DuplicateHandler(String),
    /// A handler returned an error or panicked.
    #[error("handler failed")]
    Handler(#[source] BoxError),
    /// The database failed (connection, query, transaction).
    #[error("store error")]
    Store(#[source] BoxError),
    /// The message's transaction met a transient conflict with another transaction — a
    /// deadlock, a serialization failure, a lock wait that gave up — in its handler or
    /// its dedup insert, and nothing of it committed. Neither the message's fault nor an
    /// outage: running it again is expected to succeed. Retry it soon, without counting
    /// the attempt against its delivery limit, within a bound of its own
    /// ([`is_transient`](Self::is_transient)).
    #[error("transient database conflict, nothing committed; retry")]
    Transient(#[source] BoxError),
    /// A transient conflict in message `msg_id` made the database roll back the whole
    /// transaction of a batch ([`Inbox::process_batch`](crate::Inbox::process_batch)):
    /// MySQL and MariaDB end the transaction on a deadlock, savepoints included. Nothing
    /// of the batch committed and no message failed on its own: retry the batch, or its
    /// messages one by one ([`is_transient`](Self::is_transient)).
    #[error(
        "transient database conflict{} rolled back the whole batch, nothing committed; retry",
        during(.msg_id)
    )]
    TransientBatch {
        /// The message whose handler or dedup insert met the conflict; `None` when it
        /// came at the batch's `COMMIT` (a serialization failure).
        msg_id: Option<MsgId>,
        /// The database's error.
        source: BoxError,
    },
    /// The broker as a whole is unreachable or timed out. The relay backs off without
    /// spending any message's retries.
    #[error("broker unavailable")]
    BrokerUnavailable(#[source] BoxError),
    /// Another relay holds this store exclusively (SQLite takes one relay per database):
    /// this relay must stop. Not an outage: waiting does not resolve it.
    #[error("another relay holds this store")]
    RelayConflict(#[source] BoxError),
    /// A stored status value that is not NEW, SENT or DEAD.
    #[error("unknown outbox status value {0}")]
    UnknownStatus(i16),
    /// A configuration value breaks its rule (see [`InvalidConfig`]).
    #[error(transparent)]
    Config(#[from] InvalidConfig),
}

impl Error {
    /// Wraps a database error.
    pub fn store(e: impl Into<BoxError>) -> Self {
        Self::Store(e.into())
    }

    /// Wraps a transient conflict between transactions ([`Error::Transient`]).
    pub fn transient(e: impl Into<BoxError>) -> Self {
        Self::Transient(e.into())
    }

    /// Wraps a broker connection error or timeout.
    pub fn broker_unavailable(e: impl Into<BoxError>) -> Self {
        Self::BrokerUnavailable(e.into())
    }

    /// The same business fact was emitted twice.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Self::Duplicate(_))
    }

    /// A failure of the whole broker or database rather than of one message: retry
    /// later, as a whole.
    pub fn is_outage(&self) -> bool {
        matches!(self, Self::BrokerUnavailable(_) | Self::Store(_))
    }

    /// Another relay holds this store exclusively ([`Error::RelayConflict`]): stop this
    /// relay; waiting does not resolve it.
    pub fn is_relay_conflict(&self) -> bool {
        matches!(self, Self::RelayConflict(_))
    }

    /// A transient conflict between transactions (deadlock, serialization failure, lock
    /// wait timeout), of one message ([`Error::Transient`]) or of a whole batch
    /// ([`Error::TransientBatch`]): nothing of it committed. Retry soon, without counting
    /// it as the message's failure, within a bound of its own; it is neither an outage
    /// ([`is_outage`](Self::is_outage)) nor a reason to dead-letter.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Transient(_) | Self::TransientBatch { .. })
    }

    /// A message that can never be processed as it is (bad payload, no handler, a newer
    /// schema version than the handler knows, a payload its upgrade step refuses): it
    /// goes to the dead-letter stream at once.
    pub fn is_poison(&self) -> bool {
        matches!(
            self,
            Self::Decode { .. }
                | Self::UnknownEventType(_)
                | Self::UnsupportedSchemaVersion { .. }
                | Self::Upgrade { .. }
        )
    }
}

/// A configuration value that breaks its rule: what a config's `validate` returns, and
/// what a component refuses a config with. It names the field (a nested config's field
/// as `outer.inner`, e.g. `retry.jitter`) and the rule.
///
/// ```
/// use outbox_core::RelayConfig;
///
/// let err = RelayConfig::default().with_batch_size(0).validate().unwrap_err();
/// assert_eq!(err.field(), "batch_size");
/// assert_eq!(err.rule(), "must be at least 1");
/// assert_eq!(err.to_string(), "invalid configuration: batch_size must be at least 1");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration: {field} {rule}")]
pub struct InvalidConfig {
    field: String,
    rule: String,
}

impl InvalidConfig {
    /// `field` breaks `rule`, a phrase that follows the field's name ("must be at least 1").
    pub fn new(field: impl Into<String>, rule: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            rule: rule.into(),
        }
    }

    /// The same error, seen from the config that holds this one in its field `parent`:
    /// the field becomes `parent.field`.
    #[must_use]
    pub fn in_field(mut self, parent: &str) -> Self {
        self.field = format!("{parent}.{}", self.field);
        self
    }

    /// The field, as it is spelled in its config (`batch_size`, `retry.jitter`).
    pub fn field(&self) -> &str {
        &self.field
    }

    /// The rule it breaks ("must be at least 1").
    pub fn rule(&self) -> &str {
        &self.rule
    }
}

/// ` in `msg_id``, or nothing.
fn during(msg_id: &Option<MsgId>) -> String {
    msg_id
        .as_ref()
        .map_or_else(String::new, |id| format!(" in `{id}`"))
}

/// The error a [`Handler`](crate::Handler) returns. Anything that implements
/// `std::error::Error` converts with `?`; [`HandlerError::msg`] makes one from text.
pub struct HandlerError(BoxError);

impl HandlerError {
    /// A handler error with a message.
    pub fn msg(message: impl std::fmt::Display) -> Self {
        Self(message.to_string().into())
    }

    /// The underlying error.
    pub fn into_inner(self) -> BoxError {
        self.0
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for HandlerError {
    fn from(e: E) -> Self {
        Self(Box::new(e))
    }
}

impl std::fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.0, f)
    }
}

impl std::fmt::Display for HandlerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

impl From<HandlerError> for Error {
    fn from(e: HandlerError) -> Self {
        Self::Handler(e.0)
    }
}

impl From<HandlerError> for BoxError {
    fn from(e: HandlerError) -> Self {
        e.0
    }
}

impl From<HandlerError> for Box<dyn std::error::Error> {
    fn from(e: HandlerError) -> Self {
        e.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_conflicts_are_neither_outages_nor_poison() {
        let one = Error::transient("deadlock detected");
        let batch = Error::TransientBatch {
            msg_id: Some(MsgId::new("b:Credit").unwrap()),
            source: "deadlock detected".into(),
        };
        let at_commit = Error::TransientBatch {
            msg_id: None,
            source: "could not serialize access".into(),
        };
        for e in [&one, &batch, &at_commit] {
            assert!(e.is_transient(), "{e}");
            assert!(!e.is_outage() && !e.is_poison() && !e.is_duplicate(), "{e}");
        }
        assert!(!Error::store("down").is_transient());
        assert!(!Error::Handler("refused".into()).is_transient());
        assert_eq!(
            crate::error_chain(&batch).to_string(),
            "transient database conflict in `b:Credit` rolled back the whole batch, nothing \
             committed; retry: deadlock detected"
        );
        assert!(
            at_commit
                .to_string()
                .starts_with("transient database conflict rolled back")
        );
    }
}
