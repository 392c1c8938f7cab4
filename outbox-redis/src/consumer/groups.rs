//! Consumer groups: created on start, and again when deleted.

use std::future::Future;

use super::ConsumerStore;
use redis::RedisResult;

use super::stats::Count;
use super::{Consumer, StartFrom};
use crate::Result;
use crate::conn::{partitions_key, stream_name};

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// Creates the group on each stream (and the stream, `MKSTREAM`) if it does not
    /// exist, and registers this consumer in it (`XGROUP CREATECONSUMER`). Idempotent;
    /// [`run_until`](Self::run_until) calls it first.
    pub async fn ensure_groups(&self) -> Result<()> {
        let mut conn = self.inner.commands.get().await?;
        self.create_groups(&mut conn).await?;
        self.check_partitions(&mut conn).await;
        Ok(())
    }

    /// [`ensure_groups`](Self::ensure_groups) on `conn`, without the partition check:
    /// also what recreates the groups a Redis that lost its data (a restart without
    /// persistence, a `FLUSHALL`, a failover to an empty replica) no longer has.
    pub(super) async fn create_groups(&self, conn: &mut crate::conn::Conn) -> RedisResult<()> {
        let inner = &self.inner;
        let start = match inner.config.start_from {
            StartFrom::Beginning => "0",
            StartFrom::End => "$",
        };
        for stream in &inner.streams {
            let created: RedisResult<()> = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&**stream)
                .arg(&inner.group)
                .arg(start)
                .arg("MKSTREAM")
                .query_async(&mut *conn)
                .await;
            match created {
                Ok(()) => {
                    tracing::info!(stream = &**stream, group = %inner.group, start, "consumer group created")
                }
                Err(e) if e.code() == Some("BUSYGROUP") => {}
                Err(e) => {
                    inner.commands.check(&e).await;
                    return Err(e);
                }
            }
            // Registers the consumer at once, so that `XINFO CONSUMERS` lists it before
            // its first delivery.
            let registered: RedisResult<redis::Value> = redis::cmd("XGROUP")
                .arg("CREATECONSUMER")
                .arg(&**stream)
                .arg(&inner.group)
                .arg(&inner.consumer_name)
                .query_async(&mut *conn)
                .await;
            if let Err(e) = registered {
                inner.commands.check(&e).await;
                return Err(e);
            }
        }
        Ok(())
    }

    /// Warns about each topic whose partition count, as its publishers recorded it
    /// (`<prefix>partitions`), differs from this consumer's: entries of partitions it
    /// does not read would never be handled. A topic without a record that this consumer
    /// reads as partitions is checked another way: entries in its unpartitioned stream
    /// mean a relay publishes it without partitions (no `--partitions`), where this
    /// consumer never looks. Best effort: a failed check is skipped.
    async fn check_partitions(&self, conn: &mut crate::conn::Conn) {
        let inner = &self.inner;
        let prefix = &inner.config.stream_prefix;
        for topic in inner.dispatcher.topics() {
            let published: RedisResult<Option<u32>> = redis::cmd("HGET")
                .arg(partitions_key(prefix))
                .arg(*topic)
                .query_async(&mut *conn)
                .await;
            let read = (inner.streams.iter())
                .filter(|s| crate::conn::topic_of(s, prefix, inner.cluster) == *topic)
                .count();
            match published {
                Ok(Some(published)) if published as usize != read => tracing::warn!(
                    topic,
                    published,
                    read,
                    "the topic is published to another number of partitions than this consumer reads"
                ),
                Ok(None) if read > 1 => {
                    let unpartitioned = stream_name(prefix, topic, inner.cluster);
                    let entries: RedisResult<u64> = redis::cmd("XLEN")
                        .arg(&unpartitioned)
                        .query_async(&mut *conn)
                        .await;
                    if let Ok(entries @ 1..) = entries {
                        tracing::warn!(
                            topic,
                            read,
                            stream = unpartitioned,
                            entries,
                            "no publisher recorded partitions for the topic, and its unpartitioned stream, which this consumer does not read, has entries: give the relays the same partition count (--partitions TOPIC=N)"
                        );
                    }
                }
                _ => {}
            }
        }
    }

    /// Creates the groups, waiting out an outage of Redis (a consumer started before
    /// Redis, or during a restart, must not need a restart of its own). Returns false
    /// if `shutdown` came first.
    pub(super) async fn wait_for_groups(
        &self,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Result<bool> {
        let mut outages = 0;
        loop {
            match self.ensure_groups().await {
                Ok(()) => return Ok(true),
                Err(e) if e.is_outage() => {
                    outages += 1;
                    self.count(Count::RedisError, None);
                    tracing::warn!(error = %outbox_core::error_chain(&e), "redis unavailable at start; waiting for it");
                    tokio::select! {
                        biased;
                        () = &mut *shutdown => return Ok(false),
                        () = tokio::time::sleep(self.inner.config.outage_backoff.pause(outages)) => {}
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
}
