//! A compressed day on the partitioned layout: the seed's 1,000 emits/s (one event per
//! transaction) for long enough to fill, rotate and drop several partitions of a
//! shortened interval, with one relay as users run it (defaults, Redis) keeping the
//! partitions itself. Sampled over time: the table's size, its dead tuples, its
//! partitions, the NEW rows left, the relay's claim p99 and commit → XADD p99.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::{Connection as _, PgConnection};
use outbox_core::{Backlog, Error, Relay, RelayStore};
use outbox_diesel::{Emit as _, PartitionPolicy, PgRelayStore};
use outbox_examples::AccountTransferred;

use crate::relay::{RelayBench, Sink, TimingPublisher};
use crate::stats::{self, Figure, Target};
use crate::{BoxError, Service, plot};

/// The compressed day's shape.
pub(crate) struct DaySize {
    /// Emits per second (one event per transaction).
    pub(crate) rate: u32,
    /// How long the emitters run.
    pub(crate) duration: Duration,
    /// The partition interval; retention is the same.
    pub(crate) interval: Duration,
}

/// Emitting threads sharing the rate: one connection's commits alone could not keep it.
const EMITTERS: u32 = 4;
/// Time between two samples.
const EVERY: Duration = Duration::from_secs(2);

/// One sample of the table and the relay.
struct Sample {
    at: f64,
    bytes: i64,
    dead: i64,
    partitions: i64,
    new_rows: i64,
    claim_p99_ms: f64,
    lag_p99_ms: f64,
}

pub(crate) async fn part(
    size: &DaySize,
    svc: &Service,
    out: &Path,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    let policy = PartitionPolicy::default()
        .with_interval(size.interval)
        .with_premake(3)
        .with_retention(size.interval);
    let bench = RelayBench::with_policy(svc, Some(policy)).await?;
    let result = run(size, &bench).await;
    bench.cleanup().await;
    let samples = result?;
    report(size, &samples, out, figures)
}

async fn run(size: &DaySize, bench: &RelayBench) -> Result<Vec<Sample>, BoxError> {
    println!(
        "day: {} emits/s for {} s, partitions of {} s kept {} s after their end",
        size.rate,
        size.duration.as_secs(),
        size.interval.as_secs(),
        size.interval.as_secs()
    );
    let url = bench.url().to_owned();
    let inner = tokio::task::spawn_blocking(move || PgRelayStore::connect(&url, 2)).await??;
    let store = TimedStore {
        inner,
        claims: Arc::default(),
    };
    let claims = Arc::clone(&store.claims);
    let publisher = TimingPublisher::new(bench.publisher(Sink::Redis, None)?);
    let published = Arc::clone(&publisher.published);
    let relay = Relay::new(store, publisher);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let relay_task =
        tokio::spawn(async move { relay.run_until(async { stopped.await.unwrap_or(()) }).await });

    let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let started = Instant::now();
    let emitters: Vec<_> = (0..EMITTERS)
        .map(|e| {
            let (url, log) = (bench.url().to_owned(), Arc::clone(&committed));
            let (rate, duration) = (size.rate / EMITTERS, size.duration);
            tokio::task::spawn_blocking(move || emit_at(&url, e, rate, duration, &log))
        })
        .collect();

    let mut samples = Vec::new();
    loop {
        tokio::time::sleep(EVERY).await;
        let emitting = emitters.iter().any(|e| !e.is_finished());
        let claim_p99_ms = stats::p99(&std::mem::take(&mut *claims.lock().unwrap()));
        let lags = lags_since(&committed, &published);
        let sample = sample(bench, started, claim_p99_ms, stats::p99(&lags))?;
        println!(
            "  {:>5.0} s  {:>7.1} MB  dead {:>7}  partitions {:>3}  NEW {:>6}  claim p99 {:>6.1} ms  commit→XADD p99 {:>6.1} ms",
            sample.at,
            sample.bytes as f64 / 1e6,
            sample.dead,
            sample.partitions,
            sample.new_rows,
            sample.claim_p99_ms,
            sample.lag_p99_ms
        );
        let drained = sample.new_rows == 0;
        samples.push(sample);
        // Two more intervals after the emitters stop: the last partitions expire.
        let end = size.duration + size.interval * 2;
        if !emitting && (started.elapsed() > end && drained) {
            break;
        }
        if started.elapsed() > end + Duration::from_secs(60) {
            return Err("day: the relay did not drain the outbox a minute after the end".into());
        }
    }
    for e in emitters {
        e.await??;
    }
    let _ = stop.send(());
    relay_task.await??;
    Ok(samples)
}

/// One emitter: `rate` transactions a second for `duration`, each emit's commit noted.
fn emit_at(
    url: &str,
    emitter: u32,
    rate: u32,
    duration: Duration,
    log: &Mutex<HashMap<String, Instant>>,
) -> Result<(), BoxError> {
    let mut conn = PgConnection::establish(url)?;
    let period = Duration::from_secs(1) / rate.max(1);
    let total = (f64::from(rate) * duration.as_secs_f64()) as u32;
    let start = Instant::now();
    for i in 0..total {
        if let Some(wait) = (start + period * i).checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let e = AccountTransferred::new(&format!("day-{emitter}-{i}"), "alice", "bob", 1);
        let id = conn.transaction(|c| c.emit(e))?;
        log.lock().unwrap().insert(id.into_string(), Instant::now());
    }
    Ok(())
}

/// Commit → XADD of the messages published since the last call, in ms.
fn lags_since(
    committed: &Mutex<HashMap<String, Instant>>,
    published: &Mutex<HashMap<String, Instant>>,
) -> Vec<f64> {
    let committed = committed.lock().unwrap();
    let mut published = published.lock().unwrap();
    let lags: Vec<f64> = published
        .iter()
        .filter_map(|(id, p)| committed.get(id).map(|c| p.saturating_duration_since(*c)))
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    // Only messages whose commit was noted are counted; the rest stay for the next call.
    published.retain(|id, _| !committed.contains_key(id));
    lags
}

fn sample(
    bench: &RelayBench,
    started: Instant,
    claim_p99_ms: f64,
    lag_p99_ms: f64,
) -> Result<Sample, BoxError> {
    let leaves = "pg_partition_tree('outbox') t WHERE t.isleaf";
    Ok(Sample {
        at: started.elapsed().as_secs_f64(),
        bytes: bench.scalar(&format!(
            "SELECT COALESCE(sum(pg_total_relation_size(t.relid)), 0)::bigint AS n FROM {leaves}"
        ))?,
        dead: bench.scalar(
            "SELECT COALESCE(sum(s.n_dead_tup), 0)::bigint AS n FROM pg_partition_tree('outbox') t \
             JOIN pg_stat_user_tables s ON s.relid = t.relid WHERE t.isleaf",
        )?,
        partitions: bench.scalar(&format!("SELECT count(*)::bigint AS n FROM {leaves}"))?,
        new_rows: bench.scalar("SELECT count(*)::bigint AS n FROM outbox WHERE status = 0")?,
        claim_p99_ms,
        lag_p99_ms,
    })
}

/// The table's size stays bounded (its largest after the first drop against its largest
/// before), the relay keeps up (claim and commit → XADD p99 at their worst), the plot.
fn report(
    size: &DaySize,
    samples: &[Sample],
    out: &Path,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    // Rows live at most two intervals plus the retention: by then the first partitions
    // are dropped, and the size must stop growing.
    let settled = (size.interval * 3).as_secs_f64();
    let max_of = |f: &dyn Fn(&Sample) -> f64, keep: &dyn Fn(&Sample) -> bool| {
        samples
            .iter()
            .filter(|s| keep(s))
            .map(f)
            .fold(0.0, f64::max)
    };
    let during = |s: &Sample| s.at <= size.duration.as_secs_f64();
    let early = max_of(&|s| s.bytes as f64, &|s| s.at <= settled);
    let late = max_of(&|s| s.bytes as f64, &|s| s.at > settled && during(s));
    let mut bounded = Figure::ratio(
        "day",
        format!("outbox size after the first drops, {} emits/s", size.rate),
        "largest after 3 intervals / largest before",
        Target::AtMost(1.5),
    );
    bounded.values = vec![late / early.max(1.0)];
    figures.push(bounded);
    for (name, value) in [
        (
            "claim p99, worst 2 s window",
            max_of(&|s| s.claim_p99_ms, &during),
        ),
        (
            "commit → XADD p99, worst 2 s window",
            max_of(&|s| s.lag_p99_ms, &during),
        ),
        (
            "dead tuples, most at once",
            max_of(&|s| s.dead as f64, &during),
        ),
    ] {
        let mut f = Figure::absolute(
            "day",
            name,
            if name.starts_with("dead") {
                "rows"
            } else {
                "ms"
            },
            Target::None,
        );
        f.values = vec![value];
        figures.push(f);
    }
    plots(samples, out)
}

/// The day's plots: the table's size and partitions, the p99s.
fn plots(samples: &[Sample], out: &Path) -> Result<(), BoxError> {
    let series = |name: &str, f: &dyn Fn(&Sample) -> f64| plot::Series {
        name: name.into(),
        points: samples.iter().map(|s| (s.at, f(s))).collect(),
    };
    plot::lines(
        &out.join("day-size.svg"),
        "a compressed day: the outbox's size (MB) and its partitions",
        "seconds",
        "MB / partitions",
        &[
            series("size (MB)", &|s| s.bytes as f64 / 1e6),
            series("partitions", &|s| s.partitions as f64),
        ],
        false,
    )?;
    plot::lines(
        &out.join("day-latency.svg"),
        "a compressed day: p99 of the relay's claim and of commit → XADD, per 2 s",
        "seconds",
        "ms",
        &[
            series("claim p99", &|s| s.claim_p99_ms),
            series("commit → XADD p99", &|s| s.lag_p99_ms),
        ],
        false,
    )
}

/// The relay's store, its claims timed.
struct TimedStore {
    inner: PgRelayStore,
    claims: Arc<Mutex<Vec<f64>>>,
}

impl TimedStore {
    async fn timed<T>(&self, claim: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        let started = Instant::now();
        let batch = claim.await;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        self.claims.lock().unwrap().push(ms);
        batch
    }
}

impl RelayStore for TimedStore {
    type Batch = <PgRelayStore as RelayStore>::Batch;

    async fn claim(&self, limit: usize) -> Result<Self::Batch, Error> {
        self.timed(self.inner.claim(limit)).await
    }

    async fn wait_for_work(&self, timeout: Duration) {
        self.inner.wait_for_work(timeout).await;
    }

    async fn backlog(&self) -> Result<Backlog, Error> {
        self.inner.backlog().await
    }

    fn claims_ahead(&self) -> bool {
        self.inner.claims_ahead()
    }

    async fn claim_after(&self, limit: usize, held: &[i64]) -> Result<Self::Batch, Error> {
        self.timed(self.inner.claim_after(limit, held)).await
    }
}
