//! The emit part: `emit` (each `Notify`) against a hand-written diesel insert, with no
//! relay and with one parked on LISTEN, and `AsyncEmit` against the same insert on
//! diesel-async; each as throughput and as CPU time per transaction.

use std::time::Duration;

use outbox_diesel::Notify;

use crate::emit::{self, EmitBench, Way};
use crate::stats::{Figure, Target};
use crate::{BoxError, Sizes, cpu, order, progress};

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

/// How often each way woke the parked relay: its batches per 1,000 transactions (it
/// also polls every 10 ms, and drains a woken burst in one batch or a few).
fn print_wakes(conns: usize, names: &[&str], wakes: &[(u64, usize)]) {
    let per_1000 = |&(batches, txns): &(u64, usize)| batches as f64 * 1000.0 / txns.max(1) as f64;
    let each: Vec<String> = names
        .iter()
        .zip(wakes)
        .map(|(name, w)| format!("{name} {:.0}", per_1000(w)))
        .collect();
    println!(
        "  relay batches per 1,000 transactions, {conns} conn.: {}",
        each.join(", ")
    );
}

/// The emit figures, blocking and with a relay parked or not.
pub(crate) async fn part(
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
            // Per way: the relay's batches and the transactions they carried.
            let mut wakes = vec![(0u64, 0usize); ways.len()];
            for round in 0..sizes.rounds {
                let mut timed = Slices::new(ways.len(), txns);
                for (slice, w) in timed.schedule(round) {
                    let way = ways[w].1;
                    let measured = tokio::task::block_in_place(|| match &relay {
                        None => bench.run(way, conns, slice),
                        Some(relay) => {
                            bench.settle()?;
                            let before = relay.batches();
                            let measured = bench.run(way, conns, slice)?;
                            bench.settle()?;
                            wakes[w].0 += relay.batches() - before;
                            wakes[w].1 += slice * conns;
                            Ok(measured)
                        }
                    })?;
                    timed.add(w, measured);
                }
                for (w, (name, _)) in ways.iter().enumerate() {
                    let r = timed.round(w);
                    progress_emit(&format!("{name}, {conns} conn., {relay_state}"), r);
                    rounds[parked][c][w].push(r);
                }
            }
            if relay.is_some() {
                print_wakes(conns, &ways.map(|(name, _)| name), &wakes);
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
pub(crate) async fn async_part(
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
