//! PostgreSQL: the relay store, whose idle wait is woken by `NOTIFY`.

use std::future::poll_fn;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Poll, ready};
use std::time::Duration;

use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::BigInt;
use diesel::{PgConnection, QueryableByName, RunQueryDsl as _};
use outbox_core::{Backlog, ClaimedBatch as _, RelayStore};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tokio_postgres::{AsyncMessage, Client, NoTls, Statement};

use crate::backend::NOTIFY_IDLE_SLACK;
use crate::relay::{DEFAULT_STALL_TIMEOUT, LockedBatch, blocking};
use crate::{ClaimOrder, DEFAULT_CHANNEL, OutboxConnection as _, PgPool, Result};

/// How long opening the LISTEN connection may take at least, even when the wait that
/// opens it is shorter (it goes on in the background after that wait ends).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The relay's store on PostgreSQL: claims with `FOR UPDATE SKIP LOCKED` on a pooled
/// connection, so any number of relays can run side by side, in per-key order by
/// default ([`ClaimOrder`]: the claim, its probes and its EXPLAIN are one statement).
///
/// With a listener ([`connect`](Self::connect) or [`with_listener`](Self::with_listener))
/// an idle relay waits on `LISTEN` over its own dedicated connection: it announces that
/// it is parked (its own row in `outbox_relay_idle`, keyed by a per-store id), which
/// makes emits in [`Notify::WhenRelayIdle`](crate::Notify::WhenRelayIdle) mode send
/// `NOTIFY` while any relay is parked, and wakes as soon as such a transaction commits
/// (the notification is read by a task on the tokio runtime, not polled for); a woken
/// relay removes only its own row, so other parked relays stay reachable. Without a
/// listener, or while its connection is down (it reconnects on the next wait), waiting
/// sleeps for the poll interval.
///
/// Before it marks itself parked, and once more after, the relay looks for due rows
/// newer than what its last claims saw: a relay that keeps up with its emitters goes
/// back to work without a mark (so that they send no NOTIFY), and a row committed just
/// before the mark is not left to the poll. Rows the
/// per-key claim held back (behind another relay's batch or a retry) do not count: that
/// relay, or the poll interval, picks them up.
///
/// # The LISTEN connection
///
/// It is opened with `tokio-postgres`, not libpq, so that the wait can sleep on the
/// socket. It takes the same URL as the pool (`postgres://user:password@host:port/db`,
/// with `options=-c search_path=..` and the other common parameters), but:
/// - it does not use TLS: with `sslmode=require` (or any setting or parameter that
///   `tokio-postgres` does not know, like `sslrootcert`) the listener does not connect,
///   and the relay polls, with a warning;
/// - it does not read libpq's environment variables (`PGHOST`, `PGPASSWORD`, ..) or
///   `~/.pgpass`: put what it needs in the URL.
///
/// Everything else (claims, marks of the pool, emits) goes through libpq as before.
///
/// # The claim's transaction
///
/// Each claim runs in a `READ COMMITTED` transaction whatever the database's
/// `default_transaction_isolation`: under `REPEATABLE READ` a claim that meets a row
/// another relay has just marked SENT fails with a serialization error instead of
/// skipping it.
///
/// # A stalled relay
///
/// A relay that stops answering while it holds a batch (its process stopped, its VM
/// paused, its network cut) holds that batch's row locks, and in per-key order the
/// later messages of its keys, until the server drops its session: with TCP's defaults,
/// hours. The store bounds that by the [stall timeout](Self::with_stall_timeout)
/// (default 30 s), set for each claim's transaction (`SET LOCAL`, so nothing stays on
/// the pooled connection):
///
/// - `idle_in_transaction_session_timeout`: the server ends a session that sits idle
///   inside its transaction that long, which rolls the batch back and releases its
///   rows to the other relays;
/// - `lock_timeout`: no statement of the claim waits longer for a lock (a migration's
///   `ALTER TABLE`, say).
///
/// The relay itself notices a dead server sooner with TCP keepalives on its
/// connections: [`connect`](Self::connect) adds libpq's `keepalives_idle=10`,
/// `keepalives_interval=5` and `keepalives_count=3` to a URL that sets none of them;
/// for a pool you build yourself, put them in its URL.
#[derive(Debug, Clone)]
pub struct PgRelayStore {
    pool: PgPool,
    listener: Option<Arc<Listener>>,
    channel: String,
    order: ClaimOrder,
    stall: Duration,
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
            stall: DEFAULT_STALL_TIMEOUT,
            seen: Arc::default(),
        }
    }

    /// Sets the stall timeout (default 30 s): how long the server keeps a claimed batch
    /// whose relay has gone silent before it rolls the batch back, so that another relay
    /// takes its rows and keys over (see [a stalled relay](Self#a-stalled-relay)). It
    /// must exceed the longest time a relay may take to publish one batch (with the
    /// Redis publisher, its response timeout, 5 s by default, per round trip of the
    /// batch): a batch that takes longer loses its claim, is published again by another
    /// relay, and the slow relay backs off as after a database outage.
    /// `Duration::ZERO` sets nothing: the server's settings apply.
    pub fn with_stall_timeout(mut self, timeout: Duration) -> Self {
        self.stall = timeout;
        self
    }

    /// The stall timeout.
    pub fn stall_timeout(&self) -> Duration {
        self.stall
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
    /// listens for wake-ups on a dedicated connection to the same URL. The pool's
    /// connections get TCP keepalives (see [a stalled relay](Self#a-stalled-relay))
    /// unless the URL sets its own.
    ///
    /// The pool does not test connections on check-out (r2d2's `test_on_check_out`, a
    /// `SELECT 1` round trip before each claim): a connection the server has dropped
    /// fails its claim instead, which the relay takes as a database outage and backs off
    /// from (100 ms at first), and the pool discards it.
    pub fn connect(database_url: &str, max_size: u32) -> Result<Self> {
        let pool = Pool::builder()
            .max_size(max_size)
            .test_on_check_out(false)
            .build(ConnectionManager::<PgConnection>::new(with_keepalives(
                database_url,
            )))?;
        Ok(Self::new(pool).with_listener(database_url))
    }

    /// Waits for work with `LISTEN` on a dedicated connection to `database_url` (opened
    /// on the first wait, without TLS: see [the LISTEN connection](Self#the-listen-connection)).
    /// Use the URL of the pool's database and schema.
    pub fn with_listener(mut self, database_url: impl Into<String>) -> Self {
        self.listener = Some(Arc::new(Listener {
            url: database_url.into(),
            relay_id: format!("pid{}-{:016x}", std::process::id(), fastrand::u64(..)),
            state: tokio::sync::Mutex::default(),
        }));
        self
    }

    /// Sets the `NOTIFY` channel (default `outbox`): the one emitters use in
    /// [`EmitOptions::channel`](crate::EmitOptions::channel).
    pub fn with_channel(mut self, channel: impl Into<String>) -> Self {
        // An open LISTEN connection on another channel is replaced on the next wait.
        self.channel = channel.into();
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
        let batch = LockedBatch::claim(self.pool.clone(), limit, self.order, self.stall).await?;
        let empty = batch.messages().is_empty();
        self.seen.empty.store(empty, Ordering::Relaxed);
        self.seen
            .up_to
            .store(if empty { up_to } else { 0 }, Ordering::Relaxed);
        Ok(batch)
    }

    async fn wait_for_work(&self, timeout: Duration) {
        match &self.listener {
            Some(listener) => {
                let seen = self.seen.up_to.load(Ordering::Relaxed);
                listener.wait(&self.channel, timeout, seen).await;
            }
            None => tokio::time::sleep(timeout).await,
        }
    }

    async fn backlog(&self) -> Result<Backlog, outbox_core::Error> {
        let pool = self.pool.clone();
        Ok(blocking(move || pool.get()?.__backlog()).await?)
    }

    /// Yes: a claim skips the rows another claim holds (`SKIP LOCKED`), and the per-key
    /// claim holds back the later rows of their keys.
    fn claims_ahead(&self) -> bool {
        true
    }
}

/// libpq's TCP keepalive parameters for the relay's pool: a dead server or a cut
/// network is noticed after about 25 s of silence instead of the system's two hours.
const KEEPALIVES: [(&str, &str); 4] = [
    ("keepalives", "1"),
    ("keepalives_idle", "10"),
    ("keepalives_interval", "5"),
    ("keepalives_count", "3"),
];

/// `url` with libpq's TCP keepalive parameters added (`keepalives_idle=10`,
/// `keepalives_interval=5`, `keepalives_count=3`: a dead server or a cut network is
/// noticed after about 25 s of silence instead of the system's two hours), unless it
/// sets a keepalive parameter itself. Takes both of libpq's forms: `postgres://..` URIs
/// and `key=value` strings. [`PgRelayStore::connect`] uses it for its pool; use it for a
/// relay pool you build yourself.
pub fn with_keepalives(url: &str) -> String {
    if url.contains("keepalives") {
        return url.to_owned();
    }
    let is_uri = ["postgres://", "postgresql://"].iter().any(|scheme| {
        url.get(..scheme.len())
            .is_some_and(|s| s.eq_ignore_ascii_case(scheme))
    });
    let mut out = url.to_owned();
    for (i, (key, value)) in KEEPALIVES.iter().enumerate() {
        let sep = match (is_uri, i) {
            (false, _) => " ",
            (true, 0) if !url.contains('?') => "?",
            (true, _) => "&",
        };
        out.push_str(&format!("{sep}{key}={value}"));
    }
    out
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

/// Marks this relay parked for `$2` milliseconds; also clears marks that crashed relays
/// left behind.
const MARK_SQL: &str = "WITH stale AS (DELETE FROM outbox_relay_idle \
     WHERE idle_until < now() - interval '1 hour') \
     INSERT INTO outbox_relay_idle (relay_id, idle_until) \
     VALUES ($1, now() + $2::int8 * interval '1 millisecond') \
     ON CONFLICT (relay_id) DO UPDATE SET idle_until = EXCLUDED.idle_until";

/// Due NEW rows above id `$1`.
const DUE_SQL: &str = "SELECT EXISTS (SELECT 1 FROM outbox WHERE status = 0 \
     AND next_retry_at <= now() AND id > $1::int8)";

/// This relay is busy (or stopping): emitters stop paying for NOTIFY.
const CLEAR_SQL: &str = "DELETE FROM outbox_relay_idle WHERE relay_id = $1";

/// A store's LISTEN side: its id in `outbox_relay_idle` and its dedicated connection.
struct Listener {
    url: String,
    /// This store's row in `outbox_relay_idle`.
    relay_id: String,
    /// Held by the one wait in progress.
    state: tokio::sync::Mutex<State>,
}

#[derive(Default)]
struct State {
    live: Option<Arc<Live>>,
    /// An attempt to open the connection, left running by a wait that ended first.
    connecting: Option<JoinHandle<Result<Live, String>>>,
    /// The last attempt failed (warned once per outage).
    failing: bool,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let connected = self.state.try_lock().ok().map(|s| s.live.is_some());
        f.debug_struct("Listener")
            .field("relay_id", &self.relay_id)
            .field("connected", &connected)
            .finish_non_exhaustive()
    }
}

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

impl Listener {
    /// Parks until a notification, due work above id `seen`, or `timeout`. Never
    /// fails: without a working connection it sleeps instead (and reconnects next time).
    async fn wait(&self, channel: &str, timeout: Duration, seen: i64) {
        let deadline = Instant::now() + timeout;
        // A second concurrent waiter (not the relay's pattern) just sleeps.
        let Ok(mut state) = self.state.try_lock() else {
            sleep_until(deadline).await;
            return;
        };
        let live = match state.live.clone() {
            Some(live) if live.usable(channel) => live,
            _ => {
                state.live = None;
                match self.open(&mut state, channel, deadline).await {
                    Some(live) => live,
                    None => {
                        sleep_until(deadline).await;
                        return;
                    }
                }
            }
        };
        // Bounded also when the server stops answering mid-statement.
        let parked =
            tokio::time::timeout_at(deadline, live.park(&self.relay_id, timeout, deadline, seen));
        if let Ok(Err(e)) = parked.await {
            tracing::warn!(error = %e, "outbox LISTEN connection failed; polling until it is back");
            state.failing = true;
            state.live = None;
            sleep_until(deadline).await;
        }
    }

    /// Opens the connection, or goes on opening it in the background past `deadline`.
    async fn open(&self, state: &mut State, channel: &str, deadline: Instant) -> Option<Arc<Live>> {
        let attempt = state.connecting.get_or_insert_with(|| {
            let (url, channel) = (self.url.clone(), channel.to_owned());
            tokio::spawn(async move {
                match tokio::time::timeout(CONNECT_TIMEOUT, Live::connect(&url, &channel)).await {
                    Ok(Ok(live)) => Ok(live),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err(format!("no connection within {CONNECT_TIMEOUT:?}")),
                }
            })
        });
        let opened = tokio::select! {
            opened = attempt => opened,
            () = sleep_until(deadline) => return None,
        };
        state.connecting = None;
        match opened.map_err(|e| e.to_string()).and_then(|r| r) {
            Ok(live) if live.channel == channel => {
                if std::mem::take(&mut state.failing) {
                    tracing::info!("outbox LISTEN connection is back");
                }
                let live = Arc::new(live);
                state.live = Some(live.clone());
                Some(live)
            }
            Ok(_) => None, // opened for a channel changed since: the next wait retries
            Err(e) => {
                if std::mem::replace(&mut state.failing, true) {
                    tracing::debug!(error = %e, "outbox LISTEN connection still down");
                } else {
                    tracing::warn!(error = %e, "outbox LISTEN connection failed; polling until it is back");
                }
                None
            }
        }
    }
}

/// An open LISTEN connection. A task on the runtime reads the socket and signals each
/// notification through `events`.
struct Live {
    client: Client,
    channel: String,
    events: Arc<Events>,
    reader: JoinHandle<()>,
    mark: Statement,
    due: Statement,
    clear: Statement,
    /// The last DELETE of this relay's mark, sent in the background: the next mark
    /// waits for it.
    clearing: Mutex<Option<JoinHandle<()>>>,
}

/// What the reading task tells the waits.
#[derive(Default)]
struct Events {
    /// Notifications received so far.
    received: AtomicU64,
    /// The connection has ended.
    closed: AtomicBool,
    /// Signalled on each notification and when the connection ends.
    changed: tokio::sync::Notify,
}

impl Live {
    async fn connect(url: &str, channel: &str) -> Result<Self, tokio_postgres::Error> {
        let (client, mut conn) = tokio_postgres::connect(url, NoTls).await?;
        let events = Arc::new(Events::default());
        let signal = events.clone();
        let reader = tokio::spawn(async move {
            let end = poll_fn(|cx| {
                loop {
                    match ready!(conn.poll_message(cx)) {
                        Some(Ok(AsyncMessage::Notification(_))) => {
                            signal.received.fetch_add(1, Ordering::SeqCst);
                            signal.changed.notify_waiters();
                        }
                        Some(Ok(_)) => {} // a notice
                        Some(Err(e)) => return Poll::Ready(Some(e)),
                        None => return Poll::Ready(None),
                    }
                }
            })
            .await;
            signal.closed.store(true, Ordering::SeqCst);
            signal.changed.notify_waiters();
            if let Some(e) = end {
                tracing::debug!(error = %e, "outbox LISTEN connection ended");
            }
        });
        // The marks are worth nothing after a crash: no need to wait for their WAL flush.
        client
            .batch_execute(&format!(
                "SET synchronous_commit = off; LISTEN {}",
                quote_ident(channel)
            ))
            .await?;
        let (mark, due, clear) = tokio::try_join!(
            client.prepare(MARK_SQL),
            client.prepare(DUE_SQL),
            client.prepare(CLEAR_SQL),
        )?;
        Ok(Self {
            client,
            channel: channel.to_owned(),
            events,
            reader,
            mark,
            due,
            clear,
            clearing: Mutex::default(),
        })
    }

    /// Still connected (and on `channel`), and its reading task still running (it ends
    /// with the runtime it was spawned on).
    fn usable(&self, channel: &str) -> bool {
        self.channel == channel
            && !self.events.closed.load(Ordering::SeqCst)
            && !self.reader.is_finished()
    }

    /// Marks the relay parked, looks for due work above `seen`, then waits for a
    /// notification or `deadline`.
    async fn park(
        self: &Arc<Self>,
        relay_id: &str,
        timeout: Duration,
        deadline: Instant,
        seen: i64,
    ) -> Result<(), Lost> {
        // The last wait's DELETE goes first, or it would remove the mark below.
        let clearing = self
            .clearing
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(clearing) = clearing {
            let _ = clearing.await;
        }
        // Rows committed since the claim: back to work without a mark. Marking first and
        // looking after (as below) would announce an idle relay on every turn of a relay
        // that keeps up with its emitters, and every emit meanwhile would pay for a
        // NOTIFY (which serialises commits); measured at 8 emitting connections, 0.74 of
        // a hand-written insert's rate with that churn.
        let due: bool = self
            .client
            .query_one(&self.due, &[&seen])
            .await?
            .try_get(0)?;
        if due {
            return Ok(());
        }
        // Older notifications are stale: the relay has claimed since they were sent.
        let before = self.events.received.load(Ordering::SeqCst);
        let idle_ms = i64::try_from((timeout + NOTIFY_IDLE_SLACK).as_millis()).unwrap_or(i64::MAX);
        // From here on, a dropped wait (the relay stopping) clears the mark.
        let mut mark = Marked {
            live: self,
            relay_id,
            armed: true,
        };
        self.client
            .execute(&self.mark, &[&relay_id, &idle_ms])
            .await?;
        // A row committed between the relay's last claim and the mark above sent no
        // NOTIFY: look once before parking.
        let due: bool = self
            .client
            .query_one(&self.due, &[&seen])
            .await?
            .try_get(0)?;
        // Registered before the count is read again: a notification in between is not lost.
        let mut changed = pin!(self.events.changed.notified());
        changed.as_mut().enable();
        let mut woke = due || self.events.received.load(Ordering::SeqCst) != before;
        if !woke && !self.events.closed.load(Ordering::SeqCst) {
            tokio::select! {
                () = changed => {}
                () = sleep_until(deadline) => {}
            }
            woke = self.events.received.load(Ordering::SeqCst) != before;
        }
        if self.events.closed.load(Ordering::SeqCst) && !woke {
            // Lost while parked: the mark expires by itself; the caller polls.
            mark.armed = false;
            return Err(Lost::Closed);
        }
        // Woken: busy from here on (the DELETE goes on while the relay claims). Timed
        // out: the mark stays, and expires NOTIFY_IDLE_SLACK after the timeout.
        mark.armed = woke;
        Ok(())
    }

    /// Sends the DELETE of this relay's mark in the background.
    fn clear(self: &Arc<Self>, relay_id: &str) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // no runtime (dropped outside of it): the mark expires
        };
        let (live, relay_id) = (self.clone(), relay_id.to_owned());
        let clearing = runtime.spawn(async move {
            if let Err(e) = live.client.execute(&live.clear, &[&relay_id]).await {
                tracing::debug!(error = %e, "outbox: clearing the relay's idle mark failed");
            }
        });
        *self.clearing.lock().unwrap_or_else(PoisonError::into_inner) = Some(clearing);
    }
}

/// Why a park ended without its connection.
#[derive(Debug)]
enum Lost {
    Db(tokio_postgres::Error),
    Closed,
}

impl From<tokio_postgres::Error> for Lost {
    fn from(e: tokio_postgres::Error) -> Self {
        Self::Db(e)
    }
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Db(e) => e.fmt(f),
            Self::Closed => f.write_str("connection closed while parked"),
        }
    }
}

/// While armed, clears the relay's mark when dropped: when the wait ends woken, or is
/// dropped while parked (the relay stopping).
struct Marked<'a> {
    live: &'a Arc<Live>,
    relay_id: &'a str,
    armed: bool,
}

impl Drop for Marked<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.live.clear(self.relay_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::with_keepalives;

    #[test]
    fn keepalives_join_either_form_of_url_unless_it_has_its_own() {
        let keep = "keepalives=1&keepalives_idle=10&keepalives_interval=5&keepalives_count=3";
        assert_eq!(
            with_keepalives("postgres://u@h/db"),
            format!("postgres://u@h/db?{keep}")
        );
        assert_eq!(
            with_keepalives("postgresql://h/db?options=-c%20search_path%3Dx"),
            format!("postgresql://h/db?options=-c%20search_path%3Dx&{keep}")
        );
        assert_eq!(
            with_keepalives("host=h dbname=db"),
            format!("host=h dbname=db {}", keep.replace('&', " "))
        );
        let own = "postgres://h/db?keepalives_idle=60";
        assert_eq!(with_keepalives(own), own);
    }
}
