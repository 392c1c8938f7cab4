//! The relayed watermark: an id such that every NEW row up to it was published (but the
//! parked and DEAD ones). Partition retention and the switch back to polling trust it,
//! and the recovery of a lost slot backfills from it.
//!
//! Ids are not in commit order, so the highest id published proves nothing. The
//! watermark moves in three steps, one per report: (1) note `X`, the highest id
//! committed now, and `T`, the time; every row with an id up to `X` committed before
//! `T`, or belongs to a transaction open at `T` (ids come from a sequence, so a
//! transaction that starts later draws higher ones). (2) Once no transaction that began
//! before `T` is open (`pg_stat_activity.xact_start`, prepared transactions included),
//! all of them have ended: note `L`, the WAL insert position now, past all their
//! commits. (3) Once the relay has confirmed `L` (everything it read up to there was
//! published, parked or dead), `X` is the watermark.
//!
//! The relay's role must see other roles' transactions (`pg_read_all_stats`, or
//! superuser): a session whose start it cannot see holds the watermark back.

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Bool, Text, Timestamptz};
use diesel::{PgConnection, QueryableByName, RunQueryDsl as _};
use pgwire_replication::Lsn;

use crate::Result;

/// Where the watermark's steps stand.
#[derive(Debug, Default)]
pub(crate) enum Watermark {
    /// Step 1 next.
    #[default]
    Idle,
    /// Waiting for the transactions open at `at` to end.
    Noted { id: i64, at: DateTime<Utc> },
    /// Waiting for the relay to confirm `lsn`.
    Ended { id: i64, lsn: Lsn },
}

impl Watermark {
    /// Takes the next step that is due, given the relay's confirmed position; the new
    /// watermark when step 3 completes.
    pub(crate) fn advance(&mut self, c: &mut PgConnection, confirmed: Lsn) -> Result<Option<i64>> {
        match *self {
            Self::Idle => {
                #[derive(QueryableByName)]
                struct Row {
                    #[diesel(sql_type = BigInt)]
                    id: i64,
                    #[diesel(sql_type = Timestamptz)]
                    at: DateTime<Utc>,
                }
                let r: Row = diesel::sql_query(
                    "SELECT (SELECT coalesce(max(id), 0) FROM outbox) AS id, clock_timestamp() AS at",
                )
                .get_result(c)?;
                *self = Self::Noted { id: r.id, at: r.at };
                Ok(None)
            }
            Self::Noted { id, at } => {
                #[derive(QueryableByName)]
                struct Row {
                    #[diesel(sql_type = Bool)]
                    ended: bool,
                    #[diesel(sql_type = Text)]
                    lsn: String,
                }
                let r: Row = diesel::sql_query(
                    "SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity \
                       WHERE datname = current_database() AND pid <> pg_backend_pid() \
                       AND backend_type = 'client backend' \
                       AND coalesce(xact_start, '-infinity') <= $1 \
                       AND (xact_start IS NOT NULL OR state IS NULL)) \
                     AND NOT EXISTS (SELECT 1 FROM pg_prepared_xacts \
                       WHERE database = current_database() AND prepared <= $1) AS ended, \
                     pg_current_wal_insert_lsn()::text AS lsn",
                )
                .bind::<Timestamptz, _>(at)
                .get_result(c)?;
                if r.ended
                    && let Ok(lsn) = Lsn::parse(&r.lsn)
                {
                    *self = Self::Ended { id, lsn };
                }
                Ok(None)
            }
            Self::Ended { id, lsn } => {
                if confirmed < lsn {
                    return Ok(None);
                }
                *self = Self::Idle;
                Ok(Some(id))
            }
        }
    }
}
