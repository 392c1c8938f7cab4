//! The relay part: the relay's drain rate against a pure-SQL claim-and-mark drain and
//! per-key order against unordered claims, the commit → XADD latency, the resident
//! memory while draining a backlog, and the plots against batch size and relay count.

use std::time::Duration;

use outbox_diesel::ClaimOrder;

use crate::relay::{RelayBench, Sink};
use crate::stats::{Figure, Target};
use crate::{Args, BoxError, Sizes, order, plot, progress};

/// Runs the relay figures `args` asks for.
pub(crate) async fn part(
    args: &Args,
    sizes: &Sizes,
    bench: &RelayBench,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    if args.runs("relay") {
        ratios(sizes, bench, figures).await?;
    }
    if args.runs("latency") {
        latency(args, sizes, bench, figures).await?;
    }
    if args.runs("memory") && sizes.backlog > 0 {
        memory(sizes, bench, figures).await?;
    }
    if args.runs("plots") {
        plots(args, sizes, bench).await?;
    }
    Ok(())
}

/// The relay runs of the ratios: name, relays, sink, claim order.
const RUNS: [(&str, usize, Sink, ClaimOrder); 6] = [
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
    (
        "1 relay → NATS JetStream, per-key",
        1,
        Sink::Nats,
        ClaimOrder::PerKey,
    ),
];

/// The relay's drain rates against the pure-SQL drain and each other.
async fn ratios(
    sizes: &Sizes,
    bench: &RelayBench,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    let n = sizes.relay_messages;
    println!("relay: {n} rows over 1000 keys, batches of 500");
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
    push(
        "relay → NATS beside relay → Redis, 1 relay, per-key",
        "relay → NATS / relay → Redis",
        ratio(6, 2),
        Target::None,
    );
    for (i, name) in [
        (0, "pure-SQL drain"),
        (1, "1 relay → Redis, unordered"),
        (6, "1 relay → NATS, per-key"),
    ] {
        let mut f = Figure::absolute("relay", name, "msg/s", Target::None);
        f.values = rates[i].clone();
        figures.push(f);
    }
    Ok(())
}

/// Commit → XADD latency at a steady rate, one relay on LISTEN, and its distribution.
async fn latency(
    args: &Args,
    sizes: &Sizes,
    bench: &RelayBench,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
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
    Ok(())
}

/// The relay's resident memory growth while draining a backlog.
async fn memory(
    sizes: &Sizes,
    bench: &RelayBench,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
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
    Ok(())
}

/// Throughput against batch size and relay count, as plots.
async fn plots(args: &Args, sizes: &Sizes, bench: &RelayBench) -> Result<(), BoxError> {
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
    Ok(())
}
