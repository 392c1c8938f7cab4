//! Idle entries taken over: `XAUTOCLAIM`.

use std::sync::Arc;

use super::ConsumerStore;
use redis::RedisResult;
use redis::streams::{StreamAutoClaimReply, StreamId, StreamPendingCountReply};

use super::in_flight::InFlight;
use super::stats::Count;
use super::{Consumer, Job, duration_ms};
use crate::conn::Conn;

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// Entries idle longer than `min_idle` in the group, whoever held them:
    /// `XAUTOCLAIM`, then their delivery counts from `XPENDING`.
    pub(super) async fn claim(&self, free: usize, in_flight: &InFlight) -> RedisResult<Vec<Job>> {
        let inner = &self.inner;
        let mut conn = inner.commands.get().await?;
        let result = self.claim_on(&mut conn, free, in_flight).await;
        if let Err(e) = &result {
            inner.commands.check(e).await;
        }
        result
    }

    /// [`claim`](Self::claim) on `conn`.
    async fn claim_on(
        &self,
        conn: &mut Conn,
        free: usize,
        in_flight: &InFlight,
    ) -> RedisResult<Vec<Job>> {
        let inner = &self.inner;
        let mut jobs: Vec<Job> = Vec::new();
        for stream in &inner.streams {
            let mut cursor = "0-0".to_owned();
            // Each call scans a bounded part of the pending list; a few calls per round
            // keep one round short while a long list is still covered over time.
            for _ in 0..8 {
                let budget = free.saturating_sub(jobs.len());
                if budget == 0 {
                    return Ok(jobs);
                }
                let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
                    .arg(&**stream)
                    .arg(&inner.group)
                    .arg(&inner.consumer_name)
                    .arg(duration_ms(inner.config.min_idle))
                    .arg(&cursor)
                    .arg("COUNT")
                    .arg(budget)
                    .query_async(&mut *conn)
                    .await?;
                if !reply.deleted_ids.is_empty() {
                    tracing::warn!(stream = &**stream, deleted = ?reply.deleted_ids, "pending entries were deleted from the stream before being processed");
                }
                if !reply.claimed.is_empty() {
                    let counts =
                        delivery_counts(conn, stream, &inner.group, &reply.claimed).await?;
                    for (entry, count) in reply.claimed.into_iter().zip(counts) {
                        let mine = in_flight.contains(stream, &entry.id);
                        if !mine {
                            self.count(Count::Reclaimed, Some(stream));
                            tracing::info!(stream = &**stream, entry_id = %entry.id, delivery_count = count, "pending entry claimed");
                        }
                        jobs.push(Job {
                            stream: Arc::clone(stream),
                            entry,
                            delivery_count: count,
                        });
                    }
                }
                if reply.next_stream_id == "0-0" {
                    break;
                }
                cursor = reply.next_stream_id;
            }
        }
        Ok(jobs)
    }
}

/// The delivery count of each of `entries` (pending in `group`), in order, with one
/// pipelined `XPENDING <stream> <group> <id> <id> 1` per entry.
async fn delivery_counts(
    conn: &mut Conn,
    stream: &str,
    group: &str,
    entries: &[StreamId],
) -> RedisResult<Vec<u64>> {
    let mut pipe = redis::pipe();
    for entry in entries {
        pipe.cmd("XPENDING")
            .arg(stream)
            .arg(group)
            .arg(&entry.id)
            .arg(&entry.id)
            .arg(1);
    }
    let replies: Vec<StreamPendingCountReply> = pipe.query_async(conn).await?;
    Ok(replies
        .into_iter()
        .map(|r| r.ids.first().map_or(1, |p| p.times_delivered as u64))
        .collect())
}
