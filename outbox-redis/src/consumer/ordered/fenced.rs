//! Ordered mode's reads: `XREADGROUP` only while the lease is ours, checked by Redis in
//! the same script; then, when nothing came, a blocking `XREAD` that takes nothing and
//! only waits for new entries.
//!
//! A plain blocking `XREADGROUP` would hand entries to whoever is blocked on the stream:
//! a consumer that lost its lease while blocked (stopped with `SIGSTOP`, or releasing the
//! stream) would take entries the holder then never sees, and that would come back
//! later, out of order. Checked in Redis, a read delivers entries only to the holder.

use std::sync::Arc;
use std::time::Duration;

use crate::ConsumerStore;
use redis::streams::StreamReadReply;
use redis::{FromRedisValue, ParsingError, RedisResult, Value};

use super::super::{Consumer, Job, duration_ms};
use crate::conn::{Conn, Connector, by_slot, query_all};
use crate::lease::{Lease, eval};

/// `KEYS[1]` the stream, `KEYS[2]` its lease; `ARGV`: the lease's value, the group, the
/// consumer, the count. Returns -1 if the lease is not the caller's; else the
/// `XREADGROUP` reply; else (nothing new) the stream's last entry id, or `0-0`.
const READ: &str = r"
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
local r = redis.call('XREADGROUP', 'GROUP', ARGV[2], ARGV[3], 'COUNT', ARGV[4], 'STREAMS', KEYS[1], '>')
if r then return r end
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if top[1] then return top[1][1] end
return '0-0'
";

/// How long an ordered consumer on a cluster waits before reading again after a read
/// that brought nothing: one `XREAD BLOCK` cannot wait on streams of several slots.
const CLUSTER_POLL: Duration = Duration::from_millis(50);

/// One stream's answer to [`READ`].
enum Fenced {
    /// The lease is not ours (any more).
    Lost,
    Entries(StreamReadReply),
    /// Nothing new after this id.
    Empty(String),
}

impl FromRedisValue for Fenced {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        match v {
            Value::Int(-1) => Ok(Self::Lost),
            Value::Array(_) => Ok(Self::Entries(StreamReadReply::from_redis_value(v)?)),
            v => Ok(Self::Empty(String::from_redis_value(v)?)),
        }
    }
}

/// What a read of the streams held brought.
#[derive(Default)]
pub(super) struct Read {
    /// Each with the lease it was read under.
    pub(super) jobs: Vec<(Job, Arc<Lease>)>,
    /// Streams whose lease Redis no longer has as ours.
    pub(super) lost: Vec<(Arc<str>, Arc<Lease>)>,
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// New entries of `held` (each stream with its lease), up to `count` per stream,
    /// with one pipeline of [`READ`] scripts (on a cluster, one per hash slot, sent side
    /// by side). When none came, waits up to `block` for one to be added (`XREAD BLOCK`,
    /// which takes nothing; on a cluster, whose streams live in many slots, a short
    /// pause instead), and returns nothing: the next read takes it.
    pub(super) async fn read_fenced(
        self,
        held: Vec<(Arc<str>, Arc<Lease>)>,
        count: usize,
    ) -> RedisResult<Read> {
        let inner = &self.inner;
        // One server: the reader's connection, whose timeout allows for the block.
        let connector = if inner.cluster {
            &inner.commands
        } else {
            &inner.readers[0].conn
        };
        let groups = by_slot(inner.cluster, held, |(stream, _)| stream);
        let pipes = groups
            .iter()
            .map(|group| {
                let mut pipe = redis::pipe();
                for (stream, lease) in group {
                    pipe.add_command(
                        eval(READ, 2)
                            .arg(&**stream)
                            .arg(lease.key())
                            .arg(lease.value())
                            .arg(&inner.group)
                            .arg(&inner.consumer_name)
                            .arg(count.max(1))
                            .clone(),
                    );
                }
                pipe
            })
            .collect();
        let mut conn = connector.get().await?;
        let mut read = Read::default();
        let mut tops = Vec::new();
        for (group, replies) in groups
            .iter()
            .zip(query_all::<Vec<Fenced>>(&mut conn, pipes).await)
        {
            let replies = match replies {
                Ok(replies) => replies,
                Err(e) => {
                    connector.check(&e).await;
                    return Err(e);
                }
            };
            for ((stream, lease), reply) in group.iter().zip(replies) {
                match reply {
                    Fenced::Lost => {
                        lease.give_up();
                        read.lost.push((Arc::clone(stream), Arc::clone(lease)));
                    }
                    Fenced::Entries(reply) => {
                        for key in reply.keys {
                            read.jobs.extend(key.ids.into_iter().map(|entry| {
                                let job = Job {
                                    stream: Arc::clone(stream),
                                    entry,
                                    delivery_count: 1,
                                };
                                (job, Arc::clone(lease))
                            }));
                        }
                    }
                    Fenced::Empty(top) => tops.push((stream, top)),
                }
            }
        }
        if read.jobs.is_empty() && read.lost.is_empty() && !tops.is_empty() {
            self.wait_for_new(connector, &mut conn, &tops).await?;
        }
        Ok(read)
    }

    /// Nothing read on any held stream: waits up to the block for a new entry on one of
    /// them, past its `top` (on a cluster, whose streams may be on several nodes, a
    /// short sleep instead).
    async fn wait_for_new(
        &self,
        connector: &Connector,
        conn: &mut Conn,
        tops: &[(&Arc<str>, String)],
    ) -> RedisResult<()> {
        let block = self.inner.config.block;
        if self.inner.cluster {
            tokio::time::sleep(block.min(CLUSTER_POLL)).await;
            return Ok(());
        }
        let mut wait = redis::cmd("XREAD");
        wait.arg("BLOCK").arg(duration_ms(block)).arg("STREAMS");
        for (stream, _) in tops {
            wait.arg(&***stream);
        }
        for (_, top) in tops {
            wait.arg(top);
        }
        let woken: RedisResult<Value> = wait.query_async(conn).await;
        if let Err(e) = &woken {
            connector.check(e).await;
        }
        woken.map(drop)
    }
}
