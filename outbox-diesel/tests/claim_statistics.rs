//! The PostgreSQL claim on a table whose statistics are missing or stale (autovacuum
//! off, as on this project's machines; a fresh deploy hit by a burst; a burst after a
//! quiet period): the claim, run as a relay runs it, stays on its index walks and sorts
//! nothing, and the relay store analyzes such a table itself.

mod fixtures;

use diesel::PgConnection;
use diesel::connection::{Connection, TransactionManager as _};
use fixtures::{Backend, Pg, exec, pg_plan, runtime};
use outbox_core::{ClaimedBatch as _, RelayStore};
use outbox_diesel::{ClaimOrder, DEFAULT_STALL_TIMEOUT};
use outbox_tests::wait::wait_until;

/// Rows `from..=to` over 1,000 keys, NEW (`status` 0) or SENT (1).
fn rows(from: u32, to: u32, status: i16) -> String {
    format!(
        "INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, status, sent_at)
         SELECT 'k' || (g % 1000) || '-' || g || ':E', 't', 'E', 'k' || (g % 1000),
                jsonb_build_object('n', g, 'pad', repeat('x', 100)), {status},
                CASE WHEN {status} = 1 THEN now() END
         FROM generate_series({from}, {to}) g;"
    )
}

/// The plan of `sql` in a claim's transaction, opened as the relay store opens it.
fn claim_plan(c: &mut PgConnection, sql: &str) -> String {
    outbox_diesel::__private::begin_claim(c, DEFAULT_STALL_TIMEOUT).unwrap();
    let plan = pg_plan(c, sql).join("\n");
    <PgConnection as Connection>::TransactionManager::rollback_transaction(c).unwrap();
    println!("{plan}");
    plan
}

/// Both claims walk their indexes in order and sort nothing: not the backlog (which a
/// planner that believes the backlog small reads with a bitmap scan and sorts), and
/// not the kept rows either (the store orders them).
fn assert_claims_walk_their_indexes(c: &mut PgConnection, state: &str) {
    let per_key = claim_plan(
        c,
        &outbox_diesel::__private::claim_per_key_sql::<PgConnection>(500),
    );
    assert!(
        per_key.contains("Index Scan using outbox_pending on outbox o"),
        "{state}: the lock step walks outbox_pending in id order:\n{per_key}"
    );
    assert!(
        per_key.contains("Index Scan using outbox_retrying on outbox"),
        "{state}: the keys waiting for a retry come from outbox_retrying:\n{per_key}"
    );
    assert!(
        !per_key.contains("Sort"),
        "{state}: the per-key claim sorts:\n{per_key}"
    );
    let unordered = claim_plan(c, &outbox_diesel::__private::claim_sql::<PgConnection>(500));
    assert!(
        unordered.contains("Index Scan using outbox_pending on outbox"),
        "{state}: the unordered claim walks outbox_pending in id order:\n{unordered}"
    );
    assert!(
        !unordered.contains("Sort"),
        "{state}: the unordered claim sorts:\n{unordered}"
    );
}

/// Reports this session's counts of changed rows to the cumulative statistics now (at
/// the end of this statement) instead of up to 10 s later: so that an `ANALYZE` after
/// it does not see them arrive afterwards as changes since.
fn flush_stats(c: &mut PgConnection) {
    exec(c, "SELECT pg_stat_force_next_flush();");
}

/// `ANALYZE outbox`, its changed rows reported first.
fn analyze(c: &mut PgConnection) {
    flush_stats(c);
    exec(c, "ANALYZE outbox;");
}

fn reltuples(c: &mut PgConnection) -> i64 {
    Pg::scalar(
        c,
        "SELECT reltuples::bigint AS n FROM pg_class WHERE oid = 'outbox'::regclass",
    )
}

fn changed_since_analyze(c: &mut PgConnection) -> i64 {
    Pg::scalar(
        c,
        "SELECT pg_stat_get_mod_since_analyze('outbox'::regclass) AS n",
    )
}

#[test]
fn claims_on_a_never_analyzed_table_walk_their_indexes() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    exec(&mut c, &rows(1, 20_000, 0));
    assert_eq!(reltuples(&mut c), -1, "the table has no statistics");
    assert_claims_walk_their_indexes(&mut c, "never analyzed");
}

#[test]
fn claims_on_statistics_taken_before_a_burst_walk_their_indexes() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    exec(&mut c, &rows(1, 20_000, 1));
    analyze(&mut c);
    exec(&mut c, &rows(20_001, 40_000, 0));
    assert_claims_walk_their_indexes(&mut c, "analyzed while all rows were SENT");
}

#[test]
fn claims_on_fresh_statistics_walk_their_indexes() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    exec(&mut c, &rows(1, 20_000, 0));
    analyze(&mut c);
    assert_claims_walk_their_indexes(&mut c, "freshly analyzed");
}

#[test]
fn the_store_analyzes_a_large_table_that_was_never_analyzed() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    exec(&mut c, &rows(1, 20_000, 0));
    assert_eq!(reltuples(&mut c), -1, "the table has no statistics");
    let store = Pg::store(&db).with_order(ClaimOrder::PerKey);
    runtime().block_on(async { drop(store.claim(10).await.unwrap()) });
    let n = reltuples(&mut c);
    assert!(
        n >= 19_000,
        "the first claim analyzed the table: reltuples {n}"
    );
}

#[test]
fn the_store_analyzes_a_table_outgrown_by_a_burst_since_its_last_analyze() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    exec(&mut c, &rows(1, 20_000, 1));
    analyze(&mut c);
    exec(&mut c, &rows(20_001, 50_000, 0));
    flush_stats(&mut c);
    let mut watch = Pg::connect(&db);
    wait_until(
        "the burst counted as changed since the last analyze",
        || changed_since_analyze(&mut watch) >= 30_000,
    );
    let store = Pg::store(&db);
    runtime().block_on(async { drop(store.claim(10).await.unwrap()) });
    let n = reltuples(&mut c);
    assert!(
        n >= 45_000,
        "the first claim analyzed the table: reltuples {n}"
    );
    assert!(changed_since_analyze(&mut c) < 30_000);
}

#[test]
fn the_store_leaves_fresh_statistics_alone() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    exec(&mut c, &rows(1, 20_000, 0));
    analyze(&mut c);
    exec(&mut c, &rows(20_001, 25_000, 0));
    flush_stats(&mut c);
    let mut watch = Pg::connect(&db);
    wait_until(
        "the new rows counted as changed since the last analyze",
        || changed_since_analyze(&mut watch) >= 5_000,
    );
    let store = Pg::store(&db);
    runtime().block_on(async { drop(store.claim(10).await.unwrap()) });
    assert_eq!(
        reltuples(&mut c),
        20_000,
        "no ANALYZE: 5,000 changes of 20,000"
    );
}

/// A lock that `ANALYZE` would wait for (here held by another session as a long `VACUUM`
/// would hold it) must not hold the relay's claim up: the analyze gives up at once and
/// the claim returns its rows.
#[test]
fn a_locked_table_does_not_hold_the_claim_up_for_its_analyze() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    exec(&mut c, &rows(1, 20_000, 0));
    assert_eq!(reltuples(&mut c), -1, "the table has no statistics");
    let mut vacuum = Pg::connect(&db);
    exec(
        &mut vacuum,
        "BEGIN; LOCK TABLE outbox IN SHARE UPDATE EXCLUSIVE MODE;",
    );
    let store = Pg::store(&db);
    let claimed = runtime().block_on(async {
        tokio::time::timeout(std::time::Duration::from_secs(10), store.claim(10))
            .await
            .expect("the claim waited for the lock with its ANALYZE")
            .unwrap()
    });
    assert_eq!(claimed.messages().len(), 10);
    drop(claimed);
    assert_eq!(reltuples(&mut c), -1, "the analyze gave up");
    exec(&mut vacuum, "ROLLBACK;");
}

/// After a Redis outage every key in flight waits for a retry. The lock step must not
/// compare each candidate row with every waiting key: 500 keys waiting, each with rows
/// behind its waiting one, took 241 ms per claim that way (a nested loop over `r`)
/// instead of 8 ms with an index probe. Statistics taken while far more keys waited
/// (here 60,000, since SENT) must not bring the per-candidate reading of `r` back.
#[test]
fn many_keys_waiting_for_a_retry_are_probed_not_scanned() {
    let db = Pg::create();
    let mut c = Pg::connect(&db);
    exec(
        &mut c,
        "INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, retries, next_retry_at)
         SELECT 'old' || k || ':E', 't', 'E', 'old' || k, '{}', 3, now() + interval '1 hour'
         FROM generate_series(1, 60000) k;
         ANALYZE outbox;
         UPDATE outbox SET status = 1, sent_at = now();
         INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, retries, next_retry_at)
         SELECT 'r' || k || '-' || i || ':E', 't', 'E', 'r' || k, '{}', (i = 0)::int * 3,
                CASE WHEN i = 0 THEN now() + interval '1 hour' ELSE now() END
         FROM generate_series(0, 10) i, generate_series(1, 500) k ORDER BY i, k;",
    );
    exec(&mut c, &rows(1, 2000, 0));
    let plan = claim_plan(
        &mut c,
        &outbox_diesel::__private::claim_per_key_sql::<PgConnection>(500),
    );
    let compared: u64 = plan
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Rows Removed by Join Filter: "))
        .map(|n| n.parse::<u64>().unwrap())
        .sum();
    assert!(
        compared < 100_000,
        "{compared} candidate/key comparisons in one claim:\n{plan}"
    );
    // `r` is read once, not once per candidate (a subplan that is not hashed).
    for line in plan.lines().filter(|l| l.contains("CTE Scan on r")) {
        assert!(line.contains("loops=1)"), "{line}\n{plan}");
    }
    assert!(
        plan.contains("on outbox w_1"),
        "the waiting rows are probed on the table's indexes:\n{plan}"
    );
}
