//! SQL text shared by several backends: id lists, the per-key claim's probes, the
//! duplicate lookup of `emit_all`, and what the outcome writes.

use chrono::{DateTime, Utc};
#[cfg(any(feature = "mysql", feature = "sqlite"))]
use diesel::sql_types::Text;

#[cfg(any(feature = "mysql", feature = "sqlite"))]
use super::Dialect;

/// `last_error` is cut to this many characters.
const LAST_ERROR_LEN: usize = 2000;

/// The first of some msg_ids already in the outbox (which one a multi-row insert hit).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) const FIND_ONE: &str = "SELECT msg_id FROM outbox WHERE msg_id IN ({ids}) LIMIT 1";

/// Takes back the rows an `emit_all` inserted before it hit a duplicate: all or nothing.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) const TAKE_BACK: &str = "DELETE FROM outbox WHERE msg_id IN ({ids})";

/// `sql` with its `{ids}` replaced by one `?` per msg_id, each bound as text: the
/// duplicate lookup and take-back of `emit_all` on MySQL and SQLite.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn with_msg_ids<'a, DB>(
    sql: &str,
    msg_ids: &[&'a str],
) -> diesel::query_builder::BoxedSqlQuery<'a, DB, diesel::query_builder::SqlQuery>
where
    DB: diesel::backend::Backend + diesel::sql_types::HasSqlType<Text>,
    &'a str: diesel::serialize::ToSql<Text, DB>,
{
    let sql = sql.replace("{ids}", &vec!["?"; msg_ids.len()].join(", "));
    msg_ids
        .iter()
        .fold(diesel::sql_query(sql).into_boxed::<DB>(), |q, id| {
            q.bind::<Text, _>(*id)
        })
}

pub(crate) fn in_list(ids: &[i64]) -> String {
    let mut s = String::with_capacity(ids.len() * 8);
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&id.to_string());
    }
    s
}

/// The retry delay that ends at `at`, in microseconds (0 if `at` has passed).
///
/// The relay picks `at` on its own clock, but the claim compares `next_retry_at` with the
/// database's: a relay whose clock is off would make retries due early or late by the
/// difference. Both ends of the delay are on the relay's clock, so the store writes the
/// database's clock plus the delay. (The outcome is completed right after it is decided,
/// so `at` minus now is the delay the relay chose, less a few milliseconds.)
pub(crate) fn retry_delay_us(at: DateTime<Utc>) -> i64 {
    (at - Utc::now())
        .num_microseconds()
        .unwrap_or(i64::MAX)
        .max(0)
}

pub(crate) fn truncate(s: &str) -> &str {
    match s.char_indices().nth(LAST_ERROR_LEN) {
        Some((at, _)) => &s[..at],
        None => s,
    }
}

/// The per-key claim's filter on candidate rows: the oldest NEW row of the row's key (its
/// "head", possibly the row itself) is due. A key whose head waits for its retry time
/// thus stays out of the batch altogether, so its later rows do not crowd other keys out
/// of the LIMIT. Not needed for correctness (the probe after the lock decides), only for
/// progress. One index probe per candidate on the NEW rows by `(msg_key, id)`.
/// `same_key` compares keys (see `same_key`). (PostgreSQL's claim walks instead: see
/// `pg::per_key_claim_sql`.)
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn head_is_due(d: &Dialect, table: &str, same_key: fn(&str, &str) -> String) -> String {
    format!(
        "(SELECT h.next_retry_at FROM outbox h WHERE h.status = 0 AND {key} \
         ORDER BY h.id LIMIT 1) <= {now}",
        key = same_key("h.msg_key", &format!("{table}.msg_key")),
        now = d.now
    )
}

/// The per-key probe over the locked set `L` (given as a subquery or an id list): for
/// each key of `L`, the first NEW row of that key outside `L` and below the key's last
/// row in `L`, if any. A row of `L` may be published only below it. This is ARCHITECTURE.md's
/// "no NEW row p outside L with p.key = o.key AND p.id < o.id", asked once per key
/// rather than once per row, so that a key with many rows in the batch costs a walk
/// over its rows instead of a walk per row.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn first_outside_sql(
    keys_of_l: &str,
    ids_of_l: &str,
    same_key: fn(&str, &str) -> String,
) -> String {
    format!(
        "SELECT k.msg_key, (SELECT p.id FROM outbox p WHERE p.status = 0 \
         AND {key} AND p.id < k.last AND p.id NOT IN ({ids_of_l}) \
         ORDER BY p.id LIMIT 1) AS first_out FROM ({keys_of_l}) k",
        key = same_key("p.msg_key", "k.msg_key"),
    )
}

/// Whether `e` says that `table` does not exist, in PostgreSQL's (`relation "t" does not
/// exist`), MySQL's and MariaDB's (`Table 'db.t' doesn't exist`) or SQLite's (`no such
/// table: t`) words.
pub(crate) fn is_missing_table(e: &diesel::result::Error, table: &str) -> bool {
    let diesel::result::Error::DatabaseError(_, info) = e else {
        return false;
    };
    let message = info.message();
    message.contains(table)
        && (message.contains("does not exist")
            || message.contains("doesn't exist")
            || message.contains("no such table"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_error_is_cut_on_a_char_boundary() {
        let long = "é".repeat(LAST_ERROR_LEN + 10);
        assert_eq!(truncate(&long).chars().count(), LAST_ERROR_LEN);
        assert_eq!(truncate("short"), "short");
    }
}
