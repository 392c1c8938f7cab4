//! Holding the slot: the backfill, then the stream of commits, published in commit order
//! and confirmed after the broker took them; beside the stream, the retry poll, the
//! reports, partition upkeep and the holder check (`chores.rs`), and the retry round
//! when parked messages are due.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use diesel::RunQueryDsl as _;
use diesel::sql_types::BigInt;
use outbox_core::{Publisher, StoredMessage};
use outbox_diesel::PgMessageRow;
use pgwire_replication::{Lsn, ReplicationClient};

use crate::chores::{Chores, Landed, holds_slot};
use crate::deliver::Deliverer;
use crate::park::{Writes, blocked_keys, db, due_heads};
use crate::reader::{InHand, Reader};
use crate::relay::Stop;
use crate::watermark::Watermark;
use crate::{CdcError, Result, setup};

/// Why a session ended without an error.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The shutdown signal: the slot was released.
    Stopped,
    /// The slot is no longer this session's (taken over while this process was stopped
    /// or slow): nothing more was published.
    Lost,
}

/// One holder's session on the slot.
pub(crate) struct Session<'a, P> {
    pub(crate) d: Deliverer<'a, P>,
    /// The stream, and its commits decoded.
    reader: Reader,
    /// The server process serving this session (for the fence).
    pub(crate) walsender: i32,
    pub(crate) slot: String,
    /// The commits being published.
    ready: InHand,
    /// The commits read while `ready` is published: never any unless `ready` has some.
    ahead: InHand,
    confirmed: Lsn,
    blocked: HashSet<String>,
    /// When the slot was last seen to be this session's.
    verified_at: Instant,
    watermark: Watermark,
    outages: u32,
    paused_until: Option<Instant>,
    chores: Chores,
}

impl<'a, P: Publisher> Session<'a, P> {
    pub(crate) fn new(
        d: Deliverer<'a, P>,
        client: ReplicationClient,
        walsender: i32,
        slot: String,
        confirmed: Lsn,
    ) -> Self {
        Self {
            reader: Reader::new(client, d.config.transaction_memory),
            d,
            walsender,
            slot,
            ready: InHand::default(),
            ahead: InHand::default(),
            confirmed,
            blocked: HashSet::new(),
            verified_at: Instant::now(),
            watermark: Watermark::default(),
            outages: 0,
            paused_until: None,
            chores: Chores::new(),
        }
    }

    /// Runs the session until shutdown, a lost slot, or an error (the caller backs off
    /// from an outage and acquires the slot again).
    pub(crate) async fn run<F: Future<Output = ()>>(
        mut self,
        stop: &mut Stop<'_, F>,
    ) -> Result<Ended> {
        let ended = self.run_inner(stop).await;
        metrics::gauge!("outbox_cdc_holder").set(0.0);
        if matches!(ended, Ok(Ended::Stopped)) {
            // CopyDone: the server releases the slot at once, for the next holder.
            let _ =
                tokio::time::timeout(Duration::from_secs(5), self.reader.client.shutdown()).await;
        }
        ended
    }

    async fn run_inner<F: Future<Output = ()>>(&mut self, stop: &mut Stop<'_, F>) -> Result<Ended> {
        metrics::gauge!("outbox_cdc_holder").set(1.0);
        self.blocked = db(self.d.pool, blocked_keys).await?;
        if let Some(ended) = self.backfill(stop).await? {
            return Ok(ended);
        }
        loop {
            self.start_chores();
            let deadline = self.chores.next_due(self.holder_check_at());
            if let Some(ended) = self.step(stop, deadline).await? {
                return Ok(ended);
            }
        }
    }

    /// When the holder check is due beside the stream: a quarter of the takeover time
    /// after the slot was last seen to be this session's, so that the check before a
    /// publish (due at half of it, see [`still_holder`](Self::still_holder)) finds it
    /// fresh and costs the stream no round trip.
    fn holder_check_at(&self) -> Instant {
        (self.verified_at + self.d.config.takeover_after / 4).max(self.chores.holder_not_before)
    }

    /// Starts the chores that are due and not in flight (see `chores.rs`).
    fn start_chores(&mut self) {
        let now = Instant::now();
        let config = self.d.config;
        let pool = self.d.pool.clone();
        if now >= self.chores.retry_at && !self.chores.retrying {
            self.chores.retrying = true;
            self.chores.retry_at = now + config.retry_poll;
            let (pool, limit, asked_with) = (pool.clone(), config.batch_size, self.blocked.clone());
            self.chores.spawn(async move {
                let due = db(&pool, move |c| Ok((due_heads(c, limit)?, blocked_keys(c)?))).await;
                Landed::Retry { due, asked_with }
            });
        }
        if now >= self.chores.report_at && !self.chores.reporting {
            self.chores.reporting = true;
            self.chores.report_at = now + config.lag_interval;
            self.start_report(pool.clone());
        }
        if self.chores.upkeep_at.is_some_and(|at| now >= at) {
            self.chores.upkeep_at = None;
            let pool = pool.clone();
            self.chores
                .spawn(async move { Landed::Upkeep(upkeep(&pool).await) });
        }
        if now >= self.holder_check_at() && !self.chores.asking_holder {
            self.chores.asking_holder = true;
            let (slot, pid) = (self.slot.clone(), self.walsender);
            self.chores.spawn(async move {
                let ours = db(&pool, move |c| holds_slot(c, slot, pid)).await;
                Landed::Holder {
                    ours,
                    asked_at: now,
                }
            });
        }
    }

    /// Handles a chore that landed; `Some` if the session ends (the slot was taken).
    async fn landed(
        &mut self,
        landed: Option<std::result::Result<Landed, tokio::task::JoinError>>,
    ) -> Result<Option<Ended>> {
        let Some(landed) = landed else {
            return Ok(None);
        };
        match landed.map_err(|e| CdcError::db(format!("database task failed: {e}")))? {
            Landed::Retry { due, asked_with } => {
                self.chores.retrying = false;
                self.retry_polled(due, &asked_with).await;
            }
            Landed::Report(reported) => {
                self.chores.reporting = false;
                match reported {
                    Ok((watermark, bytes)) => {
                        self.watermark = watermark;
                        metrics::gauge!("outbox_cdc_lag_bytes").set(bytes as f64);
                    }
                    Err(e) => {
                        tracing::warn!(error = %outbox_core::error_chain(&e), "CDC relay report failed")
                    }
                }
            }
            Landed::Upkeep(next) => self.chores.upkeep_at = Some(Instant::now() + next),
            Landed::Holder { ours, asked_at } => {
                self.chores.asking_holder = false;
                match ours {
                    Ok(true) => self.verified_at = self.verified_at.max(asked_at),
                    Ok(false) => {
                        tracing::warn!(slot = %self.slot, "the slot was taken over: this relay publishes nothing more and waits");
                        return Ok(Some(Ended::Lost));
                    }
                    // Asked again in a while; the check before a publish asks itself if
                    // the last answer grows too old.
                    Err(e) => {
                        self.chores.holder_not_before = Instant::now() + self.d.config.retry_poll;
                        tracing::debug!(error = %outbox_core::error_chain(&e), "holder check failed")
                    }
                }
            }
        }
        Ok(None)
    }

    /// The retry poll landed: publishes the parked messages due, if any (the failure
    /// path, in line); else refreshes the blocked keys.
    async fn retry_polled(
        &mut self,
        due: Result<(Vec<PgMessageRow>, HashSet<String>)>,
        asked_with: &HashSet<String>,
    ) {
        let retried = match due {
            Ok((heads, _)) if !heads.is_empty() => self.retry_round(heads).await,
            Ok((_, mut blocked)) => {
                // Keys this session parked since the poll was asked are not in its answer.
                blocked.extend(self.blocked.difference(asked_with).cloned());
                self.blocked = blocked;
                metrics::gauge!("outbox_cdc_parked_keys").set(self.blocked.len() as f64);
                Ok(())
            }
            Err(e) => Err(e),
        };
        if let Err(e) = retried {
            tracing::warn!(error = %outbox_core::error_chain(&e), "retrying parked messages failed; tried again later");
        }
    }

    /// Reads what the stream has (waiting until `deadline` if nothing is in hand),
    /// publishes the complete commits and confirms them.
    async fn step<F: Future<Output = ()>>(
        &mut self,
        stop: &mut Stop<'_, F>,
        deadline: Instant,
    ) -> Result<Option<Ended>> {
        if let Some(until) = self.paused_until {
            // After an outage: publish the same commits again, reading nothing more.
            tokio::select! {
                biased;
                () = stop.wait() => return Ok(Some(Ended::Stopped)),
                landed = self.chores.next(), if self.chores.any() => return self.landed(landed).await,
                () = tokio::time::sleep_until(until.min(deadline).into()) => {}
            }
            if Instant::now() < until {
                return Ok(None);
            }
            self.paused_until = None;
        } else {
            let waiting = self.ready.is_empty();
            // Chores before the stream: they land about once a second, and a busy stream
            // (whose commits were read ahead, during the last publish) must not keep them
            // from landing, nor the shutdown from being heard.
            tokio::select! {
                biased;
                () = stop.wait() => return Ok(Some(Ended::Stopped)),
                landed = self.chores.next(), if self.chores.any() => return self.landed(landed).await,
                () = std::future::ready(()), if !waiting => {}
                ev = self.reader.client.recv() => self.reader.handle(ev?, &mut self.ready)?,
                () = tokio::time::sleep_until(deadline.into()) => return Ok(None),
            }
            // Topped up to a full batch with what has arrived.
            self.reader
                .read_ready(&mut self.ready, self.d.config.batch_size)?;
        }
        if self.ready.is_empty() {
            self.ack_idle();
            return Ok(None);
        }
        if !self.still_holder().await? {
            return Ok(Some(Ended::Lost));
        }
        let (published, read) = self.publish_ready().await;
        read?;
        match published {
            Ok(()) => {
                self.outages = 0;
                Ok(None)
            }
            Err(e) if e.is_outage() => {
                self.outages = self.outages.saturating_add(1);
                let pause = self.d.config.outage_backoff.pause(self.outages);
                tracing::warn!(error = %outbox_core::error_chain(&e), ?pause, "CDC relay paused after an outage; the same commits are published again");
                metrics::counter!("outbox_relay_outages_total").increment(1);
                self.paused_until = Some(Instant::now() + pause);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Confirms `lsn`: every commit up to it was published (or parked, or dead). The
    /// server hears of it at the next status update (within `status_interval`).
    fn confirm(&mut self, lsn: Lsn) {
        self.confirmed = lsn;
        self.reader.client.update_applied_lsn(lsn);
    }

    /// Confirms a keepalive's position when nothing is in hand, so that an idle slot (or
    /// one whose commits touch only other tables) does not hold WAL back.
    fn ack_idle(&mut self) {
        if let Some(lsn) = self.reader.idle_ack.take()
            && self.reader.open.is_none()
            && lsn > self.confirmed
        {
            self.confirm(lsn);
        }
    }

    /// Whether the slot is still this session's. Trusted for half the takeover time
    /// since it was last seen so; after that (a busy relay every few seconds, and at
    /// once a process that was stopped and resumes) asked of the server, so that a
    /// holder that was taken over publishes nothing more.
    async fn still_holder(&mut self) -> Result<bool> {
        if self.verified_at.elapsed() < self.d.config.takeover_after / 2 {
            return Ok(true);
        }
        let (slot, pid) = (self.slot.clone(), self.walsender);
        let asked_at = Instant::now();
        let ours = db(self.d.pool, move |c| holds_slot(c, slot, pid)).await?;
        if ours {
            self.verified_at = asked_at;
        } else {
            tracing::warn!(slot = %self.slot, "the slot was taken over: this relay publishes nothing more and waits");
        }
        Ok(ours)
    }

    /// Publishes the complete commits in hand (a spilled one a batch per step, so that
    /// the chores and the holder check run between) and, once all of them are, confirms
    /// the last one; reads the next commits meanwhile (into `ahead`, then in hand). The
    /// publish's outcome, and the reading's: a stream that failed ends the session,
    /// whatever the publish did.
    async fn publish_ready(&mut self) -> (Result<()>, Result<()>) {
        let Self {
            d,
            reader,
            ready,
            ahead,
            blocked,
            ..
        } = self;
        let publish = deliver_part(d, ready, blocked);
        let (published, read) = reader.read_while(publish, ahead, d.config.batch_size).await;
        match published {
            Ok(()) if self.ready.is_published() => (self.confirm_ready().await, read),
            other => (other, read),
        }
    }

    /// The commits in hand were published: their unreadable rows recorded, the last
    /// one confirmed, and the commits read ahead in hand.
    async fn confirm_ready(&mut self) -> Result<()> {
        self.d.bury(self.ready.unreadable.clone()).await?;
        self.confirm(self.confirmed.max(self.ready.end_lsn));
        self.ready.clear();
        std::mem::swap(&mut self.ready, &mut self.ahead);
        Ok(())
    }

    /// Publishes the NEW rows that committed before the slot existed (`outbox_cdc`'s
    /// backfill range), in id order, before the first commit of the stream; each batch
    /// moves the range's start (one UPDATE of `outbox_cdc`, none of `outbox`).
    async fn backfill<F: Future<Output = ()>>(
        &mut self,
        stop: &mut Stop<'_, F>,
    ) -> Result<Option<Ended>> {
        let limit = i64::try_from(self.d.config.batch_size).unwrap_or(i64::MAX);
        loop {
            let rows = db(self.d.pool, move |c| backfill_batch(c, limit)).await?;
            let Some(rows) = rows else { return Ok(None) };
            if !self.still_holder().await? {
                return Ok(Some(Ended::Lost));
            }
            let last = rows.last().map_or(0, PgMessageRow::id);
            let (messages, unreadable) = split_rows(rows);
            // Rows that failed under the polling relay wait for their retry time, parked,
            // and hold back the later rows of their keys.
            for m in messages.iter().filter(|m| m.retries > 0) {
                self.blocked.insert(m.envelope.key.clone());
            }
            let mut outages = 0u32;
            while let Err(e) = self.d.deliver(&messages, &mut self.blocked).await {
                if !e.is_outage() {
                    return Err(e);
                }
                outages = outages.saturating_add(1);
                let pause = self.d.config.outage_backoff.pause(outages);
                tracing::warn!(error = %outbox_core::error_chain(&e), ?pause, "CDC backfill paused after an outage");
                tokio::select! {
                    biased;
                    () = stop.wait() => return Ok(Some(Ended::Stopped)),
                    () = tokio::time::sleep(pause) => {}
                }
            }
            db(self.d.pool, move |c| {
                Writes {
                    dead: unreadable,
                    ..Writes::default()
                }
                .apply(c)?;
                diesel::sql_query(
                    "UPDATE outbox_cdc SET backfill_from = greatest(backfill_from, $1)",
                )
                .bind::<BigInt, _>(last)
                .execute(c)?;
                Ok(())
            })
            .await?;
            metrics::gauge!("outbox_cdc_backfilled_through").set(last as f64);
        }
    }

    /// Publishes the parked messages whose retry time has come (`heads`, then those the
    /// next rounds find), the first of each key, round after round while they succeed;
    /// refreshes the blocked keys.
    async fn retry_round(&mut self, mut heads: Vec<PgMessageRow>) -> Result<()> {
        let limit = self.d.config.batch_size;
        for round in 0..10 {
            if round > 0 {
                heads = db(self.d.pool, move |c| due_heads(c, limit)).await?;
            }
            if heads.is_empty() {
                break;
            }
            if !self.still_holder().await? {
                return Ok(());
            }
            let (messages, unreadable) = split_rows(std::mem::take(&mut heads));
            if !self.d.retry(&messages, unreadable).await? {
                break;
            }
        }
        self.blocked = db(self.d.pool, blocked_keys).await?;
        metrics::gauge!("outbox_cdc_parked_keys").set(self.blocked.len() as f64);
        Ok(())
    }

    /// The report, as a chore: refreshes the lag gauges and the report in `outbox_cdc`,
    /// and moves the relayed watermark (handed to the chore until it lands). Failures
    /// are logged: the next report tries again.
    fn start_report(&mut self, pool: crate::PgPool) {
        let oldest = self
            .ready
            .oldest
            .or(self.reader.open.as_ref().map(|o| o.commit_time));
        let age = oldest.map_or(0.0, |t| {
            (Utc::now() - t).to_std().unwrap_or_default().as_secs_f64()
        });
        metrics::gauge!("outbox_cdc_oldest_unconfirmed_seconds").set(age);
        let every = self.d.config.lag_interval;
        let confirmed = self.confirmed;
        let mut watermark = std::mem::take(&mut self.watermark);
        self.chores.spawn(async move {
            Landed::Report(
                db(&pool, move |c| {
                    let through = watermark.advance(c, confirmed)?;
                    let bytes = report(c, oldest, every, through)?;
                    Ok((watermark, bytes))
                })
                .await,
            )
        });
    }
}

/// Publishes the next part of the commits in hand: their messages, else the next batch
/// of a spilled commit's rows, read back from the table as committed. What an outage
/// interrupted is published again; what it did not, not.
async fn deliver_part<P: Publisher>(
    d: &Deliverer<'_, P>,
    hand: &mut InHand,
    blocked: &mut HashSet<String>,
) -> Result<()> {
    if !hand.messages_done {
        d.deliver(&hand.messages, blocked).await?;
        hand.messages_done = true;
        return Ok(());
    }
    let ids = hand.next_spilled(d.config.batch_size).to_vec();
    let n = ids.len();
    let rows = db(d.pool, move |c| committed_rows(c, &ids)).await?;
    let (messages, unreadable) = split_rows(rows);
    d.deliver(&messages, blocked).await?;
    d.bury(unreadable).await?;
    hand.spilled_done += n;
    Ok(())
}

/// The rows of `ids` still NEW and not parked, in the order of `ids`: a spilled
/// commit's messages as committed (a row it deleted is not found, one it updated is
/// read updated).
fn committed_rows(c: &mut diesel::PgConnection, ids: &[i64]) -> Result<Vec<PgMessageRow>> {
    let mut rows: Vec<PgMessageRow> = diesel::sql_query(format!(
        "SELECT {columns} FROM outbox o WHERE o.id = ANY($1) AND o.status = 0 \
         AND NOT EXISTS (SELECT 1 FROM outbox_cdc_parked p WHERE p.id = o.id)",
        columns = PgMessageRow::COLUMNS
    ))
    .bind::<diesel::sql_types::Array<BigInt>, _>(ids)
    .load(c)?;
    crate::reader::in_order_of(ids, &mut rows, PgMessageRow::id);
    Ok(rows)
}

/// Partition upkeep, as the polling relay does it: the partitions ahead made and the
/// expired ones dropped (those the CDC relay has published, see
/// [`outbox_diesel::maintain_partitions`]). The time until the next run.
async fn upkeep(pool: &crate::PgPool) -> Duration {
    const MAX_EVERY: Duration = Duration::from_secs(600);
    let ran = db(pool, |c| {
        let Some(policy) = outbox_diesel::partition_policy(c)? else {
            return Ok(MAX_EVERY);
        };
        let report = outbox_diesel::maintain_partitions(c)?;
        for (name, reason) in &report.kept {
            tracing::warn!(partition = %name, "expired partition kept: {reason}");
        }
        for name in &report.dropped {
            tracing::info!(partition = %name, "expired partition detached and dropped");
        }
        Ok((policy.interval / 4).clamp(Duration::from_secs(1), MAX_EVERY))
    })
    .await;
    ran.unwrap_or_else(|e| {
        tracing::warn!(error = %outbox_core::error_chain(&e), "partition maintenance failed; tried again in a minute");
        Duration::from_secs(60)
    })
}

/// The next backfill batch: NEW rows in the range not parked yet, in id order. `None`
/// when the range is done (its start then moved to its end).
fn backfill_batch(c: &mut diesel::PgConnection, limit: i64) -> Result<Option<Vec<PgMessageRow>>> {
    let Some(mode) = setup::cdc_mode(c)? else {
        return Err(CdcError::NotSetUp);
    };
    let (from, upto) = mode.backfill;
    if from >= upto {
        return Ok(None);
    }
    let rows: Vec<PgMessageRow> = diesel::sql_query(format!(
        "SELECT {columns} FROM outbox o WHERE o.status = 0 AND o.id > $1 AND o.id <= $2 \
         AND NOT EXISTS (SELECT 1 FROM outbox_cdc_parked p WHERE p.id = o.id) \
         ORDER BY o.id LIMIT $3",
        columns = PgMessageRow::COLUMNS
    ))
    .bind::<BigInt, _>(from)
    .bind::<BigInt, _>(upto)
    .bind::<BigInt, _>(limit)
    .load(c)?;
    if rows.is_empty() {
        diesel::sql_query("UPDATE outbox_cdc SET backfill_from = backfill_upto").execute(c)?;
        return Ok(None);
    }
    Ok(Some(rows))
}

/// The readable rows as messages, and the unreadable ones with the reason.
fn split_rows(rows: Vec<PgMessageRow>) -> (Vec<StoredMessage>, Vec<(i64, String)>) {
    let mut messages = Vec::with_capacity(rows.len());
    let mut unreadable = Vec::new();
    for r in rows {
        let id = r.id();
        match r.into_message() {
            Ok(m) => messages.push(m),
            Err(outbox_diesel::Error::CorruptRow { reason, .. }) => unreadable.push((id, reason)),
            Err(other) => unreadable.push((id, other.to_string())),
        }
    }
    (messages, unreadable)
}

/// Writes the relay's report into `outbox_cdc`; the slot's lag in bytes.
fn report(
    c: &mut diesel::PgConnection,
    oldest: Option<DateTime<Utc>>,
    every: Duration,
    through: Option<i64>,
) -> Result<i64> {
    diesel::sql_query(
        "UPDATE outbox_cdc SET reported_at = now(), oldest_unconfirmed_at = $1, \
         report_every_ms = $2, relayed_through = greatest(relayed_through, coalesce($3, 0))",
    )
    .bind::<diesel::sql_types::Nullable<diesel::sql_types::Timestamptz>, _>(oldest)
    .bind::<BigInt, _>(i64::try_from(every.as_millis()).unwrap_or(i64::MAX))
    .bind::<diesel::sql_types::Nullable<BigInt>, _>(through)
    .execute(c)?;
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
        bytes: Option<i64>,
    }
    let rows: Vec<Row> = diesel::sql_query(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint AS bytes \
         FROM outbox_cdc c JOIN pg_replication_slots s ON s.slot_name = c.slot_name",
    )
    .load(c)?;
    Ok(rows.first().and_then(|r| r.bytes).unwrap_or(0))
}
