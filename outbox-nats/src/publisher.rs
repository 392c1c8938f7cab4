//! The relay's publisher: each message a JetStream publish with `Nats-Msg-Id`, a batch
//! sent whole before its acknowledgements are awaited.

use std::collections::HashMap;

use async_nats::connection::State;
use async_nats::jetstream::context::{PublishAckFuture, PublishError};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::{self, ErrorCode, context::PublishErrorKind};
use outbox_core::{Partitions, PublishOutcomes, Publisher, RejectKind, Rejected, StoredMessage};
use tokio::sync::Mutex;

use crate::entry::message_headers;
use crate::naming::is_subject;
use crate::streams::{StreamFacts, ensure_stream};
use crate::{Error, PublisherConfig, Result};

/// Publishes the relay's batches to NATS JetStream.
///
/// Each topic is a stream ([`stream_for`](Self::stream_for), `OUTBOX_order_paid`) over
/// the topic's subject (`outbox.order.paid`), or over one subject per partition for a
/// topic of [`PublisherConfig::partitions`]. The publisher creates a missing stream with
/// the configured [`StreamSettings`](crate::StreamSettings) at the first message of its
/// topic, and refuses one that exists with other settings ([`Error::StreamMismatch`]):
/// the relay then holds that topic's messages (no retry spent) and logs the error.
///
/// Every message carries `Nats-Msg-Id` = its msg_id, so a message the relay publishes
/// again (after a crash between the publish and the SENT mark, or an acknowledgement
/// that timed out) is acknowledged and dropped by the server if it comes within the
/// stream's duplicate window.
///
/// A batch is sent in waves of at most one message per key, each wave whole before its
/// acknowledgements are awaited: one round trip per wave, not per message, and a key's
/// message is never sent before the one ahead of it was stored (see `Call`). Outcomes:
///
/// - acknowledged (also as a duplicate): taken, the row becomes SENT;
/// - no connection, no responders (no stream leader), a timeout: an outage, no retry
///   spent, the relay backs off; the messages not sent after it are not taken either;
/// - refused by the server or before sending (too large for the stream or the server,
///   a topic that is no subject, a header value with a line break): the message
///   spends a retry, and the later messages of its key in the batch are not sent
///   ([`RejectKind::Held`]), so they cannot overtake it;
/// - a stream that is full (`maximum messages/bytes exceeded` with a discard-new policy)
///   or that differs from the settings: a fault of the topic, no retry spent.
#[derive(Debug)]
pub struct NatsPublisher {
    client: async_nats::Client,
    js: jetstream::Context,
    config: PublisherConfig,
    /// The streams created or checked, by topic.
    streams: Mutex<HashMap<String, StreamFacts>>,
}

impl NatsPublisher {
    /// Connects to `url` (`nats://127.0.0.1:4222`, or a comma-separated list of
    /// servers) with the default [`PublisherConfig`]. The client keeps reconnecting
    /// for ever; a server down at start is an outage of the first publishes, not an
    /// error here.
    pub async fn connect(url: &str) -> Result<Self> {
        let client = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect(url)
            .await
            .map_err(|e| Error::Unavailable(format!("connect to {url}: {e}")))?;
        Self::new(client, PublisherConfig::default())
    }

    /// A publisher on `client`, with `config` ([`PublisherConfig::validate`]d).
    pub fn new(client: async_nats::Client, config: PublisherConfig) -> Result<Self> {
        config.validate()?;
        let js = jetstream::ContextBuilder::new()
            .timeout(config.ack_timeout)
            .build(client.clone());
        Ok(Self {
            client,
            js,
            config,
            streams: Mutex::default(),
        })
    }

    /// Replaces the configuration (validated first). Streams already checked are
    /// checked again.
    pub fn with_config(self, config: PublisherConfig) -> Result<Self> {
        Self::new(self.client, config)
    }

    /// The configuration in force.
    pub fn config(&self) -> &PublisherConfig {
        &self.config
    }

    /// The client, for other uses of the same connection.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The partition count of `topic`: as configured, or one.
    pub fn partitions_of(&self, topic: &str) -> Partitions {
        (self.config.partitions.get(topic).copied()).unwrap_or_default()
    }

    /// The stream that keeps `topic`'s messages.
    pub fn stream_for(&self, topic: &str) -> String {
        self.config.naming.stream(topic)
    }

    /// The subject a message of `topic` with ordering key `key` is published on.
    pub fn subject_for_key(&self, topic: &str, key: &str) -> String {
        let partitions = self.partitions_of(topic);
        self.config.naming.subject_for_key(topic, partitions, key)
    }

    /// Creates the streams of `topics` that are missing and checks those that exist,
    /// as the first publish of each would: call it at start-up to fail there.
    pub async fn ensure_streams<'t>(
        &self,
        topics: impl IntoIterator<Item = &'t str>,
    ) -> Result<()> {
        for topic in topics {
            self.stream_facts(topic).await?;
        }
        Ok(())
    }

    async fn stream_facts(&self, topic: &str) -> Result<StreamFacts> {
        if let Some(facts) = self.streams.lock().await.get(topic) {
            return Ok(*facts);
        }
        let naming = &self.config.naming;
        let subjects = naming.stream_subjects(topic, self.partitions_of(topic));
        let facts = ensure_stream(
            &self.js,
            &naming.stream(topic),
            subjects,
            &self.config.streams,
        )
        .await?;
        self.streams.lock().await.insert(topic.to_owned(), facts);
        Ok(facts)
    }

    /// The stream of each topic of `batch`, or why its messages are refused; an outage
    /// fails the call before anything is sent.
    async fn streams_of(
        &self,
        batch: &[StoredMessage],
    ) -> Result<HashMap<String, Result<StreamFacts, Rejected>>, outbox_core::Error> {
        let mut out: HashMap<String, Result<StreamFacts, Rejected>> = HashMap::new();
        for m in batch {
            let topic = &m.envelope.topic;
            if out.contains_key(topic) {
                continue;
            }
            let facts = if is_subject(topic) {
                match self.stream_facts(topic).await {
                    Ok(facts) => Ok(facts),
                    Err(e) if e.is_outage() => return Err(e.into()),
                    Err(e) => Err(Rejected::topic(e.to_string())),
                }
            } else {
                Err(Rejected::new(format!(
                    "topic {topic:?} is not a NATS subject (dot-separated tokens without `*`, `>` or white space)"
                )))
            };
            out.insert(topic.clone(), facts);
        }
        Ok(out)
    }

    /// Sends message `m`; `Err` is the refusal found before it reached the server, or
    /// the outage that stops the batch (`Ok(Err(..))`).
    async fn send(
        &self,
        m: &StoredMessage,
        facts: &StreamFacts,
    ) -> Result<Result<PublishAckFuture, Rejected>, String> {
        let e = &m.envelope;
        let headers = match message_headers(e) {
            Ok(h) => h,
            Err(reason) => return Ok(Err(Rejected::new(reason))),
        };
        let size = e.payload.len() + headers_len(&headers);
        if let Some(max) = facts.max_message_size.filter(|&max| size > max) {
            return Ok(Err(Rejected::new(format!(
                "message of {size} bytes exceeds the stream's max_message_size of {max}"
            ))));
        }
        let publish = PublishMessage::build()
            .headers(headers)
            .payload(e.payload.clone().into());
        let subject = self.subject_for_key(&e.topic, &e.key);
        match self.js.send_publish(subject, publish).await {
            Ok(ack) => Ok(Ok(ack)),
            Err(err) if matches!(err.kind(), PublishErrorKind::MaxPayloadExceeded) => {
                Ok(Err(Rejected::new(err.to_string())))
            }
            Err(err) => Err(err.to_string()),
        }
    }

    /// The outcome of one acknowledgement; a missing stream is forgotten so that the
    /// next call creates it again (a server back without its data).
    async fn outcome(
        &self,
        topic: &str,
        ack: Result<PublishAck, PublishError>,
    ) -> Result<(), Rejected> {
        match ack {
            Ok(ack) => {
                if ack.duplicate {
                    metrics::counter!("outbox_nats_publish_duplicates_total").increment(1);
                }
                Ok(())
            }
            Err(e) => {
                let rejected = classify(&e);
                if matches!(e.kind(), PublishErrorKind::StreamNotFound) {
                    self.streams.lock().await.remove(topic);
                }
                if rejected.kind == RejectKind::Message {
                    metrics::counter!("outbox_nats_publish_rejected_total").increment(1);
                }
                Err(rejected)
            }
        }
    }
}

/// What `headers` add to a message on the wire, as the server counts it against
/// `max_message_size`.
fn headers_len(headers: &async_nats::HeaderMap) -> usize {
    const VERSION_LINE: usize = "NATS/1.0\r\n\r\n".len();
    VERSION_LINE
        + (headers.iter())
            .map(|(name, values)| {
                values
                    .iter()
                    .map(|v| AsRef::<str>::as_ref(name).len() + v.as_str().len() + ": \r\n".len())
                    .sum::<usize>()
            })
            .sum::<usize>()
}

/// Whose fault a failed acknowledgement is.
fn classify(e: &PublishError) -> Rejected {
    match e.kind() {
        PublishErrorKind::TimedOut
        | PublishErrorKind::BrokenPipe
        | PublishErrorKind::MaxAckPending => Rejected::unavailable(e.to_string()),
        PublishErrorKind::StreamNotFound => Rejected::unavailable(format!(
            "{e} (no responders: the stream or its leader is not there)"
        )),
        _ => match jetstream_code(e) {
            // `maximum messages/bytes exceeded`: the stream is full and discards new
            // messages; every message of the topic is refused until it has room.
            Some(code) if code == ErrorCode::STREAM_STORE_FAILED => Rejected::topic(error_text(e)),
            // JetStream not ready (a leader election, a restart).
            Some(code)
                if code == ErrorCode::CLUSTER_NOT_AVAILABLE
                    || code == ErrorCode::JETSTREAM_NOT_ENABLED =>
            {
                Rejected::unavailable(error_text(e))
            }
            Some(_) => Rejected::new(error_text(e)),
            None => Rejected::unavailable(error_text(e)),
        },
    }
}

fn jetstream_code(e: &PublishError) -> Option<ErrorCode> {
    let source = std::error::Error::source(e)?;
    source
        .downcast_ref::<jetstream::Error>()
        .map(|js| js.error_code())
}

fn error_text(e: &PublishError) -> String {
    match std::error::Error::source(e) {
        Some(source) => format!("{e}: {source}"),
        None => e.to_string(),
    }
}

impl Publisher for NatsPublisher {
    async fn publish(
        &self,
        batch: &[StoredMessage],
    ) -> Result<PublishOutcomes, outbox_core::Error> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        if self.client.connection_state() != State::Connected {
            // Nothing is sent into a connection that is down: the client would queue it
            // and send it after later messages' retries, out of order.
            return Err(outbox_core::Error::broker_unavailable(Error::Unavailable(
                "not connected to the nats server".to_owned(),
            )));
        }
        let streams = self.streams_of(batch).await?;
        let mut call = Call::new(batch.len());
        loop {
            let wave = call.next_wave(batch);
            if wave.is_empty() {
                break;
            }
            let sent = self.send_wave(batch, &streams, &wave, &mut call).await;
            let (indexes, acks): (Vec<usize>, Vec<PublishAckFuture>) = sent.into_iter().unzip();
            let acks = futures_util::future::join_all(
                acks.into_iter().map(std::future::IntoFuture::into_future),
            )
            .await;
            for (i, ack) in indexes.into_iter().zip(acks) {
                let outcome = self.outcome(&batch[i].envelope.topic, ack).await;
                call.decide(batch, i, outcome);
            }
        }
        settle(call.outcomes)
    }
}

impl NatsPublisher {
    /// Sends the messages of `wave`; those refused before sending, or not sent after an
    /// outage, are decided in `call`. The acknowledgements to await.
    async fn send_wave(
        &self,
        batch: &[StoredMessage],
        streams: &HashMap<String, std::result::Result<StreamFacts, Rejected>>,
        wave: &[usize],
        call: &mut Call,
    ) -> Vec<(usize, PublishAckFuture)> {
        let mut sent = Vec::with_capacity(wave.len());
        for &i in wave {
            let m = &batch[i];
            if let Some(reason) = &call.halted {
                let reason = format!("not sent after an earlier failure: {reason}");
                call.outcomes[i] = Some(Err(Rejected::unavailable(reason)));
                continue;
            }
            let facts = match &streams[&m.envelope.topic] {
                Ok(facts) => facts,
                Err(rejected) => {
                    call.decide(batch, i, Err(rejected.clone()));
                    continue;
                }
            };
            match self.send(m, facts).await {
                Ok(Ok(ack)) => sent.push((i, ack)),
                Ok(Err(rejected)) => {
                    tracing::debug!(msg_id = %m.envelope.msg_id, reason = %rejected.reason, "nats refused a message before sending");
                    metrics::counter!("outbox_nats_publish_rejected_total").increment(1);
                    call.decide(batch, i, Err(rejected));
                }
                Err(outage) => call.decide(batch, i, Err(Rejected::unavailable(outage))),
            }
        }
        sent
    }
}

/// One publish call's progress. It goes in waves of at most one message per key: a
/// key's next message is sent only once the server has acknowledged the one before,
/// pipelined over the keys (one round trip per wave). A whole batch sent at once could
/// lose a key's order when the connection dropped mid-batch: a message written before
/// the drop is lost with the server, while a later one of its key, still queued in the
/// client, goes out after the reconnect and is stored first. Order across keys is not
/// kept (no consumer relies on it).
struct Call {
    outcomes: Vec<Option<std::result::Result<(), Rejected>>>,
    /// Keys whose message failed: their later messages are held (no retry spent).
    held: HashMap<String, String>,
    /// An outage: nothing more is sent.
    halted: Option<String>,
}

impl Call {
    fn new(len: usize) -> Self {
        Self {
            outcomes: vec![None; len],
            held: HashMap::new(),
            halted: None,
        }
    }

    /// The first undecided message of each key, in batch order; the messages of held
    /// keys are decided on the way.
    fn next_wave(&mut self, batch: &[StoredMessage]) -> Vec<usize> {
        let mut keys = std::collections::HashSet::new();
        let mut wave = Vec::new();
        for (i, m) in batch.iter().enumerate() {
            if self.outcomes[i].is_some() {
                continue;
            }
            let key = m.envelope.key.as_str();
            if let Some(reason) = &self.halted {
                // An outage: what is left is not taken, and the call is an outage if
                // nothing was.
                let reason = format!("not sent after an earlier failure: {reason}");
                self.outcomes[i] = Some(Err(Rejected::unavailable(reason)));
            } else if let Some(reason) = self.held.get(key) {
                let reason = format!("held behind an earlier message of key `{key}`: {reason}");
                self.outcomes[i] = Some(Err(Rejected::held(reason)));
            } else if keys.insert(key) {
                wave.push(i);
            }
        }
        wave
    }

    /// Records message `i`'s outcome; a failure holds its key, an outage stops the call.
    fn decide(
        &mut self,
        batch: &[StoredMessage],
        i: usize,
        outcome: std::result::Result<(), Rejected>,
    ) {
        if let Err(rejected) = &outcome {
            if rejected.kind == RejectKind::Unavailable {
                self.halted.get_or_insert_with(|| rejected.reason.clone());
            }
            let key = batch[i].envelope.key.clone();
            self.held
                .entry(key)
                .or_insert_with(|| rejected.reason.clone());
        }
        self.outcomes[i] = Some(outcome);
    }
}

/// The call's outcomes; nothing taken and every message unavailable is an outage of
/// the whole call.
fn settle(
    outcomes: Vec<Option<Result<(), Rejected>>>,
) -> Result<PublishOutcomes, outbox_core::Error> {
    let outcomes: PublishOutcomes = outcomes
        .into_iter()
        .map(|o| o.unwrap_or_else(|| Err(Rejected::unavailable("no outcome"))))
        .collect();
    if let Some(Err(first)) = outcomes.first()
        && outcomes
            .iter()
            .all(|o| matches!(o, Err(r) if r.kind == RejectKind::Unavailable))
    {
        return Err(outbox_core::Error::broker_unavailable(first.reason.clone()));
    }
    Ok(outcomes)
}

#[cfg(test)]
mod tests {
    use outbox_core::{Envelope, Headers, MsgId};

    use super::*;

    fn batch(keys: &[&str]) -> Vec<StoredMessage> {
        (0..keys.len())
            .map(|i| StoredMessage {
                id: i as i64,
                retries: 0,
                envelope: Envelope {
                    msg_id: MsgId::new(format!("{i}:Paid")).unwrap(),
                    topic: "order.paid".into(),
                    event_type: "Paid".into(),
                    key: keys[i].into(),
                    schema_version: 1,
                    payload: "{}".into(),
                    headers: Headers::new(),
                    created_at: chrono::Utc::now(),
                },
            })
            .collect()
    }

    #[test]
    fn a_key_s_next_message_waits_for_the_wave_before_and_a_failure_holds_it() {
        let batch = batch(&["a", "a", "b", "a", "c", "b"]);
        let mut call = Call::new(batch.len());
        assert_eq!(call.next_wave(&batch), [0, 2, 4]);
        call.decide(&batch, 0, Ok(()));
        call.decide(&batch, 2, Err(Rejected::new("too large")));
        call.decide(&batch, 4, Ok(()));
        // b's later message is held behind its refusal; a goes on.
        assert_eq!(call.next_wave(&batch), [1]);
        assert!(matches!(&call.outcomes[5], Some(Err(r)) if r.kind == RejectKind::Held));
        call.decide(&batch, 1, Ok(()));
        assert_eq!(call.next_wave(&batch), [3]);
        call.decide(&batch, 3, Ok(()));
        assert!(call.next_wave(&batch).is_empty());
    }

    #[test]
    fn after_an_outage_nothing_more_is_sent_and_the_rest_is_unavailable() {
        let batch = batch(&["a", "a", "b"]);
        let mut call = Call::new(batch.len());
        assert_eq!(call.next_wave(&batch), [0, 2]);
        call.decide(&batch, 0, Err(Rejected::unavailable("timed out")));
        call.decide(&batch, 2, Ok(()));
        assert!(call.next_wave(&batch).is_empty());
        assert!(matches!(&call.outcomes[1], Some(Err(r)) if r.kind == RejectKind::Unavailable));
    }
}
