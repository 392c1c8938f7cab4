//! New entries: `XREADGROUP ... BLOCK`.

use std::sync::Arc;

use super::ConsumerStore;
use redis::RedisResult;
use redis::streams::StreamReadReply;
use tokio::task::JoinSet;

use super::{Consumer, Job, duration_ms};
use crate::conn::Connector;

/// Reads some streams with one `XREADGROUP ... BLOCK`, on a connection of its own: a
/// blocked connection holds up every command queued behind it, and its response timeout
/// must exceed the block time.
pub(super) struct Reader {
    pub(super) streams: Vec<Arc<str>>,
    pub(super) conn: Connector,
}

/// The reads in progress when a consumer has several readers (a cluster with streams in
/// several slots): each reader's read runs on, across rounds of the run loop, until it
/// returns, so that entries of one stream are processed while the others still block.
#[derive(Default)]
pub(super) struct Reads {
    tasks: JoinSet<(usize, RedisResult<Vec<Job>>)>,
    /// Each reader's read in progress, if any.
    running: Vec<Option<tokio::task::Id>>,
    /// Entries read in a round that also failed: handed out by the next round.
    held: Vec<Job>,
}

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// New entries. With one reader (always on a single server), its read. With several
    /// (a cluster), starts a read for each reader that has none in progress, waits for
    /// the first to return and takes whatever else has returned meanwhile; the others go
    /// on blocking into the next rounds.
    pub(super) async fn read(&self, count: usize, reads: &mut Reads) -> RedisResult<Vec<Job>> {
        let readers = self.inner.readers.len();
        if readers == 1 {
            return self.read_from(0, count).await;
        }
        if !reads.held.is_empty() {
            return Ok(std::mem::take(&mut reads.held));
        }
        reads.running.resize(readers, None);
        for (i, running) in reads.running.iter_mut().enumerate() {
            if running.is_none() {
                let this = self.clone();
                let task = reads
                    .tasks
                    .spawn(async move { (i, this.read_from(i, count).await) });
                *running = Some(task.id());
            }
        }
        let mut jobs = Vec::new();
        let mut error = None;
        let mut next = reads.tasks.join_next().await;
        while let Some(joined) = next {
            match joined {
                Ok((i, result)) => {
                    reads.running[i] = None;
                    match result {
                        Ok(read) => jobs.extend(read),
                        Err(e) => {
                            error.get_or_insert(e);
                        }
                    }
                }
                // A bug in the runner: the reader reads again next round, and entries
                // the failed read took stay pending and are claimed again.
                Err(e) => {
                    tracing::error!(error = %e, "read task failed");
                    for running in &mut reads.running {
                        if *running == Some(e.id()) {
                            *running = None;
                        }
                    }
                }
            }
            next = reads.tasks.try_join_next();
        }
        match error {
            Some(e) => {
                reads.held = jobs;
                Err(e)
            }
            None => Ok(jobs),
        }
    }

    /// New entries of reader `i`'s streams:
    /// `XREADGROUP GROUP g c COUNT n BLOCK ms STREAMS s... > ...`.
    async fn read_from(&self, i: usize, count: usize) -> RedisResult<Vec<Job>> {
        let inner = &self.inner;
        let reader = &inner.readers[i];
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&inner.group)
            .arg(&inner.consumer_name)
            .arg("COUNT")
            .arg(count)
            .arg("BLOCK")
            .arg(duration_ms(inner.config.block))
            .arg("STREAMS");
        for stream in &reader.streams {
            cmd.arg(&**stream);
        }
        for _ in &reader.streams {
            cmd.arg(">");
        }
        let mut conn = reader.conn.get().await?;
        let reply: Option<StreamReadReply> = match cmd.query_async(&mut conn).await {
            Ok(reply) => reply,
            Err(e) => {
                reader.conn.check(&e).await;
                return Err(e);
            }
        };
        let mut jobs = Vec::new();
        for key in reply.map(|r| r.keys).unwrap_or_default() {
            let Some(stream) = reader.streams.iter().find(|s| ***s == *key.key) else {
                continue;
            };
            jobs.extend(key.ids.into_iter().map(|entry| Job {
                stream: Arc::clone(stream),
                entry,
                delivery_count: 1,
            }));
        }
        Ok(jobs)
    }
}
