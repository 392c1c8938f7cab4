//! The NATS consumer (`outbox-nats`) beside the plain SQL loop: the same messages
//! ([`PointsEarned`], one account row each), the same handler and inbox, read from a
//! JetStream stream of the bench's own (`NATS_URL`, default the local server).

use std::time::{Duration, Instant};

use diesel::PgConnection;
use diesel::r2d2::{ConnectionManager, Pool};
use outbox_core::{Envelope, OutboxEvent as _, Publisher as _, StoredMessage};
use outbox_diesel::PgInbox;
use outbox_nats::{Consumer, ConsumerConfig, Naming, NatsPublisher, PublisherConfig, async_nats};

use super::{Award, ConsumerBench, PointsEarned};
use crate::BoxError;

impl ConsumerBench {
    /// The stream and subject prefixes of the bench's NATS stream.
    fn naming(&self) -> Result<Naming, BoxError> {
        Ok(Naming::new(
            format!("bench{}", self.tag),
            format!("BENCH{}_", self.tag.to_uppercase()),
        )?)
    }

    async fn nats(&self) -> Result<async_nats::Client, BoxError> {
        Ok(async_nats::connect(outbox_tests::nats_url()).await?)
    }

    /// Publishes the [`PointsEarned`] messages to NATS once, in batches of 500.
    pub(crate) async fn publish_nats(&self) -> Result<(), BoxError> {
        let config = PublisherConfig::default().with_naming(self.naming()?);
        let publisher = NatsPublisher::new(self.nats().await?, config)?;
        let all: Vec<usize> = (0..self.messages).collect();
        for chunk in all.chunks(500) {
            let mut batch = Vec::with_capacity(chunk.len());
            for &i in chunk {
                let points = PointsEarned {
                    award_id: format!("award-{i}"),
                    account: i32::try_from(i)?,
                };
                batch.push(StoredMessage {
                    id: batch.len() as i64 + 1,
                    retries: 0,
                    envelope: Envelope::from_event(&points, 1 << 20)?,
                });
            }
            let outcomes = publisher.publish(&batch).await?;
            if let Some(Err(e)) = outcomes.into_iter().find(Result::is_err) {
                return Err(format!("NATS publish rejected: {e:?}").into());
            }
        }
        Ok(())
    }

    /// One NATS consumer of a new group, single mode, `in_flight` transactions at once,
    /// drains the stream: messages/s.
    pub(crate) async fn nats_consumer(&self, in_flight: usize) -> Result<f64, BoxError> {
        let group = self.group("nats");
        let url = self.url.clone();
        let size = u32::try_from(in_flight)?;
        let pool = tokio::task::spawn_blocking(move || {
            Pool::builder()
                .max_size(size)
                .test_on_check_out(false)
                .build(ConnectionManager::<PgConnection>::new(url))
        })
        .await??;
        let config = ConsumerConfig::default()
            .with_naming(self.naming()?)
            .with_max_in_flight(in_flight)
            .with_fetch_wait(Duration::from_millis(100));
        let consumer = Consumer::builder(self.nats().await?, group)
            .handle::<PointsEarned, _>(Award)
            .idempotency(PgInbox::new(pool))
            .with_config(config)
            .build()?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let started = Instant::now();
        let task = {
            let c = consumer.clone();
            let mut stopped = stopped.clone();
            tokio::spawn(async move {
                c.run_until(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
            })
        };
        let deadline = started + self.deadline;
        let consumed = loop {
            let stats = consumer.stats();
            let consumed = usize::try_from(stats.consumed)?;
            if consumed >= self.messages {
                break consumed;
            }
            if stats.dead_lettered > 0 {
                return Err(format!("the NATS consumer dead-lettered messages: {stats:?}").into());
            }
            if Instant::now() > deadline {
                eprintln!(
                    "  note: {consumed} of {} messages in {:?}: stopped at the deadline",
                    self.messages, self.deadline
                );
                break consumed;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let elapsed = started.elapsed();
        let _ = stop.send(true);
        task.await??;
        Ok(consumed as f64 / elapsed.as_secs_f64())
    }

    /// Deletes the bench's NATS streams (the topic's and the dead letters').
    pub(crate) async fn cleanup_nats(&self) {
        let (Ok(naming), Ok(client)) = (self.naming(), self.nats().await) else {
            return;
        };
        let js = async_nats::jetstream::new(client);
        let _ = js
            .delete_stream(naming.stream(PointsEarned::TOPICS[0]))
            .await;
        let _ = js.delete_stream(naming.dead_letter_stream()).await;
    }
}
