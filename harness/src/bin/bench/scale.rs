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

/// NEW rows the claims of the size sweep find: the newest rows of the table, as in
/// production, where every row below them was sent before.
const NEW_ROWS: usize = 10_000;
/// Claims timed at each size.
const CLAIMS: usize = 40;
/// Rows inserted NEW per statement while the table grows.
const INSERT_CHUNK: usize = 500_000;
/// Rows marked SENT per transaction while the table grows.
const MARK_CHUNK: usize = 50_000;

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
        let result = claim_vs_size(sizes, &bench, name, partitioned, figures).await;
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
/// table grows to each of `scale_rows` rows, the newest [`NEW_ROWS`] of them NEW; `(rows,
/// ms)` points.
///
/// The table grows as production's does: rows inserted NEW (the emit's columns and
/// defaults), then marked SENT by id in the relay's statement and plan settings, one
/// transaction per [`MARK_CHUNK`] rows. Every row thus enters `outbox_pending` and leaves
/// it, leaving a dead index entry and a dead heap tuple until (auto)vacuum, which runs
/// as it is set up to (nothing here vacuums). On the partitioned layout the rows' times
/// spread over the retention (the partitions it keeps behind the current one, made here
/// as maintenance would have made them day by day), oldest first, the NEW rows now: the
/// claim walks every partition a production table has (behind, current, ahead).
///
/// Before the timed claims the relay's store claims (rolled back) until its floor has
/// reached the first NEW row, as a relay running all along would have it.
async fn claim_vs_size(
    sizes: &Sizes,
    bench: &RelayBench,
    layout: &str,
    partitioned: bool,
    figures: &mut Vec<Figure>,
) -> Result<Vec<(f64, f64)>, BoxError> {
    println!("scale: claim time against table size, {layout}");
    bench.fill(NEW_ROWS, 1000)?;
    let oldest = if partitioned {
        past_partitions(bench)?
    } else {
        "now() - interval '7 days'".to_owned()
    };
    let url = bench.url().to_owned();
    let store = tokio::task::spawn_blocking(move || PgRelayStore::connect(&url, 2)).await??;
    let (mut rows, mut sent_to, mut points) = (NEW_ROWS, 0_i64, Vec::new());
    for &size in &sizes.scale_rows {
        grow(bench, size, (&mut rows, &mut sent_to), &oldest)?;
        bench.exec("ANALYZE outbox")?;
        let first_new = bench.scalar("SELECT min(id) AS n FROM outbox WHERE status = 0")?;
        let walk = walk_from_zero(bench)?;
        let warm_until = Instant::now() + Duration::from_secs(10);
        while store.claim_floor() < first_new && Instant::now() < warm_until {
            drop(store.claim(100).await?);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (dead, vacuums, parts) = table_state(bench)?;
        let mut times = Vec::with_capacity(CLAIMS);
        for _ in 0..CLAIMS {
            let started = Instant::now();
            let batch = store.claim(100).await?;
            times.push(started.elapsed().as_secs_f64() * 1000.0);
            drop(batch);
        }
        let (p50, p99) = (stats::median(&times), stats::p99(&times));
        progress(
            &format!("{layout}, {rows} rows: claim p50 (µs)"),
            p50 * 1000.0,
            "µs",
        );
        progress(
            &format!("{layout}, {rows} rows: claim p99 (µs)"),
            p99 * 1000.0,
            "µs",
        );
        progress(
            &format!("{layout}, {rows} rows: walk from id 0 (µs)"),
            walk,
            "µs",
        );
        println!(
            "  {layout}, {rows} rows: {parts} partitions, {dead} dead tuples at the claims, \
             {vacuums} autovacuums so far, floor {} (first NEW row {first_new})",
            store.claim_floor()
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

/// Adds rows up to `size` (`rows` so far), all NEW, then marks all but the last
/// [`NEW_ROWS`] SENT (up to id `sent_to` so far), in chunks.
fn grow(
    bench: &RelayBench,
    size: usize,
    (rows, sent_to): (&mut usize, &mut i64),
    oldest: &str,
) -> Result<(), BoxError> {
    let start = *rows;
    while *rows < size {
        let to = size.min(*rows + INSERT_CHUNK);
        add_new(bench, (start, *rows, to, size), oldest)?;
        *rows = to;
        let last = bench.scalar("SELECT max(id) AS n FROM outbox")?;
        let upto = last - NEW_ROWS as i64;
        while *sent_to < upto {
            let next = upto.min(*sent_to + MARK_CHUNK as i64);
            bench.exec(&format!(
                "BEGIN; SET LOCAL enable_seqscan = off; \
                 UPDATE outbox SET status = 1, sent_at = now() \
                 WHERE status = 0 AND id > {sent_to} AND id <= {next}; COMMIT"
            ))?;
            *sent_to = next;
        }
    }
    Ok(())
}

/// The walk a floor of 0 makes (a relay's first claim, its floor's recomputation every
/// 30 s): every dead entry of `outbox_pending` not yet vacuumed. Under the claim's plan
/// settings: an index walk, whatever the statistics say. In µs.
fn walk_from_zero(bench: &RelayBench) -> Result<f64, BoxError> {
    bench.exec("BEGIN; SET LOCAL enable_sort = off; SET LOCAL enable_seqscan = off")?;
    let started = Instant::now();
    let walked = bench.scalar("SELECT id AS n FROM outbox WHERE status = 0 ORDER BY id LIMIT 1");
    let walk = started.elapsed().as_secs_f64() * 1e6;
    bench.exec("COMMIT")?;
    walked?;
    Ok(walk)
}

/// The outbox tables' dead tuples, their autovacuums so far, and the partitions.
fn table_state(bench: &RelayBench) -> Result<(i64, i64, i64), BoxError> {
    let dead = bench.scalar(
        "SELECT COALESCE(sum(n_dead_tup), 0)::bigint AS n FROM pg_stat_user_tables \
         WHERE schemaname = current_schema() AND relname LIKE 'outbox%'",
    )?;
    let vacuums = bench.scalar(
        "SELECT COALESCE(sum(autovacuum_count), 0)::bigint AS n FROM pg_stat_user_tables \
         WHERE schemaname = current_schema() AND relname LIKE 'outbox%'",
    )?;
    let parts = bench
        .scalar("SELECT count(*) AS n FROM pg_inherits WHERE inhparent = 'outbox'::regclass")?;
    Ok((dead, vacuums, parts))
}

/// The partitions the retention keeps behind the current one (migrate_partitioned makes
/// the current one and those ahead), made as maintenance makes a partition; the start
/// of the oldest, as SQL.
fn past_partitions(bench: &RelayBench) -> Result<String, BoxError> {
    let oldest = bench.scalar(
        "SELECT ((floor(extract(epoch FROM now()) / interval_secs) \
                 - ceil(retention_secs::numeric / interval_secs)) * interval_secs)::bigint AS n \
         FROM outbox_partitioning",
    )?;
    bench.exec(&format!(
        "DO $$ DECLARE s timestamptz := to_timestamp({oldest}); step interval; n text; \
         BEGIN \
           SELECT make_interval(secs => interval_secs) INTO step FROM outbox_partitioning; \
           WHILE s + step <= now() LOOP \
             n := 'outbox_p' || to_char(s AT TIME ZONE 'UTC', 'YYYYMMDD\"t\"HH24MISS'); \
             EXECUTE format('CREATE TABLE %I (LIKE outbox INCLUDING DEFAULTS)', n); \
             EXECUTE format('CREATE UNIQUE INDEX %I ON %I (id)', n || '_id', n); \
             EXECUTE format('CREATE UNIQUE INDEX %I ON %I (msg_id)', n || '_msg_id', n); \
             EXECUTE format('ALTER TABLE outbox ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', \
                            n, s, s + step); \
             s := s + step; \
           END LOOP; \
         END $$"
    ))?;
    Ok(format!("to_timestamp({oldest})"))
}

/// Rows `from + 1 ..= to` of the step that grows the table from `start` to `size` rows,
/// inserted NEW with the emit's columns (defaults for the rest) and small payloads. Their
/// times rise with their ids from `oldest` to now over the step; the step's last
/// [`NEW_ROWS`] rows are now.
///
/// Without triggers, as [`RelayBench::fill`]: the partitioned layout's msg_id trigger
/// only reads (a probe of each past partition's msg_id index) and takes a transaction
/// lock on the msg_id's hash, and returns the row unchanged when the msg_id is new, which
/// each is here. The rows and every index end up as with it; with it, a chunk would need
/// one lock per row, more than the server's lock table holds.
fn add_new(
    bench: &RelayBench,
    (start, from, to, size): (usize, usize, usize, usize),
    oldest: &str,
) -> Result<(), BoxError> {
    let (span, recent) = ((size - start) as f64, size - NEW_ROWS.min(size));
    bench.exec(&format!(
        "SET session_replication_role = replica; \
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, created_at) \
         SELECT 's-' || g || ':AccountTransferred', 'account.transferred', 'AccountTransferred', \
                'k' || (g % 1000), \
                jsonb_build_object('transfer_id', 's-' || g, 'from', 'alice', 'to', 'bob', 'amount', g), \
                CASE WHEN g > {recent} THEN now() \
                     ELSE now() - (now() - {oldest}) * (({size} - g) / {span}::float8) END \
         FROM generate_series({}, {to}) g; RESET session_replication_role",
        from + 1
    ))
}
