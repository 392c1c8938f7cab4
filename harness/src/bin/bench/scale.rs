//! Production scale on PostgreSQL, on both layouts (unpartitioned and
//! `migrate_partitioned`): the relay's drain with the xmin horizon held back by an open
//! `REPEATABLE READ` transaction against the same drain without it, and the claim's time
//! as SENT rows pile up in the table.

use std::path::Path;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection as _;
use diesel::{Connection as _, PgConnection};
use outbox_core::RelayStore as _;
use outbox_diesel::{ClaimOrder, PgRelayStore};

use crate::relay::{RelayBench, Sink};
use crate::stats::{Figure, Target};
use crate::{BoxError, Service, Sizes, order, plot, progress, stats};

const LAYOUTS: [(&str, bool); 2] = [("unpartitioned", false), ("partitioned", true)];

/// NEW rows the claims of the size sweep find on top of the SENT ones.
const NEW_ROWS: usize = 10_000;
/// Claims timed at each size.
const CLAIMS: usize = 40;

/// `horizon`: the held-back drains; `size`: the claim against the table's size.
pub(crate) async fn part(
    sizes: &Sizes,
    svc: &Service,
    out: &Path,
    figures: &mut Vec<Figure>,
    (horizon, size): (bool, bool),
) -> Result<(), BoxError> {
    for (name, partitioned) in LAYOUTS.into_iter().filter(|_| horizon) {
        let bench = RelayBench::with_layout(svc, partitioned).await?;
        let result = held_horizon(sizes, &bench, name, partitioned, figures).await;
        bench.cleanup().await;
        result?;
    }
    if !size {
        return Ok(());
    }
    let mut series = Vec::new();
    for (name, partitioned) in LAYOUTS {
        let bench = RelayBench::with_layout(svc, partitioned).await?;
        let result = claim_vs_size(sizes, &bench, name, figures).await;
        bench.cleanup().await;
        series.push(plot::Series {
            name: name.into(),
            points: result?,
        });
    }
    plot::lines(
        &out.join("claim-vs-size.svg"),
        "per-key claim of 100 rows (p50) against SENT rows in the table",
        "rows in the table",
        "ms",
        &series,
        false,
    )
}

/// The relay drains `scale_drain` rows with and without a transaction holding the horizon
/// back, rounds interleaved; the ratio, and the dead tuples left behind.
async fn held_horizon(
    sizes: &Sizes,
    bench: &RelayBench,
    layout: &str,
    partitioned: bool,
    figures: &mut Vec<Figure>,
) -> Result<(), BoxError> {
    let n = sizes.scale_drain;
    println!("scale: 1 relay drains {n} rows, {layout}, with and without the horizon held back");
    let (mut rates, mut dead) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
    for round in 0..sizes.rounds {
        for held in order(round, 2) {
            bench.fill(n, 1000)?;
            let holder = if held == 1 {
                Some(hold_horizon(bench.url())?)
            } else {
                None
            };
            let rate = bench
                .relays(n, 1, Sink::Count, ClaimOrder::PerKey, 500)
                .await?;
            tokio::time::sleep(Duration::from_millis(1500)).await; // the backends' statistics
            let tuples = bench.scalar(
                "SELECT COALESCE(sum(n_dead_tup), 0)::bigint AS n FROM pg_stat_user_tables \
                 WHERE schemaname = current_schema() AND relname LIKE 'outbox%'",
            )? as f64;
            drop(holder);
            let what = if held == 1 { "held back" } else { "free" };
            progress(&format!("{layout}, horizon {what}"), rate, "msg/s");
            rates[held].push(rate);
            dead[held].push(tuples);
        }
    }
    let mut ratio = Figure::ratio(
        "scale",
        format!("drain with the horizon held back, {layout}"),
        "held back / free",
        if partitioned {
            Target::AtLeast(0.8)
        } else {
            Target::None
        },
    );
    ratio.values = rates[1].iter().zip(&rates[0]).map(|(h, f)| h / f).collect();
    figures.push(ratio);
    let mut tuples = Figure::absolute(
        "scale",
        format!("dead tuples after the held-back drain, {layout}"),
        "rows",
        Target::None,
    );
    tuples.values = dead[1].clone();
    figures.push(tuples);
    Ok(())
}

/// A session in a `REPEATABLE READ` transaction that has read a snapshot: until it is
/// dropped, no row version it could see is removed, by vacuum or by pruning.
fn hold_horizon(url: &str) -> Result<PgConnection, BoxError> {
    let mut c = PgConnection::establish(url)?;
    c.batch_execute(
        "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM outbox_migrations",
    )?;
    Ok(c)
}

/// Claim time (p50 of [`CLAIMS`] per-key claims of 100 rows, each rolled back) as the
/// table grows to each of `scale_rows` rows, [`NEW_ROWS`] of them NEW; `(rows, ms)` points.
async fn claim_vs_size(
    sizes: &Sizes,
    bench: &RelayBench,
    layout: &str,
    figures: &mut Vec<Figure>,
) -> Result<Vec<(f64, f64)>, BoxError> {
    println!("scale: claim time against table size, {layout}");
    bench.fill(NEW_ROWS, 1000)?;
    let url = bench.url().to_owned();
    let store = tokio::task::spawn_blocking(move || PgRelayStore::connect(&url, 2)).await??;
    let (mut rows, mut points) = (NEW_ROWS, Vec::new());
    for &size in &sizes.scale_rows {
        while rows < size {
            let to = size.min(rows + 5_000_000);
            add_sent(bench, rows, to)?;
            rows = to;
        }
        bench.exec("ANALYZE outbox")?;
        let mut times = Vec::with_capacity(CLAIMS);
        for _ in 0..CLAIMS {
            let started = Instant::now();
            let batch = store.claim(100).await?;
            times.push(started.elapsed().as_secs_f64() * 1000.0);
            drop(batch);
        }
        let p50 = stats::median(&times);
        progress(
            &format!("{layout}, {rows} rows: claim p50 (µs)"),
            p50 * 1000.0,
            "µs",
        );
        points.push((rows as f64, p50));
    }
    if let (Some(first), Some(last)) = (points.first(), points.last()) {
        let mut f = Figure::ratio(
            "scale",
            format!("claim at {} rows, {layout}", last.0),
            format!("claim at {} / at {} rows", last.0, first.0),
            Target::AtMost(1.5),
        );
        f.values = vec![last.1 / first.1];
        figures.push(f);
    }
    Ok(points)
}

/// SENT rows `from + 1 ..= to` (ids above the NEW ones), small payloads: what the claim
/// must not walk. Without triggers, as [`RelayBench::fill`].
fn add_sent(bench: &RelayBench, from: usize, to: usize) -> Result<(), BoxError> {
    bench.exec(&format!(
        "SET session_replication_role = replica; INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, status, sent_at) \
         SELECT 's-' || g || ':AccountTransferred', 'account.transferred', 'AccountTransferred', \
                'k' || (g % 1000), '{{\"amount\": 1}}', 1, now() \
         FROM generate_series({}, {to}) g; RESET session_replication_role",
        from + 1
    ))
}
