//! Ordered mode's leases: the group's live consumers, the leases held renewed, free
//! streams acquired up to a fair share, and a stream taken over with the entries its
//! previous holder left pending.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::Partitions;

use crate::ConsumerStore;
use redis::streams::{StreamClaimReply, StreamPendingCountReply};
use redis::{FromRedisValue, ParsingError, RedisError, RedisResult, Value};

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

/// `XCLAIM` (no minimum idle time) only while the lease is the caller's: `KEYS[1]` the
/// stream, `KEYS[2]` its lease; `ARGV`: the lease's value, the group, the consumer, then
/// the ids. Returns -1 if the lease is not the caller's, else the `XCLAIM` reply. A
/// process stopped between acquiring a stream and claiming its entries must not take
/// them from the holder that acquired it meanwhile.
const CLAIM: &str = r"
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
return redis.call('XCLAIM', KEYS[1], ARGV[2], ARGV[3], 0, unpack(ARGV, 4))
";

/// One answer to [`CLAIM`]: `None` if the lease is not the caller's (any more).
struct Claimed(Option<StreamClaimReply>);

impl FromRedisValue for Claimed {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        match v {
            Value::Int(-1) => Ok(Self(None)),
            v => Ok(Self(Some(StreamClaimReply::from_redis_value(v)?))),
        }
    }
}

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
                    let orphans = (self.orphans(&mut conn, stream, lease, &holding.queued)).await?;
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
            match self.taken_or_recreated(conn, stream, &lease).await {
                Ok(None) => {
                    // Lost between its acquisition and its takeover (this process was
                    // stopped meanwhile): another consumer holds it now.
                    tracing::warn!(
                        stream = &**stream,
                        epoch = lease.epoch(),
                        "lease lost during its takeover"
                    );
                    lease.give_up();
                }
                Ok(Some((pending, blocked))) => {
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

    /// [`taken`](Self::taken), after creating the groups again if Redis lost them (a
    /// restart without persistence, a `FLUSHALL`, a failover to an empty replica): only
    /// their creation brings the stream back, and no read does it for a consumer that
    /// holds nothing.
    async fn taken_or_recreated(
        &self,
        conn: &mut Conn,
        stream: &Arc<str>,
        lease: &Lease,
    ) -> RedisResult<Option<(Vec<Job>, Vec<Vec<u8>>)>> {
        match self.taken(conn, stream, lease).await {
            Err(e) if e.code() == Some("NOGROUP") => {
                tracing::warn!(stream = &**stream, error = %e, "consumer group missing; recreating it");
                self.create_groups(conn).await?;
                self.taken(conn, stream, lease).await
            }
            taken => taken,
        }
    }

    /// What taking `stream` over under `lease` brings: its pending entries and its
    /// blocked keys. `None`: the lease was lost meanwhile.
    async fn taken(
        &self,
        conn: &mut Conn,
        stream: &Arc<str>,
        lease: &Lease,
    ) -> RedisResult<Option<(Vec<Job>, Vec<Vec<u8>>)>> {
        let Some(pending) = self.take_over(conn, stream, lease).await? else {
            return Ok(None);
        };
        let blocked = self.blocked_keys(conn, stream).await?;
        Ok(Some((pending, blocked)))
    }

    /// [`CLAIM`]s `ids` of `stream` for this consumer if `lease` is still its lease.
    async fn claim_fenced(
        &self,
        conn: &mut Conn,
        stream: &str,
        lease: &Lease,
        ids: &[&str],
    ) -> RedisResult<Option<StreamClaimReply>> {
        let inner = &self.inner;
        let claimed: Claimed = eval(CLAIM, 2)
            .arg(stream)
            .arg(lease.key())
            .arg(lease.value())
            .arg(&inner.group)
            .arg(&inner.consumer_name)
            .arg(ids)
            .query_async(conn)
            .await?;
        Ok(claimed.0)
    }

    /// Claims every entry pending in the group on `stream`, whoever holds it
    /// (`XPENDING`, then `XCLAIM` with no minimum idle time: safe, the lease is ours,
    /// which [`CLAIM`] checks), in stream order. `None`: the lease was lost meanwhile.
    async fn take_over(
        &self,
        conn: &mut Conn,
        stream: &Arc<str>,
        lease: &Lease,
    ) -> RedisResult<Option<Vec<Job>>> {
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
            let Some(claimed) = self.claim_fenced(conn, stream, lease, &ids).await? else {
                return Ok(None);
            };
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
        Ok(Some(jobs))
    }

    /// The entries of `stream` pending in this consumer's name for at least `min_idle`
    /// that are not in `queued`, claimed again (`XCLAIM`, which counts a delivery).
    async fn orphans(
        &self,
        conn: &mut Conn,
        stream: &Arc<str>,
        lease: &Lease,
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
        let Some(claimed) = self.claim_fenced(conn, stream, lease, &ids).await? else {
            // Lost: the next read or renewal drops the stream.
            lease.give_up();
            return Ok(Vec::new());
        };
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
    use std::sync::Arc;
    use std::time::Duration;

    use redis::streams::StreamPendingCountReply;

    use crate::conn::lease_key;
    use crate::lease::Lease;

    /// A process stopped between acquiring a stream and taking it over resumes after
    /// another consumer acquired it: it must claim nothing from the new holder.
    #[tokio::test]
    async fn a_takeover_claims_nothing_once_the_lease_is_someone_elses() {
        let consumer = super::super::tests::consumer();
        let mut conn = consumer.inner.commands.get().await.unwrap();
        let stream: Arc<str> = Arc::from(outbox_tests::unique("takeover"));
        let key = lease_key(&stream, "g");
        let () = redis::pipe()
            .cmd("XGROUP")
            .arg("CREATE")
            .arg(&*stream)
            .arg("g")
            .arg("0")
            .arg("MKSTREAM")
            .ignore()
            .cmd("XADD")
            .arg(&*stream)
            .arg("*")
            .arg("f")
            .arg("v")
            .ignore()
            .cmd("XREADGROUP")
            .arg("GROUP")
            .arg("g")
            .arg("new-holder")
            .arg("STREAMS")
            .arg(&*stream)
            .arg(">")
            .ignore()
            .query_async(&mut conn)
            .await
            .unwrap();
        let lease = Lease::acquire(
            &mut conn,
            &key,
            consumer.consumer_name(),
            Duration::from_secs(10),
        )
        .await
        .unwrap()
        .unwrap();
        // It expired while this process stood still, and went to another consumer.
        let () = redis::cmd("SET")
            .arg(&key)
            .arg("99:new-holder")
            .query_async(&mut conn)
            .await
            .unwrap();
        let taken = consumer
            .take_over(&mut conn, &stream, &lease)
            .await
            .unwrap();
        assert!(taken.is_none(), "claimed under a lease no longer ours");
        let pending: StreamPendingCountReply = redis::cmd("XPENDING")
            .arg(&*stream)
            .arg("g")
            .arg("-")
            .arg("+")
            .arg(10)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(pending.ids.len(), 1);
        assert_eq!(pending.ids[0].consumer, "new-holder");
        let () = redis::cmd("DEL")
            .arg(&*stream)
            .arg(&key)
            .arg(format!("{key}:epoch"))
            .query_async(&mut conn)
            .await
            .unwrap();
    }

    #[test]
    fn ids_sort_as_numbers() {
        let mut ids = ["10-0", "9-1", "9-0", "100-0"];
        ids.sort_by_key(|id| super::id_order(id));
        assert_eq!(ids, ["9-0", "9-1", "10-0", "100-0"]);
    }
}
