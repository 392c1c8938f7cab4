//! How the outbox is doing: the backlog, the messages per topic, publishing per minute.

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Double, Nullable, SmallInt, Text};
use outbox_core::{Backlog, Status};

use crate::backend::Database as _;
use crate::{OutboxConnection, Result};

/// Backlog statistics: due NEW rows, the age of the oldest of them, DEAD rows. Both
/// counts are served by indexes holding only NEW (DEAD) rows.
pub fn backlog<C: OutboxConnection>(conn: &mut C) -> Result<Backlog> {
    let row: BacklogRow = conn.db().load_one(C::Db::DIALECT.backlog)?;
    Ok(Backlog {
        due: u64::try_from(row.due).unwrap_or(0),
        oldest_due_age: row
            .oldest_us
            .map(|us| std::time::Duration::from_micros(u64::try_from(us).unwrap_or(0))),
        dead: u64::try_from(row.dead).unwrap_or(0),
    })
}

/// A row of [`Dialect::backlog`](crate::backend::Dialect::backlog).
#[derive(QueryableByName)]
struct BacklogRow {
    #[diesel(sql_type = BigInt)]
    due: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    oldest_us: Option<i64>,
    #[diesel(sql_type = BigInt)]
    dead: i64,
}

/// One topic's NEW and DEAD messages, as [`topic_counts`] returns them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TopicCounts {
    /// The topic.
    pub topic: String,
    /// NEW messages (due or waiting for a retry).
    pub new: u64,
    /// DEAD messages.
    pub dead: u64,
}

/// NEW and DEAD messages per topic, in topic order (one `GROUP BY`; topics with only SENT
/// messages are left out, and SENT rows are not counted: that would read the whole table).
pub fn topic_counts<C: OutboxConnection>(conn: &mut C) -> Result<Vec<TopicCounts>> {
    // SENT rows are left out: counting them would read the whole table, where the
    // partial indexes hold only NEW and DEAD rows.
    const SQL: &str = "SELECT topic, status, COUNT(*) AS n FROM outbox \
         WHERE status IN (0, 2) GROUP BY topic, status ORDER BY topic";
    let mut counts: Vec<TopicCounts> = Vec::new();
    for row in conn.db().load::<TopicRow>(SQL, None)? {
        if counts.last().is_none_or(|c| c.topic != row.topic) {
            counts.push(TopicCounts {
                topic: row.topic.clone(),
                ..TopicCounts::default()
            });
        }
        let n = u64::try_from(row.n).unwrap_or(0);
        if let Some(c) = counts.last_mut() {
            if row.status == Status::Dead.as_i16() {
                c.dead += n;
            } else {
                c.new += n;
            }
        }
    }
    Ok(counts)
}

/// One minute of publishing, as [`published_per_minute`] returns it.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct PublishedMinute {
    /// How many minutes ago it began, by the database clock (0: the current minute).
    pub minutes_ago: u32,
    /// Messages published (marked SENT) in it.
    pub published: u64,
    /// Their mean commit→publish latency (`sent_at - created_at`) in seconds; `None`
    /// when none was published. Negative only if the clocks that stamped the two
    /// columns disagree.
    pub avg_latency_seconds: Option<f64>,
}

/// Messages published in each of the last `minutes` minutes, oldest first, empty minutes
/// included (so the result has `minutes` entries). Reads the SENT rows of that window
/// (one `GROUP BY` over `sent_at`), so its cost grows with the publish rate, not with
/// the table; SENT rows already purged are not counted.
///
/// ```no_run
/// use diesel::Connection as _;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let mut conn = diesel::PgConnection::establish("postgres://localhost/app")?;
/// for m in outbox_diesel::published_per_minute(&mut conn, 15)? {
///     println!("{} min ago: {} published", m.minutes_ago, m.published);
/// }
/// # Ok(())
/// # }
/// ```
pub fn published_per_minute<C: OutboxConnection>(
    conn: &mut C,
    minutes: u32,
) -> Result<Vec<PublishedMinute>> {
    let sql = (C::Db::DIALECT.published_minutes)(minutes);
    let rows: Vec<MinuteRow> = conn.db().load(&sql, None)?;
    Ok((0..minutes)
        .rev()
        .map(|ago| {
            let row = rows.iter().find(|r| r.minutes_ago == i64::from(ago));
            PublishedMinute {
                minutes_ago: ago,
                published: row.map_or(0, |r| u64::try_from(r.n).unwrap_or_default()),
                avg_latency_seconds: row.and_then(|r| r.latency),
            }
        })
        .collect())
}

/// One (topic, status) group of [`topic_counts`].
#[derive(QueryableByName)]
struct TopicRow {
    #[diesel(sql_type = Text)]
    topic: String,
    #[diesel(sql_type = SmallInt)]
    status: i16,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// One minute of [`Dialect::published_minutes`](crate::backend::Dialect::published_minutes).
#[derive(QueryableByName)]
struct MinuteRow {
    #[diesel(sql_type = BigInt)]
    minutes_ago: i64,
    #[diesel(sql_type = BigInt)]
    n: i64,
    #[diesel(sql_type = Nullable<Double>)]
    latency: Option<f64>,
}
