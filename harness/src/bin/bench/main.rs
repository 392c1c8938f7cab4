//! Run with: cargo run --release -p outbox-harness --bin bench
//!
//! Every figure of BENCHMARKS.md against its baseline, measured in the same run with the
//! rounds alternating (baseline first in one round, last in the next), on PostgreSQL
//! (`DATABASE_URL`, default the local `test` database) and Redis (`REDIS_URL`):
//!
//! - relay: one relay into Redis against a pure-SQL claim-and-mark drain, one relay into
//!   NATS JetStream (`NATS_URL`) beside one into Redis, per-key
//!   against unordered claims with one and two relays, commit→XADD latency at a steady
//!   1,000 messages/s, resident memory while draining a 1M-row backlog;
//! - cdc: the CDC relay (`outbox-cdc`) beside the polling relay on a private cluster with
//!   `wal_level = logical`: backlog drain against the polling relay and against the same
//!   entries published from memory (the broker's own limit), commit→XADD latency at the
//!   steady rate, rows updated and dead tuples per message, the database's CPU per message;
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
//!
//! Where the parts are: each part's figures (what it measures, in which order, against
//! what) are in `relay_part.rs`, `consumer_part.rs` and `emit_part.rs`, or in the part's
//! own module (`scale.rs`, `day.rs`, `stream.rs`); what they drive is in `relay.rs`,
//! `consumer.rs` and `emit.rs`; `stats.rs` judges and tabulates the figures, `plot.rs`
//! draws them, `cpu.rs` and `machine.rs` read the machine.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use diesel::connection::SimpleConnection as _;
use diesel::{Connection as _, PgConnection};

mod cdc;
mod consumer;
mod consumer_part;
mod cpu;
mod day;
mod emit;
mod emit_part;
mod machine;
mod plot;
mod relay;
mod relay_part;
mod scale;
mod stats;
mod stream;

use consumer::ConsumerBench;
use emit::EmitBench;
use relay::RelayBench;
use stats::Figure;

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
    /// Only these parts (comma-separated): relay, latency, memory, cdc (the CDC relay
    /// beside the polling relay on a private `wal_level = logical` cluster), consumer, emit,
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

/// One measurement's line on the way.
fn progress(what: &str, value: f64, unit: &str) {
    println!("  {what:<52} {value:>10.0} {unit}");
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
    run_parts(&args, &sizes, &svc, &mut figures).await?;
    let load = (load_before, machine::load());
    write_report(&args, &sizes, &facts, load, neighbours, started, &figures)
}

/// Runs the parts `args` asks for, adding their figures to `figures`.
async fn run_parts(
    args: &Args,
    sizes: &Sizes,
    svc: &Service,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    if args.runs("relay") || args.runs("latency") || args.runs("memory") || args.runs("plots") {
        let bench = RelayBench::new(svc).await?;
        let result = relay_part::part(args, sizes, &bench, figures).await;
        bench.cleanup().await;
        result?;
    }
    if args.runs("cdc") {
        cdc::part(sizes, svc, figures).await?;
    }
    if args.runs("consumer") {
        let deadline = Duration::from_secs(if args.tiny { 20 } else { 60 });
        let bench = ConsumerBench::new(svc, sizes.consumer_messages, deadline).await?;
        let result = consumer_part::part(sizes, &args.consumer_figures, &bench, figures).await;
        bench.cleanup().await;
        result?;
    }
    if args.runs("emit") || args.runs("async-emit") {
        let bench = EmitBench::new(svc)?;
        let mut result = Ok(());
        if args.runs("emit") {
            result = emit_part::part(sizes, &bench, figures).await;
        }
        if result.is_ok() && args.runs("async-emit") {
            result = emit_part::async_part(sizes, &bench, figures).await;
        }
        bench.cleanup();
        result?;
    }
    let (horizon, size) = (args.runs("horizon"), args.runs("size"));
    if args.runs("scale") || horizon || size {
        let all = args.runs("scale");
        scale::part(
            sizes,
            svc,
            &args.out,
            figures,
            (all || horizon, all || size),
        )
        .await?;
    }
    if args.runs("day") {
        day::part(&sizes.day, svc, &args.out, figures).await?;
    }
    if args.runs("stream") {
        stream::part(&sizes.stream, svc, figures).await?;
    }
    Ok(())
}

/// Prints the table with the machine's facts and writes it to `--out`.
fn write_report(
    args: &Args,
    sizes: &Sizes,
    facts: &[String],
    (load_before, load_after): (String, String),
    neighbours: usize,
    started: std::time::Instant,
    figures: &[Figure],
) -> Result<(), BoxError> {
    let table = stats::table(figures, !args.tiny);
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
