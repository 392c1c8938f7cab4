//! The consumer groups of the outbox's streams.

use chrono::Utc;
use serde::Serialize;

use super::{Failure, entry_ms, redis_conn, streams};
use crate::serve::App;

/// A consumer group of a stream.
#[derive(Debug, Serialize)]
pub(crate) struct Group {
    /// The stream.
    pub(crate) stream: String,
    /// The group.
    pub(crate) group: String,
    /// Entries not yet delivered to the group (Redis 7+; `null` when Redis cannot tell;
    /// NATS: the durable consumer's pending messages).
    pub(crate) lag: Option<usize>,
    /// Entries delivered and not acknowledged.
    pub(crate) pending: usize,
    /// The last entry delivered.
    pub(crate) last_delivered_id: String,
    /// The oldest pending entry's id.
    pub(crate) oldest_pending_id: Option<String>,
    /// Its age in seconds (from its id).
    pub(crate) oldest_pending_age_seconds: Option<f64>,
    /// The group's consumers.
    pub(crate) consumers: Vec<GroupConsumer>,
}

/// A consumer of a group.
#[derive(Debug, Serialize)]
pub(crate) struct GroupConsumer {
    /// Its name.
    pub(crate) name: String,
    /// Entries it holds unacknowledged.
    pub(crate) pending: usize,
    /// Milliseconds since it last read or claimed.
    pub(crate) idle_ms: usize,
}

/// Every group of every stream of the prefix (dead-letter streams have none).
pub(crate) async fn groups(app: &App) -> Result<Option<Vec<Group>>, Failure> {
    if let Some(nats) = &app.nats {
        return nats.groups().await.map(Some);
    }
    let Some(mut conn) = redis_conn(app).await? else {
        return Ok(None);
    };
    let (_, streams) = streams(app, &mut conn).await?;
    let mut out = Vec::new();
    for stream in streams {
        let now = Utc::now().timestamp_millis();
        let infos = outbox_redis::consumer_groups(&mut conn, &stream)
            .await
            .map_err(|e| Failure::of(&e))?;
        for g in infos {
            out.push(Group {
                stream: stream.clone(),
                group: g.name,
                lag: g.lag,
                pending: g.pending,
                last_delivered_id: g.last_delivered_id,
                oldest_pending_age_seconds: g
                    .oldest_pending_id
                    .as_deref()
                    .and_then(entry_ms)
                    .map(|ms| now.saturating_sub(ms).max(0) as f64 / 1000.0),
                oldest_pending_id: g.oldest_pending_id,
                consumers: g
                    .consumers
                    .into_iter()
                    .map(|c| GroupConsumer {
                        name: c.name,
                        pending: c.pending,
                        idle_ms: c.idle_ms,
                    })
                    .collect(),
            });
        }
    }
    Ok(Some(out))
}
