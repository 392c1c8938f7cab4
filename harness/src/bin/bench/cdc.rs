//! The CDC relay (`outbox-cdc`) beside the polling relay, in the same run on the same
//! private PostgreSQL cluster (`wal_level = logical`; the shared server runs `replica`):
//! backlog drain, the broker's own limit (the same entries published from memory), the
//! log's own limit (the same backlog streamed to a client that only counts, `cdc/log.rs`),
//! the commit → XADD latency at a steady rate, the rows each relay updates (dead tuples)
//! and the database's CPU time per relayed message (with the walsender's share); the CDC
//! drain with a REPEATABLE READ transaction held open, and the emit rate of eight
//! connections beside each relay (`cdc/load.rs`).
//!
//! The cluster is `outbox_tests::ScratchPostgres` (initdb, `fsync = off`): both relays
//! meet the same server, so the ratios hold; the absolute figures are a little kinder
//! than on a server that flushes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection as _;
use diesel::{Connection as _, PgConnection, RunQueryDsl as _};
use outbox_cdc::{CdcConfig, CdcRelay};
use outbox_core::{Error, PublishOutcomes, Publisher, StoredMessage};
use outbox_diesel::{ClaimOrder, Emit as _};
use outbox_examples::AccountTransferred;
use outbox_tests::ScratchPostgres;

use crate::relay::{AnyPublisher, RelayBench, Sink, TimingPublisher};
use crate::stats::{Figure, Target};
use crate::{BoxError, Service, Sizes, order, progress};

mod load;
mod log;

/// How long after a relay stopped its sessions' counts and CPU are in the statistics
/// (a session reports at its end).
const STATS_FLUSH: Duration = Duration::from_millis(300);

/// The CDC relay's database on the private cluster.
struct CdcBench {
    url: String,
    bench: RelayBench,
    conn: Mutex<PgConnection>,
    /// Rows filled so far: each fill's msg_ids are new (the slot's stream is append-only).
    filled: AtomicUsize,
}

/// What one drain cost.
struct Drain {
    rate: f64,
    /// Row updates (`n_tup_upd`) and dead tuples made, per message, over the database's
    /// tables.
    updates: f64,
    dead: f64,
    /// The server's CPU time per message, µs (every process of the cluster).
    cpu_us: Option<f64>,
}

/// Runs the part: `sizes.rounds` rounds of drains and latencies.
pub(crate) async fn part(
    sizes: &Sizes,
    svc: &Service,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    let pg = tokio::task::spawn_blocking(ScratchPostgres::start_logical).await?;
    let private = Service {
        pg_url: pg.url(),
        redis_url: svc.redis_url.clone(),
        async_commit: svc.async_commit,
    };
    println!(
        "cdc: on a private cluster (initdb; wal_level = logical, fsync = off), both relays alike"
    );
    let polling = RelayBench::new(&private).await?;
    let cdc = CdcBench::new(&private).await?;
    let result = measure(sizes, &polling, &cdc, figures).await;
    polling.cleanup().await;
    cdc.bench.cleanup().await;
    drop(pg);
    result
}

async fn measure(
    sizes: &Sizes,
    polling: &RelayBench,
    cdc: &CdcBench,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    let n = sizes.relay_messages;
    let postmaster = postmaster(&mut cdc.conn.lock().unwrap())?;
    println!("cdc: {n} rows over 1000 keys, polling (per-key) and CDC relays into Redis");
    let mut runs: [Vec<Drain>; 2] = [Vec::new(), Vec::new()];
    let mut broker = Vec::new();
    let mut alone = Vec::new();
    let mut held = Vec::new();
    for round in 0..sizes.rounds {
        for i in order(round, 2) {
            let d = if i == 0 {
                polling.fill(n, 1000)?;
                let before = Counters::take(polling_stats(polling)?, postmaster);
                let rate = polling
                    .relays(n, 1, Sink::Redis, ClaimOrder::PerKey, 500)
                    .await?;
                tokio::time::sleep(STATS_FLUSH).await;
                let after = Counters::take(polling_stats(polling)?, postmaster);
                before.drain(&after, rate, n)
            } else {
                log::mark(&mut cdc.conn.lock().unwrap())?;
                cdc.fill(n, 1000)?;
                let (d, batches) = cdc.drain(n, postmaster).await?;
                let batches = cdc.messages(batches)?;
                broker.push(cdc.broker(&batches).await?);
                progress(
                    "the same entries published from memory",
                    broker[broker.len() - 1],
                    "msg/s",
                );
                alone.push(log::read_alone(&cdc.url, &CdcConfig::default().publication, n).await?);
                log::release(&mut cdc.conn.lock().unwrap())?;
                progress(
                    "the same backlog's log read alone (counted)",
                    alone[alone.len() - 1],
                    "msg/s",
                );
                d
            };
            progress(
                if i == 0 {
                    "polling relay (per-key) → Redis"
                } else {
                    "CDC relay → Redis"
                },
                d.rate,
                "msg/s",
            );
            runs[i].push(d);
        }
        // Side by side with a free drain of its own, in turn: drains of half a second
        // on a loaded machine drift between the round's first drains and this one.
        let mut pair = [0.0; 2];
        for j in order(round, 2) {
            pair[j] = if j == 0 {
                cdc.fill(n, 1000)?;
                cdc.drain(n, postmaster).await?.0.rate
            } else {
                load::held_snapshot_drain(cdc, n, postmaster).await?
            };
            let what = [
                "CDC relay → Redis (beside the next)",
                "CDC relay → Redis, a REPEATABLE READ transaction held open",
            ][j];
            progress(what, pair[j], "msg/s");
        }
        held.push(pair[1] / pair[0]);
    }
    drains(&runs, &broker, &alone, figures);
    let mut f = Figure::ratio(
        "cdc",
        "CDC drain with a snapshot held",
        "a REPEATABLE READ transaction held open / none (drained side by side)",
        Target::AtLeast(0.95),
    );
    f.values = held;
    figures.push(f);
    latency(sizes, polling, cdc, figures).await?;
    load::emit_side_by_side(sizes, polling, cdc, figures).await
}

/// The drain figures.
fn drains(runs: &[Vec<Drain>; 2], broker: &[f64], alone: &[f64], figures: &mut Vec<Figure>) {
    let [poll, cdc] = runs;
    let mut push = |f: Figure, values: Vec<f64>| {
        let mut f = f;
        f.values = values;
        figures.push(f);
    };
    let ratio = |a: &[Drain], b: &[f64]| a.iter().zip(b).map(|(x, y)| x.rate / y).collect();
    let poll_rates: Vec<f64> = poll.iter().map(|d| d.rate).collect();
    push(
        Figure::ratio(
            "cdc",
            "CDC drain",
            "CDC relay / polling relay (per-key)",
            Target::AtLeast(1.0),
        ),
        ratio(cdc, &poll_rates),
    );
    push(
        Figure::ratio(
            "cdc",
            "CDC drain against the broker",
            "CDC relay / the same entries published from memory",
            Target::AtLeast(0.7),
        ),
        ratio(cdc, broker),
    );
    // Why the figure above stops where it does: the log's own rate on this machine, and
    // what the relay keeps of it.
    push(
        Figure::ratio(
            "cdc",
            "the log read alone against the broker",
            "the backlog streamed to a client that only counts / the same entries published from memory",
            Target::None,
        ),
        alone.iter().zip(broker).map(|(a, b)| a / b).collect(),
    );
    push(
        Figure::ratio(
            "cdc",
            "CDC drain against the log read alone",
            "CDC relay / the backlog streamed to a client that only counts",
            Target::None,
        ),
        ratio(cdc, alone),
    );
    for (name, d) in [("polling relay (per-key)", poll), ("CDC relay", cdc)] {
        push(
            Figure::absolute("cdc", format!("{name} drain"), "msg/s", Target::None),
            d.iter().map(|d| d.rate).collect(),
        );
        let updates_target = if name == "CDC relay" {
            Target::AtMost(0.01)
        } else {
            Target::None
        };
        push(
            Figure::absolute(
                "cdc",
                format!("{name}: rows updated per message"),
                "rows",
                updates_target,
            ),
            d.iter().map(|d| d.updates).collect(),
        );
        push(
            Figure::absolute(
                "cdc",
                format!("{name}: dead tuples per message"),
                "rows",
                Target::None,
            ),
            d.iter().map(|d| d.dead).collect(),
        );
        push(
            Figure::absolute(
                "cdc",
                format!("{name}: database CPU per message"),
                "µs",
                Target::None,
            ),
            d.iter().filter_map(|d| d.cpu_us).collect(),
        );
    }
    push(
        Figure::absolute(
            "cdc",
            "the same entries published from memory",
            "msg/s",
            Target::None,
        ),
        broker.to_vec(),
    );
    push(
        Figure::absolute("cdc", "the log read alone", "msg/s", Target::None),
        alone.to_vec(),
    );
    let cpu: Vec<f64> = cdc
        .iter()
        .zip(poll)
        .filter_map(|(c, p)| Some(c.cpu_us? / p.cpu_us?))
        .collect();
    push(
        Figure::ratio(
            "cdc",
            "database CPU per message",
            "CDC / polling",
            Target::AtMost(0.5),
        ),
        cpu,
    );
}

/// Commit → XADD at a steady rate, each relay in turn.
async fn latency(
    sizes: &Sizes,
    polling: &RelayBench,
    cdc: &CdcBench,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    let rate = sizes.latency_rate;
    let duration = Duration::from_secs_f64(sizes.latency_secs);
    println!("cdc: commit → XADD at {rate}/s, polling (LISTEN) and CDC");
    let mut pct: [[Vec<f64>; 2]; 2] = Default::default();
    for round in 0..sizes.rounds {
        for i in order(round, 2) {
            let lat = if i == 0 {
                polling.latency(rate, duration).await?
            } else {
                cdc.latency(rate, duration).await?
            };
            let at = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
            println!(
                "  {}: p50 {:.2} ms, p99 {:.2} ms",
                if i == 0 { "polling" } else { "CDC" },
                at(0.5),
                at(0.99)
            );
            pct[i][0].push(at(0.5));
            pct[i][1].push(at(0.99));
        }
    }
    for (i, name) in [(0, "polling relay"), (1, "CDC relay")] {
        for (j, p) in [(0, "p50"), (1, "p99")] {
            let mut f = Figure::absolute(
                "cdc",
                format!("{name}: commit → XADD {p} at {rate}/s"),
                "ms",
                Target::None,
            );
            f.values = pct[i][j].clone();
            figures.push(f);
        }
    }
    let mut f = Figure::ratio(
        "cdc",
        "commit → XADD p99",
        "CDC / polling",
        Target::AtMost(1.0),
    );
    f.values = pct[1][1]
        .iter()
        .zip(&pct[0][1])
        .map(|(c, p)| c / p)
        .collect();
    figures.push(f);
    Ok(())
}

impl CdcBench {
    /// Database `bench_cdc` on the private cluster, migrated and set up for CDC.
    async fn new(private: &Service) -> Result<Self, BoxError> {
        PgConnection::establish(&private.pg_url)?.batch_execute("CREATE DATABASE bench_cdc")?;
        let url = with_database(&private.pg_url, "bench_cdc");
        let mut conn = PgConnection::establish(&url)?;
        outbox_diesel::migrate(&mut conn)?;
        outbox_cdc::setup(&mut conn, &CdcConfig::default())?;
        let svc = Service {
            pg_url: url.clone(),
            ..private.clone()
        };
        // For its publisher and its streams (the schema it makes is not used).
        let bench = RelayBench::new(&svc).await?;
        Ok(Self {
            url,
            bench,
            conn: Mutex::new(conn),
            filled: AtomicUsize::new(0),
        })
    }

    /// `n` rows as [`RelayBench::fill`] makes them, committed in transactions of 500
    /// while no relay runs: a backlog the slot holds.
    fn fill(&self, n: usize, keys: usize) -> Result<(), BoxError> {
        let first = self.filled.fetch_add(n, Ordering::Relaxed);
        let mut conn = self.conn.lock().unwrap();
        skip_other_wal(&mut conn)?;
        conn.batch_execute("TRUNCATE outbox")?;
        for start in (first..first + n).step_by(500) {
            let end = (start + 500).min(first + n);
            conn.batch_execute(&format!(
                "INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) \
                 SELECT 't-' || g || ':AccountTransferred', 'account.transferred', 'AccountTransferred', \
                        'k' || (g % {keys}), \
                        jsonb_build_object('transfer_id', 't-' || g, 'from', 'alice', 'to', 'bob', 'amount', g, \
                                           'memo', repeat('x', 120)) \
                 FROM generate_series({}, {end}) g",
                start + 1
            ))?;
        }
        conn.batch_execute("CHECKPOINT")?;
        Ok(())
    }

    /// One CDC relay drains the `n` rows the slot holds; what it cost, and the ids of
    /// the batches it published (for [`broker`](Self::broker)).
    async fn drain(&self, n: usize, postmaster: u32) -> Result<(Drain, Vec<Vec<i64>>), BoxError> {
        let before = Counters::take(self.stats()?, postmaster);
        let first = self.filled.load(Ordering::Relaxed) - n;
        let publisher = Recorded {
            inner: self.bench.publisher(Sink::Redis, None)?,
            // Only this fill's messages count: a relay stopped before its last
            // confirmation reads the previous fill's tail again.
            from: first,
            published: Arc::default(),
            batches: Arc::default(),
            first: Arc::default(),
        };
        let (published, batches) = (
            Arc::clone(&publisher.published),
            Arc::clone(&publisher.batches),
        );
        let first = Arc::clone(&publisher.first);
        let mut ended = None;
        let mut walsender_cpu = None;
        let relay_cpu = load::process_cpu();
        self.run_relay(
            publisher,
            || {
                let done = published.load(Ordering::Relaxed) >= n;
                if done && ended.is_none() {
                    ended = Some(Instant::now());
                    // The walsender's CPU (it started with this relay), read before the
                    // relay stops and it exits.
                    walsender_cpu = load::walsender_cpu(postmaster);
                }
                done
            },
            None,
        )
        .await?;
        let relay_cpu = load::process_cpu()
            .zip(relay_cpu)
            .map(|(after, before)| after.saturating_sub(before));
        // From the first publish call: the relay's start (its connections, taking the
        // slot, the start check) is left out, as the polling relay's connections are.
        let started = first
            .get()
            .copied()
            .ok_or("the CDC relay published nothing")?;
        let took = ended.map_or(started.elapsed(), |e| e.duration_since(started));
        let rate = n as f64 / took.as_secs_f64();
        let per_message = |cpu: Duration| cpu.as_secs_f64() * 1e6 / n as f64;
        println!(
            "  walsender {} µs/msg, this process (relay and bench) {} µs/msg, over {:.2} s",
            walsender_cpu.map_or("-".into(), |c| format!("{:.1}", per_message(c))),
            relay_cpu.map_or("-".into(), |c| format!("{:.1}", per_message(c))),
            took.as_secs_f64()
        );
        tokio::time::sleep(STATS_FLUSH).await;
        let after = Counters::take(self.stats()?, postmaster);
        let batches = std::mem::take(&mut *batches.lock().unwrap());
        Ok((before.drain(&after, rate, n), batches))
    }

    /// Runs a CDC relay with `publisher` until `done` holds (at most 10 minutes), then
    /// stops it.
    async fn run_relay<P: Publisher + Send + Sync + 'static>(
        &self,
        publisher: P,
        mut done: impl FnMut() -> bool,
        name: Option<tokio::sync::oneshot::Sender<String>>,
    ) -> Result<(), BoxError> {
        let url = self.url.clone();
        let pool = tokio::task::spawn_blocking(move || {
            outbox_diesel::PgPool::builder()
                .max_size(4)
                .build(diesel::r2d2::ConnectionManager::<PgConnection>::new(url))
        })
        .await??;
        let relay = CdcRelay::new(&self.url, pool, publisher)?.with_config(CdcConfig::default())?;
        if let Some(name) = name {
            let _ = name.send(relay.application_name().to_owned());
        }
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        // In a task of its own, as the polling relay runs in the latency run: this task
        // only watches.
        let run =
            tokio::spawn(
                async move { relay.run_until(async { stopped.await.unwrap_or(()) }).await },
            );
        let deadline = Instant::now() + Duration::from_secs(600);
        while !done() && Instant::now() < deadline && !run.is_finished() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let _ = stop.send(());
        run.await??;
        if !done() {
            return Err("the CDC relay did not drain the outbox in 10 minutes".into());
        }
        Ok(())
    }

    /// The messages of `batches` (ids), read back from the table: the batches the relay
    /// published, without copying them in the timed drain. Rows of an earlier fill
    /// (published again by a relay stopped before its last confirmation) are gone.
    fn messages(&self, batches: Vec<Vec<i64>>) -> Result<Vec<Vec<StoredMessage>>, BoxError> {
        let ids: Vec<i64> = batches.iter().flatten().copied().collect();
        let rows: Vec<outbox_diesel::PgMessageRow> = diesel::sql_query(format!(
            "SELECT {} FROM outbox o WHERE o.id = ANY($1)",
            outbox_diesel::PgMessageRow::COLUMNS
        ))
        .bind::<diesel::sql_types::Array<diesel::sql_types::BigInt>, _>(&ids)
        .load(&mut *self.conn.lock().unwrap())?;
        let mut by_id: std::collections::HashMap<i64, StoredMessage> = rows
            .into_iter()
            .map(|r| Ok((r.id(), r.into_message()?)))
            .collect::<Result<_, outbox_diesel::Error>>()?;
        Ok(batches
            .into_iter()
            .map(|b| b.iter().filter_map(|id| by_id.remove(id)).collect())
            .collect())
    }

    /// `batches` published again from memory through the same publisher: the broker's
    /// own limit for these entries. Messages/s.
    async fn broker(&self, batches: &[Vec<StoredMessage>]) -> Result<f64, BoxError> {
        let publisher = self.bench.publisher(Sink::Redis, None)?;
        let n: usize = batches.iter().map(Vec::len).sum();
        let started = Instant::now();
        for batch in batches {
            publisher.publish(batch).await?;
        }
        Ok(n as f64 / started.elapsed().as_secs_f64())
    }

    /// Commit → XADD at `rate` for `duration`, one event per transaction, a CDC relay
    /// streaming. Milliseconds, one per message.
    async fn latency(&self, rate: u32, duration: Duration) -> Result<Vec<f64>, BoxError> {
        let publisher = TimingPublisher::new(self.bench.publisher(Sink::Redis, None)?);
        let published = Arc::clone(&publisher.published);
        let total = (f64::from(rate) * duration.as_secs_f64()) as usize;
        let committed: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
        let (url, log, tag) = (
            self.url.clone(),
            Arc::clone(&committed),
            self.filled.fetch_add(total, Ordering::Relaxed),
        );
        let (name_tx, name) = tokio::sync::oneshot::channel::<String>();
        let warm_published = Arc::clone(&published);
        let producer = async {
            let warm = format!("cdc-warm-{tag}");
            self.settle(name, &warm, |id| {
                warm_published.lock().unwrap().contains_key(id)
            })
            .await?;
            tokio::task::spawn_blocking(move || emit_at(&url, rate, total, tag, &log)).await?
        };
        // A relay stopped before its last confirmation reads the previous run's tail again:
        // only this run's messages count.
        let prefix = format!("cdc-lat-{tag}-");
        // Counted again only when a publish call added entries.
        let mut counted = (0, 0);
        let done = || {
            let published = published.lock().unwrap();
            if published.len() != counted.0 {
                let n = published.keys().filter(|k| k.starts_with(&prefix)).count();
                counted = (published.len(), n);
            }
            counted.1 >= total
        };
        let (relay, produced) =
            tokio::join!(self.run_relay(publisher, done, Some(name_tx)), producer);
        produced?;
        relay?;
        let published = published.lock().unwrap();
        let mut lat: Vec<f64> = committed
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(id, c)| {
                published
                    .get(id)
                    .map(|p| p.saturating_duration_since(*c).as_secs_f64() * 1e3)
            })
            .collect();
        if lat.len() < total {
            return Err(format!("{} of {total} messages published", lat.len()).into());
        }
        lat.sort_by(f64::total_cmp);
        Ok(lat)
    }

    /// Waits until the relay named by `name` holds the slot and has read up to now: a
    /// slot idle since the last run starts behind by all the WAL written since (the
    /// polling runs' too), which a running relay would have read as it came. Up to now
    /// is until the event `warm` (emitted now) was published, as `published` tells by
    /// its msg_id; then it settles as the polling relay is given time to park on LISTEN.
    async fn settle(
        &self,
        name: tokio::sync::oneshot::Receiver<String>,
        warm: &str,
        published: impl Fn(&str) -> bool,
    ) -> Result<(), BoxError> {
        let name = name.await?;
        let wait_url = self.url.clone();
        tokio::task::spawn_blocking(move || wait_for_holder(&wait_url, &name)).await??;
        let (warm_url, warm) = (self.url.clone(), warm.to_owned());
        let id = tokio::task::spawn_blocking(move || -> Result<String, BoxError> {
            let mut conn = PgConnection::establish(&warm_url)?;
            let e = AccountTransferred::new(&warm, "alice", "bob", 1);
            Ok(conn.transaction(|c| c.emit(e))?.into_string())
        })
        .await??;
        let deadline = Instant::now() + Duration::from_secs(120);
        while !published(&id) {
            if Instant::now() > deadline {
                return Err("the warm-up message was not published in 120 s".into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(())
    }

    /// `(n_tup_upd, n_dead_tup)` summed over the database's tables.
    fn stats(&self) -> Result<(i64, i64), BoxError> {
        table_stats(&mut self.conn.lock().unwrap(), "")
    }
}

/// Moves the slot to the end of the WAL before a fill: what the polling runs wrote in
/// the other database since the last CDC run is not this drain's work (a CDC relay
/// running beside them would have read past it as it came; the latency run's warm-up
/// does the same). Its decoding is done here, by this session, before the drain's
/// counters are taken. Waits (at most 10 s) for the last relay's session to let go of
/// the slot.
fn skip_other_wal(conn: &mut PgConnection) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match conn.batch_execute(&format!(
            "SELECT pg_replication_slot_advance('{}', pg_current_wal_lsn())",
            outbox_cdc::DEFAULT_SLOT
        )) {
            Ok(()) => return Ok(()),
            Err(e) if e.to_string().contains("active") && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Waits (at most 60 s) until the relay named `name` holds the slot.
fn wait_for_holder(url: &str, name: &str) -> Result<(), BoxError> {
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let mut conn = PgConnection::establish(url)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let held: N = diesel::sql_query(
            "SELECT count(*) AS n FROM pg_replication_slots s \
             JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE r.application_name = $1",
        )
        .bind::<diesel::sql_types::Text, _>(name)
        .get_result(&mut conn)?;
        if held.n > 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("the CDC relay {name} did not take the slot in 60 s").into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `total` events at `rate`, one per transaction, each noted when its commit returned.
fn emit_at(
    url: &str,
    rate: u32,
    total: usize,
    tag: usize,
    log: &Mutex<Vec<(String, Instant)>>,
) -> Result<(), BoxError> {
    let mut conn = PgConnection::establish(url)?;
    let period = Duration::from_secs(1) / rate;
    let start = Instant::now();
    for i in 0..total {
        let due = start + period * i as u32;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let e = AccountTransferred::new(&format!("cdc-lat-{tag}-{i}"), "alice", "bob", 1);
        let id = conn.transaction(|c| c.emit(e))?;
        log.lock().unwrap().push((id.into_string(), Instant::now()));
    }
    Ok(())
}

/// The polling bench schema's `(n_tup_upd, n_dead_tup)`.
fn polling_stats(bench: &RelayBench) -> Result<(i64, i64), BoxError> {
    let upd = bench.scalar(&stats_sql("n_tup_upd", "AND schemaname = current_schema()"))?;
    let dead = bench.scalar(&stats_sql(
        "n_dead_tup",
        "AND schemaname = current_schema()",
    ))?;
    Ok((upd, dead))
}

fn table_stats(conn: &mut PgConnection, filter: &str) -> Result<(i64, i64), BoxError> {
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let upd = diesel::sql_query(stats_sql("n_tup_upd", filter))
        .get_result::<N>(conn)?
        .n;
    let dead = diesel::sql_query(stats_sql("n_dead_tup", filter))
        .get_result::<N>(conn)?
        .n;
    Ok((upd, dead))
}

/// One column of `pg_stat_user_tables` summed (a fresh snapshot: each statement is its
/// own transaction).
fn stats_sql(column: &str, filter: &str) -> String {
    format!(
        "SELECT coalesce(sum({column}), 0)::int8 AS n FROM pg_stat_user_tables \
         WHERE true {filter}"
    )
}

/// Row counters and the server's CPU at one instant.
struct Counters {
    updates: i64,
    dead: i64,
    cpu: Option<Duration>,
}

impl Counters {
    fn take((updates, dead): (i64, i64), postmaster: u32) -> Self {
        Self {
            updates,
            dead,
            cpu: server_cpu(postmaster),
        }
    }

    /// What the drain of `n` messages between `self` and `after` cost.
    fn drain(&self, after: &Self, rate: f64, n: usize) -> Drain {
        let per = |a: i64, b: i64| (a - b).max(0) as f64 / n as f64;
        Drain {
            rate,
            updates: per(after.updates, self.updates),
            dead: per(after.dead, self.dead),
            cpu_us: match (self.cpu, after.cpu) {
                (Some(b), Some(a)) => Some(a.saturating_sub(b).as_secs_f64() * 1e6 / n as f64),
                _ => None,
            },
        }
    }
}

/// The cluster's postmaster: the checkpointer's parent.
fn postmaster(conn: &mut PgConnection) -> Result<u32, BoxError> {
    #[derive(diesel::QueryableByName)]
    struct Pid {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        pid: i32,
    }
    let p: Pid =
        diesel::sql_query("SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'")
            .get_result(conn)?;
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", p.pid))?;
    let ppid = stat_fields(&stat)
        .and_then(|f| f.get(1)?.parse().ok())
        .ok_or("cannot read the checkpointer's parent")?;
    Ok(ppid)
}

/// The fields of `/proc/<pid>/stat` after the command name (from the state on).
fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    Some(
        stat.get(stat.rfind(')')? + 2..)?
            .split_whitespace()
            .collect(),
    )
}

/// The CPU time every process of the cluster has used: the live children's (`schedstat`,
/// ns), the postmaster's, and the exited children's it reaped (`cutime + cstime`, 10 ms
/// ticks). `None` where `/proc` cannot tell (not Linux, another machine).
fn server_cpu(postmaster: u32) -> Option<Duration> {
    let ns = |pid: &str| -> Option<u64> {
        std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
            .ok()?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let pm = postmaster.to_string();
    let stat = std::fs::read_to_string(format!("/proc/{pm}/stat")).ok()?;
    let f = stat_fields(&stat)?;
    let reaped_ticks: u64 = f.get(13)?.parse::<u64>().ok()? + f.get(14)?.parse::<u64>().ok()?;
    let mut total = ns(&pm)? + reaped_ticks * 10_000_000;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        if stat_fields(&stat).and_then(|f| f.get(1).copied()) == Some(pm.as_str()) {
            total += ns(pid).unwrap_or(0);
        }
    }
    Some(Duration::from_nanos(total))
}

/// `url` with its database (path) replaced by `db`.
fn with_database(url: &str, db: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let host_start = base.find("://").map_or(0, |i| i + 3);
    let host_end = base[host_start..]
        .find('/')
        .map_or(base.len(), |i| host_start + i);
    let mut out = format!("{}/{db}", &base[..host_end]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// Counts the messages of the current fill it published, and keeps the batches.
struct Recorded {
    inner: AnyPublisher,
    from: usize,
    published: Arc<AtomicUsize>,
    /// The ids of each batch (copying the messages would charge the drain for it).
    batches: Arc<Mutex<Vec<Vec<i64>>>>,
    /// When the first publish call began.
    first: Arc<std::sync::OnceLock<Instant>>,
}

impl Publisher for Recorded {
    async fn publish(&self, batch: &[StoredMessage]) -> Result<PublishOutcomes, Error> {
        self.first.get_or_init(Instant::now);
        let outcomes = self.inner.publish(batch).await?;
        let current = |m: &StoredMessage| {
            m.envelope
                .msg_id
                .as_str()
                .strip_prefix("t-")
                .and_then(|s| s.split(':').next()?.parse::<usize>().ok())
                .is_some_and(|g| g > self.from)
        };
        let ok = batch
            .iter()
            .zip(&outcomes)
            .filter(|(m, o)| o.is_ok() && current(m))
            .count();
        self.published.fetch_add(ok, Ordering::Relaxed);
        let ids = batch.iter().map(|m| m.id).collect();
        self.batches.lock().unwrap().push(ids);
        Ok(outcomes)
    }
}
