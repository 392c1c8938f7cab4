//! Ordered mode's leases: the group's live consumers, the leases held renewed, free
//! streams acquired up to a fair share, and a stream taken over with the entries its
//! previous holder left pending.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::Partitions;

use crate::ConsumerStore;
use redis::streams::{StreamClaimReply, StreamPendingCountReply};
use redis::{RedisError, RedisResult};

use super::super::stats::Count;
use super::super::{Consumer, Job};
use super::keys::EntryId;
use crate::conn::{Conn, blocked_key, lease_key, members_key};
use crate::lease::{Lease, eval, millis};

/// Keeps `ARGV[1]` in the sorted set `KEYS[1]` of live members for `ARGV[2]` ms more
/// (score: expiry on Redis's clock), drops the expired members, and returns how many
/// are live. The set itself expires when its last member stops renewing.
const HEARTBEAT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[2]))
return redis.call('ZCARD', KEYS[1])
";

/// Pending entries claimed per round trip at a takeover.
const TAKEOVER_PAGE: usize = 100;

/// What one round of lease keeping found.
#[derive(Default)]
pub(super) struct Tick {
    /// Live consumers of the group, this one included; 0 if unknown (Redis failed).
    pub(super) live: usize,
    /// Held streams whose lease could not be renewed: lost.
    pub(super) lost: Vec<(Arc<str>, Arc<Lease>)>,
    pub(super) acquired: Vec<Acquired>,
    /// The keys still blocked on each stream asked about.
    pub(super) blocked: Vec<(Arc<str>, Vec<Vec<u8>>)>,
    /// Entries of the streams held, pending in this consumer's name for `min_idle` and
    /// not queued: read and settled, but whose `XACK` failed. Claimed to queue them again
    /// (they are found applied, and acknowledged). Each with the lease it was found under.
    pub(super) orphans: Vec<(Job, Arc<Lease>)>,
    pub(super) error: Option<RedisError>,
}

/// A stream just acquired.
pub(super) struct Acquired {
    pub(super) stream: Arc<str>,
    pub(super) lease: Arc<Lease>,
    /// The entries pending in the group, whoever held them, in stream order: handled
    /// before any new one.
    pub(super) pending: Vec<Job>,
    /// Keys blocked on it after dead letters.
    pub(super) blocked: Vec<Vec<u8>>,
}

/// What the run holds when a round starts.
pub(super) struct Holding {
    pub(super) held: Vec<(Arc<str>, Arc<Lease>)>,
    /// Streams with blocked keys, to ask whether an operator unblocked them.
    pub(super) blocked: Vec<Arc<str>>,
    /// Whether to take free streams (not while shutting down).
    pub(super) acquire: bool,
    /// The entries queued, not to be taken for orphans.
    pub(super) queued: HashSet<EntryId>,
    /// Streams not to acquire: work of an earlier holding of theirs still runs.
    pub(super) busy: Vec<Arc<str>>,
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// The lease TTL of ordered mode.
    pub(super) fn lease_ttl(&self) -> Duration {
        self.inner
            .config
            .ordered
            .as_ref()
            .map_or(Duration::from_secs(10), |o| o.lease_ttl)
    }

    /// One round: renews this consumer's membership and its leases, acquires free
    /// streams while it holds fewer than its share, takes each over, and asks which
    /// blocked keys are still blocked.
    pub(super) async fn keep_leases(self, holding: Holding) -> Tick {
        let mut tick = Tick::default();
        let result: RedisResult<()> = async {
            let mut conn = self.inner.commands.get().await?;
            tick.live = self.heartbeat(&mut conn).await?;
            for (stream, lease) in &holding.held {
                if !lease.renew(&mut conn).await? || !lease.is_held() {
                    tracing::warn!(stream = &**stream, epoch = lease.epoch(), "lease lost");
                    tick.lost.push((Arc::clone(stream), Arc::clone(lease)));
                }
            }
            let held = holding.held.len() - tick.lost.len();
            if holding.acquire {
                self.acquire(&mut conn, &holding, held, &mut tick).await?;
            }
            for stream in &holding.blocked {
                let keys = self.blocked_keys(&mut conn, stream).await?;
                tick.blocked.push((Arc::clone(stream), keys));
            }
            for (stream, lease) in &holding.held {
                if lease.is_held() {
                    let orphans = self.orphans(&mut conn, stream, &holding.queued).await?;
                    tick.orphans
                        .extend(orphans.into_iter().map(|job| (job, Arc::clone(lease))));
                }
            }
            Ok(())
        }
        .await;
        if let Err(e) = result {
            self.inner.commands.check(&e).await;
            tick.error = Some(e);
        }
        tick
    }

    async fn heartbeat(&self, conn: &mut Conn) -> RedisResult<usize> {
        let inner = &self.inner;
        eval(HEARTBEAT, 1)
            .arg(members_key(&inner.config.stream_prefix, &inner.group))
            .arg(&inner.consumer_name)
            .arg(millis(self.lease_ttl()))
            .query_async(conn)
            .await
    }

    /// Leaves the group's live members (at shutdown), so that the others take its
    /// streams at once instead of after the TTL. Best effort.
    pub(super) async fn leave(&self) {
        let inner = &self.inner;
        let left: RedisResult<()> = async {
            let mut conn = inner.commands.get().await?;
            redis::cmd("ZREM")
                .arg(members_key(&inner.config.stream_prefix, &inner.group))
                .arg(&inner.consumer_name)
                .query_async(&mut conn)
                .await
        }
        .await;
        self.redis_done(left, "cannot leave the group's members")
            .await;
    }

    /// Acquires free streams up to this consumer's share, `ceil(streams / live)`,
    /// trying them from an offset of its own, so that consumers starting together do
    /// not all race for the same streams.
    async fn acquire(
        &self,
        conn: &mut Conn,
        holding: &Holding,
        mut held: usize,
        tick: &mut Tick,
    ) -> RedisResult<()> {
        let inner = &self.inner;
        let total = inner.streams.len();
        let share = total.div_ceil(tick.live.max(1));
        if held >= share {
            return Ok(());
        }
        let offset = u32::try_from(total)
            .ok()
            .and_then(|n| Partitions::new(n).ok())
            .map_or(0, |n| n.of(&inner.consumer_name) as usize);
        for i in 0..total {
            if held >= share {
                break;
            }
            let stream = &inner.streams[(offset + i) % total];
            if holding.held.iter().any(|(s, _)| s == stream) || holding.busy.contains(stream) {
                continue;
            }
            let key = lease_key(stream, &inner.group);
            let Some(lease) =
                Lease::acquire(conn, &key, &inner.consumer_name, self.lease_ttl()).await?
            else {
                continue;
            };
            let lease = Arc::new(lease);
            let taken = match self.taken(conn, stream).await {
                // Redis lost its data (a restart without persistence, a `FLUSHALL`, a
                // failover to an empty replica): only the groups' creation brings the
                // stream back, and no read does it for a consumer that holds nothing.
                Err(e) if e.code() == Some("NOGROUP") => {
                    tracing::warn!(stream = &**stream, error = %e, "consumer group missing; recreating it");
                    match self.create_groups(conn).await {
                        Ok(()) => self.taken(conn, stream).await,
                        Err(e) => Err(e),
                    }
                }
                taken => taken,
            };
            match taken {
                Ok((pending, blocked)) => {
                    tracing::info!(
                        stream = &**stream,
                        epoch = lease.epoch(),
                        pending = pending.len(),
                        "lease acquired"
                    );
                    held += 1;
                    tick.acquired.push(Acquired {
                        stream: Arc::clone(stream),
                        lease,
                        pending,
                        blocked,
                    });
                }
                Err(e) => {
                    // Reading new entries before the pending ones would break their
                    // order: give the stream back instead.
                    let _ = lease.release(conn).await;
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// What taking `stream` over brings: its pending entries and its blocked keys.
    async fn taken(
        &self,
        conn: &mut Conn,
        stream: &Arc<str>,
    ) -> RedisResult<(Vec<Job>, Vec<Vec<u8>>)> {
        let pending = self.take_over(conn, stream).await?;
        let blocked = self.blocked_keys(conn, stream).await?;
        Ok((pending, blocked))
    }

    /// Claims every entry pending in the group on `stream`, whoever holds it
    /// (`XPENDING`, then `XCLAIM` with no minimum idle time: safe, the lease is ours),
    /// in stream order.
    async fn take_over(&self, conn: &mut Conn, stream: &Arc<str>) -> RedisResult<Vec<Job>> {
        let inner = &self.inner;
        let mut jobs = Vec::new();
        let mut start = "-".to_owned();
        loop {
            let pending: StreamPendingCountReply = redis::cmd("XPENDING")
                .arg(&**stream)
                .arg(&inner.group)
                .arg(&start)
                .arg("+")
                .arg(TAKEOVER_PAGE)
                .query_async(&mut *conn)
                .await?;
            let Some(last) = pending.ids.last() else {
                break;
            };
            start = format!("({}", last.id);
            let ids: Vec<&str> = pending.ids.iter().map(|p| p.id.as_str()).collect();
            let claimed: StreamClaimReply = redis::cmd("XCLAIM")
                .arg(&**stream)
                .arg(&inner.group)
                .arg(&inner.consumer_name)
                .arg(0)
                .arg(&ids)
                .query_async(&mut *conn)
                .await?;
            for entry in claimed.ids {
                let Some(p) = pending.ids.iter().find(|p| p.id == entry.id) else {
                    continue;
                };
                if p.consumer != inner.consumer_name {
                    self.count(Count::Reclaimed, Some(stream));
                }
                jobs.push(Job {
                    stream: Arc::clone(stream),
                    delivery_count: p.times_delivered as u64 + 1,
                    entry,
                });
            }
            if pending.ids.len() < TAKEOVER_PAGE {
                break;
            }
        }
        jobs.sort_by_key(|job| id_order(&job.entry.id));
        Ok(jobs)
    }

    /// The entries of `stream` pending in this consumer's name for at least `min_idle`
    /// that are not in `queued`, claimed again (`XCLAIM`, which counts a delivery).
    async fn orphans(
        &self,
        conn: &mut Conn,
        stream: &Arc<str>,
        queued: &HashSet<EntryId>,
    ) -> RedisResult<Vec<Job>> {
        let inner = &self.inner;
        let pending: StreamPendingCountReply = redis::cmd("XPENDING")
            .arg(&**stream)
            .arg(&inner.group)
            .arg("IDLE")
            .arg(millis(inner.config.min_idle))
            .arg("-")
            .arg("+")
            .arg(TAKEOVER_PAGE)
            .arg(&inner.consumer_name)
            .query_async(&mut *conn)
            .await?;
        let ids: Vec<&str> = pending
            .ids
            .iter()
            .map(|p| p.id.as_str())
            .filter(|id| !queued.contains(&(Arc::clone(stream), (*id).to_owned())))
            .collect();
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        tracing::info!(
            stream = &**stream,
            orphans = ids.len(),
            "entries left pending without a queue (a failed XACK); claimed again"
        );
        let claimed: StreamClaimReply = redis::cmd("XCLAIM")
            .arg(&**stream)
            .arg(&inner.group)
            .arg(&inner.consumer_name)
            .arg(0)
            .arg(&ids)
            .query_async(&mut *conn)
            .await?;
        Ok(claimed
            .ids
            .into_iter()
            .map(|entry| {
                let times = (pending.ids.iter())
                    .find(|p| p.id == entry.id)
                    .map_or(1, |p| p.times_delivered as u64);
                Job {
                    stream: Arc::clone(stream),
                    delivery_count: times + 1,
                    entry,
                }
            })
            .collect())
    }

    /// The keys blocked on `stream` (none unless blocking after dead letters).
    async fn blocked_keys(&self, conn: &mut Conn, stream: &str) -> RedisResult<Vec<Vec<u8>>> {
        let inner = &self.inner;
        let blocking = inner
            .config
            .ordered
            .as_ref()
            .is_some_and(|o| o.after_dead_letter == crate::AfterDeadLetter::Block);
        if !blocking {
            return Ok(Vec::new());
        }
        redis::cmd("HKEYS")
            .arg(blocked_key(stream, &inner.group))
            .query_async(conn)
            .await
    }
}

/// A stream entry id as numbers, to sort by (`<ms>-<seq>`).
fn id_order(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_sort_as_numbers() {
        let mut ids = ["10-0", "9-1", "9-0", "100-0"];
        ids.sort_by_key(|id| super::id_order(id));
        assert_eq!(ids, ["9-0", "9-1", "10-0", "100-0"]);
    }
}
