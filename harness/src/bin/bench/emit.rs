//! Emit against a hand-written diesel insert of the same row on PostgreSQL, one event
//! per transaction, with and without a relay parked on LISTEN.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection as _;
use diesel::prelude::*;
use outbox_core::{
    Error, OutboxEvent, PublishOutcomes, Publisher, Relay, RelayConfig, StoredMessage,
};
use outbox_diesel::schema::pg::outbox;
use outbox_diesel::{Emit, EmitOptions, Notify, PgRelayStore};
use outbox_examples::AccountTransferred;

use crate::{BoxError, Service, cpu};

/// The parked relay's poll interval (see [`ParkedRelay`]).
const PARKED_POLL: Duration = Duration::from_millis(10);

/// How a round writes its rows.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Way {
    Hand,
    Emit(Notify),
}

/// The hand-written insert of `e`'s row, as a diesel statement (blocking and async
/// rounds run the same one).
macro_rules! hand_written_insert {
    ($e:expr) => {{
        let e: &AccountTransferred = $e;
        let payload = serde_json::to_value(e).expect("serializable");
        diesel::insert_into(outbox::table).values((
            outbox::msg_id.eq(e.msg_id().expect("valid").into_string()),
            outbox::topic.eq(e.topic()),
            outbox::event_type.eq(e.event_type()),
            outbox::msg_key.eq(e.ordering_key()),
            outbox::schema_version.eq(1),
            outbox::payload.eq(payload),
            outbox::headers.eq(serde_json::json!({})),
        ))
    }};
}

fn hand_written(c: &mut PgConnection, e: &AccountTransferred) -> QueryResult<usize> {
    hand_written_insert!(e).execute(c)
}

pub(crate) struct EmitBench {
    svc: Service,
    url: String,
    schema: String,
    rounds: std::sync::atomic::AtomicUsize,
}

/// A relay parked on LISTEN for the whole of some rounds: it wakes on the emits'
/// NOTIFY (or its poll), drains into a sink that only counts, and parks again.
///
/// It polls every [`PARKED_POLL`], so that it drains the rows of a hand-written round
/// as it goes too: with the default 1 s, it drained them mostly after the round (or
/// during the next one), while it drained an emitting round's rows inside it, woken
/// by their NOTIFY, and the relay's work counted against emit alone.
pub(crate) struct ParkedRelay {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), Error>>,
    batches: Arc<AtomicU64>,
}

/// A sink that counts the batches it is given: one per relay wake at least, so how
/// often the emits woke the relay.
struct Discard(Arc<AtomicU64>);

impl Publisher for Discard {
    async fn publish(&self, batch: &[StoredMessage]) -> Result<PublishOutcomes, Error> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(vec![Ok(()); batch.len()])
    }
}

impl ParkedRelay {
    /// The batches the relay has published so far.
    pub(crate) fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    pub(crate) async fn stop(self) -> Result<(), BoxError> {
        let _ = self.stop.send(());
        self.task.await??;
        Ok(())
    }
}

impl EmitBench {
    pub(crate) fn new(svc: &Service) -> Result<Self, BoxError> {
        let schema = format!(
            "bench_emit_{}_{:08x}",
            std::process::id(),
            fastrand::u32(..)
        );
        let url = svc.schema(&schema)?;
        outbox_diesel::migrate(&mut PgConnection::establish(&url)?)?;
        Ok(Self {
            svc: svc.clone(),
            url,
            schema,
            rounds: Default::default(),
        })
    }

    pub(crate) fn cleanup(&self) {
        self.svc.drop_schema(&self.schema);
    }

    /// Empties the outbox: the rounds without a relay leave their rows NEW, which a relay
    /// parked afterwards would first have to drain (and 100,000s of them took it longer
    /// than `settle` waits).
    pub(crate) fn clear(&self) -> Result<(), BoxError> {
        PgConnection::establish(&self.url)?.batch_execute("TRUNCATE outbox")?;
        Ok(())
    }

    pub(crate) async fn park_relay(&self) -> Result<ParkedRelay, BoxError> {
        // Named, so that `settle` finds its LISTEN session's hold on the wake-up lock.
        let sep = if self.url.contains('?') { '&' } else { '?' };
        let url = format!("{}{sep}application_name={}", self.url, self.schema);
        let store = tokio::task::spawn_blocking(move || -> Result<_, BoxError> {
            // The rounds without a relay left 100,000s of NEW rows in a table that was
            // never analyzed where autovacuum is off (as on the CI machines): the planner
            // then takes the backlog for a few dozen rows and runs each claim as a bitmap
            // scan and an on-disk sort of the whole backlog (~260 ms per 500 rows at
            // 150,000), which drained too slowly for `settle`. With statistics the claim
            // walks `outbox_pending` in id order (~5 ms).
            PgConnection::establish(&url)?.batch_execute("ANALYZE outbox")?;
            Ok(PgRelayStore::connect(&url, 2)?)
        })
        .await??;
        let batches = Arc::new(AtomicU64::new(0));
        let relay = Relay::new(store, Discard(batches.clone()))
            .with_config(RelayConfig::default().with_poll_interval(PARKED_POLL))?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task =
            tokio::spawn(
                async move { relay.run_until(async { stopped.await.unwrap_or(()) }).await },
            );
        tokio::time::sleep(Duration::from_millis(300)).await; // parked
        Ok(ParkedRelay {
            stop,
            task,
            batches,
        })
    }

    /// Waits until a parked relay has drained the rows of the rounds before, so that
    /// no round pays for the last one's, and is parked again (it holds the wake-up
    /// lock): a round that began while it was still on its way there would measure a
    /// relay that keeps up instead of a parked one.
    pub(crate) fn settle(&self) -> Result<(), BoxError> {
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let (class, key) = outbox_diesel::wake_lock_key(outbox_diesel::DEFAULT_CHANNEL);
        let parked = format!(
            "SELECT COUNT(*) AS n FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
             WHERE l.locktype = 'advisory' AND l.classid = {class} AND l.objid = {key} \
             AND l.objsubid = 2 AND l.granted AND a.application_name = '{}'",
            self.schema
        );
        let mut c = PgConnection::establish(&self.url)?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let new: i64 = outbox::table
                .filter(outbox::status.eq(0))
                .count()
                .get_result(&mut c)?;
            if new == 0 && diesel::sql_query(&parked).get_result::<N>(&mut c)?.n == 1 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the relay did not drain ({new} rows NEW) and park within 60 s"
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `conns` threads, each `txns` transactions of one row written `way`.
    pub(crate) fn run(&self, way: Way, conns: usize, txns: usize) -> Result<Measured, BoxError> {
        let round = self.rounds.fetch_add(1, Ordering::Relaxed);
        let mut connections = (0..conns)
            .map(|_| PgConnection::establish(&self.url))
            .collect::<Result<Vec<_>, _>>()?;
        let backends: Vec<_> = connections.iter_mut().map(cpu::Backend::of).collect();
        // Each connection's first transaction (a new backend's first insert is cold: 1.2
        // ms against 0.3) runs before the clock starts.
        let warm = std::sync::Barrier::new(conns + 1);
        let mut started = Instant::now();
        let cpu = std::thread::scope(|s| {
            let workers: Vec<_> = connections
                .iter_mut()
                .zip(backends)
                .enumerate()
                .map(|(w, (c, backend))| {
                    let warm = &warm;
                    s.spawn(move || -> Result<Option<cpu::Cpu>, BoxError> {
                        let backend = [backend];
                        let opts = match way {
                            Way::Emit(n) => EmitOptions::new().with_notify(n),
                            Way::Hand => EmitOptions::new(),
                        };
                        let mut one = |i: usize| {
                            let e = AccountTransferred::new(
                                &format!("r{round}-{w}-{i}"),
                                "alice",
                                "bob",
                                100,
                            );
                            c.transaction(|c| {
                                match way {
                                    Way::Hand => {
                                        hand_written(c, &e)?;
                                    }
                                    Way::Emit(_) => {
                                        c.emit_with(&opts, e)?;
                                    }
                                }
                                Ok::<_, outbox_diesel::Error>(())
                            })
                        };
                        let warmed = one(0);
                        warm.wait();
                        warmed?;
                        let before = cpu::Sample::take(&backend, cpu::Client::Thread);
                        (1..=txns).try_for_each(one)?;
                        let after = cpu::Sample::take(&backend, cpu::Client::Thread);
                        Ok(after.zip(before).and_then(|(a, b)| a.since(&b)))
                    })
                })
                .collect();
            warm.wait();
            started = Instant::now();
            workers
                .into_iter()
                .map(|w| w.join().expect("worker panicked"))
                .sum::<Result<Option<cpu::Cpu>, BoxError>>()
        })?;
        Ok(Measured {
            txns: conns * txns,
            elapsed: started.elapsed(),
            cpu,
        })
    }

    /// [`run`](Self::run) on diesel-async: `conns` tasks on `AsyncPgConnection`s, each
    /// `txns` transactions of one row written `way` (`AsyncEmit`, or the hand-written
    /// insert awaited). The client's CPU time is the whole process's: its runtime's
    /// threads serve the tasks.
    pub(crate) async fn run_async(
        &self,
        way: Way,
        conns: usize,
        txns: usize,
    ) -> Result<Measured, BoxError> {
        use diesel_async::{AsyncConnection as _, AsyncPgConnection};

        let round = self.rounds.fetch_add(1, Ordering::Relaxed);
        let mut connections = Vec::with_capacity(conns);
        let mut backends = Vec::with_capacity(conns);
        for _ in 0..conns {
            let mut c = AsyncPgConnection::establish(&self.url).await?;
            backends.push(cpu::Backend::of_async(&mut c).await);
            connections.push(c);
        }
        // As in `run`: each connection's first transaction before the clock starts.
        let warm = std::sync::Arc::new(tokio::sync::Barrier::new(conns + 1));
        let workers: Vec<_> = connections
            .into_iter()
            .enumerate()
            .map(|(w, c)| {
                let warm = warm.clone();
                tokio::spawn(async_worker(c, way, txns, format!("a{round}-{w}"), warm))
            })
            .collect();
        // Sampled once the tasks are past their first transaction: the first moments of
        // the timed ones, on the other core, may go unmeasured (as they go untimed).
        warm.wait().await;
        let started = Instant::now();
        let before = cpu::Sample::take(&backends, cpu::Client::Process);
        let mut done = Vec::with_capacity(conns);
        for w in workers {
            done.push(w.await??);
        }
        let elapsed = started.elapsed();
        let after = cpu::Sample::take(&backends, cpu::Client::Process);
        drop(done);
        Ok(Measured {
            txns: conns * txns,
            elapsed,
            cpu: after.zip(before).and_then(|(a, b)| a.since(&b)),
        })
    }
}

/// One task of [`EmitBench::run_async`]: `txns` transactions and one to warm up, of
/// one row written `way`, ids starting `prefix`; waits at `warm` after the first. Gives
/// back its connection, whose backend ends with it: kept until the CPU time is read.
async fn async_worker(
    mut c: diesel_async::AsyncPgConnection,
    way: Way,
    txns: usize,
    prefix: String,
    warm: std::sync::Arc<tokio::sync::Barrier>,
) -> Result<diesel_async::AsyncPgConnection, outbox_diesel::Error> {
    use diesel_async::AsyncConnection as _;
    use outbox_diesel::AsyncEmit as _;

    let opts = match way {
        Way::Emit(n) => EmitOptions::new().with_notify(n),
        Way::Hand => EmitOptions::new(),
    };
    for i in 0..=txns {
        let e = AccountTransferred::new(&format!("{prefix}-{i}"), "alice", "bob", 100);
        let opts = &opts;
        let done = c
            .transaction(async |c| {
                match way {
                    Way::Hand => {
                        diesel_async::RunQueryDsl::execute(hand_written_insert!(&e), c).await?;
                    }
                    Way::Emit(_) => {
                        c.emit_with(opts, e).await?;
                    }
                }
                Ok::<_, outbox_diesel::Error>(())
            })
            .await;
        if i == 0 {
            warm.wait().await;
        }
        done?;
    }
    Ok(c)
}

/// One run of a way: its transactions, their time, and the CPU time they took (the
/// client's and their backends', see [`cpu`]), if known.
pub(crate) struct Measured {
    pub(crate) txns: usize,
    pub(crate) elapsed: Duration,
    pub(crate) cpu: Option<cpu::Cpu>,
}
