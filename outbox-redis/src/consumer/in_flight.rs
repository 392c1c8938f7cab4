//! The entries a consumer is processing, kept from looking idle.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ConsumerStore;
use redis::RedisResult;

use super::{Consumer, Job};

/// The entries this consumer is processing, with when each started; shared by the run
/// loop and the task that keeps them from looking idle.
#[derive(Clone, Default)]
pub(super) struct InFlight(Arc<std::sync::Mutex<Started>>);

/// When each entry in flight, by stream and id, started.
type Started = HashMap<(Arc<str>, String), Instant>;

impl InFlight {
    /// The map, locked.
    fn entries(&self) -> std::sync::MutexGuard<'_, Started> {
        // The map holds no invariant a panic could break.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds `job`'s entry; false if it is in flight already.
    pub(super) fn insert(&self, job: &Job) -> bool {
        let key = (Arc::clone(&job.stream), job.entry.id.clone());
        match self.entries().entry(key) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Instant::now());
                true
            }
        }
    }

    /// Whether the entry `id` of `stream` is in flight.
    pub(super) fn contains(&self, stream: &Arc<str>, id: &str) -> bool {
        self.entries()
            .contains_key(&(Arc::clone(stream), id.to_owned()))
    }

    /// Removes `entries`, finished.
    pub(super) fn remove(&self, entries: &[(Arc<str>, String)]) {
        let mut map = self.entries();
        for entry in entries {
            map.remove(entry);
        }
    }

    /// The ids of entries in flight for longer than `age`, per stream.
    fn older_than(&self, age: Duration) -> Vec<(Arc<str>, Vec<String>)> {
        let mut by_stream: Vec<(Arc<str>, Vec<String>)> = Vec::new();
        for ((stream, id), started) in self.entries().iter() {
            if started.elapsed() < age {
                continue;
            }
            match by_stream.iter_mut().find(|(s, _)| s == stream) {
                Some((_, ids)) => ids.push(id.clone()),
                None => by_stream.push((Arc::clone(stream), vec![id.clone()])),
            }
        }
        by_stream
    }
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// Keeps the entries this consumer works on from looking idle: every third of
    /// `min_idle`, an `XCLAIM ... JUSTID` to itself resets the idle time of those in
    /// flight for longer than that, without counting a delivery. So neither another
    /// consumer nor this one's own `XAUTOCLAIM` takes over a slow handler's entry and
    /// runs it a second time concurrently; if this process stalls or dies, the refreshes
    /// stop and the entries are claimed after `min_idle`.
    pub(super) async fn keep_in_flight_alive(self, in_flight: InFlight) {
        let every = self.inner.config.min_idle / 3;
        loop {
            tokio::time::sleep(every).await;
            let stale = in_flight.older_than(every);
            for (stream, ids) in stale {
                let refreshed: RedisResult<redis::Value> = async {
                    let mut conn = self.inner.commands.get().await?;
                    redis::cmd("XCLAIM")
                        .arg(&*stream)
                        .arg(&self.inner.group)
                        .arg(&self.inner.consumer_name)
                        .arg(0)
                        .arg(&ids)
                        .arg("JUSTID")
                        .query_async(&mut conn)
                        .await
                }
                .await;
                self.redis_done(refreshed, "cannot refresh the entries in flight")
                    .await;
            }
        }
    }
}
