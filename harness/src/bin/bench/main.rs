//! Run with: cargo run --release -p outbox-harness --bin bench
//!
//! Every figure of BENCHMARKS.md against its baseline, measured in the same run with the
//! rounds alternating (baseline first in one round, last in the next), on PostgreSQL
//! (`DATABASE_URL`, default the local `test` database) and Redis (`REDIS_URL`):
//!
//! - relay: one relay into Redis against a pure-SQL claim-and-mark drain, per-key
//!   against unordered claims with one and two relays, commit→XADD latency at a steady
//!   1,000 messages/s, resident memory while draining a 1M-row backlog;
//! - consumer: single mode against a plain SQL loop doing the same writes, batch mode
//!   against single mode, and two consumers in batch mode against single mode when
//!   handlers update one row per key over 64 keys;
//! - emit: `emit` (default `Notify::WhenRelayIdle`) against a hand-written diesel insert,
//!   with no relay and with one parked on LISTEN (beside it, without a target,
//!   `Notify::Never` and `Notify::Always`); and `AsyncEmit` against the same
//!   insert on diesel-async (`AsyncPgConnection`), no relay parked; each as throughput
//!   and as CPU time per transaction (the client's and its PostgreSQL backend's, when
//!   the server runs on this machine: see `cpu`).
//!
//! Prints one table (median and range over the rounds of each ratio) with the machine's
//! facts, and writes it with SVG plots (throughput against batch size and relay count,
//! the latency distribution) to `docs/bench/` (`--out`). `--tiny` runs every figure with
//! tiny sizes, to prove that the bench works (CI); its numbers mean nothing.
//!
//! Read the ratios, not the absolute figures: the machines are shared.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use diesel::connection::SimpleConnection as _;
use diesel::{Connection as _, PgConnection};
use outbox_diesel::{ClaimOrder, Notify};

mod consumer;
mod cpu;
mod day;
mod emit;
mod machine;
mod plot;
mod relay;
mod scale;
mod stats;
mod stream;

use consumer::{ConsumerBench, Load, Mode};
use emit::{EmitBench, Way};
use relay::{RelayBench, Sink};
use stats::{Figure, Target};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Benchmarks of the outbox against baselines measured in the same run.
#[derive(Parser)]
struct Args {
    /// Tiny sizes: proves that every part runs (for CI); the figures mean nothing.
    #[arg(long)]
    tiny: bool,
    /// Rounds per ratio (each round measures the figure and its baseline).
    #[arg(long)]
    rounds: Option<usize>,
    /// Only these parts (comma-separated): relay, latency, memory, consumer, emit,
    /// async-emit, plots, scale (= horizon, a drain with the horizon held back, and size,
    /// the claim against 50M rows), day, stream (Redis memory per stream entry and what
    /// the trim leaves). Without it, every part but scale (about half an hour), day (a
    /// compressed day of partitions: about three minutes) and stream (absolute figures,
    /// no baseline), which run by default only with --tiny.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Only these figures of the consumer part, by their place in its list (from 0; e.g.
    /// `3,4`: the plain SQL loop and single mode at 8 in flight); the ratios of the
    /// others are left out.
    #[arg(long, value_delimiter = ',')]
    consumer_figures: Vec<usize>,
    /// Where the table and the plots go.
    #[arg(long, default_value = "docs/bench")]
    out: PathBuf,
    /// Every PostgreSQL session of the bench sets `synchronous_commit = off`: a commit no
    /// longer waits for its WAL flush. Where one flush per transaction bounds a figure
    /// (one connection, a VM's disk whose flush time varies from round to round), this
    /// shows the library's own cost against its baseline without that noise. Not the
    /// default: the published figures are taken as users run PostgreSQL.
    #[arg(long)]
    async_commit: bool,
    /// The claim against the table's size (`size`) stops at this many rows (the sizes
    /// below it, then this one) instead of 50M.
    #[arg(long)]
    max_rows: Option<usize>,
}

impl Args {
    fn runs(&self, part: &str) -> bool {
        let by_default =
            !matches!(part, "scale" | "horizon" | "size" | "day" | "stream") || self.tiny;
        (self.only.is_empty() && by_default) || self.only.iter().any(|p| p == part)
    }
}

/// Sizes of one run.
struct Sizes {
    rounds: usize,
    relay_messages: usize,
    latency_rate: u32,
    latency_secs: f64,
    backlog: usize,
    consumer_messages: usize,
    emit_txns: usize,
    batch_sizes: Vec<usize>,
    relay_counts: Vec<usize>,
    /// Rows the relay drains with the horizon held back (`scale`).
    scale_drain: usize,
    /// Table sizes the claim is timed at (`scale`).
    scale_rows: Vec<usize>,
    /// The compressed day (`day`).
    day: day::DaySize,
    /// Stream memory and the trim (`stream`).
    stream: stream::StreamSize,
}

impl Sizes {
    fn new(args: &Args) -> Self {
        let mut sizes = if args.tiny {
            Self {
                rounds: 3,
                relay_messages: 2_000,
                latency_rate: 200,
                latency_secs: 1.0,
                backlog: 20_000,
                consumer_messages: 300,
                emit_txns: 40,
                batch_sizes: vec![100, 500],
                relay_counts: vec![1, 2],
                scale_drain: 5_000,
                scale_rows: vec![10_000, 50_000],
                day: day::DaySize {
                    rate: 100,
                    duration: Duration::from_secs(6),
                    interval: Duration::from_secs(2),
                },
                stream: stream::StreamSize {
                    entries: 2_000,
                    large_entries: 400,
                    kept: 20,
                },
            }
        } else {
            Self {
                rounds: 3,
                relay_messages: 50_000,
                latency_rate: 1_000,
                latency_secs: 5.0,
                backlog: 1_000_000,
                consumer_messages: 10_000,
                emit_txns: 2_000,
                batch_sizes: vec![50, 100, 250, 500, 1000],
                relay_counts: vec![1, 2, 4],
                scale_drain: 200_000,
                scale_rows: vec![10_000, 1_000_000, 10_000_000, 50_000_000],
                day: day::DaySize {
                    rate: 1000,
                    duration: Duration::from_secs(150),
                    interval: Duration::from_secs(10),
                },
                stream: stream::StreamSize {
                    entries: 100_000,
                    large_entries: 20_000,
                    kept: 1_000,
                },
            }
        };
        if let Some(rounds) = args.rounds {
            sizes.rounds = rounds.max(1);
        }
        if let Some(max) = args.max_rows {
            sizes.scale_rows.retain(|&rows| rows < max);
            sizes.scale_rows.push(max);
        }
        sizes
    }
}

/// The services under test.
#[derive(Clone)]
struct Service {
    pg_url: String,
    redis_url: String,
    /// `--async-commit`.
    async_commit: bool,
}

impl Service {
    /// Creates schema `name` and returns a URL whose connections use it.
    fn schema(&self, name: &str) -> Result<String, BoxError> {
        PgConnection::establish(&self.pg_url)?.batch_execute(&format!("CREATE SCHEMA {name}"))?;
        let sep = if self.pg_url.contains('?') { '&' } else { '?' };
        let flush = if self.async_commit {
            "%20-c%20synchronous_commit%3Doff"
        } else {
            ""
        };
        Ok(format!(
            "{}{sep}options=-c%20search_path%3D{name}{flush}",
            self.pg_url
        ))
    }

    fn drop_schema(&self, name: &str) {
        if let Ok(mut c) = PgConnection::establish(&self.pg_url) {
            let _ = c.batch_execute(&format!("DROP SCHEMA IF EXISTS {name} CASCADE"));
        }
    }
}

/// The order of `n` measurements in `round`: forward, then backward, so that a drift of
/// the machine during a round weighs on the figure and its baseline alike.
fn order(round: usize, n: usize) -> Vec<usize> {
    if round.is_multiple_of(2) {
        (0..n).collect()
    } else {
        (0..n).rev().collect()
    }
}

/// A round of the emit figures, its ways alternating in [`Slices::COUNT`] slices of
/// `txns / COUNT` transactions per connection: at one connection each transaction waits
/// for its WAL flush, whose time on this kind of VM moves by 3× within seconds (pgbench,
/// one client: 540 to 3,700 tx/s in consecutive 8 s runs), and one way's whole round
/// after another's measured the disk's drift as much as the library.
struct Slices {
    slice: usize,
    /// Per way: its slices summed.
    ways: Vec<Sum>,
}

/// A way's slices so far: their transactions, time, and CPU time (`None` once a slice's
/// was not known).
#[derive(Clone, Copy)]
struct Sum {
    txns: usize,
    secs: f64,
    cpu: Option<cpu::Cpu>,
}

impl Sum {
    const EMPTY: Self = Self {
        txns: 0,
        secs: 0.0,
        cpu: Some(cpu::Cpu::ZERO),
    };
}

/// A way's figures over a round: transactions per second, and CPU time per transaction
/// (the client's and the backends', see `cpu`), if known.
#[derive(Clone, Copy)]
struct WayRound {
    rate: f64,
    cpu: Option<cpu::Cpu>,
}

impl Slices {
    const COUNT: usize = 10;

    fn new(ways: usize, txns: usize) -> Self {
        Self {
            slice: (txns / Self::COUNT).max(1),
            ways: vec![Sum::EMPTY; ways],
        }
    }

    /// (transactions per connection, way) in the order to run them: every way once per
    /// slice, the order reversed from one slice to the next.
    fn schedule(&self, round: usize) -> Vec<(usize, usize)> {
        (0..Self::COUNT)
            .flat_map(|s| order(round + s, self.ways.len()))
            .map(|w| (self.slice, w))
            .collect()
    }

    /// One slice of way `w`.
    fn add(&mut self, w: usize, m: emit::Measured) {
        let sum = &mut self.ways[w];
        sum.txns += m.txns;
        sum.secs += m.elapsed.as_secs_f64();
        sum.cpu = sum.cpu.zip(m.cpu).map(|(a, b)| a + b);
    }

    /// Way `w` over the round.
    fn round(&self, w: usize) -> WayRound {
        let sum = self.ways[w];
        WayRound {
            rate: sum.txns as f64 / sum.secs,
            cpu: sum.cpu.map(|c| c.per(sum.txns)),
        }
    }
}

/// A way's throughput and CPU figures against the baseline's, over the rounds, both
/// judged against `target`. The CPU ratio is the baseline's CPU per transaction over the
/// way's: like the throughput ratio, below 1 where the way costs more. No CPU figure
/// where the CPU time could not be read (see `cpu`).
fn emit_figures(
    name: &str,
    (way_name, baseline_name): (&str, &str),
    target: Target,
    way: &[WayRound],
    baseline: &[WayRound],
) -> Vec<Figure> {
    let mut rate = Figure::ratio(
        "emit",
        name,
        format!("{way_name} / {baseline_name}"),
        target,
    );
    rate.values = way
        .iter()
        .zip(baseline)
        .map(|(x, y)| x.rate / y.rate)
        .collect();
    let mut cpu = Figure::ratio(
        "emit",
        format!("{name}: CPU"),
        format!("{baseline_name}'s / {way_name}'s CPU per transaction (client + backend)"),
        target,
    );
    cpu.values = way
        .iter()
        .zip(baseline)
        .filter_map(|(x, y)| Some(y.cpu?.total().as_secs_f64() / x.cpu?.total().as_secs_f64()))
        .collect();
    let mut figures = vec![rate];
    if cpu.values.len() == way.len() {
        figures.push(cpu);
    }
    figures
}

fn progress(what: &str, value: f64, unit: &str) {
    println!("  {what:<52} {value:>10.0} {unit}");
}

fn progress_emit(what: &str, r: WayRound) {
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    match r.cpu {
        Some(cpu) => println!(
            "  {what:<52} {:>10.0} tx/s {:>7.1} µs CPU/tx (client {:.1}, server {:.1})",
            r.rate,
            us(cpu.total()),
            us(cpu.client),
            us(cpu.server)
        ),
        None => progress(what, r.rate, "tx/s"),
    }
}

// Tokio's default runtime, one worker per core, as `#[tokio::main]` gives users: more
// workers than cores (this bench had 4 on 2) cost the consumer figures about a tenth in
// thread switches that no user pays.
#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    // Warnings of the relay and the consumer (outages, failed marks) show in the output.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let sizes = Sizes::new(&args);
    let svc = Service {
        pg_url: std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into()),
        redis_url: std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into()),
        async_commit: args.async_commit,
    };
    let mut facts = machine::facts(&svc.pg_url, &svc.redis_url).await?;
    if args.async_commit {
        facts.push("- --async-commit: every bench session sets synchronous_commit = off".into());
    }
    let load_before = machine::load();
    let neighbours = machine::neighbours();
    let started = std::time::Instant::now();
    for fact in &facts {
        println!("{fact}");
    }
    println!(
        "- load average at start: {load_before}; other outbox/chaos processes: {neighbours}; {} rounds{}\n",
        sizes.rounds,
        if args.tiny { " (--tiny)" } else { "" }
    );
    std::fs::create_dir_all(&args.out)?;
    let mut figures = Vec::new();
    if args.runs("relay") || args.runs("latency") || args.runs("memory") || args.runs("plots") {
        let bench = RelayBench::new(&svc).await?;
        let result = relay_part(&args, &sizes, &bench, &mut figures).await;
        bench.cleanup().await;
        result?;
    }
    if args.runs("consumer") {
        let deadline = Duration::from_secs(if args.tiny { 20 } else { 60 });
        let bench = ConsumerBench::new(&svc, sizes.consumer_messages, deadline).await?;
        let result = consumer_part(&sizes, &args.consumer_figures, &bench, &mut figures).await;
        bench.cleanup().await;
        result?;
    }
    if args.runs("emit") || args.runs("async-emit") {
        let bench = EmitBench::new(&svc)?;
        let mut result = Ok(());
        if args.runs("emit") {
            result = emit_part(&sizes, &bench, &mut figures).await;
        }
        if result.is_ok() && args.runs("async-emit") {
            result = emit_async_part(&sizes, &bench, &mut figures).await;
        }
        bench.cleanup();
        result?;
    }
    let (horizon, size) = (args.runs("horizon"), args.runs("size"));
    if args.runs("scale") || horizon || size {
        let all = args.runs("scale");
        scale::part(
            &sizes,
            &svc,
            &args.out,
            &mut figures,
            (all || horizon, all || size),
        )
        .await?;
    }
    if args.runs("day") {
        day::part(&sizes.day, &svc, &args.out, &mut figures).await?;
    }
    if args.runs("stream") {
        stream::part(&sizes.stream, &svc, &mut figures).await?;
    }
    let table = stats::table(&figures, !args.tiny);
    let load_after = machine::load();
    let mut report = String::new();
    report.push_str(&facts.join("\n"));
    report.push_str(&format!(
        "\n- load average at start {load_before}, at the end {load_after}; other outbox/chaos \
         processes at start: {neighbours}\n- {} rounds per ratio{}, {:.0} s in all\n\n",
        sizes.rounds,
        if args.tiny {
            " (--tiny: sizes too small to mean anything)"
        } else {
            ""
        },
        started.elapsed().as_secs_f64()
    ));
    report.push_str(&table);
    println!("\n{report}");
    let path = args.out.join(if args.tiny {
        "results-tiny.md"
    } else {
        "results.md"
    });
    std::fs::write(&path, &report)?;
    println!("written: {}", path.display());
    Ok(())
}

async fn relay_part(
    args: &Args,
    sizes: &Sizes,
    bench: &RelayBench,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    let n = sizes.relay_messages;
    if args.runs("relay") {
        println!("relay: {n} rows over 1000 keys, batches of 500");
        const RUNS: [(&str, usize, Sink, ClaimOrder); 5] = [
            (
                "1 relay → Redis, unordered",
                1,
                Sink::Redis,
                ClaimOrder::Unordered,
            ),
            (
                "1 relay → Redis, per-key",
                1,
                Sink::Redis,
                ClaimOrder::PerKey,
            ),
            (
                "2 relays → Redis, unordered",
                2,
                Sink::Redis,
                ClaimOrder::Unordered,
            ),
            (
                "2 relays → Redis, per-key",
                2,
                Sink::Redis,
                ClaimOrder::PerKey,
            ),
            (
                "1 relay → counting sink, unordered",
                1,
                Sink::Count,
                ClaimOrder::Unordered,
            ),
        ];
        // rates[0]: the SQL drain; rates[1 + i]: RUNS[i].
        let mut rates = vec![Vec::new(); RUNS.len() + 1];
        for round in 0..sizes.rounds {
            for i in order(round, RUNS.len() + 1) {
                bench.fill(n, 1000)?;
                let (name, rate) = if i == 0 {
                    (
                        "pure-SQL claim-and-mark drain",
                        bench.sql_drain(n, 500).await?,
                    )
                } else {
                    let (name, instances, sink, order) = RUNS[i - 1];
                    (name, bench.relays(n, instances, sink, order, 500).await?)
                };
                progress(name, rate, "msg/s");
                rates[i].push(rate);
            }
        }
        let ratio = |a: usize, b: usize| -> Vec<f64> {
            rates[a].iter().zip(&rates[b]).map(|(x, y)| x / y).collect()
        };
        let mut push = |name: &str, compared: &str, values: Vec<f64>, target| {
            let mut f = Figure::ratio("relay", name, compared, target);
            f.values = values;
            figures.push(f);
        };
        push(
            "relay drain rate, 1 relay, unordered",
            "relay → Redis / pure-SQL drain",
            ratio(1, 0),
            Target::AtLeast(0.8),
        );
        push(
            "per-key order, 1 relay",
            "per-key / unordered",
            ratio(2, 1),
            Target::AtLeast(0.8),
        );
        push(
            "per-key order, 2 relays",
            "per-key / unordered",
            ratio(4, 3),
            Target::AtLeast(0.8),
        );
        push(
            "relay without a broker",
            "relay → counting sink / pure-SQL drain",
            ratio(5, 0),
            Target::None,
        );
        push(
            "a second relay, unordered",
            "2 relays / 1 relay",
            ratio(3, 1),
            Target::None,
        );
        for (i, name) in [(0, "pure-SQL drain"), (1, "1 relay → Redis, unordered")] {
            let mut f = Figure::absolute("relay", name, "msg/s", Target::None);
            f.values = rates[i].clone();
            figures.push(f);
        }
    }
    if args.runs("latency") {
        let rate = sizes.latency_rate;
        let secs = sizes.latency_secs;
        println!(
            "latency: commit → XADD at {rate}/s, {} × {secs} s",
            sizes.rounds
        );
        let mut all = Vec::new();
        let (mut p50, mut p99) = (
            Figure::absolute(
                "relay",
                format!("commit → XADD p50 at {rate}/s"),
                "ms",
                Target::AtMost(2.0),
            ),
            Figure::absolute(
                "relay",
                format!("commit → XADD p99 at {rate}/s"),
                "ms",
                Target::AtMost(5.0),
            ),
        );
        for _ in 0..sizes.rounds {
            let lat = bench.latency(rate, Duration::from_secs_f64(secs)).await?;
            let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
            println!(
                "  p50 {:.2} ms, p99 {:.2} ms over {} messages",
                pct(0.5),
                pct(0.99),
                lat.len()
            );
            p50.values.push(pct(0.5));
            p99.values.push(pct(0.99));
            all.extend(lat);
        }
        all.sort_by(f64::total_cmp);
        figures.push(p50);
        figures.push(p99);
        plot::latency_cdf(
            &args.out.join("latency.svg"),
            &format!("commit → XADD at {rate} messages/s, one relay on LISTEN"),
            &all,
        )?;
    }
    if args.runs("memory") && sizes.backlog > 0 {
        println!("memory: one relay drains a {}-row backlog", sizes.backlog);
        let (before, peak, after, rate) = bench.memory(sizes.backlog).await?;
        println!(
            "  RSS {} MiB before, peak {} MiB, after {} MiB ({rate:.0} msg/s)",
            before / 1024,
            peak / 1024,
            after / 1024
        );
        let mut f = Figure::absolute(
            "relay",
            format!(
                "RSS growth while draining {} rows (peak − start)",
                sizes.backlog
            ),
            "MiB",
            Target::None,
        );
        f.values = vec![(peak.saturating_sub(before)) as f64 / 1024.0];
        figures.push(f);
    }
    if args.runs("plots") {
        let n = sizes.relay_messages;
        println!("plots: throughput against batch size and relay count");
        let mut by_batch = [
            ("pure-SQL drain", Vec::new()),
            ("1 relay, unordered", Vec::new()),
            ("1 relay, per-key", Vec::new()),
        ];
        for &batch in &sizes.batch_sizes {
            for (i, series) in by_batch.iter_mut().enumerate() {
                bench.fill(n, 1000)?;
                let rate = match i {
                    0 => bench.sql_drain(n, batch).await?,
                    1 => {
                        bench
                            .relays(n, 1, Sink::Redis, ClaimOrder::Unordered, batch)
                            .await?
                    }
                    _ => {
                        bench
                            .relays(n, 1, Sink::Redis, ClaimOrder::PerKey, batch)
                            .await?
                    }
                };
                progress(&format!("{}, batch {batch}", series.0), rate, "msg/s");
                series.1.push((batch as f64, rate));
            }
        }
        plot::lines(
            &args.out.join("relay_batch.svg"),
            "Relay drain rate against batch size (PostgreSQL → Redis)",
            "batch size (rows per claim)",
            "messages/s",
            &by_batch.map(|(name, points)| plot::Series {
                name: name.into(),
                points,
            }),
            true,
        )?;
        let mut by_count = [("unordered", Vec::new()), ("per-key", Vec::new())];
        for &count in &sizes.relay_counts {
            for (i, series) in by_count.iter_mut().enumerate() {
                bench.fill(n, 1000)?;
                let order = if i == 0 {
                    ClaimOrder::Unordered
                } else {
                    ClaimOrder::PerKey
                };
                let rate = bench.relays(n, count, Sink::Redis, order, 500).await?;
                progress(&format!("{count} relay(s), {}", series.0), rate, "msg/s");
                series.1.push((count as f64, rate));
            }
        }
        plot::lines(
            &args.out.join("relay_instances.svg"),
            "Relay drain rate against relay count (batches of 500)",
            "relays",
            "messages/s",
            &by_count.map(|(name, points)| plot::Series {
                name: name.into(),
                points,
            }),
            false,
        )?;
    }
    Ok(())
}

async fn consumer_part(
    sizes: &Sizes,
    only: &[usize],
    bench: &ConsumerBench,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    println!(
        "consumer: {} messages per run; batch mode 100 per transaction; contention: 2 consumers, \
         batches of 50, 64 keys; partitioned: 8 partitions, 4 messages per key",
        bench.messages
    );
    const NAMES: [&str; 14] = [
        "plain SQL loop, 1 connection",
        "consumer single mode, 1 in flight",
        "consumer batch mode, 1 in flight",
        "plain SQL loop, 8 connections",
        "consumer single mode, 8 in flight",
        "consumer batch mode, 8 in flight",
        "2 consumers, single mode, 64 keys",
        "2 consumers, batch mode (50), 64 keys",
        "8 partitions, 1 consumer, 8 in flight, unordered",
        "8 partitions, 1 consumer, 8 in flight, ordered",
        "8 partitions, 3 consumers, 8 in flight, unordered",
        "8 partitions, 3 consumers, 8 in flight, ordered",
        "consumer single mode, async inbox, 1 in flight",
        "consumer single mode, async inbox, 8 in flight",
    ];
    let mut rates = vec![Vec::new(); NAMES.len()];
    for round in 0..sizes.rounds {
        for i in order(round, NAMES.len()) {
            if !only.is_empty() && !only.contains(&i) {
                continue;
            }
            let rate = match i {
                0 => tokio::task::block_in_place(|| bench.plain_loop(1))?,
                1 => bench.consumers(Load::Distinct, 1, 1, None).await?,
                2 => bench.consumers(Load::Distinct, 1, 1, Some(100)).await?,
                3 => tokio::task::block_in_place(|| bench.plain_loop(8))?,
                4 => bench.consumers(Load::Distinct, 1, 8, None).await?,
                5 => bench.consumers(Load::Distinct, 1, 8, Some(100)).await?,
                6 => bench.consumers(Load::Shared, 2, 8, None).await?,
                7 => bench.consumers(Load::Shared, 2, 8, Some(50)).await?,
                8..=11 => {
                    let mode = if i % 2 == 0 {
                        Mode::Unordered
                    } else {
                        Mode::Ordered
                    };
                    let consumers = if i < 10 { 1 } else { 3 };
                    bench
                        .consumers_in(Load::Partitioned, mode, consumers, 8, None)
                        .await?
                }
                12 => bench.async_consumer(1).await?,
                13 => bench.async_consumer(8).await?,
                _ => unreachable!("one rate per name"),
            };
            progress(NAMES[i], rate, "msg/s");
            rates[i].push(rate);
        }
    }
    let ratio = |a: usize, b: usize| -> Vec<f64> {
        rates[a].iter().zip(&rates[b]).map(|(x, y)| x / y).collect()
    };
    for (name, compared, a, b, target) in [
        (
            "single mode, 1 in flight",
            "consumer / plain SQL loop",
            1,
            0,
            Target::AtLeast(0.8),
        ),
        (
            "single mode, 8 in flight",
            "consumer / plain SQL loop",
            4,
            3,
            Target::AtLeast(0.8),
        ),
        (
            "batch mode, 1 in flight",
            "batch / single mode",
            2,
            1,
            Target::AtLeast(2.0),
        ),
        (
            "batch mode, 8 in flight",
            "batch / single mode",
            5,
            4,
            Target::AtLeast(2.0),
        ),
        (
            "batch mode under contention (2 consumers, batch 50, 64 keys)",
            "batch / single mode",
            7,
            6,
            Target::AtLeast(1.0),
        ),
        (
            "ordered over 8 partitions, 1 consumer, 8 in flight",
            "ordered / unordered",
            9,
            8,
            Target::AtLeast(0.7),
        ),
        (
            "ordered over 8 partitions, 3 consumers, 8 in flight each",
            "ordered / unordered",
            11,
            10,
            Target::AtLeast(0.7),
        ),
        // Shown, not judged yet: the lead sets the target from a quiet run.
        (
            "async inbox (diesel-async), single mode, 1 in flight",
            "consumer / plain SQL loop",
            12,
            0,
            Target::None,
        ),
        (
            "async inbox (diesel-async), single mode, 8 in flight",
            "consumer / plain SQL loop",
            13,
            3,
            Target::None,
        ),
    ] {
        if rates[a].is_empty() || rates[b].is_empty() {
            continue;
        }
        let mut f = Figure::ratio("consumer", name, compared, target);
        f.values = ratio(a, b);
        figures.push(f);
    }
    Ok(())
}

async fn emit_part(
    sizes: &Sizes,
    bench: &EmitBench,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    let txns = sizes.emit_txns;
    println!("emit: {txns} transactions of one event per connection and round");
    let ways = [
        ("hand-written insert", Way::Hand),
        ("emit, Notify::Never", Way::Emit(Notify::Never)),
        (
            "emit, Notify::WhenRelayIdle (default)",
            Way::Emit(Notify::WhenRelayIdle),
        ),
        // What delivering at once costs: the same statement notifying on every
        // transaction, without the check. With a relay that parks between two emits
        // (one connection) the default sends a NOTIFY per transaction too.
        ("emit, Notify::Always", Way::Emit(Notify::Always)),
    ];
    // rounds[parked][conns index][way][round]
    let mut rounds = vec![vec![vec![Vec::new(); ways.len()]; 2]; 2];
    for (parked, relay_state) in ["no relay", "a relay parked on LISTEN"].iter().enumerate() {
        let relay = if parked == 1 {
            tokio::task::block_in_place(|| bench.clear())?;
            Some(bench.park_relay().await?)
        } else {
            None
        };
        for (c, conns) in [1usize, 8].into_iter().enumerate() {
            // Warm-up: connections, prepared statements, the table's first pages.
            for (_, way) in ways {
                tokio::task::block_in_place(|| bench.run(way, conns, txns / 10 + 1))?;
            }
            for round in 0..sizes.rounds {
                let mut timed = Slices::new(ways.len(), txns);
                for (slice, w) in timed.schedule(round) {
                    let way = ways[w].1;
                    let measured = tokio::task::block_in_place(|| {
                        if relay.is_some() {
                            bench.settle()?;
                        }
                        bench.run(way, conns, slice)
                    })?;
                    timed.add(w, measured);
                }
                for (w, (name, _)) in ways.iter().enumerate() {
                    let r = timed.round(w);
                    progress_emit(&format!("{name}, {conns} conn., {relay_state}"), r);
                    rounds[parked][c][w].push(r);
                }
            }
        }
        if let Some(relay) = relay {
            relay.stop().await?;
        }
    }
    for (parked, relay_state) in ["no relay parked", "one relay parked"].iter().enumerate() {
        for (c, conns) in [1usize, 8].into_iter().enumerate() {
            for (w, name, target) in [
                (2, "emit (default WhenRelayIdle)", Target::AtLeast(0.95)),
                (1, "emit, Notify::Never", Target::None),
                (3, "emit, Notify::Always", Target::None),
            ] {
                let r = &rounds[parked][c];
                figures.extend(emit_figures(
                    &format!("{name}, {conns} conn., {relay_state}"),
                    ("emit", "hand-written insert"),
                    target,
                    &r[w],
                    &r[0],
                ));
            }
        }
    }
    Ok(())
}

/// `AsyncEmit` against the same hand-written insert on diesel-async, no relay parked.
async fn emit_async_part(
    sizes: &Sizes,
    bench: &EmitBench,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    let txns = sizes.emit_txns;
    let ways = [
        ("diesel-async hand-written insert", Way::Hand),
        (
            "AsyncEmit, Notify::WhenRelayIdle (default)",
            Way::Emit(Notify::WhenRelayIdle),
        ),
        ("AsyncEmit, Notify::Never", Way::Emit(Notify::Never)),
    ];
    for conns in [1usize, 8] {
        for (_, way) in ways {
            bench.run_async(way, conns, txns / 10 + 1).await?;
        }
        // rounds[way][round]
        let mut rounds = vec![Vec::new(); ways.len()];
        for round in 0..sizes.rounds {
            let mut timed = Slices::new(ways.len(), txns);
            for (slice, w) in timed.schedule(round) {
                timed.add(w, bench.run_async(ways[w].1, conns, slice).await?);
            }
            for (w, (name, _)) in ways.iter().enumerate() {
                let r = timed.round(w);
                progress_emit(&format!("{name}, {conns} conn."), r);
                rounds[w].push(r);
            }
        }
        for (w, name, target) in [
            (
                1,
                "AsyncEmit (default WhenRelayIdle)",
                Target::AtLeast(0.95),
            ),
            (2, "AsyncEmit, Notify::Never", Target::None),
        ] {
            figures.extend(emit_figures(
                &format!("{name}, {conns} conn., no relay parked"),
                ("AsyncEmit", "diesel-async hand-written insert"),
                target,
                &rounds[w],
                &rounds[0],
            ));
        }
    }
    Ok(())
}
