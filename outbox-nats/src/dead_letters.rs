//! Dead letters: written by the consumer to the dead-letter stream with their reason;
//! listed, redriven and purged by operators.

use async_nats::HeaderMap;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::RawMessageErrorKind;
use async_nats::jetstream::{self, ErrorCode};
use chrono::{DateTime, Utc};
use outbox_core::Envelope;

use crate::consumer::screen::Job;
use crate::entry::{REDRIVE_GROUP_HEADER, envelope_from_message};
use crate::{Error, Naming, Result};

/// Why the message is dead, as the consumer last saw it fail.
pub const DEAD_REASON_HEADER: &str = "Outbox-Dead-Reason";
/// The consumer group that gave up on it.
pub const DEAD_GROUP_HEADER: &str = "Outbox-Dead-Group";
/// The stream it was read from.
pub const DEAD_STREAM_HEADER: &str = "Outbox-Dead-Stream";
/// Its sequence in that stream.
pub const DEAD_SEQUENCE_HEADER: &str = "Outbox-Dead-Sequence";
/// The subject it was published on: where a redrive publishes it again.
pub const DEAD_SUBJECT_HEADER: &str = "Outbox-Dead-Subject";
/// The deliveries it had (those that met an outage of the store not counted).
pub const DEAD_DELIVERIES_HEADER: &str = "Outbox-Dead-Deliveries";

/// The longest reason kept, in bytes.
const MAX_REASON_LEN: usize = 1024;

/// The headers of `job`'s dead letter: its own, and why, where from, and a
/// `Nats-Msg-Id` of its own (`dead:<group>:<stream>:<sequence>`), so that a dead letter
/// written twice (a crash before the ack) is stored once.
pub(crate) fn dead_letter_headers(
    job: &Job,
    group: &str,
    reason: &str,
    deliveries: u64,
) -> HeaderMap {
    let mut headers = job.msg.headers.clone().unwrap_or_default();
    let mut reason: String = reason
        .chars()
        .map(|c| if c == '\r' || c == '\n' { ' ' } else { c })
        .collect();
    if reason.len() > MAX_REASON_LEN {
        let end = (0..=MAX_REASON_LEN)
            .rev()
            .find(|&i| reason.is_char_boundary(i))
            .unwrap_or(0);
        reason.truncate(end);
    }
    headers.insert(
        async_nats::header::NATS_MESSAGE_ID,
        format!("dead:{group}:{}:{}", job.topic.stream, job.seq),
    );
    headers.insert(DEAD_REASON_HEADER, reason);
    headers.insert(DEAD_GROUP_HEADER, group);
    headers.insert(DEAD_STREAM_HEADER, &*job.topic.stream);
    headers.insert(DEAD_SEQUENCE_HEADER, job.seq.to_string());
    headers.insert(DEAD_SUBJECT_HEADER, job.msg.subject.as_str());
    headers.insert(DEAD_DELIVERIES_HEADER, deliveries.to_string());
    headers
}

/// A message in the dead-letter stream.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Its sequence in the dead-letter stream: what [`redrive_dead_letter`] and
    /// [`purge_dead_letter`] take.
    pub sequence: u64,
    /// The group that gave up on it.
    pub group: String,
    /// Why.
    pub reason: String,
    /// The stream and sequence it was read from.
    pub stream: String,
    /// Its sequence there.
    pub stream_sequence: u64,
    /// The subject it was published on.
    pub subject: String,
    /// Its deliveries.
    pub deliveries: u64,
    /// When it was dead-lettered.
    pub dead_at: DateTime<Utc>,
    /// The message, or why it cannot be read as one (a malformed message is
    /// dead-lettered too).
    pub envelope: std::result::Result<Envelope, String>,
}

/// The dead letters of `group` (all groups if `None`), oldest first, at most `limit`.
pub async fn dead_letters(
    js: &jetstream::Context,
    naming: &Naming,
    group: Option<&str>,
    limit: usize,
) -> Result<Vec<DeadLetter>> {
    let name = naming.dead_letter_stream();
    let mut stream = js
        .get_stream(&name)
        .await
        .map_err(|e| Error::Unavailable(format!("dead-letter stream {name}: {e}")))?;
    let state = stream
        .info()
        .await
        .map_err(|e| Error::Unavailable(format!("dead-letter stream {name}: {e}")))?
        .state
        .clone();
    let mut out = Vec::new();
    let mut seq = state.first_sequence;
    while seq <= state.last_sequence && out.len() < limit {
        if let Some(dead) = read(&stream, seq).await?
            && group.is_none_or(|g| g == dead.group)
        {
            out.push(dead);
        }
        seq += 1;
    }
    Ok(out)
}

/// Dead letter `sequence`, or `None` if there is none (purged, redriven).
pub async fn dead_letter(
    js: &jetstream::Context,
    naming: &Naming,
    sequence: u64,
) -> Result<Option<DeadLetter>> {
    let name = naming.dead_letter_stream();
    let stream = js
        .get_stream_no_info(&name)
        .await
        .map_err(|e| Error::Unavailable(format!("dead-letter stream {name}: {e}")))?;
    read(&stream, sequence).await
}

async fn read<T>(stream: &jetstream::stream::Stream<T>, seq: u64) -> Result<Option<DeadLetter>> {
    let raw = match stream.get_raw_message(seq).await {
        Ok(raw) => raw,
        Err(e) => match e.kind() {
            RawMessageErrorKind::NoMessageFound => return Ok(None),
            _ => return Err(Error::Unavailable(format!("dead letter {seq}: {e}"))),
        },
    };
    let header = |name: &str| {
        raw.headers
            .get(name)
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default()
    };
    let stream_name = header(DEAD_STREAM_HEADER);
    Ok(Some(DeadLetter {
        sequence: seq,
        group: header(DEAD_GROUP_HEADER),
        reason: header(DEAD_REASON_HEADER),
        stream_sequence: header(DEAD_SEQUENCE_HEADER).parse().unwrap_or(0),
        subject: header(DEAD_SUBJECT_HEADER),
        deliveries: header(DEAD_DELIVERIES_HEADER).parse().unwrap_or(0),
        dead_at: DateTime::from_timestamp(raw.time.unix_timestamp(), raw.time.nanosecond())
            .unwrap_or_default(),
        envelope: envelope_from_message(Some(&raw.headers), &raw.payload, &stream_name)
            .map_err(|e| e.to_string()),
        stream: stream_name,
    }))
}

/// Puts dead letter `sequence` back on its subject for the group that gave up on it,
/// then removes it from the dead-letter stream. Returns whether there was one.
///
/// The copy carries [`REDRIVE_GROUP_HEADER`]: every other group acknowledges it
/// without applying it. Its `Nats-Msg-Id` is `<msg_id>:redrive:<sequence>`, so the
/// stream's duplicate window does not drop it as the message published before.
pub async fn redrive_dead_letter(
    js: &jetstream::Context,
    naming: &Naming,
    sequence: u64,
) -> Result<bool> {
    let name = naming.dead_letter_stream();
    let stream = js
        .get_stream_no_info(&name)
        .await
        .map_err(|e| Error::Unavailable(format!("dead-letter stream {name}: {e}")))?;
    let raw = match stream.get_raw_message(sequence).await {
        Ok(raw) => raw,
        Err(e) => match e.kind() {
            RawMessageErrorKind::NoMessageFound => return Ok(false),
            _ => return Err(Error::Unavailable(format!("dead letter {sequence}: {e}"))),
        },
    };
    let text = |name: &str| raw.headers.get(name).map(|v| v.as_str().to_owned());
    let subject = text(DEAD_SUBJECT_HEADER).ok_or_else(|| {
        Error::MalformedMessage(format!(
            "dead letter {sequence} has no `{DEAD_SUBJECT_HEADER}`"
        ))
    })?;
    let group = text(DEAD_GROUP_HEADER).unwrap_or_default();
    let msg_id = text(crate::entry::MSG_ID).unwrap_or_else(|| format!("dead-{sequence}"));
    let mut headers = HeaderMap::new();
    for (header, values) in raw.headers.iter() {
        let header: &str = header.as_ref();
        if header.starts_with("Outbox-Dead-") || header == "Nats-Msg-Id" {
            continue;
        }
        for v in values {
            headers.append(header, v.as_str());
        }
    }
    headers.insert(
        async_nats::header::NATS_MESSAGE_ID,
        format!("{msg_id}:redrive:{sequence}"),
    );
    headers.insert(REDRIVE_GROUP_HEADER, group);
    let publish = PublishMessage::build()
        .headers(headers)
        .payload(raw.payload.clone());
    let ack = js
        .send_publish(subject.clone(), publish)
        .await
        .map_err(|e| Error::Unavailable(format!("redrive to {subject}: {e}")))?;
    ack.await
        .map_err(|e| Error::Unavailable(format!("redrive to {subject}: {e}")))?;
    purge(&stream, sequence).await
}

/// Removes dead letter `sequence`. Returns whether there was one.
pub async fn purge_dead_letter(
    js: &jetstream::Context,
    naming: &Naming,
    sequence: u64,
) -> Result<bool> {
    let name = naming.dead_letter_stream();
    let stream = js
        .get_stream_no_info(&name)
        .await
        .map_err(|e| Error::Unavailable(format!("dead-letter stream {name}: {e}")))?;
    purge(&stream, sequence).await
}

async fn purge(stream: &jetstream::stream::Stream<()>, sequence: u64) -> Result<bool> {
    match stream.delete_message(sequence).await {
        Ok(deleted) => Ok(deleted),
        Err(e) => match e.kind() {
            async_nats::jetstream::stream::DeleteMessageErrorKind::JetStream(js)
                if js.error_code() == ErrorCode::NO_MESSAGE_FOUND
                    || js.error_code() == ErrorCode::STREAM_MESSAGE_DELETE_FAILED =>
            {
                Ok(false)
            }
            _ => Err(Error::Unavailable(format!(
                "delete dead letter {sequence}: {e}"
            ))),
        },
    }
}
