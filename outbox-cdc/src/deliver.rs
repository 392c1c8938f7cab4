//! Publishing a run of messages in order, with the failure path: what the stream, the
//! backfill and the retry round share.

use std::collections::HashSet;

use chrono::Utc;
use outbox_core::{Publisher, RejectKind, StoredMessage};

use crate::park::{Writes, db};
use crate::{CdcConfig, CdcError, PgPool, Result};

/// The publisher and the database, as the holder of the slot uses them.
pub(crate) struct Deliverer<'a, P> {
    pub(crate) pool: &'a PgPool,
    pub(crate) publisher: &'a P,
    pub(crate) config: &'a CdcConfig,
}

impl<P: Publisher> Deliverer<'_, P> {
    /// Publishes `messages` (in commit order) in calls of at most `batch_size`, parking
    /// those whose key has parked messages (`blocked`), and records the refusals. `Ok`
    /// once every message was taken by the broker, parked or dead: the caller may then
    /// confirm them. An outage (the call failed, or the broker did not take a message
    /// for a fault of its own or of its topic) is returned before anything is written:
    /// the caller publishes the same messages again after a pause (those already taken
    /// are published twice, in order, and the inbox absorbs them).
    pub(crate) async fn deliver(
        &self,
        messages: &[StoredMessage],
        blocked: &mut HashSet<String>,
    ) -> Result<()> {
        let mut writes = Writes::default();
        let mut chunk: Vec<StoredMessage> = Vec::new();
        for m in messages {
            if blocked.contains(&m.envelope.key) {
                writes.park.push((m.id, m.envelope.key.clone()));
                continue;
            }
            chunk.push(m.clone());
            if chunk.len() >= self.config.batch_size {
                self.publish(&std::mem::take(&mut chunk), blocked, &mut writes)
                    .await?;
            }
        }
        if !chunk.is_empty() {
            self.publish(&chunk, blocked, &mut writes).await?;
        }
        if !writes.is_empty() {
            db(self.pool, move |c| writes.apply(c)).await?;
        }
        Ok(())
    }

    /// One publish call. A refused message blocks its key for the later messages of
    /// `messages`' successors (a later message of its key in this very call was sent with
    /// it, as the polling relay would: counted in `outbox_relay_key_order_broken_total`).
    async fn publish(
        &self,
        chunk: &[StoredMessage],
        blocked: &mut HashSet<String>,
        writes: &mut Writes,
    ) -> Result<()> {
        let outcomes = self.call(chunk).await?;
        let mut refused_here: HashSet<&str> = HashSet::new();
        let (mut refused, mut dead) = (0usize, 0usize);
        for (m, outcome) in chunk.iter().zip(outcomes) {
            let key = m.envelope.key.as_str();
            match outcome {
                Ok(()) if refused_here.contains(key) => {
                    tracing::warn!(msg_id = %m.envelope.msg_id, key, "published after a refused message of its key");
                    metrics::counter!("outbox_relay_key_order_broken_total").increment(1);
                }
                Ok(()) => {}
                Err(rejected) => {
                    refused += 1;
                    refused_here.insert(key);
                    if writes.refused(m, rejected.reason, &self.config.retry) {
                        blocked.insert(key.to_owned());
                        writes.park.push((m.id, key.to_owned()));
                    } else {
                        dead += 1;
                    }
                }
            }
        }
        record_published(chunk, refused, dead);
        Ok(())
    }

    /// Calls the publisher; an outage (see [`deliver`](Self::deliver)) as an error.
    pub(crate) async fn call(
        &self,
        chunk: &[StoredMessage],
    ) -> Result<Vec<std::result::Result<(), outbox_core::Rejected>>> {
        let outcomes = self
            .publisher
            .publish(chunk)
            .await
            .map_err(CdcError::Publish)?;
        if outcomes.len() != chunk.len() {
            return Err(CdcError::Publish(outbox_core::Error::broker_unavailable(
                format!(
                    "publisher returned {} results for {} messages",
                    outcomes.len(),
                    chunk.len()
                ),
            )));
        }
        if let Some(r) = outcomes
            .iter()
            .filter_map(|o| o.as_ref().err())
            .find(|r| r.kind != RejectKind::Message)
        {
            if r.kind == RejectKind::Topic {
                metrics::counter!("outbox_relay_topic_errors_total").increment(1);
            }
            return Err(CdcError::Publish(outbox_core::Error::broker_unavailable(
                format!("the broker did not take a message: {}", r.reason),
            )));
        }
        Ok(outcomes)
    }
}

/// The relay's counters, as the polling relay names them: `refused` of `chunk` failed,
/// `dead` of them for the last time.
fn record_published(chunk: &[StoredMessage], refused: usize, dead: usize) {
    let now = Utc::now();
    let lag = metrics::histogram!("outbox_relay_commit_to_publish_seconds");
    for m in chunk {
        lag.record(
            (now - m.envelope.created_at)
                .to_std()
                .unwrap_or_default()
                .as_secs_f64(),
        );
    }
    metrics::counter!("outbox_relay_published_total")
        .increment(chunk.len().saturating_sub(refused) as u64);
    metrics::counter!("outbox_relay_failed_attempts_total").increment(refused as u64);
    metrics::counter!("outbox_relay_dead_lettered_total").increment(dead as u64);
}
