//! The session's database work beside the stream: the retry poll, the report, partition
//! upkeep and the holder check run on the pool's blocking threads while the session
//! goes on publishing the commits that stream in, and are handled when they land.
//!
//! Run in line, each held the stream back for its round trips to the database: on a
//! loaded server, the retry poll (three statements and their connection check-outs,
//! every `retry_poll`) stalled the stream by 100 ms and more once a second, which set
//! the commit → XADD p99 at 1,000 commits/s (300 ms, against 12 ms for the polling
//! relay; see BENCHMARKS.md).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use diesel::sql_types::{Bool, Integer, Text};
use diesel::{PgConnection, QueryableByName, RunQueryDsl as _};
use outbox_diesel::PgMessageRow;
use tokio::task::{JoinError, JoinSet};

use crate::Result;
use crate::watermark::Watermark;

/// A chore's result.
pub(crate) enum Landed {
    /// The retry poll: the parked messages due (first of their keys) and the keys with
    /// parked messages; `asked_with`, the session's blocked keys when it was asked.
    Retry {
        due: Result<(Vec<PgMessageRow>, HashSet<String>)>,
        asked_with: HashSet<String>,
    },
    /// The report: the watermark's new state and the slot's lag in bytes.
    Report(Result<(Watermark, i64)>),
    /// Partition upkeep ran: the time until the next run.
    Upkeep(Duration),
    /// Whether the slot is still the session's, asked at `asked_at`.
    Holder {
        ours: Result<bool>,
        asked_at: Instant,
    },
}

/// The chores in flight and when each is due next.
pub(crate) struct Chores {
    tasks: JoinSet<Landed>,
    pub(crate) retry_at: Instant,
    pub(crate) report_at: Instant,
    /// `None` while upkeep runs (its result says when it is due next).
    pub(crate) upkeep_at: Option<Instant>,
    pub(crate) retrying: bool,
    pub(crate) reporting: bool,
    pub(crate) asking_holder: bool,
    /// After a failed holder check: not asked again before this.
    pub(crate) holder_not_before: Instant,
}

impl Chores {
    /// Every chore due at once.
    pub(crate) fn new() -> Self {
        let now = Instant::now();
        Self {
            tasks: JoinSet::new(),
            retry_at: now,
            report_at: now,
            upkeep_at: Some(now),
            retrying: false,
            reporting: false,
            asking_holder: false,
            holder_not_before: now,
        }
    }

    /// Runs `chore` beside the stream.
    pub(crate) fn spawn(&mut self, chore: impl Future<Output = Landed> + Send + 'static) {
        self.tasks.spawn(chore);
    }

    /// The next chore due that is not in flight; `holder_at` when the holder check is.
    pub(crate) fn next_due(&self, holder_at: Instant) -> Instant {
        let far = Instant::now() + Duration::from_secs(3600);
        let at = |due: Instant, busy: bool| if busy { far } else { due };
        at(self.retry_at, self.retrying)
            .min(at(self.report_at, self.reporting))
            .min(self.upkeep_at.unwrap_or(far))
            .min(at(holder_at, self.asking_holder))
    }

    /// Whether any chore is in flight.
    pub(crate) fn any(&self) -> bool {
        !self.tasks.is_empty()
    }

    /// The next chore to land (pending forever while none is in flight: guard with
    /// [`any`](Self::any)).
    pub(crate) async fn next(&mut self) -> Option<std::result::Result<Landed, JoinError>> {
        self.tasks.join_next().await
    }
}

/// Whether the slot is held by the server process `walsender` (this session's).
pub(crate) fn holds_slot(c: &mut PgConnection, slot: String, walsender: i32) -> Result<bool> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Bool)]
        ours: bool,
    }
    let rows: Vec<Row> = diesel::sql_query(
        "SELECT coalesce(active_pid = $2, false) AS ours FROM pg_replication_slots \
         WHERE slot_name = $1",
    )
    .bind::<Text, _>(slot)
    .bind::<Integer, _>(walsender)
    .load(c)?;
    Ok(rows.first().is_some_and(|r| r.ours))
}
