//! PostgreSQL: the relay store, whose idle wait is woken by `NOTIFY`.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection as _;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::Bool;
use diesel::{Connection as _, PgConnection, QueryableByName, RunQueryDsl as _};
use outbox_core::{Backlog, RelayStore};

use crate::backend::NOTIFY_IDLE_SLACK;
use crate::relay::{LockedBatch, blocking};
use crate::{DEFAULT_CHANNEL, OutboxConnection as _, PgPool, Result};

/// How often a parked relay looks for a notification on its LISTEN connection (a
/// non-blocking read of the socket; no round trip).
const LISTEN_POLL_STEP: Duration = Duration::from_millis(20);

/// The relay's store on PostgreSQL: claims with `FOR UPDATE SKIP LOCKED` on a pooled
/// connection, so any number of relays can run side by side.
///
/// With a listener ([`connect`](Self::connect) or [`with_listener`](Self::with_listener))
/// an idle relay waits on `LISTEN` over its own dedicated connection: it announces that
/// it is parked (`outbox_relay_state.idle_until`), which makes emits in
/// [`Notify::WhenRelayIdle`](crate::Notify::WhenRelayIdle) mode send `NOTIFY`, and wakes
/// as soon as such a transaction commits. Without one, or while the listener connection
/// is down (it reconnects on the next wait), waiting sleeps for the poll interval.
///
/// Known limit: with several relays, one that wakes clears the shared idle mark, and a
/// relay still parked then falls back to its poll interval until it parks again.
#[derive(Debug, Clone)]
pub struct PgRelayStore {
    pool: PgPool,
    listener: Option<Arc<Mutex<Listener>>>,
    channel: String,
}

impl PgRelayStore {
    /// A store over `pool`, without a listener: waiting for work polls.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            listener: None,
            channel: DEFAULT_CHANNEL.to_owned(),
        }
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
        Ok(LockedBatch::claim(self.pool.clone(), limit).await?)
    }

    async fn wait_for_work(&self, timeout: Duration) {
        let Some(listener) = self.listener.clone() else {
            tokio::time::sleep(timeout).await;
            return;
        };
        let waited = blocking(move || {
            // A second concurrent waiter (not the relay's pattern) just sleeps.
            match listener.try_lock() {
                Ok(mut l) => l.wait(timeout),
                Err(_) => std::thread::sleep(timeout),
            }
            Ok(())
        })
        .await;
        if let Err(e) = waited {
            tracing::warn!(error = %e, "outbox LISTEN wait failed");
        }
    }

    async fn backlog(&self) -> Result<Backlog, outbox_core::Error> {
        let pool = self.pool.clone();
        Ok(blocking(move || pool.get()?.__backlog()).await?)
    }
}

#[derive(QueryableByName)]
struct Due {
    #[diesel(sql_type = Bool)]
    due: bool,
}

struct Listener {
    url: String,
    channel: String,
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
    /// Parks until a notification, due work, or `timeout`. Never fails: on a database
    /// error it drops the connection (reconnecting next time) and sleeps instead.
    fn wait(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        if let Err(e) = self.try_wait(timeout, deadline) {
            tracing::warn!(error = %e, "outbox LISTEN connection failed; polling until it is back");
            self.conn = None;
            std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
        }
    }

    fn try_wait(&mut self, timeout: Duration, deadline: Instant) -> Result<()> {
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
        diesel::sql_query(format!(
            "UPDATE outbox_relay_state SET idle_until = now() + interval '{idle_ms} milliseconds'"
        ))
        .execute(conn)?;
        // A row committed between the relay's last claim and the mark above sent no
        // NOTIFY: look once before parking.
        let due = diesel::sql_query(
            "SELECT EXISTS (SELECT 1 FROM outbox WHERE status = 0 AND next_retry_at <= now()) AS due",
        )
        .get_result::<Due>(conn)?
        .due;
        loop {
            let mut woke = due;
            for n in conn.notifications_iter() {
                n?;
                woke = true;
            }
            if woke {
                // Busy from here on: emitters stop paying for NOTIFY.
                diesel::sql_query("UPDATE outbox_relay_state SET idle_until = NULL")
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
