//! Publishing a run of messages in order, with the failure path: what the stream, the
//! backfill and the retry round share.

use std::borrow::Cow;
use std::collections::HashSet;

use chrono::Utc;
use outbox_core::{Publisher, RejectKind, StoredMessage};

use crate::park::Writes;
use crate::store::FailureWrites;
use crate::{CdcConfig, CdcError, PgPool, Result};

/// The publisher and the database, as the holder of the slot uses them (`S`: the
/// database the failure path writes to, PostgreSQL's pool or MySQL's).
pub(crate) struct Deliverer<'a, P, S = PgPool> {
    pub(crate) pool: &'a S,
    pub(crate) publisher: &'a P,
    pub(crate) config: &'a CdcConfig,
}

impl<P: Publisher, S: FailureWrites> Deliverer<'_, P, S> {
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
        let mut next = NextCall::new(messages);
        for (i, m) in messages.iter().enumerate() {
            if blocked.contains(&m.envelope.key) {
                next.leave_out(i);
                writes.park.push((m.id, m.envelope.key.clone()));
                continue;
            }
            if next.len(i + 1) >= self.config.batch_size {
                self.publish(&next.take(i + 1), blocked, &mut writes)
                    .await?;
            }
        }
        let last = next.take(messages.len());
        if !last.is_empty() {
            self.publish(&last, blocked, &mut writes).await?;
        }
        if !writes.is_empty() {
            self.pool.write(writes).await?;
        }
        Ok(())
    }

    /// Marks the `unreadable` rows (id, why) DEAD with the reason, if any.
    pub(crate) async fn bury(&self, unreadable: Vec<(i64, String)>) -> Result<()> {
        if unreadable.is_empty() {
            return Ok(());
        }
        let writes = Writes {
            dead: unreadable,
            ..Writes::default()
        };
        self.pool.write(writes).await
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

    /// One retry of parked messages: `messages`, the first parked message of each key
    /// whose retry time has come, published in one call; the outcome written (taken:
    /// SENT and unparked; refused: a later retry time, or DEAD past the limit), with
    /// `unreadable` marked DEAD. `true` when any was taken or ended DEAD: the next
    /// message of its key may be due at once, worth another round.
    pub(crate) async fn retry(
        &self,
        messages: &[StoredMessage],
        unreadable: Vec<(i64, String)>,
    ) -> Result<bool> {
        let mut writes = Writes {
            dead: unreadable,
            ..Writes::default()
        };
        let outcomes = self.call(messages).await?;
        for (m, outcome) in messages.iter().zip(outcomes) {
            match outcome {
                Ok(()) => writes.sent.push(m.id),
                Err(rejected) => {
                    writes.refused(m, rejected.reason, &self.config.retry);
                }
            }
        }
        let progressed = !writes.sent.is_empty() || !writes.dead.is_empty();
        metrics::counter!("outbox_relay_published_total").increment(writes.sent.len() as u64);
        self.pool.write(writes).await?;
        Ok(progressed)
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

/// The messages of the next publish call, gathered from a run of messages: published
/// as a slice of the run, without a copy, while none in it was left out (parked); copied
/// once one was.
struct NextCall<'m> {
    all: &'m [StoredMessage],
    /// Where the part of `all` not yet taken starts.
    from: usize,
    /// What was gathered before the last message left out.
    copied: Vec<StoredMessage>,
}

impl<'m> NextCall<'m> {
    fn new(all: &'m [StoredMessage]) -> Self {
        Self {
            all,
            from: 0,
            copied: Vec::new(),
        }
    }

    /// How many messages the call has with `all[..upto]` gathered.
    fn len(&self, upto: usize) -> usize {
        self.copied.len() + upto - self.from
    }

    /// `all[i]` is not published (it is parked).
    fn leave_out(&mut self, i: usize) {
        self.copied.extend_from_slice(&self.all[self.from..i]);
        self.from = i + 1;
    }

    /// The call's messages, gathered up to `all[..upto]`; the next call starts empty.
    fn take(&mut self, upto: usize) -> Cow<'m, [StoredMessage]> {
        let run = &self.all[self.from..upto];
        self.from = upto;
        if self.copied.is_empty() {
            Cow::Borrowed(run)
        } else {
            self.copied.extend_from_slice(run);
            Cow::Owned(std::mem::take(&mut self.copied))
        }
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

#[cfg(test)]
mod tests {
    use outbox_core::{Envelope, Headers, MsgId};

    use super::*;

    fn message(id: i64) -> StoredMessage {
        StoredMessage {
            id,
            retries: 0,
            envelope: Envelope {
                msg_id: MsgId::new(format!("m-{id}")).unwrap(),
                topic: "t".into(),
                event_type: "E".into(),
                key: format!("k{id}"),
                schema_version: 1,
                payload: "{}".into(),
                headers: Headers::default(),
                created_at: Utc::now(),
            },
        }
    }

    fn ids(call: &[StoredMessage]) -> Vec<i64> {
        call.iter().map(|m| m.id).collect()
    }

    #[test]
    fn a_run_with_nothing_left_out_is_published_without_a_copy() {
        let all: Vec<StoredMessage> = (1..=5).map(message).collect();
        let mut next = NextCall::new(&all);
        assert_eq!(next.len(3), 3);
        let first = next.take(3);
        assert!(matches!(first, Cow::Borrowed(_)));
        assert_eq!(ids(&first), [1, 2, 3]);
        let rest = next.take(5);
        assert!(matches!(rest, Cow::Borrowed(_)));
        assert_eq!(ids(&rest), [4, 5]);
        assert!(next.take(5).is_empty());
    }

    #[test]
    fn messages_left_out_are_skipped_and_the_rest_keeps_its_order() {
        let all: Vec<StoredMessage> = (1..=6).map(message).collect();
        let mut next = NextCall::new(&all);
        next.leave_out(1);
        next.leave_out(3);
        assert_eq!(next.len(5), 3);
        assert_eq!(ids(&next.take(5)), [1, 3, 5]);
        assert_eq!(ids(&next.take(6)), [6]);
    }
}
