//! Acknowledgements: `XACK`, queued and shared by the entries finished together.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::ConsumerStore;
use redis::RedisResult;

use super::{Consumer, Job, Outcome};
use crate::conn::{by_slot, query_all};

/// The acknowledgements of one [`run_until`](Consumer::run_until): work whose
/// transaction committed queues its entries here and is done; a task sends what has
/// queued meanwhile as one `XACK` per stream ([`Consumer::flush_acks`]). An ack
/// follows its commit without holding up the next message: at one message in flight
/// the `XACK` round trip overlaps the next transaction, and under load many entries
/// share one `XACK`.
#[derive(Clone)]
pub(super) struct AckQueue {
    pub(super) queue: tokio::sync::mpsc::UnboundedSender<(Arc<str>, String)>,
    /// An `XACK` failed since the run loop last looked (it then backs off).
    pub(super) failed: Arc<AtomicBool>,
}

/// Most entries one `XACK` round of the ack queue sends.
const ACK_BATCH: usize = 1024;

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// Acknowledges entries whose work committed: through this run's ack queue, or (outside
    /// [`run_until`](Self::run_until)) at once. Returns whether Redis failed; a queued ack
    /// reports its failure to the run loop instead.
    pub(super) async fn ack_all(&self, jobs: &[&Job]) -> bool {
        if jobs.is_empty() {
            return false;
        }
        if let Some(acks) = &self.acks {
            let queued = jobs.iter().all(|job| {
                acks.queue
                    .send((Arc::clone(&job.stream), job.entry.id.clone()))
                    .is_ok()
            });
            if queued {
                return false;
            }
        }
        let entries: Vec<(Arc<str>, String)> = jobs
            .iter()
            .map(|job| (Arc::clone(&job.stream), job.entry.id.clone()))
            .collect();
        self.xack(&entries).await
    }

    /// Sends the queued acks of a run until every sender is gone: each round takes what
    /// has queued (up to [`ACK_BATCH`]) and sends it as one `XACK` per stream.
    pub(super) async fn flush_acks(
        self,
        queued: tokio::sync::mpsc::UnboundedReceiver<(Arc<str>, String)>,
        failed: Arc<AtomicBool>,
    ) {
        self.flush_acks_until(queued, failed, std::future::pending())
            .await;
    }

    /// [`flush_acks`](Self::flush_acks), which also ends, after sending what has queued,
    /// once `closing` completes: a sender still alive then (a worker whose handler ran
    /// past the shutdown timeout) sends its ack itself ([`ack_all`](Self::ack_all)).
    pub(super) async fn flush_acks_until(
        self,
        mut queued: tokio::sync::mpsc::UnboundedReceiver<(Arc<str>, String)>,
        failed: Arc<AtomicBool>,
        closing: impl std::future::Future<Output = ()>,
    ) {
        let mut closing = std::pin::pin!(closing);
        let mut open = true;
        let mut entries = Vec::new();
        loop {
            tokio::select! {
                n = queued.recv_many(&mut entries, ACK_BATCH) => {
                    if n == 0 {
                        return;
                    }
                    if self.xack(&entries).await {
                        failed.store(true, Ordering::Relaxed);
                    }
                    entries.clear();
                }
                () = &mut closing, if open => {
                    // What is queued still comes out; nothing more goes in.
                    queued.close();
                    open = false;
                }
            }
        }
    }

    /// `XACK` of many entries, one command per stream in one pipeline (on a cluster, one
    /// pipeline per hash slot, sent concurrently); returns whether Redis failed.
    async fn xack(&self, entries: &[(Arc<str>, String)]) -> bool {
        let inner = &self.inner;
        let mut streams: Vec<&Arc<str>> = Vec::new();
        for (stream, _) in entries {
            if !streams.contains(&stream) {
                streams.push(stream);
            }
        }
        let pipes = by_slot(inner.cluster, streams, |s| s)
            .into_iter()
            .map(|streams| {
                let mut pipe = redis::pipe();
                for stream in streams {
                    let cmd = pipe.cmd("XACK").arg(&**stream).arg(&inner.group);
                    for (_, id) in entries.iter().filter(|(s, _)| s == stream) {
                        cmd.arg(id);
                    }
                    cmd.ignore();
                }
                pipe
            })
            .collect();
        let acked: RedisResult<()> = async {
            let mut conn = inner.commands.get().await?;
            query_all(&mut conn, pipes).await.into_iter().collect()
        }
        .await;
        self.redis_done(
            acked,
            "ack failed; the entries stay pending and are claimed again",
        )
        .await
    }

    /// `XACK` of one entry, through the ack queue.
    pub(super) async fn ack(&self, job: &Job) -> Outcome {
        if self.ack_all(&[job]).await {
            Outcome::Pending { outage: true }
        } else {
            Outcome::Acked
        }
    }
}
