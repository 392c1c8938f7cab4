//! The messages the relay failed to publish and will try again.

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Integer, Nullable};

use crate::backend::Database as _;
use crate::{OutboxConnection, Result};

/// The NEW messages that failed to publish at least once, as [`retrying`] returns them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Retrying {
    /// How many there are.
    pub messages: u64,
    /// How many keys they hold back: under [`ClaimOrder::PerKey`](crate::ClaimOrder)
    /// each waits for its retry with every later message of its key behind it.
    pub keys: u64,
    /// The most failed attempts of one of them (0 when there is none).
    pub most_retries: u32,
}

/// The NEW messages waiting for a retry: how many, over how many keys, and the most
/// attempts among them. A number that grows says the broker refuses some messages (or a
/// topic) while the backlog of [`backlog`](crate::backlog) may still look small. One
/// statement over the NEW rows that failed (on PostgreSQL a partial index holds exactly
/// those).
pub fn retrying<C: OutboxConnection>(conn: &mut C) -> Result<Retrying> {
    // The same text on every database.
    const SQL: &str = "SELECT COUNT(*) AS messages, COUNT(DISTINCT msg_key) AS n_keys, \
        MAX(retries) AS most_retries FROM outbox WHERE status = 0 AND retries > 0";
    let row: RetryingRow = conn.db().load_one(SQL)?;
    Ok(Retrying {
        messages: u64::try_from(row.messages).unwrap_or(0),
        keys: u64::try_from(row.n_keys).unwrap_or(0),
        most_retries: row
            .most_retries
            .map_or(0, |n| u32::try_from(n).unwrap_or(0)),
    })
}

#[derive(QueryableByName)]
struct RetryingRow {
    #[diesel(sql_type = BigInt)]
    messages: i64,
    #[diesel(sql_type = BigInt)]
    n_keys: i64,
    #[diesel(sql_type = Nullable<Integer>)]
    most_retries: Option<i32>,
}
