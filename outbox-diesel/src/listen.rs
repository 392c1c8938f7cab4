//! PostgreSQL: the relay store, whose idle wait is woken by `NOTIFY`.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection as _;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::{BigInt, Bool, Text};
use diesel::{Connection as _, PgConnection, QueryableByName, RunQueryDsl as _};
use outbox_core::{Backlog, ClaimedBatch as _, RelayStore};

use crate::backend::NOTIFY_IDLE_SLACK;
use crate::relay::{LockedBatch, blocking};
use crate::{ClaimOrder, DEFAULT_CHANNEL, OutboxConnection as _, PgPool, Result};

/// How often a parked relay looks for a notification on its LISTEN connection (a
/// non-blocking read of the socket; no round trip).
const LISTEN_POLL_STEP: Duration = Duration::from_millis(20);

/// The relay's store on PostgreSQL: claims with `FOR UPDATE SKIP LOCKED` on a pooled
/// connection, so any number of relays can run side by side, in per-key order by
/// default ([`ClaimOrder`]: the claim, its probes and its EXPLAIN are one statement).
///
/// With a listener ([`connect`](Self::connect) or [`with_listener`](Self::with_listener))
/// an idle relay waits on `LISTEN` over its own dedicated connection: it announces that
/// it is parked (its own row in `outbox_relay_idle`, keyed by a per-store id), which
/// makes emits in [`Notify::WhenRelayIdle`](crate::Notify::WhenRelayIdle) mode send
/// `NOTIFY` while any relay is parked, and wakes as soon as such a transaction commits;
/// a woken relay removes only its own row, so other parked relays stay reachable.
/// Without a listener, or while its connection is down (it reconnects on the next wait),
/// waiting sleeps for the poll interval.
///
/// Before parking, the relay looks once for due rows newer than what its last claims
/// saw, so a row committed just before it parked is not left to the poll. Rows the
/// per-key claim held back (behind another relay's batch or a retry) do not count: that
/// relay, or the poll interval, picks them up.
#[derive(Debug, Clone)]
pub struct PgRelayStore {
    pool: PgPool,
    listener: Option<Arc<Mutex<Listener>>>,
    channel: String,
    order: ClaimOrder,
    seen: Arc<Seen>,
}

/// What the last claims saw, for the due check before parking.
#[derive(Debug, Default)]
struct Seen {
    /// The last claim returned nothing.
    empty: AtomicBool,
    /// Due rows up to this id were there before the last (empty) claim.
    up_to: AtomicI64,
}

impl PgRelayStore {
    /// A store over `pool` claiming in [`ClaimOrder::PerKey`], without a listener:
    /// waiting for work polls.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            listener: None,
            channel: DEFAULT_CHANNEL.to_owned(),
            order: ClaimOrder::default(),
            seen: Arc::default(),
        }
    }

    /// Sets the claim order.
    pub fn with_order(mut self, order: ClaimOrder) -> Self {
        self.order = order;
        self
    }

    /// The claim order.
    pub fn order(&self) -> ClaimOrder {
        self.order
    }

    /// Builds a pool of `max_size` connections to `database_url` and a store that
    /// listens for wake-ups on a dedicated connection to the same URL.
    pub fn connect(database_url: &str, max_size: u32) -> Result<Self> {
        let pool = Pool::builder()
            .max_size(max_size)
            .build(ConnectionManager::<PgConnection>::new(database_url))?;
        Ok(Self::new(pool).with_listener(database_url))
    }

    /// Waits for work with `LISTEN` on a dedicated connection to `database_url` (opened
    /// on the first wait). Use the URL of the pool's database and schema.
    pub fn with_listener(mut self, database_url: impl Into<String>) -> Self {
        self.listener = Some(Arc::new(Mutex::new(Listener {
            url: database_url.into(),
            channel: self.channel.clone(),
            relay_id: format!("pid{}-{:016x}", std::process::id(), fastrand::u64(..)),
            conn: None,
        })));
        self
    }

    /// Sets the `NOTIFY` channel (default `outbox`): the one emitters use in
    /// [`EmitOptions::channel`](crate::EmitOptions::channel).
    pub fn with_channel(mut self, channel: impl Into<String>) -> Self {
        self.channel = channel.into();
        if let Some(l) = &self.listener {
            let mut l = l.lock().unwrap_or_else(PoisonError::into_inner);
            l.channel.clone_from(&self.channel);
            l.conn = None; // re-LISTEN on the new channel
        }
        self
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The `NOTIFY` channel.
    pub fn channel(&self) -> &str {
        &self.channel
    }
}

impl RelayStore for PgRelayStore {
    type Batch = LockedBatch<PgConnection>;

    async fn claim(&self, limit: usize) -> Result<Self::Batch, outbox_core::Error> {
        // An idle relay notes the newest due row before it claims: if the claim still
        // returns nothing, every due row up to there is held back or taken, and the due
        // check before parking looks only above it. (Taken before the claim, so that a
        // row committed in between counts as new.)
        let up_to = if self.listener.is_some() && self.seen.empty.load(Ordering::Relaxed) {
            let pool = self.pool.clone();
            blocking(move || newest_due(&mut *pool.get()?)).await?
        } else {
            0
        };
        let batch = LockedBatch::claim(self.pool.clone(), limit, self.order).await?;
        let empty = batch.messages().is_empty();
        self.seen.empty.store(empty, Ordering::Relaxed);
        self.seen
            .up_to
            .store(if empty { up_to } else { 0 }, Ordering::Relaxed);
        Ok(batch)
    }

    async fn wait_for_work(&self, timeout: Duration) {
        let Some(listener) = self.listener.clone() else {
            tokio::time::sleep(timeout).await;
            return;
        };
        let seen = self.seen.up_to.load(Ordering::Relaxed);
        // The relay drops this future when it shuts down; the blocking park notices
        // within a poll step instead of holding a thread (and the runtime's shutdown)
        // for the rest of the poll interval.
        let cancel = CancelOnDrop(Arc::default());
        let cancelled = cancel.0.clone();
        let waited = blocking(move || {
            // A second concurrent waiter (not the relay's pattern) just sleeps.
            match listener.try_lock() {
                Ok(mut l) => l.wait(timeout, seen, &cancelled),
                Err(_) => std::thread::sleep(timeout),
            }
            Ok(())
        })
        .await;
        drop(cancel);
        if let Err(e) = waited {
            tracing::warn!(error = %e, "outbox LISTEN wait failed");
        }
    }

    async fn backlog(&self) -> Result<Backlog, outbox_core::Error> {
        let pool = self.pool.clone();
        Ok(blocking(move || pool.get()?.__backlog()).await?)
    }
}

/// Sets its flag when dropped.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[derive(QueryableByName)]
struct Due {
    #[diesel(sql_type = Bool)]
    due: bool,
}

#[derive(QueryableByName)]
struct Newest {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// The id of the newest due NEW row (0 if none): one backward step on `outbox_pending`.
fn newest_due(conn: &mut PgConnection) -> Result<i64> {
    Ok(diesel::sql_query(
        "SELECT COALESCE((SELECT id FROM outbox WHERE status = 0 AND next_retry_at <= now() \
         ORDER BY id DESC LIMIT 1), 0) AS id",
    )
    .get_result::<Newest>(conn)?
    .id)
}

struct Listener {
    url: String,
    channel: String,
    /// This store's row in `outbox_relay_idle`.
    relay_id: String,
    conn: Option<PgConnection>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("channel", &self.channel)
            .field("connected", &self.conn.is_some())
            .finish_non_exhaustive()
    }
}

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

impl Listener {
    /// Parks until a notification, due work above id `seen`, or `timeout`. Never
    /// fails: on a database error it drops the connection (reconnecting next time) and
    /// sleeps instead.
    fn wait(&mut self, timeout: Duration, seen: i64, cancelled: &AtomicBool) {
        let deadline = Instant::now() + timeout;
        if let Err(e) = self.try_wait(timeout, deadline, seen, cancelled) {
            tracing::warn!(error = %e, "outbox LISTEN connection failed; polling until it is back");
            self.conn = None;
            while !cancelled.load(Ordering::Relaxed) {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                std::thread::sleep(LISTEN_POLL_STEP.min(deadline - now));
            }
        }
    }

    fn try_wait(
        &mut self,
        timeout: Duration,
        deadline: Instant,
        seen: i64,
        cancelled: &AtomicBool,
    ) -> Result<()> {
        let conn = match &mut self.conn {
            Some(conn) => conn,
            None => {
                let mut conn = PgConnection::establish(&self.url)?;
                conn.batch_execute(&format!("LISTEN {}", quote_ident(&self.channel)))?;
                self.conn.insert(conn)
            }
        };
        // Older notifications are stale: the relay has claimed since they were sent.
        for n in conn.notifications_iter() {
            n?;
        }
        let idle_ms = (timeout + NOTIFY_IDLE_SLACK).as_millis();
        // Marks this relay parked; also clears marks that crashed relays left behind.
        diesel::sql_query(format!(
            "WITH stale AS (DELETE FROM outbox_relay_idle WHERE idle_until < now() - interval '1 hour') \
             INSERT INTO outbox_relay_idle (relay_id, idle_until) \
             VALUES ($1, now() + interval '{idle_ms} milliseconds') \
             ON CONFLICT (relay_id) DO UPDATE SET idle_until = EXCLUDED.idle_until"
        ))
        .bind::<Text, _>(&self.relay_id)
        .execute(conn)?;
        // A row committed between the relay's last claim and the mark above sent no
        // NOTIFY: look once before parking.
        let due = diesel::sql_query(format!(
            "SELECT EXISTS (SELECT 1 FROM outbox WHERE status = 0 AND next_retry_at <= now() \
             AND id > {seen}) AS due"
        ))
        .get_result::<Due>(conn)?
        .due;
        loop {
            let mut woke = due;
            for n in conn.notifications_iter() {
                n?;
                woke = true;
            }
            if woke || cancelled.load(Ordering::Relaxed) {
                // Busy (or stopping) from here on: emitters stop paying for NOTIFY.
                diesel::sql_query("DELETE FROM outbox_relay_idle WHERE relay_id = $1")
                    .bind::<Text, _>(&self.relay_id)
                    .execute(conn)?;
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(());
            }
            std::thread::sleep(LISTEN_POLL_STEP.min(deadline - now));
        }
    }
}
