//! The relay's claim: its transaction's settings, the per-key and unordered claims,
//! the SENT mark.

use std::time::Duration;

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::result::QueryResult;
use diesel::sql_types::{Array, BigInt};
use diesel::{PgConnection, RunQueryDsl};
use outbox_core::StoredMessage;

use crate::Result;
use crate::backend::{Floor, PgMessageRow};

/// The claim's `BEGIN`, in one round trip: READ COMMITTED whatever the database's
/// default (under REPEATABLE READ, locking a row that another relay has marked SENT
/// since the claim's snapshot is a serialization failure, not a skip), a commit that
/// does not wait for its WAL flush ([`COMMIT_SETTINGS`]), planner settings that keep
/// the claim's plan off the table's statistics ([`PLAN_SETTINGS`]), and, unless `stall`
/// is zero, bounds for a relay that stalls while it holds the batch (see
/// `PgRelayStore`). All `SET LOCAL`, so they end with the transaction.
pub(super) fn begin_claim_sql(stall: Duration) -> String {
    const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";
    if stall.is_zero() {
        return format!("{BEGIN}; {COMMIT_SETTINGS}; {PLAN_SETTINGS}");
    }
    // Milliseconds, at least 1 (0 would disable the timeouts), at most PostgreSQL's limit.
    let ms = stall.as_millis().clamp(1, i32::MAX as u128);
    format!(
        "{BEGIN}; {COMMIT_SETTINGS}; {PLAN_SETTINGS}; \
         SET LOCAL idle_in_transaction_session_timeout = {ms}; SET LOCAL lock_timeout = {ms}"
    )
}

/// The claim's commit setting, for its transaction only: `synchronous_commit = off`.
///
/// A claim's transaction only records what the relay did with rows that are already
/// durable (SENT, a retry): it writes no message. Should the server crash, or fail over
/// to a standby, before such a commit reached the disk or the standby, the rows are
/// back as they were: a row SENT is published once more (a duplicate on the stream,
/// which the consumers' deduplication absorbs, as after a relay killed between its XADD
/// and its commit); a retry comes early and counts one attempt fewer. WAL is replayed
/// (and streamed) in order, so a later batch's marks never survive an earlier one's.
/// Marking a row DEAD is the exception: it frees the row's key for the next message, so
/// a batch with dead letters commits durably ([`DIALECT`]'s `durable_dead`). What it
/// saves is the flush on the relay's path: a relay woken by a steady stream of emits
/// would otherwise spend most of its time waiting for its previous batch's commit
/// (BENCHMARKS.md, "Figures behind the API's defaults"). Emits and the consumers' deduplication
/// are the users' own transactions, untouched: their commits stay as durable as the
/// server is set up to make them.
pub(crate) const COMMIT_SETTINGS: &str = "SET LOCAL synchronous_commit = off";

/// The claim's planner settings, for its transaction only.
///
/// A claim is a walk of `outbox_pending` in id order that stops after `LIMIT` rows. The
/// planner picks that walk only while it knows the backlog is large: on a table without
/// statistics (never analyzed: autovacuum off, or a fresh table in its first minute) it
/// guesses a few hundred NEW rows and reads them all with a bitmap scan, then sorts them,
/// a cost that grows with the backlog (BENCHMARKS.md, "Claim plans"). No claim needs a sort: every ordered step is an index
/// walk (`l` and the unordered claim on `outbox_pending`, `r` on `outbox_retrying`) and
/// the relay orders the final rows itself. So `enable_sort = off` leaves the planner
/// only the walks, whatever it believes about the row counts; the settings that would
/// name the walk instead (`enable_bitmapscan`, `enable_hashjoin`) leave a sort after a
/// hash anti join over `r`.
///
/// `enable_nestloop = off`: the one join left, the per-key claim's last step (a row of
/// `l` against the keys of `b`), is then a hash anti join. On statistics that promise
/// few rows the planner would pick a nested loop comparing every row of `l` with every
/// row of `b` (BENCHMARKS.md, "Claim plans").
///
/// `enable_seqscan = off`: the statements that record the batch (SENT by
/// `id = ANY(..)`, a retry, DEAD) find their rows by primary key. `MarkSent` is a
/// prepared statement, whose generic plan PostgreSQL keeps until the table's statistics
/// change: planned while the table is empty (a fresh table, before autovacuum's first
/// analyze), it is a sequential scan, and stays one as the table grows (BENCHMARKS.md,
/// "Claim plans"). The mark of a batch sent in
/// full ([`mark_sent_and_commit_sql`]) is planned for each batch, on whatever the
/// statistics say then: an empty table's as well.
///
/// `jit = off`: a claim is a short walk, which JIT compilation never pays back; and
/// should a sort ever be unavoidable, its disabled cost (10^10) would pass
/// `jit_above_cost` and compile the plan (BENCHMARKS.md, "Claim plans").
pub(crate) const PLAN_SETTINGS: &str = "SET LOCAL enable_sort = off; SET LOCAL jit = off; \
     SET LOCAL enable_nestloop = off; SET LOCAL enable_seqscan = off";

/// The per-key claim (ARCHITECTURE.md, "Order per key") in one statement, with walks instead of a
/// probe per row:
///
/// - `r`: the keys whose NEW rows wait for a retry, with the first waiting id of each,
///   from the small `outbox_retrying` index (NEW rows that failed before). The lock step
///   skips a key's rows after its waiting one, so that they do not crowd other keys out
///   of the LIMIT (progress only: the next step decides order);
/// - `l`: the due NEW rows in id order, `LIMIT n FOR UPDATE SKIP LOCKED`; while any key
///   waits (`r` is not empty, looked at once per claim), each candidate is probed on
///   `outbox_retrying` for a waiting row of its key before it. (The planner turns an
///   anti join over `r` into a nested loop comparing every candidate with every row of
///   `r`, slow when many keys wait for a retry, as after a Redis outage; a hashed `NOT
///   IN (SELECT msg_key FROM r)` in front of the probe falls back to re-reading `r` per
///   candidate when the statistics promise a large `r`. BENCHMARKS.md, "Claim plans".)
/// - `b`: the NEW rows below `l`'s last id that `l` does not hold (held by another relay,
///   or waiting for a retry), with the first id of each key: one walk of the range the
///   lock step walked, on `outbox_pending`;
/// - `k`, with a floor: the keys of `l` with a NEW row in the floor's watch window, below
///   it ([`Floor`]): a row the floor passed may still appear there (an insert stalled
///   between its id and its transaction id, ids moved back by a few), until the floor's
///   next step comes down to it. One walk of `outbox_pending_key` per key of `l`, over
///   the window only: below it lie the dead entries the floor is there to skip;
/// - a row of `l` goes out only if no row of `b` with its key comes before it, and its
///   key is not in `k`.
///
/// The two walks cost less than a head probe per candidate and a gap probe per key
/// (BENCHMARKS.md, "Claim plans").
///
/// The plan must not depend on the table's statistics (see [`PLAN_SETTINGS`], under
/// which the claim runs): `r` is a `DISTINCT ON` in `(msg_key, id)` order, which only an
/// index on `(msg_key, id)` gives without a sort, and `outbox_retrying` is the smallest
/// one and needs no filter on `retries`. (As `GROUP BY msg_key`, on statistics taken
/// while every row is SENT, the planner walks the whole backlog on `outbox_pending`
/// instead; BENCHMARKS.md, "Claim plans".) The statement has no final
/// `ORDER BY`: the relay sorts the kept rows by id ([`claim_per_key`]), which leaves no
/// sort in the plan.
///
/// A claim ahead leaves the rows of the batch in hand (`held`) out of `b` too: the
/// relay publishes them first. (A constant list: PostgreSQL hashes it.)
pub(super) fn per_key_claim_sql(limit: usize, held: &[i64], floor: Floor) -> String {
    let (k, not_k) = watched_keys(floor);
    let not_held = if held.is_empty() {
        String::new()
    } else {
        format!(" AND p.id NOT IN ({})", crate::backend::in_list(held))
    };
    format!(
        "WITH r AS MATERIALIZED (SELECT DISTINCT ON (w.msg_key) w.msg_key, w.id AS first_wait \
           FROM outbox w WHERE w.status = 0 AND w.retries > 0 AND w.next_retry_at > now() \
           ORDER BY w.msg_key, w.id), \
         l AS MATERIALIZED (SELECT {columns} FROM outbox o \
           WHERE status = 0 AND next_retry_at <= now(){from_o} \
           AND (NOT EXISTS (SELECT FROM r) OR NOT EXISTS (SELECT 1 FROM outbox w \
             WHERE w.status = 0 AND w.retries > 0 AND w.msg_key = o.msg_key AND w.id < o.id \
             AND w.next_retry_at > now() OFFSET 0)) \
           ORDER BY id LIMIT {limit} FOR UPDATE SKIP LOCKED), \
         b AS MATERIALIZED (SELECT p.msg_key, min(p.id) AS first_out FROM outbox p \
           WHERE p.status = 0 AND p.id < (SELECT max(id) FROM l){from_p} \
           AND p.id NOT IN (SELECT id FROM l){not_held} GROUP BY p.msg_key){k} \
         SELECT l.* FROM l WHERE NOT EXISTS \
           (SELECT 1 FROM b WHERE b.msg_key = l.msg_key AND b.first_out < l.id){not_k}",
        columns = PgMessageRow::COLUMNS,
        from_o = from_floor(floor.at, "o"),
        from_p = from_floor(floor.at, "p"),
    )
}

/// `k` and the filter on it (see [`per_key_claim_sql`]); nothing without a window. As
/// `msg_key = ANY(..)` in `(msg_key, id)` order (which only `outbox_pending_key` gives
/// without a sort), one descent per key: a probe per row of `l` is planned on
/// `outbox_pending` instead, which walks every entry of the window.
fn watched_keys(floor: Floor) -> (String, &'static str) {
    if floor.watch >= floor.at {
        return (String::new(), "");
    }
    let k = format!(
        ", k AS MATERIALIZED (SELECT DISTINCT ON (q.msg_key) q.msg_key FROM outbox q \
         WHERE q.status = 0 AND q.msg_key = ANY(ARRAY(SELECT msg_key FROM l)) \
         AND q.id >= {} AND q.id < {} ORDER BY q.msg_key, q.id)",
        floor.watch, floor.at
    );
    (k, " AND l.msg_key NOT IN (SELECT msg_key FROM k)")
}

/// ` AND t.id >= floor`: the claim's walk starts at the floor (`ClaimFloor`), past the
/// dead index entries below it; nothing for 0.
fn from_floor(floor: i64, table: &str) -> String {
    if floor > 0 {
        format!(" AND {table}.id >= {floor}")
    } else {
        String::new()
    }
}

/// Runs [`per_key_claim_sql`] and puts the kept rows in id order.
pub(super) fn claim_per_key(
    conn: &mut PgConnection,
    limit: usize,
    held: &[i64],
    floor: Floor,
) -> Result<Vec<StoredMessage>> {
    let mut rows: Vec<PgMessageRow> =
        diesel::sql_query(per_key_claim_sql(limit, held, floor)).load(conn)?;
    rows.sort_unstable_by_key(PgMessageRow::id);
    crate::backend::claimed(conn, rows)
}

/// The unordered claim: due NEW rows in id order, `LIMIT n FOR UPDATE SKIP LOCKED`, as
/// [`PgMessageRow`]s (the relay's columns only, `created_at` as PostgreSQL's binary
/// timestamp).
///
/// `held`: a claim ahead leaves the rows of the batch in hand out by id (`o.id <>
/// ALL($1)`, the ids bound as one array, which the planner hashes) before it tries their
/// locks. They are locked by that batch's transaction, so `SKIP LOCKED` would skip them
/// anyway, but only after a heap fetch and two lock-manager calls each (the tuple lock,
/// then the holder's transaction lock): the claim ahead walks past all of them, since
/// the batch in hand is the front of the backlog. The filter leaves out exactly those
/// rows and no other, so a row below them that is due (a retry) is still claimed.
pub(super) fn claim_sql(limit: usize, held: bool, floor: i64) -> String {
    format!(
        "SELECT {} FROM outbox o WHERE o.status = 0 AND o.next_retry_at <= now(){}{} \
         ORDER BY o.id LIMIT {limit} FOR UPDATE SKIP LOCKED",
        PgMessageRow::COLUMNS,
        from_floor(floor, "o"),
        if held { " AND o.id <> ALL($1)" } else { "" },
    )
}

/// Runs [`claim_sql`].
pub(super) fn claim(
    conn: &mut PgConnection,
    limit: usize,
    held: &[i64],
    floor: i64,
) -> Result<Vec<StoredMessage>> {
    let query = diesel::sql_query(claim_sql(limit, !held.is_empty(), floor));
    let rows: Vec<PgMessageRow> = if held.is_empty() {
        query.load(conn)?
    } else {
        query.bind::<Array<BigInt>, _>(held).load(conn)?
    };
    crate::backend::claimed(conn, rows)
}

/// `UPDATE outbox SET status = 1, sent_at = now() WHERE status = 0 AND id = ANY($1)`:
/// a batch's rows marked SENT, the ids bound as one array, so that the text is the same
/// for every batch and the statement is prepared once per connection (static query id).
/// Against an `IN (..)` list of 500 literals the server neither parses nor plans the
/// list for each batch. Now only for a batch that also records retries or dead letters:
/// one sent in full, the usual batch, goes with its COMMIT in one string
/// ([`mark_sent_and_commit_sql`]), parsed and planned each time.
pub(super) struct MarkSent<'a> {
    pub(super) ids: &'a [i64],
}

impl QueryId for MarkSent<'_> {
    type QueryId = MarkSent<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

/// The SENT mark up to its array of ids, for [`MarkSent`] and
/// [`mark_sent_and_commit_sql`].
pub(super) const MARK_SENT_HEAD: &str =
    "UPDATE outbox SET status = 1, sent_at = now() WHERE status = 0 AND id = ANY(";

impl QueryFragment<Pg> for MarkSent<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(MARK_SENT_HEAD);
        out.push_bind_param::<Array<BigInt>, [i64]>(self.ids)?;
        out.push_sql(")");
        Ok(())
    }
}

impl<Conn> RunQueryDsl<Conn> for MarkSent<'_> {}

/// [`MarkSent`] for `ids` and a `COMMIT`, as one string; the ids, integers, as one
/// array literal.
pub(super) fn mark_sent_and_commit_sql(ids: &[i64]) -> String {
    if ids.is_empty() {
        return "COMMIT".into();
    }
    let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
    format!("{MARK_SENT_HEAD}'{{{}}}'::int8[]); COMMIT", ids.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_sent_in_full_is_marked_and_committed_by_one_string() {
        assert_eq!(
            mark_sent_and_commit_sql(&[7, 12]),
            "UPDATE outbox SET status = 1, sent_at = now() WHERE status = 0 \
             AND id = ANY('{7,12}'::int8[]); COMMIT"
        );
        assert_eq!(mark_sent_and_commit_sql(&[]), "COMMIT");
    }

    #[test]
    fn the_claims_start_at_the_floor() {
        assert!(claim_sql(100, false, 42).contains("now() AND o.id >= 42 ORDER BY"));
        let floor = |watch, at| Floor { at, watch };
        let per_key = per_key_claim_sql(100, &[], floor(42, 42));
        assert!(per_key.contains("o.id >= 42"), "{per_key}");
        assert!(per_key.contains("FROM l) AND p.id >= 42"), "{per_key}");
        assert!(!per_key.contains(" k AS"), "{per_key}");
        let watching = per_key_claim_sql(100, &[], floor(30, 42));
        assert!(watching.contains("q.id >= 30 AND q.id < 42"), "{watching}");
        assert!(
            watching.ends_with("NOT IN (SELECT msg_key FROM k)"),
            "{watching}"
        );
        assert!(!claim_sql(100, false, 0).contains(">="));
        assert!(!per_key_claim_sql(100, &[], Floor::default()).contains("id >="));
    }

    #[test]
    fn the_claim_begins_read_committed_with_its_stall_bounds() {
        assert_eq!(
            begin_claim_sql(Duration::ZERO),
            format!("BEGIN ISOLATION LEVEL READ COMMITTED; {COMMIT_SETTINGS}; {PLAN_SETTINGS}")
        );
        let sql = begin_claim_sql(Duration::from_secs(30));
        assert!(
            sql.starts_with("BEGIN ISOLATION LEVEL READ COMMITTED; "),
            "{sql}"
        );
        assert!(
            sql.contains("SET LOCAL idle_in_transaction_session_timeout = 30000;"),
            "{sql}"
        );
        assert!(sql.ends_with("SET LOCAL lock_timeout = 30000"), "{sql}");
        // Never 0 (which disables the timeouts), never past PostgreSQL's limit.
        assert!(begin_claim_sql(Duration::from_micros(1)).contains("timeout = 1;"));
        assert!(begin_claim_sql(Duration::MAX).contains(&format!("= {};", i32::MAX)));
    }
}
