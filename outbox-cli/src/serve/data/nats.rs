//! The consumers' side of the page on NATS JetStream: the dead-letter stream
//! `<prefix>DEAD` (listed, shown, redriven and purged through outbox-nats, as the
//! consumers write it) and each stream's durable consumers, one per group, with their
//! lag.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::Utc;
use futures_util::TryStreamExt as _;
use outbox_nats::async_nats::jetstream::{self, ErrorCode, context::GetStreamErrorKind};
use outbox_nats::{DeadLetter, Naming};
use tokio::sync::OnceCell;

use super::groups::Group;
use super::{Action, ConsumerDead, Failure};
use crate::broker::NatsServers;

/// How long a JetStream request may take.
const TIMEOUT: Duration = Duration::from_secs(5);

/// The page's NATS side: where it is, the outbox's names there, and one client for the
/// server's life (it reconnects by itself; a request during an outage fails after
/// [`TIMEOUT`]).
pub(crate) struct NatsSide {
    servers: NatsServers,
    naming: Naming,
    js: OnceCell<jetstream::Context>,
}

impl NatsSide {
    /// The side of `servers` whose streams are named `<stream_prefix>…`; a prefix NATS
    /// cannot take is refused.
    pub(crate) fn new(
        servers: NatsServers,
        stream_prefix: &str,
    ) -> Result<Self, outbox_core::InvalidConfig> {
        Ok(Self {
            servers,
            naming: Naming::new(outbox_nats::DEFAULT_SUBJECT_PREFIX, stream_prefix)?,
            js: OnceCell::new(),
        })
    }

    /// The dead-letter stream's name.
    pub(crate) fn dead_stream(&self) -> String {
        self.naming.dead_letter_stream()
    }

    async fn js(&self) -> Result<&jetstream::Context, Failure> {
        self.js
            .get_or_try_init(|| async {
                let client = self
                    .servers
                    .client()
                    .await
                    .map_err(|e| Failure::server(e.to_string()))?;
                Ok(jetstream::ContextBuilder::new()
                    .timeout(TIMEOUT)
                    .build(client))
            })
            .await
    }

    /// Whether the dead-letter stream exists (it does once a consumer ran).
    async fn has_dead_stream(&self) -> Result<bool, Failure> {
        let js = self.js().await?;
        match js.get_stream(self.dead_stream()).await {
            Ok(_) => Ok(true),
            Err(e) => match e.kind() {
                GetStreamErrorKind::JetStream(j)
                    if j.error_code() == ErrorCode::STREAM_NOT_FOUND =>
                {
                    Ok(false)
                }
                _ => Err(Failure::of(&e)),
            },
        }
    }

    /// The dead letters, newest first, at most `limit` of the oldest read (and whether
    /// there were more).
    pub(super) async fn dead_letters(
        &self,
        limit: usize,
    ) -> Result<(Vec<ConsumerDead>, bool), Failure> {
        if !self.has_dead_stream().await? {
            return Ok((Vec::new(), false));
        }
        let js = self.js().await?;
        let letters = outbox_nats::dead_letters(js, &self.naming, None, limit + 1)
            .await
            .map_err(|e| Failure::of(&e))?;
        let truncated = letters.len() > limit;
        let dead_stream = self.dead_stream();
        let mut all: Vec<ConsumerDead> = letters
            .iter()
            .take(limit)
            .map(|d| consumer_dead(&dead_stream, d))
            .collect();
        all.reverse();
        Ok((all, truncated))
    }

    /// Dead letter `id` (its sequence in the dead-letter stream), if there is one.
    pub(super) async fn dead_letter(&self, id: &str) -> Result<Option<ConsumerDead>, Failure> {
        let Ok(sequence) = id.parse::<u64>() else {
            return Ok(None);
        };
        if !self.has_dead_stream().await? {
            return Ok(None);
        }
        let js = self.js().await?;
        let found = outbox_nats::dead_letter(js, &self.naming, sequence)
            .await
            .map_err(|e| Failure::of(&e))?;
        Ok(found.map(|d| consumer_dead(&self.dead_stream(), &d)))
    }

    /// Redrives or purges dead letter `id`; whether it was there.
    pub(super) async fn apply(&self, action: Action, id: &str) -> Result<bool, Failure> {
        let Ok(sequence) = id.parse::<u64>() else {
            return Ok(false);
        };
        let js = self.js().await?;
        match action {
            Action::Redrive => outbox_nats::redrive_dead_letter(js, &self.naming, sequence).await,
            Action::Purge => outbox_nats::purge_dead_letter(js, &self.naming, sequence).await,
        }
        .map_err(|e| Failure::of(&e))
    }

    /// The durable consumers (one per group) of every stream of the prefix but the
    /// dead-letter stream, by stream and group. JetStream counts by sequence: `lag` is
    /// the messages not yet delivered to the group, `pending` those delivered and not
    /// acknowledged, the oldest of which follows the group's acknowledgement floor.
    pub(super) async fn groups(&self) -> Result<Vec<Group>, Failure> {
        let js = self.js().await?;
        let (prefix, dead) = (&self.naming.stream_prefix, self.dead_stream());
        let mut names: Vec<String> = js
            .streams()
            .map_ok(|info| info.config.name)
            .try_filter(|name| {
                std::future::ready(name.starts_with(prefix.as_str()) && *name != dead)
            })
            .try_collect()
            .await
            .map_err(|e| Failure::of(&e))?;
        names.sort();
        let mut out = Vec::new();
        for name in names {
            let stream = js
                .get_stream_no_info(&name)
                .await
                .map_err(|e| Failure::of(&e))?;
            let mut infos: Vec<jetstream::consumer::Info> = stream
                .consumers()
                .try_collect()
                .await
                .map_err(|e| Failure::of(&e))?;
            infos.sort_by(|a, b| a.name.cmp(&b.name));
            out.extend(infos.into_iter().map(|c| group(&name, c)));
        }
        Ok(out)
    }
}

fn group(stream: &str, c: jetstream::consumer::Info) -> Group {
    Group {
        stream: stream.to_owned(),
        group: c.name,
        lag: usize::try_from(c.num_pending).ok(),
        pending: c.num_ack_pending,
        last_delivered_id: c.delivered.stream_sequence.to_string(),
        oldest_pending_id: (c.num_ack_pending > 0)
            .then(|| (c.ack_floor.stream_sequence + 1).to_string()),
        oldest_pending_age_seconds: None,
        consumers: Vec::new(),
    }
}

/// A dead letter for the API and the pages: its id is its sequence in the dead-letter
/// stream, its entry id the sequence it had in its own stream.
fn consumer_dead(dead_stream: &str, d: &DeadLetter) -> ConsumerDead {
    let mut fields = BTreeMap::from([("subject".to_owned(), d.subject.clone())]);
    let envelope = d.envelope.as_ref().ok();
    match &d.envelope {
        Ok(e) => fields.extend([
            ("payload".to_owned(), e.payload.clone()),
            ("key".to_owned(), e.key.clone()),
            ("version".to_owned(), e.schema_version.to_string()),
            (
                "headers".to_owned(),
                serde_json::to_string(&e.headers).unwrap_or_default(),
            ),
            ("created_at".to_owned(), e.created_at.to_rfc3339()),
        ]),
        Err(why) => {
            fields.insert("unreadable".to_owned(), why.clone());
        }
    }
    let text = |f: fn(&outbox_core::Envelope) -> String| envelope.map(f).unwrap_or_default();
    ConsumerDead {
        item: format!("consumer:{}:{dead_stream}", d.sequence),
        dead_stream: dead_stream.to_owned(),
        id: d.sequence.to_string(),
        stream: d.stream.clone(),
        group: d.group.clone(),
        entry_id: d.stream_sequence.to_string(),
        reason: d.reason.clone(),
        delivery_count: Some(d.deliveries),
        topic: text(|e| e.topic.clone()),
        event_type: text(|e| e.event_type.clone()),
        msg_id: text(|e| e.msg_id.as_str().to_owned()),
        age_seconds: (Utc::now() - d.dead_at)
            .to_std()
            .unwrap_or_default()
            .as_secs_f64(),
        fields,
    }
}
