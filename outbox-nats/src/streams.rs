//! The streams the outbox writes to: their recommended settings, created when missing
//! and checked when present.

use std::time::Duration;

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::stream::{Config, DiscardPolicy, RetentionPolicy, StorageType};
use async_nats::jetstream::{self, context::CreateStreamErrorKind, context::GetStreamErrorKind};
use outbox_core::InvalidConfig;

use crate::{Error, Result};

/// The settings of the streams the outbox creates, and checks on streams that exist:
/// a stream whose subjects, replicas, duplicate window, retention, storage, `max_age`
/// (or `max_message_size`, when set) differ is refused with
/// [`Error::StreamMismatch`].
///
/// The defaults suit one server: one replica, file storage, limits retention (every
/// consumer group reads the whole stream; messages leave by age), a duplicate window
/// of two minutes, messages kept seven days. On a cluster choose three replicas:
/// a publish is then acknowledged once a majority stored it, and a killed leader loses
/// nothing.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct StreamSettings {
    /// Copies of each message (1 to 5). Default 1; 3 on a cluster.
    pub replicas: usize,
    /// How long the server remembers a `Nats-Msg-Id`: a message published again inside
    /// this window is acknowledged and dropped. Cover the relay's longest time between a
    /// publish and the row's SENT mark (its batch timeout and one outage backoff).
    /// Default two minutes.
    pub duplicate_window: Duration,
    /// `Limits` (the default): every group reads every message; `Interest` removes a
    /// message once every consumer acknowledged it. `WorkQueue` does not allow more than
    /// one group.
    pub retention: RetentionPolicy,
    /// `File` (the default) or `Memory` (lost with the server).
    pub storage: StorageType,
    /// How long a message is kept (`Duration::ZERO`: for ever). Default seven days.
    pub max_age: Duration,
    /// The largest message the stream takes, in bytes (`None`: the server's
    /// `max_payload`). The publisher refuses a larger one before sending it.
    pub max_message_size: Option<u32>,
    /// Create a missing stream (the default), or refuse with [`Error::StreamMissing`].
    pub create: bool,
}

impl Default for StreamSettings {
    fn default() -> Self {
        Self {
            replicas: 1,
            duplicate_window: Duration::from_secs(120),
            retention: RetentionPolicy::Limits,
            storage: StorageType::File,
            max_age: Duration::from_secs(7 * 24 * 3600),
            max_message_size: None,
            create: true,
        }
    }
}

impl StreamSettings {
    /// With `replicas` copies of each message.
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// With this duplicate window.
    pub fn with_duplicate_window(mut self, window: Duration) -> Self {
        self.duplicate_window = window;
        self
    }

    /// With this retention policy.
    pub fn with_retention(mut self, retention: RetentionPolicy) -> Self {
        self.retention = retention;
        self
    }

    /// With this storage.
    pub fn with_storage(mut self, storage: StorageType) -> Self {
        self.storage = storage;
        self
    }

    /// With this maximum age of a message.
    pub fn with_max_age(mut self, max_age: Duration) -> Self {
        self.max_age = max_age;
        self
    }

    /// With this largest message size, in bytes.
    pub fn with_max_message_size(mut self, bytes: u32) -> Self {
        self.max_message_size = Some(bytes);
        self
    }

    /// Creating missing streams (`true`) or refusing them.
    pub fn with_create(mut self, create: bool) -> Self {
        self.create = create;
        self
    }

    /// Refuses values the server would refuse: replicas out of 1..=5, a zero duplicate
    /// window, a duplicate window longer than `max_age`.
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        if !(1..=5).contains(&self.replicas) {
            return Err(InvalidConfig::new(
                "replicas",
                format!("must be between 1 and 5; got {}", self.replicas),
            ));
        }
        if self.duplicate_window.is_zero() {
            return Err(InvalidConfig::new(
                "duplicate_window",
                "must be above zero: without it a message published again is stored twice",
            ));
        }
        // JetStream takes durations as i64 nanoseconds (about 292 years): a longer one
        // would wrap, to a negative or a short one.
        const LONGEST: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
        for (field, d) in [
            ("duplicate_window", self.duplicate_window),
            ("max_age", self.max_age),
        ] {
            if d > LONGEST {
                return Err(InvalidConfig::new(field, "must be at most 100 years"));
            }
        }
        // JetStream keeps the limit as an i32: a larger one would be cut to i32::MAX,
        // and the stream found would never match the settings.
        if self
            .max_message_size
            .is_some_and(|n| i32::try_from(n).is_err() || n == 0)
        {
            return Err(InvalidConfig::new(
                "max_message_size",
                format!("must be from 1 to {} bytes", i32::MAX),
            ));
        }
        if !self.max_age.is_zero() && self.duplicate_window > self.max_age {
            return Err(InvalidConfig::new(
                "duplicate_window",
                format!(
                    "must not exceed max_age ({:?}); got {:?}",
                    self.max_age, self.duplicate_window
                ),
            ));
        }
        Ok(())
    }

    /// The configuration of a new stream `name` over `subjects`.
    pub(crate) fn config(&self, name: &str, subjects: Vec<String>) -> Config {
        Config {
            name: name.to_owned(),
            subjects,
            retention: self.retention,
            storage: self.storage,
            num_replicas: self.replicas,
            duplicate_window: self.duplicate_window,
            max_age: self.max_age,
            max_message_size: self
                .max_message_size
                .map_or(-1, |n| i32::try_from(n).unwrap_or(i32::MAX)),
            discard: DiscardPolicy::Old,
            ..Config::default()
        }
    }

    /// The first setting of `found` that differs from these for a stream over
    /// `subjects`.
    fn mismatch(&self, found: &Config, subjects: &[String]) -> Option<Error> {
        let differs = |field, expected: String, value: String| {
            Some(Error::StreamMismatch {
                stream: found.name.clone(),
                field,
                expected,
                found: value,
            })
        };
        if let Some(missing) = subjects.iter().find(|s| !found.subjects.contains(s)) {
            return differs(
                "subjects",
                format!("{missing:?} among them"),
                format!("{:?}", found.subjects),
            );
        }
        if found.num_replicas.max(1) != self.replicas {
            return differs(
                "num_replicas",
                self.replicas.to_string(),
                found.num_replicas.to_string(),
            );
        }
        if found.duplicate_window != self.duplicate_window {
            return differs(
                "duplicate_window",
                format!("{:?}", self.duplicate_window),
                format!("{:?}", found.duplicate_window),
            );
        }
        if found.retention != self.retention {
            return differs(
                "retention",
                format!("{:?}", self.retention),
                format!("{:?}", found.retention),
            );
        }
        if let Some(max) = self.max_message_size
            && i64::from(found.max_message_size) != i64::from(max)
        {
            return differs(
                "max_message_size",
                max.to_string(),
                found.max_message_size.to_string(),
            );
        }
        if found.storage != self.storage {
            return differs(
                "storage",
                format!("{:?}", self.storage),
                format!("{:?}", found.storage),
            );
        }
        // Messages leaving sooner than configured would be lost to a consumer that is
        // behind; kept longer, to the operator's surprise: either way, say so.
        if found.max_age != self.max_age {
            return differs(
                "max_age",
                format!("{:?}", self.max_age),
                format!("{:?}", found.max_age),
            );
        }
        None
    }
}

/// The first setting of the durable consumer `found` that differs from the consumer's
/// configuration ([`Error::ConsumerMismatch`]): its `ack_wait`, which decides when a
/// message in a handler's hands is delivered to another reader.
pub(crate) fn consumer_mismatch(
    found: &async_nats::jetstream::consumer::Config,
    stream: &str,
    ack_wait: Duration,
) -> Option<Error> {
    (found.ack_wait != ack_wait).then(|| Error::ConsumerMismatch {
        stream: stream.to_owned(),
        consumer: found.durable_name.clone().unwrap_or_default(),
        expected: ack_wait,
        found: found.ack_wait,
    })
}

/// What the publisher keeps of a stream it created or checked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StreamFacts {
    /// The largest message it takes, if it says.
    pub(crate) max_message_size: Option<usize>,
}

/// Creates stream `name` over `subjects` with `settings`, or checks the one that exists.
pub(crate) async fn ensure_stream(
    js: &jetstream::Context,
    name: &str,
    subjects: Vec<String>,
    settings: &StreamSettings,
) -> Result<StreamFacts> {
    for _ in 0..2 {
        match js.get_stream(name).await {
            Ok(stream) => {
                let found = &stream.cached_info().config;
                if let Some(e) = settings.mismatch(found, &subjects) {
                    return Err(e);
                }
                return Ok(facts(found));
            }
            Err(e) => match e.kind() {
                GetStreamErrorKind::JetStream(js_err)
                    if js_err.error_code() == ErrorCode::STREAM_NOT_FOUND => {}
                GetStreamErrorKind::JetStream(js_err) => {
                    return Err(refused(format!("get stream {name}"), &js_err));
                }
                _ => return Err(Error::Unavailable(format!("stream {name}: {e}"))),
            },
        }
        if !settings.create {
            return Err(Error::StreamMissing(name.to_owned()));
        }
        match js
            .create_stream(settings.config(name, subjects.clone()))
            .await
        {
            Ok(stream) => return Ok(facts(&stream.cached_info().config)),
            Err(e) => match e.kind() {
                // Another publisher created it meanwhile: check it.
                CreateStreamErrorKind::JetStream(js_err)
                    if js_err.error_code() == ErrorCode::STREAM_NAME_EXIST => {}
                // Not found, yet its subjects are taken: a server just started may still
                // be restoring it (seen after a restart). Asked again after a backoff;
                // an overlap with another stream stays in the health's last error.
                CreateStreamErrorKind::JetStream(js_err)
                    if js_err.error_code() == ErrorCode::STREAM_SUBJECT_OVERLAP =>
                {
                    return Err(Error::Unavailable(format!(
                        "create stream {name}: {js_err}"
                    )));
                }
                CreateStreamErrorKind::JetStream(js_err) => {
                    return Err(refused(format!("create stream {name}"), &js_err));
                }
                _ => return Err(Error::Unavailable(format!("create stream {name}: {e}"))),
            },
        }
    }
    Err(Error::Unavailable(format!(
        "stream {name} was created and removed while it was checked"
    )))
}

/// The server's answer to a stream request: an outage while the cluster has no
/// JetStream leader or too few peers for the replicas (a node down, an election), a
/// refusal otherwise.
pub(crate) fn refused(what: String, e: &jetstream::Error) -> Error {
    let code = e.error_code();
    if code == ErrorCode::CLUSTER_NOT_AVAILABLE
        || code == ErrorCode::CLUSTER_NO_PEERS
        || code == ErrorCode::INSUFFICIENT_RESOURCES
        || e.code() == 503
    {
        Error::Unavailable(format!("{what}: {e}"))
    } else {
        Error::Refused {
            what,
            reason: e.to_string(),
        }
    }
}

fn facts(config: &Config) -> StreamFacts {
    StreamFacts {
        max_message_size: usize::try_from(config.max_message_size)
            .ok()
            .filter(|&n| n > 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes_jetstream_cannot_hold_are_refused() {
        let ok = StreamSettings::default();
        assert!(ok.validate().is_ok());
        let field = |s: StreamSettings| s.validate().unwrap_err().field().to_owned();
        assert_eq!(field(ok.clone().with_max_age(Duration::MAX)), "max_age");
        assert_eq!(
            field(
                ok.clone()
                    .with_max_age(Duration::ZERO)
                    .with_duplicate_window(Duration::MAX)
            ),
            "duplicate_window"
        );
        assert_eq!(
            field(ok.clone().with_max_message_size(u32::MAX)),
            "max_message_size"
        );
        assert_eq!(field(ok.with_max_message_size(0)), "max_message_size");
    }
}
