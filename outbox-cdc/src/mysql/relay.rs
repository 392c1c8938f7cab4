//! The relay on the binlog: one reader at a time (a named lock on a session of its own),
//! the backfill, then the binlog's commits published in commit order and the position
//! stored after the broker took them; the retry round and the reports between.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use futures_util::FutureExt as _;
use mysql_async::prelude::Queryable as _;
use mysql_async::{Conn, Opts, Pool};
use outbox_core::{Publisher, StoredMessage};

use super::binlog::{Binlog, Commit};
use super::watermark::Watermark;
use super::{GtidPosition, park, setup};
use crate::deliver::Deliverer;
use crate::relay::{Stop, after_hold};
use crate::session::Ended;
use crate::{CdcConfig, CdcError, Result};

#[doc = include_str!("../../docs/mysql.md")]
pub struct MysqlCdcRelay<P> {
    opts: Opts,
    pool: Pool,
    publisher: P,
    config: CdcConfig,
    server_id: u32,
}

impl<P> std::fmt::Debug for MysqlCdcRelay<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MysqlCdcRelay")
            .field("host", &self.opts.ip_or_hostname())
            .field("database", &self.opts.db_name())
            .field("config", &self.config)
            .field("server_id", &self.server_id)
            .finish_non_exhaustive()
    }
}

impl<P: Publisher> MysqlCdcRelay<P> {
    /// A relay with the default [`CdcConfig`] that reads the binlog of the MariaDB at
    /// `database_url` (`mysql://user:password@host:port/database`; the database holds
    /// the outbox) and runs its queries on a pool of its own (up to 4 connections), as a
    /// replica with a random `server_id` (see [`with_server_id`](Self::with_server_id)).
    /// The URL is the application's: diesel's `ssl_mode`, `ssl_ca`, `ssl_cert`, `ssl_key`
    /// and `unix_socket` mean here what they mean to its emit (TLS on rustls; the table
    /// in the [module's docs](super#one-url-for-the-emit-and-the-relay)).
    pub fn new(database_url: &str, publisher: P) -> Result<Self> {
        let opts = super::url::opts(database_url)?;
        if opts.db_name().is_none_or(str::is_empty) {
            return Err(CdcError::Url(
                "the URL must name the outbox's database (mysql://host/database)".into(),
            ));
        }
        let constraints = mysql_async::PoolConstraints::new(0, 4).unwrap_or_default();
        let pool = Pool::new(
            mysql_async::OptsBuilder::from_opts(opts.clone())
                .pool_opts(mysql_async::PoolOpts::default().with_constraints(constraints)),
        );
        Ok(Self {
            opts,
            pool,
            publisher,
            config: CdcConfig::default(),
            server_id: random_server_id(),
        })
    }

    /// Replaces the configuration, after [`CdcConfig::validate`]. On MySQL / MariaDB
    /// [`CdcConfig::slot`] names the readers' lock (`GET_LOCK`); `publication` is unused.
    pub fn with_config(mut self, config: CdcConfig) -> Result<Self> {
        config.validate()?;
        self.config = config;
        Ok(self)
    }

    /// Sets the `server_id` this relay reads the binlog as. It must differ from every
    /// other replica's of the server (the server ends the older of two dumps with the
    /// same id); the default is random in `2^31..2^32`, away from the small ids that
    /// replicas are usually given. Zero is refused.
    pub fn with_server_id(mut self, server_id: u32) -> Result<Self> {
        if server_id == 0 {
            return Err(outbox_core::InvalidConfig::new("server_id", "must not be 0").into());
        }
        self.server_id = server_id;
        Ok(self)
    }

    /// The `server_id` this relay reads the binlog as.
    pub fn server_id(&self) -> u32 {
        self.server_id
    }

    /// The configuration in force.
    pub fn config(&self) -> &CdcConfig {
        &self.config
    }

    /// Runs until `shutdown` completes: waits for the readers' lock, holds it (backfill,
    /// then the binlog), and releases it at shutdown (a waiting relay takes it at once).
    ///
    /// Outages (the database, the binlog dump, the broker) are logged and backed off
    /// without end ([`CdcError::is_outage`]); any other error (a server that cannot
    /// serve the relay, a purged position, CDC mode not set up) stops the relay and is
    /// returned.
    pub async fn run_until(&self, shutdown: impl Future<Output = ()>) -> Result<()> {
        let signal = std::pin::pin!(shutdown);
        let mut stop = Stop::new(signal);
        let mut outages = 0u32;
        loop {
            let ended = self.hold(&mut stop).await;
            let done = after_hold(
                "binlog CDC relay",
                &self.config,
                &mut outages,
                &mut stop,
                ended,
            );
            if let Some(result) = done.await {
                return result;
            }
        }
    }

    /// Acquires the lock, then runs a session.
    async fn hold<F: Future<Output = ()>>(&self, stop: &mut Stop<'_, F>) -> Result<Ended> {
        let Some(lock) = self.acquire(stop).await? else {
            return Ok(Ended::Stopped);
        };
        let mut conn = self.pool.get_conn().await.map_err(CdcError::db)?;
        let (_, position) = setup::cdc_mode(&mut conn)
            .await?
            .ok_or(CdcError::NotSetUp)?;
        drop(conn);
        tracing::info!(lock = %self.config.slot, %position, server_id = self.server_id, "binlog CDC relay holds the lock");
        let session = Session {
            relay: self,
            d: Deliverer {
                pool: &self.pool,
                publisher: &self.publisher,
                config: &self.config,
            },
            lock,
            binlog: None,
            ready: Vec::new(),
            messages_done: false,
            spilled_done: 0,
            stored: position,
            blocked: HashSet::new(),
            verified_at: Instant::now(),
            watermark: Watermark::default(),
            outages: 0,
            paused_until: None,
        };
        session.run(stop).await
    }

    /// Waits until this relay holds the readers' lock: the session that holds it.
    /// `None` at shutdown.
    async fn acquire<F: Future<Output = ()>>(
        &self,
        stop: &mut Stop<'_, F>,
    ) -> Result<Option<Conn>> {
        let mut lock = Conn::new(self.opts.clone()).await.map_err(CdcError::db)?;
        loop {
            setup::check_server(&mut lock).await?;
            let (mode, _) = setup::cdc_mode(&mut lock)
                .await?
                .ok_or(CdcError::NotSetUp)?;
            if mode.slot != self.config.slot {
                return Err(CdcError::SlotMismatch {
                    configured: self.config.slot.clone(),
                    recorded: mode.slot,
                });
            }
            let got: Option<Option<i64>> = lock
                .exec_first("SELECT GET_LOCK(?, 0)", (self.config.slot.as_str(),))
                .await
                .map_err(CdcError::db)?;
            if got == Some(Some(1)) {
                return Ok(Some(lock));
            }
            self.take_over_if_silent(&mut lock).await?;
            metrics::gauge!("outbox_cdc_holder").set(0.0);
            tokio::select! {
                biased;
                () = stop.wait() => return Ok(None),
                () = tokio::time::sleep(self.config.standby_poll) => {}
            }
        }
    }

    /// Ends the lock session of a holder silent for [`CdcConfig::takeover_after`]: its
    /// process is stopped (SIGSTOP) or frozen, or it died without its connection
    /// closing. A live holder runs a statement on it every `status_interval`. The
    /// server would otherwise keep the lock until `wait_timeout` (8 hours by default).
    /// Needs the same user as the holder's, or `CONNECTION ADMIN` (`SUPER`).
    async fn take_over_if_silent(&self, conn: &mut Conn) -> Result<()> {
        let after = self.config.takeover_after.as_secs_f64().ceil() as u64;
        let silent: Option<u64> = conn
            .exec_first(
                "SELECT ID FROM information_schema.PROCESSLIST \
                 WHERE ID = IS_USED_LOCK(?) AND COMMAND = 'Sleep' AND TIME >= ?",
                (self.config.slot.as_str(), after),
            )
            .await
            .map_err(CdcError::db)?;
        let Some(id) = silent else { return Ok(()) };
        match conn.query_drop(format!("KILL CONNECTION {id}")).await {
            Ok(()) => {
                tracing::warn!(connection = id, after = ?self.config.takeover_after, "the lock's holder ran nothing: its session was ended, this relay takes over");
                metrics::counter!("outbox_cdc_takeovers_total").increment(1);
            }
            // It ended by itself in between.
            Err(mysql_async::Error::Server(e)) if e.code == 1094 => {}
            Err(e) => return Err(CdcError::db(e)),
        }
        Ok(())
    }
}

/// A replica id for this process: random in `2^31..2^32`.
fn random_server_id() -> u32 {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    (h.finish() as u32) | 0x8000_0000
}

/// One holder's session.
struct Session<'r, P> {
    relay: &'r MysqlCdcRelay<P>,
    d: Deliverer<'r, P, Pool>,
    /// The session holding the readers' lock: the fence and the heartbeat.
    lock: Conn,
    binlog: Option<Binlog>,
    ready: Vec<Commit>,
    /// Whether the messages of `ready` were published (a spilled commit, the last, may
    /// still be being, a batch per step).
    messages_done: bool,
    /// How many rows of the spilled commit were published.
    spilled_done: usize,
    /// The position stored in `outbox_cdc`.
    stored: GtidPosition,
    blocked: HashSet<String>,
    /// When the lock was last seen to be this session's.
    verified_at: Instant,
    watermark: Watermark,
    outages: u32,
    paused_until: Option<Instant>,
}

impl<P: Publisher> Session<'_, P> {
    async fn run<F: Future<Output = ()>>(mut self, stop: &mut Stop<'_, F>) -> Result<Ended> {
        metrics::gauge!("outbox_cdc_holder").set(1.0);
        let ended = self.run_inner(stop).await;
        metrics::gauge!("outbox_cdc_holder").set(0.0);
        if let Some(binlog) = self.binlog.take() {
            binlog.close_stream().await;
        }
        // The server releases the lock with its session: a waiting relay takes it.
        let _ = tokio::time::timeout(Duration::from_secs(5), self.lock.disconnect()).await;
        ended
    }

    async fn run_inner<F: Future<Output = ()>>(&mut self, stop: &mut Stop<'_, F>) -> Result<Ended> {
        self.blocked = park::blocked_keys(self.d.pool).await?;
        if let Some(ended) = self.backfill(stop).await? {
            return Ok(ended);
        }
        let config = self.d.config;
        self.binlog = Some(
            Binlog::open(
                &self.relay.opts,
                self.relay.server_id,
                &self.stored,
                config.status_interval,
                config.transaction_memory,
            )
            .await?,
        );
        let mut next_retry = Instant::now();
        let mut next_report = Instant::now();
        loop {
            let deadline = next_retry
                .min(next_report)
                .min(self.verified_at + config.status_interval);
            if let Some(ended) = self.step(stop, deadline).await? {
                return Ok(ended);
            }
            if !self.still_holder().await? {
                return Ok(Ended::Lost);
            }
            let now = Instant::now();
            if now >= next_retry {
                next_retry = now + config.retry_poll;
                if let Err(e) = self.retry_round().await {
                    tracing::warn!(error = %outbox_core::error_chain(&e), "retrying parked messages failed; tried again later");
                }
            }
            if now >= next_report {
                next_report = now + config.lag_interval;
                if let Err(e) = self.report().await {
                    tracing::warn!(error = %outbox_core::error_chain(&e), "binlog CDC relay report failed");
                }
            }
        }
    }

    /// Reads what the binlog has (waiting until `deadline` if nothing is in hand),
    /// publishes the complete commits and stores the position after them.
    async fn step<F: Future<Output = ()>>(
        &mut self,
        stop: &mut Stop<'_, F>,
        deadline: Instant,
    ) -> Result<Option<Ended>> {
        let limit = self.d.config.batch_size;
        let binlog = self
            .binlog
            .as_mut()
            .ok_or_else(|| CdcError::Replication("the binlog is not open".into()))?;
        if let Some(until) = self.paused_until {
            // After an outage: publish the same commits again, reading nothing more.
            tokio::select! {
                biased;
                () = stop.wait() => return Ok(Some(Ended::Stopped)),
                () = tokio::time::sleep_until(until.min(deadline).into()) => {}
            }
            if Instant::now() < until {
                return Ok(None);
            }
            self.paused_until = None;
        } else if self.ready.is_empty() {
            tokio::select! {
                biased;
                () = stop.wait() => return Ok(Some(Ended::Stopped)),
                read = binlog.read(&mut self.ready) => read?,
                () = tokio::time::sleep_until(deadline.into()) => return Ok(None),
            }
            binlog.read_ready(&mut self.ready, limit)?;
        } else if stop.wait().now_or_never().is_some() {
            // A spilled commit published a batch per step: the shutdown is heard between.
            return Ok(Some(Ended::Stopped));
        }
        if self.ready.iter().all(|c| !c.wrote_outbox()) {
            // Nothing of the outbox: the position is stored with the next report.
            self.ready.clear();
            return Ok(None);
        }
        if !self.still_holder().await? {
            return Ok(Some(Ended::Lost));
        }
        match self.publish_ready().await {
            Ok(stored) => {
                self.outages = 0;
                Ok((!stored).then_some(Ended::Lost))
            }
            Err(e) if e.is_outage() => {
                self.outages = self.outages.saturating_add(1);
                let pause = self.d.config.outage_backoff.pause(self.outages);
                tracing::warn!(error = %outbox_core::error_chain(&e), ?pause, "binlog CDC relay paused after an outage; the same commits are published again");
                metrics::counter!("outbox_relay_outages_total").increment(1);
                self.paused_until = Some(Instant::now() + pause);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Publishes the commits in hand (a spilled one a batch per call) and, once all of
    /// them are, stores the position after the last; `false` if the lock was found
    /// taken over (nothing stored).
    async fn publish_ready(&mut self) -> Result<bool> {
        if !self.messages_done {
            let messages: Vec<StoredMessage> = self
                .ready
                .iter()
                .flat_map(|c| c.messages.iter().cloned())
                .collect();
            if !self.deliver_holding(&messages).await? {
                return Ok(false);
            }
            self.messages_done = true;
        }
        let spilled = self.ready.last().and_then(|c| c.spilled.as_deref());
        if let Some(ids) = spilled.filter(|ids| self.spilled_done < ids.len()) {
            let end = ids.len().min(self.spilled_done + self.d.config.batch_size);
            let batch = ids[self.spilled_done..end].to_vec();
            return self.deliver_spilled(&batch).await;
        }
        let dead: Vec<(i64, String)> = self
            .ready
            .iter()
            .flat_map(|c| c.unreadable.iter().cloned())
            .collect();
        self.d.bury(dead).await?;
        let stored = match self.ready.last() {
            Some(last) => {
                let after = last.after.clone();
                self.store(&after).await?
            }
            None => true,
        };
        self.ready.clear();
        self.messages_done = false;
        self.spilled_done = 0;
        Ok(stored)
    }

    /// Publishes the rows `ids` of the spilled commit in hand, read back from the table
    /// as committed; `false` if the lock was lost.
    async fn deliver_spilled(&mut self, ids: &[i64]) -> Result<bool> {
        let (messages, unreadable) = park::committed_rows(self.d.pool, ids).await?;
        if !self.deliver_holding(&messages).await? {
            return Ok(false);
        }
        self.d.bury(unreadable).await?;
        self.spilled_done += ids.len();
        Ok(true)
    }

    /// Stores `position` in `outbox_cdc`, on the lock's session and only while it holds
    /// the lock; `false` if it no longer does.
    async fn store(&mut self, position: &GtidPosition) -> Result<bool> {
        if *position == self.stored {
            return Ok(true);
        }
        self.lock
            .exec_drop(
                "UPDATE outbox_cdc SET gtid_position = ? WHERE IS_USED_LOCK(?) = CONNECTION_ID()",
                (position.to_string(), self.d.config.slot.as_str()),
            )
            .await
            .map_err(CdcError::db)?;
        if self.lock.affected_rows() == 0 {
            tracing::warn!(lock = %self.d.config.slot, "the lock was taken over: this relay publishes nothing more and waits");
            return Ok(false);
        }
        self.stored = position.clone();
        self.verified_at = Instant::now();
        Ok(true)
    }

    /// Whether the lock is still this session's, asked on the lock's session every
    /// `status_interval`: also the heartbeat by which a waiting relay tells a live
    /// holder from a frozen one.
    async fn still_holder(&mut self) -> Result<bool> {
        if self.verified_at.elapsed() < self.d.config.status_interval {
            return Ok(true);
        }
        let ours = lock_is_ours(&mut self.lock, &self.d.config.slot).await?;
        if ours {
            self.verified_at = Instant::now();
        } else {
            tracing::warn!(lock = %self.d.config.slot, "the lock was taken over: this relay publishes nothing more and waits");
        }
        Ok(ours)
    }

    /// Delivers `messages` while asking for the lock on its session every
    /// `status_interval`: a publish slower than `takeover_after` (a broker that hangs)
    /// must not look like a frozen holder to a waiting relay, which would end this
    /// session and publish the same messages too. `false` when the lock was lost (the
    /// delivery is abandoned: the new holder publishes those messages).
    async fn deliver_holding(&mut self, messages: &[StoredMessage]) -> Result<bool> {
        let every = self.d.config.status_interval;
        let slot = &self.d.config.slot;
        let deliver = self.d.deliver(messages, &mut self.blocked);
        tokio::pin!(deliver);
        loop {
            tokio::select! {
                delivered = &mut deliver => {
                    delivered?;
                    return Ok(true);
                }
                () = tokio::time::sleep_until((self.verified_at + every).into()) => {
                    if !lock_is_ours(&mut self.lock, slot).await? {
                        tracing::warn!(lock = %slot, "the lock was taken over while publishing: this relay publishes nothing more and waits");
                        return Ok(false);
                    }
                    self.verified_at = Instant::now();
                }
            }
        }
    }

    /// Waits `pause` after an outage while keeping the heartbeat on the lock's session
    /// (every `status_interval`), so that a waiting relay does not take this live holder
    /// for a frozen one; `Some` when stopped or the lock is gone.
    async fn pause_holding<F: Future<Output = ()>>(
        &mut self,
        stop: &mut Stop<'_, F>,
        pause: Duration,
    ) -> Result<Option<Ended>> {
        let until = Instant::now() + pause;
        loop {
            if !self.still_holder().await? {
                return Ok(Some(Ended::Lost));
            }
            if Instant::now() >= until {
                return Ok(None);
            }
            let wake = until.min(self.verified_at + self.d.config.status_interval);
            tokio::select! {
                biased;
                () = stop.wait() => return Ok(Some(Ended::Stopped)),
                () = tokio::time::sleep_until(wake.into()) => {}
            }
        }
    }

    /// Publishes the NEW rows that committed before the stored position (the backfill
    /// range), in id order, before the binlog; each batch moves the range's start.
    async fn backfill<F: Future<Output = ()>>(
        &mut self,
        stop: &mut Stop<'_, F>,
    ) -> Result<Option<Ended>> {
        let limit = self.d.config.batch_size;
        while let Some(((messages, unreadable), last)) =
            park::backfill_batch(self.d.pool, limit).await?
        {
            if !self.still_holder().await? {
                return Ok(Some(Ended::Lost));
            }
            // Rows that failed under the polling relay wait for their retry time,
            // parked, and hold back the later rows of their keys.
            for m in messages.iter().filter(|m| m.retries > 0) {
                self.blocked.insert(m.envelope.key.clone());
            }
            let mut outages = 0u32;
            loop {
                match self.deliver_holding(&messages).await {
                    Ok(true) => break,
                    Ok(false) => return Ok(Some(Ended::Lost)),
                    Err(e) if e.is_outage() => {
                        outages = outages.saturating_add(1);
                        let pause = self.d.config.outage_backoff.pause(outages);
                        tracing::warn!(error = %outbox_core::error_chain(&e), ?pause, "binlog CDC backfill paused after an outage");
                        if let Some(ended) = self.pause_holding(stop, pause).await? {
                            return Ok(Some(ended));
                        }
                    }
                    Err(e) => return Err(e),
                }
            }
            self.d.bury(unreadable).await?;
            park::backfilled(self.d.pool, last).await?;
            metrics::gauge!("outbox_cdc_backfilled_through").set(last as f64);
        }
        Ok(None)
    }

    /// Publishes the parked messages whose retry time has come, the first of each key,
    /// round after round while they succeed; refreshes the blocked keys.
    async fn retry_round(&mut self) -> Result<()> {
        let limit = self.d.config.batch_size;
        for _ in 0..10 {
            let (messages, unreadable) = park::due_heads(self.d.pool, limit).await?;
            if messages.is_empty() && unreadable.is_empty() {
                break;
            }
            if !self.still_holder().await? {
                return Ok(());
            }
            if !self.d.retry(&messages, unreadable).await? {
                break;
            }
        }
        self.blocked = park::blocked_keys(self.d.pool).await?;
        metrics::gauge!("outbox_cdc_parked_keys").set(self.blocked.len() as f64);
        Ok(())
    }

    /// Writes the report into `outbox_cdc` and, when nothing is in hand, the position
    /// the binlog was read to (commits that touched other tables only move it), in one
    /// statement: an idle relay writes one row every `lag_interval`.
    async fn report(&mut self) -> Result<()> {
        let oldest = self
            .ready
            .first()
            .map(|c| c.time)
            .or_else(|| self.binlog.as_ref().and_then(Binlog::open_since));
        let age = oldest.map_or(0.0, |t| {
            (chrono::Utc::now() - t)
                .to_std()
                .unwrap_or_default()
                .as_secs_f64()
        });
        metrics::gauge!("outbox_cdc_oldest_unconfirmed_seconds").set(age);
        let idle = self.ready.is_empty() && self.paused_until.is_none();
        let position = match (&self.binlog, idle) {
            (Some(b), true) => b.position().clone(),
            _ => self.stored.clone(),
        };
        let every = i64::try_from(self.d.config.lag_interval.as_millis()).unwrap_or(i64::MAX);
        let oldest = oldest.map(|t| t.format("%Y-%m-%d %H:%M:%S%.6f").to_string());
        // A failed watermark (e.g. the PROCESS privilege revoked) must not stop the
        // report and the idle position below: it only leaves `relayed_through` as is.
        let through = match self.watermark.advance(&mut self.lock, &self.stored).await {
            Ok(through) => through,
            Err(e) => {
                tracing::warn!(error = %outbox_core::error_chain(&e), "the relayed-through watermark was not advanced");
                None
            }
        };
        self.lock
            .exec_drop(
                "UPDATE outbox_cdc SET reported_at = UTC_TIMESTAMP(6), oldest_unconfirmed_at = ?, \
                 report_every_ms = ?, gtid_position = ?, \
                 relayed_through = GREATEST(relayed_through, COALESCE(?, 0)) \
                 WHERE IS_USED_LOCK(?) = CONNECTION_ID()",
                (
                    oldest,
                    every,
                    position.to_string(),
                    through,
                    self.d.config.slot.as_str(),
                ),
            )
            .await
            .map_err(CdcError::db)?;
        if self.lock.affected_rows() > 0 {
            self.stored = position;
        }
        Ok(())
    }
}

/// Whether the readers' lock is held by `lock`'s session; the statement is also the
/// holder's heartbeat (a waiting relay ends a session idle for `takeover_after`).
async fn lock_is_ours(lock: &mut Conn, slot: &str) -> Result<bool> {
    let ours: Option<Option<i64>> = lock
        .exec_first("SELECT IS_USED_LOCK(?) = CONNECTION_ID()", (slot,))
        .await
        .map_err(CdcError::db)?;
    Ok(ours.flatten() == Some(1))
}
