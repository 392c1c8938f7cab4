//! The consumer part: single mode against a plain SQL loop doing the same writes, batch
//! mode against single mode, ordered against unordered over partitions, and the async
//! inbox; the NATS consumer against the plain SQL loop.

use crate::consumer::{ConsumerBench, Load, Mode};
use crate::stats::{Figure, Target};
use crate::{BoxError, Sizes, order, progress};

/// The consumer part's measurements, by their place (`--consumer-figures`).
const NAMES: [&str; 16] = [
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
    "NATS consumer single mode, 1 in flight",
    "NATS consumer single mode, 8 in flight",
];

/// The ratios: name, what is compared, the measurements (by place in [`NAMES`]) over
/// each other, and the target.
const RATIOS: [(&str, &str, usize, usize, Target); 11] = [
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
    // NATS beside Redis: shown, not judged; the same handler, inbox and writes.
    (
        "NATS consumer, single mode, 1 in flight",
        "NATS consumer / plain SQL loop",
        14,
        0,
        Target::None,
    ),
    (
        "NATS consumer, single mode, 8 in flight",
        "NATS consumer / plain SQL loop",
        15,
        3,
        Target::None,
    ),
];

/// Measures the consumer figures (`only` these, by place in [`NAMES`], if any).
pub(crate) async fn part(
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
    let mut rates = vec![Vec::new(); NAMES.len()];
    for round in 0..sizes.rounds {
        for i in order(round, NAMES.len()) {
            if !only.is_empty() && !only.contains(&i) {
                continue;
            }
            let rate = measure(bench, i).await?;
            progress(NAMES[i], rate, "msg/s");
            rates[i].push(rate);
        }
    }
    let ratio = |a: usize, b: usize| -> Vec<f64> {
        rates[a].iter().zip(&rates[b]).map(|(x, y)| x / y).collect()
    };
    for &(name, compared, a, b, target) in &RATIOS {
        if rates[a].is_empty() || rates[b].is_empty() {
            continue;
        }
        let mut f = Figure::ratio("consumer", name, compared, target);
        f.values = ratio(a, b);
        figures.push(f);
    }
    Ok(())
}

/// Measurement `i` of [`NAMES`]: messages per second.
async fn measure(bench: &ConsumerBench, i: usize) -> Result<f64, BoxError> {
    Ok(match i {
        0 => tokio::task::block_in_place(|| bench.plain_loop(1))?,
        1 => bench.consumers(Load::Distinct, 1, 1, None).await?,
        2 => bench.consumers(Load::Distinct, 1, 1, Some(100)).await?,
        3 => tokio::task::block_in_place(|| bench.plain_loop(8))?,
        4 => bench.consumers(Load::Distinct, 1, 8, None).await?,
        5 => bench.consumers(Load::Distinct, 1, 8, Some(100)).await?,
        6 => bench.consumers(Load::Shared, 2, 8, None).await?,
        7 => bench.consumers(Load::Shared, 2, 8, Some(50)).await?,
        8..=11 => {
            let mode = if i.is_multiple_of(2) {
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
        14 => bench.nats_consumer(1).await?,
        15 => bench.nats_consumer(8).await?,
        _ => unreachable!("one rate per name"),
    })
}
