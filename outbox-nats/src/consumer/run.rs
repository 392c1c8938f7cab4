//! [`Consumer::run_until`]: the streams and durable consumers it sets up, and its
//! readers' pulls.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::consumer::PullConsumer;
use futures_util::StreamExt as _;
use outbox_core::ConsumerStore;
use tokio::sync::watch;

use super::health::Count;
use super::lanes::{Lane, lanes};
use super::process::Outcome;
use super::screen::Job;
use super::{Consumer, Topic};
use crate::Result;
use crate::streams::ensure_stream;

/// Pulls failed in a row after which a reader sets its stream and durable consumer up
/// again.
const REFIND_AFTER: u32 = 3;

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// Reads and applies messages until `shutdown` completes, then stops pulling,
    /// finishes the messages in hand (for at most
    /// [`shutdown_timeout`](super::ConsumerConfig::shutdown_timeout); a message cut
    /// off is delivered again after `ack_wait`) and returns.
    ///
    /// At start it creates each handled topic's stream when missing (and checks it
    /// when present, see [`StreamSettings`](crate::StreamSettings)), the dead-letter
    /// stream, and the group's durable pull consumer on each stream. While NATS is
    /// unreachable it waits and tries again; a stream with other settings is
    /// [`Error::StreamMismatch`](crate::Error::StreamMismatch), a durable consumer of
    /// the group with another `ack_wait`
    /// [`Error::ConsumerMismatch`](crate::Error::ConsumerMismatch).
    pub async fn run_until(&self, shutdown: impl Future<Output = ()>) -> Result<()> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let work = async {
            let Some(readers) = self.set_up(stop_rx.clone()).await? else {
                return Ok(());
            };
            self.inner.health.set_running(true);
            let reads = readers
                .into_iter()
                .map(|(lane, consumer)| self.read(lane, consumer, stop_rx.clone()));
            futures_util::future::join_all(reads).await;
            Ok(())
        };
        tokio::pin!(work);
        tokio::pin!(shutdown);
        let result = tokio::select! {
            result = &mut work => result,
            () = &mut shutdown => {
                let _ = stop_tx.send(true);
                let grace = self.inner.config.shutdown_timeout + self.inner.config.fetch_wait;
                match tokio::time::timeout(grace, &mut work).await {
                    Ok(result) => result,
                    Err(_) => {
                        tracing::warn!("shutdown timed out with messages in hand; they are delivered again after ack_wait");
                        Ok(())
                    }
                }
            }
        };
        self.inner.health.set_running(false);
        result
    }

    /// The streams and durable consumers, tried again after each outage until they are
    /// there (`Some`) or the run is stopped (`None`).
    async fn set_up(
        &self,
        mut stop: watch::Receiver<bool>,
    ) -> Result<Option<Vec<(Lane, PullConsumer)>>> {
        let mut failures = 0;
        loop {
            match self.try_set_up().await {
                Ok(readers) => return Ok(Some(readers)),
                Err(e) if e.is_outage() => {
                    failures += 1;
                    self.inner.health.broker_failed(&e);
                    tracing::warn!(error = %e, "nats unavailable while setting up the consumer; trying again");
                    if self.pause(self.outage_delay(failures), &mut stop).await {
                        return Ok(None);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn try_set_up(&self) -> Result<Vec<(Lane, PullConsumer)>> {
        let inner = &self.inner;
        let naming = &inner.config.naming;
        // Dead letters are kept until redriven, and take the topics' largest messages
        // with the dead letter's headers added: no size limit of their own (a message
        // that fit its topic's limit and not this one would be redelivered forever).
        let mut dead = inner.config.streams.clone().with_max_age(Duration::ZERO);
        dead.max_message_size = None;
        ensure_stream(
            &inner.js,
            &naming.dead_letter_stream(),
            vec![naming.dead_letter_subjects()],
            &dead,
        )
        .await?;
        for topic in &inner.topics {
            let subjects = naming.stream_subjects(&topic.name, topic.partitions);
            ensure_stream(&inner.js, &topic.stream, subjects, &inner.config.streams).await?;
        }
        let mut readers = Vec::new();
        for lane in lanes(&inner.group, &inner.topics, naming, inner.config.ordered) {
            let consumer = self.lane_consumer(&lane).await?;
            readers.push((lane, consumer));
        }
        Ok(readers)
    }

    /// `lane`'s stream and durable consumer, checked or created again.
    async fn refind(&self, lane: &Lane) -> Result<PullConsumer> {
        let inner = &self.inner;
        let topic = &lane.topic;
        let subjects = inner
            .config
            .naming
            .stream_subjects(&topic.name, topic.partitions);
        ensure_stream(&inner.js, &topic.stream, subjects, &inner.config.streams).await?;
        self.lane_consumer(lane).await
    }

    /// Waits `delay`, or less if the run is stopped; returns whether it was.
    async fn pause(&self, delay: Duration, stop: &mut watch::Receiver<bool>) -> bool {
        if *stop.borrow() {
            return true;
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => *stop.borrow(),
            _ = stop.changed() => true,
        }
    }

    /// One reader: pulls from `lane`'s `consumer` and applies what comes, until stopped.
    async fn read(&self, lane: Lane, mut consumer: PullConsumer, mut stop: watch::Receiver<bool>) {
        let topic = &lane.topic;
        // Readers share the consumer's health: the consumer is not ready while any of
        // them fails, whatever the others read.
        let mut health = self.inner.health.reader();
        let mut failures = 0;
        while !*stop.borrow() {
            self.inner.health.round();
            if failures >= REFIND_AFTER && failures % REFIND_AFTER == 0 {
                // The server may have come back without the stream or the durable
                // consumer (memory storage, an operator's delete): set them up again.
                match self.refind(&lane).await {
                    Ok(found) => consumer = found,
                    Err(e) => {
                        tracing::warn!(stream = %topic.stream, error = %e, "cannot set the stream up again")
                    }
                }
            }
            let outage = match self.pull(topic, &consumer, &stop).await {
                Ok(outage) => {
                    failures = 0;
                    health.answered();
                    outage
                }
                Err(e) => {
                    self.count(Count::NatsError, 1);
                    failures = health.failed(&e);
                    tracing::warn!(stream = %topic.stream, error = %e, "pull failed");
                    true
                }
            };
            if outage
                && self
                    .pause(self.outage_delay(failures.max(1)), &mut stop)
                    .await
            {
                break;
            }
        }
    }

    /// One pull: its messages applied as they arrive, concurrently in single mode, a
    /// batch of those ready at a time in batch mode. Returns whether one met an outage;
    /// `Err` when the pull itself failed.
    async fn pull(
        &self,
        topic: &Topic,
        consumer: &PullConsumer,
        stop: &watch::Receiver<bool>,
    ) -> Result<bool, String> {
        let config = &self.inner.config;
        if self.inner.client.connection_state() != State::Connected {
            // A pull sent now would wait in the client's buffer: nothing to read.
            return Err("not connected to the nats server".to_owned());
        }
        let messages = consumer
            .batch()
            .max_messages(config.fetch_count)
            .expires(config.fetch_wait)
            .messages()
            .await
            .map_err(|e| e.to_string())?;
        // A pull the server does not end (the connection dropped) is cut off: each wait
        // for its next message is bounded. What the server already sent is finished,
        // however long the handlers take: a deadline on the whole pull left the rest of
        // a slow pull unacknowledged, and their redeliveries counted toward the limit.
        let cut_off = AtomicBool::new(false);
        let silence = config.fetch_wait.saturating_add(Duration::from_secs(2));
        let messages = futures_util::stream::unfold(messages, |mut messages| {
            let cut_off = &cut_off;
            async move {
                match tokio::time::timeout(silence, messages.next()).await {
                    Ok(next) => next.map(|m| (m, messages)),
                    Err(_) => {
                        cut_off.store(true, Ordering::Relaxed);
                        None
                    }
                }
            }
        });
        let outage = AtomicBool::new(false);
        let failed = std::sync::Mutex::new(None::<String>);
        let jobs = messages.filter_map(|m| {
            let job = match m {
                Ok(msg) => Job::new(msg, topic),
                Err(e) => {
                    *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                    None
                }
            };
            std::future::ready(job)
        });
        match config.batch_size {
            None => {
                let outage = &outage;
                jobs.for_each_concurrent(config.max_in_flight, |job| async move {
                    if self.process(&job, stop).await == Outcome::Outage {
                        outage.store(true, Ordering::Relaxed);
                    }
                })
                .await;
            }
            Some(n) => {
                let mut batches = std::pin::pin!(jobs.ready_chunks(n));
                while let Some(batch) = batches.next().await {
                    if self.process_batch(batch, stop).await == Outcome::Outage {
                        outage.store(true, Ordering::Relaxed);
                    }
                }
            }
        }
        match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None if cut_off.into_inner() => Err("the server did not end a pull".to_owned()),
            None => Ok(outage.into_inner()),
        }
    }
}
