//! The consumer's full path on PostgreSQL + Redis (XREADGROUP → dedup transaction with
//! the handler's UPDATE → XACK) against the same SQL issued from a plain loop.

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection as _;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::{Integer, Text};
use diesel::{Connection as _, PgConnection, RunQueryDsl as _};
use outbox_core::AsyncTxHandler;
use outbox_core::{
    Delivery, Envelope, Handler, HandlerError, OutboxEvent, Publisher as _, StoredMessage,
};
use outbox_diesel::{AsyncPgInbox, PgInbox};
use outbox_redis::{
    Consumer, ConsumerConfig, ConsumerStore, OrderedConfig, PublisherConfig, RedisPublisher,
};
use serde::{Deserialize, Serialize};

use crate::{BoxError, Service};

mod nats;

/// One message per account row: handlers never touch the same row.
#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
struct PointsEarned {
    #[outbox(id)]
    award_id: String,
    account: i32,
}

/// One message per transfer, keyed by its account: many messages update each row.
#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(key = account)]
struct Credited {
    #[outbox(id)]
    n: String,
    account: String,
}

/// One message per score of a player, over 8 partitions: each player (a quarter as many
/// as messages) scores 4 times, in order in ordered mode.
#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(key = player, partitions = 8)]
struct Scored {
    #[outbox(id)]
    n: String,
    player: String,
    /// The player's row in `points`.
    row: i32,
}

/// The handler's write for [`PointsEarned`]: one UPDATE of the account's row.
fn credit(conn: &mut PgConnection, account: i32) -> diesel::QueryResult<usize> {
    diesel::sql_query("UPDATE points SET n = n + 1 WHERE id = $1")
        .bind::<Integer, _>(account)
        .execute(conn)
}

struct Award;

impl Handler<PointsEarned> for Award {
    type Conn = PgConnection;

    fn handle(
        &self,
        e: PointsEarned,
        conn: &mut PgConnection,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        credit(conn, e.account)?;
        Ok(())
    }
}

impl Handler<Credited> for Award {
    type Conn = PgConnection;

    fn handle(
        &self,
        e: Credited,
        conn: &mut PgConnection,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        diesel::sql_query("UPDATE accounts SET n = n + 1 WHERE id = $1")
            .bind::<Text, _>(&e.account)
            .execute(conn)?;
        Ok(())
    }
}

impl Handler<Scored> for Award {
    type Conn = PgConnection;

    fn handle(&self, e: Scored, conn: &mut PgConnection, _: &Delivery) -> Result<(), HandlerError> {
        credit(conn, e.row)?;
        Ok(())
    }
}

/// [`Award`] on the async inbox: the same UPDATE, on the transaction's
/// `AsyncPgConnection`.
struct AwardAsync;

impl AsyncTxHandler<PointsEarned> for AwardAsync {
    type Conn = diesel_async::AsyncPgConnection;

    async fn handle(
        &self,
        e: PointsEarned,
        conn: &mut diesel_async::AsyncPgConnection,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        // Named: the file's blocking statements use diesel's `RunQueryDsl`.
        let update = diesel::sql_query("UPDATE points SET n = n + 1 WHERE id = $1")
            .bind::<Integer, _>(e.account);
        diesel_async::RunQueryDsl::execute(update, conn).await?;
        Ok(())
    }
}

/// Which stream a consumer run drains.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Load {
    /// [`PointsEarned`]: a row per message.
    Distinct,
    /// [`Credited`] over 64 accounts.
    Shared,
    /// [`Scored`]: 8 partitions, 4 messages per player.
    Partitioned,
}

/// How a consumer run reads.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Any consumer takes any entry.
    Unordered,
    /// Leased partitions, one key's messages one after another.
    Ordered,
}

/// Accounts of the [`Load::Shared`] stream.
pub(crate) const SHARED_KEYS: usize = 64;

pub(crate) struct ConsumerBench {
    svc: Service,
    url: String,
    schema: String,
    prefix: String,
    /// Names the schema, the Redis streams and the NATS streams.
    tag: String,
    pub(crate) messages: usize,
    /// How long a consumer run may take before it is stopped and its rate so far taken.
    deadline: Duration,
    groups: std::sync::atomic::AtomicUsize,
}

impl ConsumerBench {
    /// Publishes `messages` of each load once; every run reads them as a new group.
    pub(crate) async fn new(
        svc: &Service,
        messages: usize,
        deadline: Duration,
    ) -> Result<Self, BoxError> {
        let tag = format!("{}_{:08x}", std::process::id(), fastrand::u32(..));
        let schema = format!("bench_consumer_{tag}");
        let url = svc.schema(&schema)?;
        let mut conn = PgConnection::establish(&url)?;
        outbox_diesel::migrate(&mut conn)?;
        conn.batch_execute(&format!(
            "CREATE TABLE points (id INT PRIMARY KEY, n BIGINT NOT NULL);
             INSERT INTO points (id, n) SELECT g, 0 FROM generate_series(0, {}) g;
             CREATE TABLE accounts (id TEXT PRIMARY KEY, n BIGINT NOT NULL);
             INSERT INTO accounts (id, n) SELECT 'acct-' || g, 0 FROM generate_series(0, {}) g;
             ANALYZE points; ANALYZE accounts;",
            messages - 1,
            SHARED_KEYS - 1
        ))?;
        let bench = Self {
            svc: svc.clone(),
            url,
            schema,
            prefix: format!("bench:{tag}:"),
            tag,
            messages,
            deadline,
            groups: Default::default(),
        };
        bench.publish().await?;
        bench.publish_nats().await?;
        Ok(bench)
    }

    async fn publish(&self) -> Result<(), BoxError> {
        let publisher = RedisPublisher::new(self.svc.redis_url.as_str())?.with_config(
            PublisherConfig::default()
                .with_stream_prefix(self.prefix.clone())
                .with_partitions_of::<Scored>(),
        )?;
        let players = (self.messages / 4).max(1);
        let all: Vec<usize> = (0..self.messages).collect();
        for chunk in all.chunks(500) {
            let mut batch = Vec::with_capacity(chunk.len() * 3);
            for &i in chunk {
                let points = PointsEarned {
                    award_id: format!("award-{i}"),
                    account: i32::try_from(i)?,
                };
                let credited = Credited {
                    n: format!("c-{i}"),
                    account: format!("acct-{}", i % SHARED_KEYS),
                };
                let row = i32::try_from(i % players)?;
                let scored = Scored {
                    n: format!("s-{i}"),
                    player: format!("player-{row}"),
                    row,
                };
                for envelope in [
                    Envelope::from_event(&points, 1 << 20)?,
                    Envelope::from_event(&credited, 1 << 20)?,
                    Envelope::from_event(&scored, 1 << 20)?,
                ] {
                    batch.push(StoredMessage {
                        id: batch.len() as i64 + 1,
                        retries: 0,
                        envelope,
                    });
                }
            }
            let outcomes = publisher.publish(&batch).await?;
            if let Some(Err(e)) = outcomes.into_iter().find(Result::is_err) {
                return Err(format!("publish rejected: {e:?}").into());
            }
        }
        Ok(())
    }

    fn group(&self, what: &str) -> String {
        let n = self
            .groups
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{what}-{n}")
    }

    /// The baseline: each of `conns` threads runs its share of the messages, one
    /// transaction per message with the dedup INSERT and the UPDATE. Messages/s.
    pub(crate) fn plain_loop(&self, conns: usize) -> Result<f64, BoxError> {
        let group = self.group("plain");
        let mut connections = (0..conns)
            .map(|_| PgConnection::establish(&self.url))
            .collect::<Result<Vec<_>, _>>()?;
        let started = Instant::now();
        std::thread::scope(|s| {
            let workers: Vec<_> = connections
                .iter_mut()
                .enumerate()
                .map(|(t, conn)| {
                    let group = &group;
                    s.spawn(move || -> diesel::QueryResult<()> {
                        for i in (t..self.messages).step_by(conns) {
                            let e = PointsEarned {
                                award_id: format!("award-{i}"),
                                account: i as i32,
                            };
                            let msg_id = e.msg_id().expect("valid id");
                            conn.transaction(|c| {
                                diesel::sql_query(
                                    "INSERT INTO consumed_msg (consumer_group, msg_id) \
                                     VALUES ($1, $2) ON CONFLICT DO NOTHING",
                                )
                                .bind::<Text, _>(group.as_str())
                                .bind::<Text, _>(msg_id.as_str())
                                .execute(c)?;
                                credit(c, e.account)?;
                                Ok::<_, diesel::result::Error>(())
                            })?;
                        }
                        Ok(())
                    })
                })
                .collect();
            workers
                .into_iter()
                .try_for_each(|w| w.join().expect("worker panicked"))
        })?;
        Ok(self.messages as f64 / started.elapsed().as_secs_f64())
    }

    /// `consumers` consumers of one new group drain the `load` stream: single mode, or
    /// batch mode with `batch` messages per transaction, `in_flight` transactions each.
    /// Messages/s.
    pub(crate) async fn consumers(
        &self,
        load: Load,
        consumers: usize,
        in_flight: usize,
        batch: Option<usize>,
    ) -> Result<f64, BoxError> {
        self.consumers_in(load, Mode::Unordered, consumers, in_flight, batch)
            .await
    }

    /// [`consumers`](Self::consumers), read in `mode`.
    pub(crate) async fn consumers_in(
        &self,
        load: Load,
        mode: Mode,
        consumers: usize,
        in_flight: usize,
        batch: Option<usize>,
    ) -> Result<f64, BoxError> {
        let group = self.group("c");
        let mut running = Vec::new();
        for _ in 0..consumers {
            // r2d2 pings each connection on checkout by default (`SELECT 1`, one more
            // round trip per transaction); the plain loop does not, so neither does
            // this pool (`DieselInbox::connect` builds it so).
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
                .with_stream_prefix(self.prefix.clone())
                .with_max_in_flight(in_flight)
                .with_batch_size(batch)
                .with_block(Duration::from_millis(100))
                .with_ordered((mode == Mode::Ordered).then(OrderedConfig::default));
            let builder = Consumer::builder(self.svc.redis_url.as_str(), group.clone());
            let consumer = match load {
                Load::Distinct => builder.handle::<PointsEarned, _>(Award),
                Load::Shared => builder.handle::<Credited, _>(Award),
                Load::Partitioned => builder.handle::<Scored, _>(Award),
            }
            .idempotency(PgInbox::new(pool))
            .with_config(config)
            .build()?;
            running.push(consumer);
        }
        self.drain(running).await
    }

    /// One consumer in single mode on the async inbox (`AsyncPgInbox`, diesel-async's
    /// deadpool pool of `in_flight` connections, tested on checkout as little as the
    /// blocking pool above) drains the [`Load::Distinct`] stream. Messages/s.
    pub(crate) async fn async_consumer(&self, in_flight: usize) -> Result<f64, BoxError> {
        let group = self.group("async");
        let config = ConsumerConfig::default()
            .with_stream_prefix(self.prefix.clone())
            .with_max_in_flight(in_flight)
            .with_block(Duration::from_millis(100));
        let consumer = Consumer::builder(self.svc.redis_url.as_str(), group)
            .handle_tx::<PointsEarned, _>(AwardAsync)
            .idempotency_async(AsyncPgInbox::connect(&self.url, in_flight)?)
            .with_config(config)
            .build()?;
        self.drain(vec![consumer]).await
    }

    /// Runs `running` until they consumed every message (or the deadline): messages/s.
    async fn drain<I, C>(&self, running: Vec<Consumer<I, C>>) -> Result<f64, BoxError>
    where
        I: ConsumerStore<Conn = C>,
        C: Send + 'static,
    {
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let started = Instant::now();
        let tasks: Vec<_> = running
            .iter()
            .map(|c| {
                let c = c.clone();
                let mut stopped = stopped.clone();
                tokio::spawn(async move {
                    c.run_until(async move {
                        let _ = stopped.wait_for(|s| *s).await;
                    })
                    .await
                })
            })
            .collect();
        let deadline = started + self.deadline;
        let consumed = loop {
            let consumed = running.iter().map(|c| c.stats().consumed).sum::<u64>() as usize;
            if consumed >= self.messages {
                break consumed;
            }
            if running.iter().any(|c| c.stats().dead_lettered > 0) {
                let stats: Vec<_> = running.iter().map(|c| c.stats()).collect();
                return Err(format!("the consumers dead-lettered messages: {stats:?}").into());
            }
            if Instant::now() > deadline {
                // Stalled (batches that lock each other's rows, say): the rate reached.
                eprintln!(
                    "  note: {consumed} of {} messages in {:?}: stopped at the deadline",
                    self.messages, self.deadline
                );
                break consumed;
            }
            // Every 5 ms: a round lasts seconds, so this adds at most a few per mille to
            // it, while looking every 1 ms woke a worker a thousand times a second on the
            // consumer's cores.
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let elapsed = started.elapsed();
        let _ = stop.send(true);
        for task in tasks {
            task.await??;
        }
        for c in &running {
            let s = c.stats();
            if s.failures > 0 || s.conflicts > 0 {
                eprintln!("  note: {s:?}");
            }
        }
        Ok(consumed as f64 / elapsed.as_secs_f64())
    }

    pub(crate) async fn cleanup(&self) {
        self.svc.drop_schema(&self.schema);
        self.cleanup_nats().await;
        if let Ok(client) = redis::Client::open(self.svc.redis_url.as_str())
            && let Ok(mut conn) = client.get_multiplexed_async_connection().await
        {
            // The streams, partitions and their leases, members, the partition counts.
            let _: redis::RedisResult<()> = redis::cmd("EVAL")
                .arg("for _, k in ipairs(redis.call('KEYS', ARGV[1])) do redis.call('DEL', k) end")
                .arg(0)
                .arg(format!("{}*", self.prefix))
                .query_async(&mut conn)
                .await;
        }
    }
}
