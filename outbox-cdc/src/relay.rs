//! The relay: waits for the slot, holds it, and takes it over from a holder that died or
//! froze.

use std::pin::Pin;
use std::time::Duration;

use diesel::sql_types::{BigInt, Integer, Text};
use diesel::{QueryableByName, RunQueryDsl as _};
use outbox_core::Publisher;
use pgwire_replication::{Lsn, ReplicationClient};

use crate::deliver::Deliverer;
use crate::park::db;
use crate::session::{Ended, Session};
use crate::{CdcConfig, CdcError, PgPool, ReplicationTarget, Result, setup};

/// How long a replication session may take to connect and start streaming.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The shutdown signal, polled from several places but never after it completed.
pub(crate) struct Stop<'a, F> {
    signal: Pin<&'a mut F>,
    done: bool,
}

impl<'a, F: Future<Output = ()>> Stop<'a, F> {
    /// The signal, not completed yet.
    pub(crate) fn new(signal: Pin<&'a mut F>) -> Self {
        Self {
            signal,
            done: false,
        }
    }

    /// Completes when the signal has (at once, if it already did).
    pub(crate) async fn wait(&mut self) {
        if !self.done {
            self.signal.as_mut().await;
            self.done = true;
        }
    }
}

/// What both relays do when a hold of the reader's place ended: `Some` to return from
/// `run_until` (stopped, or an error that is not an outage), `None` to hold again, after
/// backing off an outage (`outages` in a row). `what` names the relay in the logs.
pub(crate) async fn after_hold<F: Future<Output = ()>>(
    what: &str,
    config: &CdcConfig,
    outages: &mut u32,
    stop: &mut Stop<'_, F>,
    ended: Result<Ended>,
) -> Option<Result<()>> {
    let err = match ended {
        Ok(Ended::Stopped) => {
            tracing::info!("{what} stopped");
            return Some(Ok(()));
        }
        Ok(Ended::Lost) => {
            *outages = 0;
            return None;
        }
        Err(e) => e,
    };
    if !err.is_outage() {
        tracing::error!(error = %outbox_core::error_chain(&err), "{what} stopped by an error");
        return Some(Err(err));
    }
    *outages = outages.saturating_add(1);
    let pause = config.outage_backoff.pause(*outages);
    tracing::warn!(error = %outbox_core::error_chain(&err), ?pause, "{what} paused after an outage");
    metrics::counter!("outbox_relay_outages_total").increment(1);
    tokio::select! {
        biased;
        () = stop.wait() => Some(Ok(())),
        () = tokio::time::sleep(pause) => None,
    }
}

#[doc = include_str!("../docs/relay.md")]
pub struct CdcRelay<P> {
    pool: PgPool,
    target: ReplicationTarget,
    /// For the heartbeat's own connection (see `heartbeat.rs`). Never printed.
    url: String,
    publisher: P,
    config: CdcConfig,
    /// This process's name on the server (`application_name`), unique per relay.
    name: String,
}

impl<P> std::fmt::Debug for CdcRelay<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CdcRelay")
            .field("target", &self.target)
            .field("config", &self.config)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl<P: Publisher> CdcRelay<P> {
    /// A relay with the default [`CdcConfig`] that reads the slot over a replication
    /// connection to `database_url` (see [`ReplicationTarget`] for what it reads of the
    /// URL), and runs its queries (the start check, the backfill, the failure path, the
    /// reports) on `pool`, a pool of the same database. Two to four connections are
    /// plenty; give the pool a short `connection_timeout` (r2d2's default is 30 s), as
    /// every outage of the database waits that long per attempt.
    pub fn new(database_url: &str, pool: PgPool, publisher: P) -> Result<Self> {
        Ok(Self {
            pool,
            target: ReplicationTarget::from_url(database_url)?,
            url: database_url.to_owned(),
            publisher,
            config: CdcConfig::default(),
            name: format!("outbox-cdc-{}-{:08x}", std::process::id(), fastrand_u32()),
        })
    }

    /// Replaces the configuration, after [`CdcConfig::validate`].
    pub fn with_config(mut self, config: CdcConfig) -> Result<Self> {
        config.validate()?;
        self.config = config;
        Ok(self)
    }

    /// The configuration in force.
    pub fn config(&self) -> &CdcConfig {
        &self.config
    }

    /// The relay's `application_name` on the server: its row in `pg_stat_replication`
    /// while it holds the slot.
    pub fn application_name(&self) -> &str {
        &self.name
    }

    /// Runs until `shutdown` completes: waits for the slot, holds it (backfill, then the
    /// stream), and releases it at shutdown (a waiting relay takes it at once).
    ///
    /// Outages (the database, the replication connection, the broker) are logged and
    /// backed off without end ([`CdcError::is_outage`]); any other error (a server that
    /// cannot serve the relay, a lost slot, CDC mode not set up) stops the relay and is
    /// returned.
    pub async fn run_until(&self, shutdown: impl Future<Output = ()>) -> Result<()> {
        let signal = std::pin::pin!(shutdown);
        let mut stop = Stop::new(signal);
        let mut outages = 0u32;
        loop {
            let ended = self.hold(&mut stop).await;
            let done = after_hold("CDC relay", &self.config, &mut outages, &mut stop, ended);
            if let Some(result) = done.await {
                return result;
            }
        }
    }

    /// Acquires the slot, then runs a session on it.
    async fn hold<F: Future<Output = ()>>(&self, stop: &mut Stop<'_, F>) -> Result<Ended> {
        let Some((client, walsender, confirmed)) = self.acquire(stop).await? else {
            return Ok(Ended::Stopped);
        };
        tracing::info!(slot = %self.config.slot, %confirmed, "CDC relay holds the slot");
        // Beats while the session lives (dropped with this function's frame).
        let _heartbeat = crate::heartbeat::Heartbeat::start(
            self.url.clone(),
            self.name.clone(),
            self.config.status_interval,
        );
        let d = Deliverer {
            pool: &self.pool,
            publisher: &self.publisher,
            config: &self.config,
        };
        Session::new(d, client, walsender, self.config.slot.clone(), confirmed)
            .run(stop)
            .await
    }

    /// Waits until this relay holds the slot: the streaming session, its server
    /// process, and the confirmed position it resumes from. `None` at shutdown.
    async fn acquire<F: Future<Output = ()>>(
        &self,
        stop: &mut Stop<'_, F>,
    ) -> Result<Option<(ReplicationClient, i32, Lsn)>> {
        loop {
            let (mode, slot) = db(&self.pool, setup::check).await?;
            if mode.slot != self.config.slot {
                return Err(CdcError::SlotMismatch {
                    configured: self.config.slot.clone(),
                    recorded: mode.slot,
                });
            }
            if let Some(pid) = slot.active_pid {
                self.take_over_if_silent(pid).await?;
            } else {
                let confirmed = slot
                    .confirmed_flush_lsn
                    .as_deref()
                    .and_then(|l| Lsn::parse(l).ok())
                    .unwrap_or(Lsn::ZERO);
                if let Some(held) = self.start(&mode.publication, confirmed).await? {
                    return Ok(Some(held));
                }
            }
            metrics::gauge!("outbox_cdc_holder").set(0.0);
            tokio::select! {
                biased;
                () = stop.wait() => return Ok(None),
                () = tokio::time::sleep(self.config.standby_poll) => {}
            }
        }
    }

    /// Starts streaming from `confirmed`; `None` if another relay took the slot first.
    async fn start(
        &self,
        publication: &str,
        confirmed: Lsn,
    ) -> Result<Option<(ReplicationClient, i32, Lsn)>> {
        let config = self
            .target
            .config(&self.config.slot, publication)
            .with_start_lsn(confirmed)
            .with_ack_lsn(confirmed)
            .with_status_interval(self.config.status_interval)
            .with_wakeup_interval(self.config.status_interval)
            .with_buffer_size(4 * self.config.batch_size.max(256))
            .with_application_name(self.name.clone());
        let mut client = ReplicationClient::connect(config).await?;
        match tokio::time::timeout(START_TIMEOUT, client.wait_started()).await {
            Err(_) => Err(CdcError::Replication("START_REPLICATION timed out".into())),
            Ok(Err(e)) if e.to_string().contains("is active for PID") => Ok(None),
            Ok(Err(e)) => Err(e.into()),
            Ok(Ok(())) => {
                let name = self.name.clone();
                let pid = db(&self.pool, move |c| {
                    #[derive(QueryableByName)]
                    struct Row {
                        #[diesel(sql_type = Integer)]
                        pid: i32,
                    }
                    let rows: Vec<Row> = diesel::sql_query(
                        "SELECT pid FROM pg_stat_replication WHERE application_name = $1",
                    )
                    .bind::<Text, _>(name)
                    .load(c)?;
                    rows.first().map(|r| r.pid).ok_or_else(|| {
                        CdcError::Replication(
                            "the walsender of this relay is not in pg_stat_replication".into(),
                        )
                    })
                })
                .await?;
                Ok(Some((client, pid, confirmed)))
            }
        }
    }

    /// Ends the session of a holder whose heartbeat (or, without one, whose status
    /// updates) stopped for [`CdcConfig::takeover_after`]: it died without its
    /// connection closing, or it is stopped (SIGSTOP) or frozen. Its server process would otherwise keep the slot
    /// until `wal_sender_timeout`.
    async fn take_over_if_silent(&self, pid: i32) -> Result<()> {
        let after = i64::try_from(self.config.takeover_after.as_millis()).unwrap_or(i64::MAX);
        let ended = db(&self.pool, move |c| {
            #[derive(QueryableByName)]
            struct Row {
                #[diesel(sql_type = diesel::sql_types::Bool)]
                ended: bool,
            }
            // The holder's heartbeat session if it has one (see heartbeat.rs), else its
            // replication session's last status update.
            let rows: Vec<Row> = diesel::sql_query(
                "SELECT pg_terminate_backend(r.pid) AS ended FROM pg_stat_replication r \
                 WHERE r.pid = $1 AND coalesce((SELECT max(greatest(a.query_start, a.state_change)) \
                 FROM pg_stat_activity a WHERE a.application_name = r.application_name \
                 AND a.backend_type = 'client backend'), r.reply_time, r.backend_start) \
                 < now() - make_interval(secs => $2 / 1000.0)",
            )
            .bind::<Integer, _>(pid)
            .bind::<BigInt, _>(after)
            .load(c)?;
            Ok(rows.first().is_some_and(|r| r.ended))
        })
        .await?;
        if ended {
            tracing::warn!(pid, after = ?self.config.takeover_after, "the slot's holder sent no status update: its session was ended, this relay takes the slot over");
            metrics::counter!("outbox_cdc_takeovers_total").increment(1);
        }
        Ok(())
    }
}

/// A random suffix for the relay's name, without a dependency for it.
fn fastrand_u32() -> u32 {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.finish() as u32
}
