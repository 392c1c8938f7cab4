//! How topics, partitions and groups become NATS subjects, stream and consumer names.

use outbox_core::{InvalidConfig, Partitions};

/// The default subject prefix: topic `order.paid` is published on `outbox.order.paid`.
pub const DEFAULT_SUBJECT_PREFIX: &str = "outbox";

/// The default stream-name prefix: topic `order.paid` is kept in the stream
/// `OUTBOX_order_paid`.
pub const DEFAULT_STREAM_PREFIX: &str = "OUTBOX_";

/// Where the messages of the topics go: the subject and stream prefixes, shared by the
/// publisher and the consumers (they must agree).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Naming {
    /// Prefix of every subject, a valid subject of its own (tokens without `*`, `>` or
    /// white space). Default [`DEFAULT_SUBJECT_PREFIX`].
    pub subject_prefix: String,
    /// Prefix of every stream name (no `.`, `*`, `>`, `/`, `\` or white space).
    /// Default [`DEFAULT_STREAM_PREFIX`].
    pub stream_prefix: String,
}

impl Default for Naming {
    fn default() -> Self {
        Self {
            subject_prefix: DEFAULT_SUBJECT_PREFIX.to_owned(),
            stream_prefix: DEFAULT_STREAM_PREFIX.to_owned(),
        }
    }
}

impl Naming {
    /// Names with these prefixes, checked ([`validate`](Self::validate)).
    pub fn new(
        subject_prefix: impl Into<String>,
        stream_prefix: impl Into<String>,
    ) -> Result<Self, InvalidConfig> {
        let naming = Self {
            subject_prefix: subject_prefix.into(),
            stream_prefix: stream_prefix.into(),
        };
        naming.validate()?;
        Ok(naming)
    }

    /// Refuses a subject prefix that is not a valid subject, or a stream prefix with a
    /// character stream names cannot hold.
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        if !is_subject(&self.subject_prefix) {
            return Err(InvalidConfig::new(
                "subject_prefix",
                format!(
                    "must be a NATS subject (dot-separated tokens without `*`, `>` or white space); got {:?}",
                    self.subject_prefix
                ),
            ));
        }
        if self.stream_prefix.is_empty() || !self.stream_prefix.chars().all(stream_char) {
            return Err(InvalidConfig::new(
                "stream_prefix",
                format!(
                    "must be non-empty, without `.`, `*`, `>`, `/`, `\\` or white space; got {:?}",
                    self.stream_prefix
                ),
            ));
        }
        Ok(())
    }

    /// The subject of `topic` unpartitioned: `<subject_prefix>.<topic>`.
    pub fn subject(&self, topic: &str) -> String {
        format!("{}.{topic}", self.subject_prefix)
    }

    /// The subject of partition `p` of `topic`: `<subject_prefix>.<topic>.p<p>`.
    pub fn partition_subject(&self, topic: &str, p: u32) -> String {
        format!("{}.{topic}.p{p}", self.subject_prefix)
    }

    /// The subject that carries a message of `topic` with ordering key `key`.
    pub fn subject_for_key(&self, topic: &str, partitions: Partitions, key: &str) -> String {
        if partitions.is_partitioned() {
            self.partition_subject(topic, partitions.of(key))
        } else {
            self.subject(topic)
        }
    }

    /// The subjects the stream of `topic` holds: the topic's subject, or the wildcard
    /// over its partitions (`<subject_prefix>.<topic>.*`).
    pub fn stream_subjects(&self, topic: &str, partitions: Partitions) -> Vec<String> {
        if partitions.is_partitioned() {
            vec![format!("{}.{topic}.*", self.subject_prefix)]
        } else {
            vec![self.subject(topic)]
        }
    }

    /// The stream of `topic`: `<stream_prefix><topic>`, each character a stream name
    /// cannot hold (`.` first of all) written `_`.
    pub fn stream(&self, topic: &str) -> String {
        let topic: String = topic
            .chars()
            .map(|c| if stream_char(c) { c } else { '_' })
            .collect();
        format!("{}{topic}", self.stream_prefix)
    }

    /// The dead-letter stream: `<stream_prefix>DEAD`, subjects `<subject_prefix>-dead.>`.
    pub fn dead_letter_stream(&self) -> String {
        format!("{}DEAD", self.stream_prefix)
    }

    /// The subjects of the dead-letter stream.
    pub fn dead_letter_subjects(&self) -> String {
        format!("{}-dead.>", self.subject_prefix)
    }

    /// The dead-letter subject of `group`'s messages of `topic`:
    /// `<subject_prefix>-dead.<group>.<topic>`.
    pub fn dead_letter_subject(&self, group: &str, topic: &str) -> String {
        format!("{}-dead.{group}.{topic}", self.subject_prefix)
    }
}

/// Whether `s` is a literal NATS subject: dot-separated, non-empty tokens without
/// wildcards or white space.
pub(crate) fn is_subject(s: &str) -> bool {
    !s.is_empty()
        && s.split('.').all(|token| {
            !token.is_empty()
                && token != "*"
                && token != ">"
                && !token.contains(|c: char| c.is_whitespace() || c == '*' || c == '>')
        })
}

fn stream_char(c: char) -> bool {
    !(c.is_whitespace() || c.is_control() || matches!(c, '.' | '*' | '>' | '/' | '\\'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_topic() {
        let n = Naming::default();
        assert_eq!(n.subject("order.paid"), "outbox.order.paid");
        assert_eq!(n.stream("order.paid"), "OUTBOX_order_paid");
        let eight = Partitions::new(8).unwrap();
        let p = eight.of("order-42");
        assert_eq!(
            n.subject_for_key("order.paid", eight, "order-42"),
            format!("outbox.order.paid.p{p}")
        );
        assert_eq!(
            n.stream_subjects("order.paid", eight),
            ["outbox.order.paid.*"]
        );
        assert_eq!(
            n.subject_for_key("order.paid", Partitions::ONE, "k"),
            "outbox.order.paid"
        );
    }

    #[test]
    fn bad_prefixes_are_refused_with_the_field() {
        assert_eq!(
            Naming::new("a b", "X_").unwrap_err().field(),
            "subject_prefix"
        );
        assert_eq!(
            Naming::new("a.>", "X_").unwrap_err().field(),
            "subject_prefix"
        );
        assert_eq!(Naming::new("a", "X.").unwrap_err().field(), "stream_prefix");
        assert!(Naming::new("app.outbox", "APP_").is_ok());
        assert!(!is_subject("a..b"));
    }
}
