//! The LISTEN side of the PostgreSQL relay store: the parked relay's hold on the
//! channel's wake-up lock, and its dedicated `tokio-postgres` connection.
//!
//! # Why an advisory lock
//!
//! A `WhenRelayIdle` emit must know, inside its INSERT, whether some relay is parked.
//! A parked relay holds the channel's [wake-up lock](crate::wake_lock_key) exclusively
//! on its LISTEN session, and the emit tries it shared (a lock-manager call, no table
//! scan): the try fails while a relay holds it or queues for it, and then the row
//! notifies. The emit's shared lock lasts to its commit, so a relay taking the lock
//! first waits for the transactions that emitted without a NOTIFY, and its due check
//! after that sees their rows, but for the cases at the end of this section. A session
//! that ends (a crashed relay, a cut connection) releases the lock with it; a stopped
//! relay's idle session is ended by the server ([`PARKED_IDLE_SLACK`]). Every emit's try
//! goes to one lock of the shared lock table (advisory locks have no fast path): with
//! very many emitting connections, watch for the wait event `LockManager`.
//!
//! The lock is taken in slices of [`LOCK_SLICE`]: a session hears of a notification
//! only between statements, so a relay must not sit in one long lock wait. One relay
//! holds the lock at a time; another one waits for it slice after slice (emits notify
//! meanwhile: their try fails against a queued request too), and is woken by a
//! notification between two slices, or takes the lock when the holder, woken, releases
//! it. An emit whose try succeeded between two slices holds the lock shared to its
//! commit, so the next slice waits for it, and the look after the lock sees its row.
//!
//! Before parking, the relay looks for due rows it has not seen, before it takes the
//! lock and once more after: rows above the newest due row at its last empty claim
//! (rows up to there were held back by the per-key claim or taken by another relay, and
//! must not keep it awake). Left to the poll: a row below that one, emitted without a
//! NOTIFY by a transaction still in flight at that claim. It needs due rows held back
//! per key and an emit in flight with a lower id at once, and waits one poll interval
//! (1 s by default): a look for it by transaction did not earn its cost (BENCHMARKS.md,
//! "The parked relay's late-row look, weighed").

use std::future::poll_fn;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Poll, ready};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, Client, NoTls, Statement};

/// How long opening the LISTEN connection may take at least, even when the wait that
/// opens it is shorter (it goes on in the background after that wait ends).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one statement of the relay waits for the wake-up lock (see the module docs).
const LOCK_SLICE: Duration = Duration::from_millis(50);

/// How long past its wait timeout a relay's LISTEN session may sit idle while it holds
/// the wake-up lock (`idle_session_timeout`, PostgreSQL 14 and later): a relay that
/// stopped (SIGSTOP, a paused VM) while parked would otherwise have every emit send a
/// NOTIFY until its session ends. A relay back from its poll runs its due check well
/// within it (a timed-out wait keeps the lock, see [`Listener::busy`]). Where the server
/// cannot end idle sessions (before PostgreSQL 14) or the wait is longer than it takes
/// (`i32::MAX` ms), a timed-out wait releases the lock instead.
const PARKED_IDLE_SLACK: Duration = Duration::from_secs(5);

/// Due NEW rows above id `$1`, the newest due row the relay's last empty claim saw
/// (0 for none).
///
/// Prepared once per LISTEN session, whose settings keep its generic plan on the
/// `outbox_pending` index ([`SESSION_SQL`]), a range scan.
const DUE_SQL: &str = "SELECT EXISTS (SELECT 1 FROM outbox WHERE status = 0 \
     AND next_retry_at <= now() AND id > $1::int8)";

/// The LISTEN session's settings. `enable_seqscan = off`: PostgreSQL keeps a prepared
/// statement's generic plan until the table's statistics change, and [`DUE_SQL`]'s,
/// planned on a fresh table (before autovacuum's first analyze), is a sequential scan
/// that stays one as the table grows: a scan of the whole table per park
/// (BENCHMARKS.md, "Claim plans"). `jit = off`: as for the claim, a short index walk
/// never pays a compilation back.
const SESSION_SQL: &str = "SET enable_seqscan = off; SET jit = off";

/// Ends this session's hold (the connection is the listener's alone, so all of its
/// advisory locks) and the limits the hold came with.
const RELEASE_SQL: &str = "SELECT pg_advisory_unlock_all(); RESET idle_session_timeout";
/// [`RELEASE_SQL`] where the server has no `idle_session_timeout`.
const RELEASE_SQL_BEFORE_14: &str = "SELECT pg_advisory_unlock_all()";

/// A store's LISTEN side: its dedicated connection, and whether a wait left the
/// wake-up lock held.
pub(super) struct Listener {
    url: String,
    /// Held by the one wait in progress.
    state: tokio::sync::Mutex<State>,
    /// A wait that timed out left the wake-up lock held: released when the relay finds
    /// work.
    standing: AtomicBool,
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
            .field("connected", &connected)
            .field("standing", &self.standing)
            .finish_non_exhaustive()
    }
}

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

impl Listener {
    /// A listener on `url`; it connects on the first wait.
    pub(super) fn new(url: String) -> Self {
        Self {
            url,
            state: tokio::sync::Mutex::default(),
            standing: AtomicBool::new(false),
        }
    }

    /// The relay has claimed rows: if a wait that timed out left the wake-up lock held,
    /// releases it now. Otherwise every emit in `WhenRelayIdle` mode would go on sending
    /// a NOTIFY (which serializes their commits) while the relay is busy and needs none.
    ///
    /// The release goes in the background and the relay does not wait for it: the
    /// LISTEN connection may be dead without a word (a failover, a cut network path: no
    /// keepalives reach it), and the claimed batch must not wait on it. The next wait
    /// awaits it before taking the lock again, within its own deadline.
    pub(super) fn busy(&self) {
        if !self.standing.swap(false, Ordering::SeqCst) {
            return;
        }
        // No wait runs while the relay claims; if one did, its own lock handling applies.
        let Ok(state) = self.state.try_lock() else {
            return;
        };
        if let Some(live) = &state.live {
            live.release();
        }
    }

    /// Parks until a notification, due work beyond `seen`, or `timeout`. Never
    /// fails: without a working connection it sleeps instead (and reconnects next time).
    pub(super) async fn wait(&self, channel: &str, timeout: Duration, seen: i64) {
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
        // Bounded also when the server stops answering mid-statement (the wait for the
        // lock ends on the server at the deadline).
        let parked = tokio::time::timeout_at(
            deadline + PARKED_IDLE_SLACK,
            live.park(timeout, deadline, seen),
        )
        .await;
        match parked {
            Ok(Ok(Parked::Holding)) => self.standing.store(true, Ordering::SeqCst),
            Ok(Ok(Parked::Released)) => self.standing.store(false, Ordering::SeqCst),
            Ok(Ok(Parked::Due)) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "outbox LISTEN connection failed; polling until it is back");
                state.failing = true;
                state.live = None;
                sleep_until(deadline).await;
            }
            // Whether it holds the lock is unknown: the next wait opens a new session
            // (the server releases the old one's lock when it ends).
            Err(_) => state.live = None,
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
    due: Statement,
    /// The channel's wake-up lock.
    lock: (i32, i32),
    /// The server ends idle sessions on request (`idle_session_timeout`, PostgreSQL 14).
    idle_limit: bool,
    /// This session holds the wake-up lock (from the last wait that took it until the
    /// release that follows).
    held: AtomicBool,
    /// The last release of the lock, sent in the background: the next wait awaits it.
    releasing: Mutex<Option<JoinHandle<()>>>,
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
        client
            .batch_execute(&format!("{SESSION_SQL}; LISTEN {}", quote_ident(channel)))
            .await?;
        let (due, version) = tokio::try_join!(
            client.prepare(DUE_SQL),
            client.query_one("SELECT current_setting('server_version_num')::int4", &[]),
        )?;
        Ok(Self {
            client,
            channel: channel.to_owned(),
            events,
            reader,
            due,
            lock: crate::wake_lock_key(channel),
            idle_limit: version.try_get::<_, i32>(0)? >= 140_000,
            held: AtomicBool::new(false),
            releasing: Mutex::default(),
        })
    }

    /// Still connected (and on `channel`), and its reading task still running (it ends
    /// with the runtime it was spawned on).
    fn usable(&self, channel: &str) -> bool {
        self.channel == channel
            && !self.events.closed.load(Ordering::SeqCst)
            && !self.reader.is_finished()
    }

    /// Looks for due work beyond `seen`, takes the wake-up lock (unless a timed-out wait
    /// left it held), looks again, then waits for a notification or `deadline`.
    async fn park(
        self: &Arc<Self>,
        timeout: Duration,
        deadline: Instant,
        seen: i64,
    ) -> Result<Parked, Lost> {
        // The last wait's release goes first, or it would end the hold below.
        let releasing = self
            .releasing
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(releasing) = releasing {
            let _ = releasing.await;
        }
        // Rows committed since the claim: back to work without the lock. Taking it first
        // and looking after (as below) would announce an idle relay on every turn of a
        // relay that keeps up with its emitters, and every emit meanwhile would pay for a
        // NOTIFY (which serialises commits: BENCHMARKS.md, the emit rows).
        if self.due(seen).await? {
            return Ok(Parked::Due);
        }
        // Older notifications are stale: the relay has claimed since they were sent.
        let before = self.events.received.load(Ordering::SeqCst);
        // From here on, a dropped wait (the relay stopping) releases the lock.
        let mut hold = Hold {
            live: self,
            armed: true,
        };
        let idle_limit = self.idle_limit(timeout);
        while !self.held.load(Ordering::SeqCst) {
            match self.lock(idle_limit).await {
                Ok(()) => self.held.store(true, Ordering::SeqCst),
                // Behind another parked relay, or an emitting transaction in flight:
                // between two slices, a notification or the deadline ends the wait.
                Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                    if self.events.received.load(Ordering::SeqCst) != before
                        || self.events.closed.load(Ordering::SeqCst)
                        || Instant::now() >= deadline
                    {
                        break;
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        // The emits that committed before the lock was taken sent no NOTIFY: look once
        // more before parking.
        let due = self.due(seen).await?;
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
            // Lost while parked (and the lock with the session); the caller polls.
            hold.armed = false;
            return Err(Lost::Closed);
        }
        // Woken: busy from here on (the release goes on while the relay claims). Timed
        // out holding the lock: it stays, so that an idle relay re-parks without churn,
        // until a claim returns rows ([`Listener::busy`]).
        let standing = !woke && idle_limit.is_some() && self.held.load(Ordering::SeqCst);
        hold.armed = !standing;
        Ok(if standing {
            Parked::Holding
        } else {
            Parked::Released
        })
    }

    /// Whether due NEW rows above `seen` are committed.
    async fn due(&self, seen: i64) -> Result<bool, tokio_postgres::Error> {
        self.client.query_one(&self.due, &[&seen]).await?.try_get(0)
    }

    /// The `idle_session_timeout` of a hold for a wait of `timeout`, in ms: `None` where
    /// the server has none, or the wait is longer than the setting takes.
    fn idle_limit(&self, timeout: Duration) -> Option<i32> {
        let ms = (timeout + PARKED_IDLE_SLACK).as_millis();
        self.idle_limit.then(|| i32::try_from(ms).ok()).flatten()
    }

    /// Tries to take the wake-up lock for [`LOCK_SLICE`], with the server ending the
    /// session if it then sits idle `idle_limit` ms. The statement's own limits are
    /// `SET LOCAL`: they end with the batch's implicit transaction (the lock does not).
    async fn lock(&self, idle_limit: Option<i32>) -> Result<(), tokio_postgres::Error> {
        let idle = idle_limit.map_or(String::new(), |ms| {
            format!("SET idle_session_timeout = {ms}; ")
        });
        let (class, key) = self.lock;
        let slice = LOCK_SLICE.as_millis();
        self.client
            .batch_execute(&format!(
                "SET LOCAL lock_timeout = {slice}; SET LOCAL statement_timeout = 0; \
                 {idle}SELECT pg_advisory_lock({class}, {key})"
            ))
            .await
    }

    /// Releases the wake-up lock ([`RELEASE_SQL`]) in the background.
    fn release(self: &Arc<Self>) {
        self.held.store(false, Ordering::SeqCst);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // no runtime (dropped outside of it): the session ends with the runtime
        };
        let sql = if self.idle_limit {
            RELEASE_SQL
        } else {
            RELEASE_SQL_BEFORE_14
        };
        let live = self.clone();
        let releasing = runtime.spawn(async move {
            if let Err(e) = live.client.batch_execute(sql).await {
                tracing::debug!(error = %e, "outbox: releasing the relay's wake-up lock failed");
            }
        });
        *self
            .releasing
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(releasing);
    }
}

/// How a park ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parked {
    /// Due rows were committed since the claim: back to work without taking the lock.
    Due,
    /// Woken by a notification or due rows (or timed out where the hold cannot stand):
    /// the lock is released.
    Released,
    /// Timed out holding the lock: it stays held, so that an idle relay re-parks without
    /// churn, until a claim returns rows ([`Listener::busy`]).
    Holding,
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

/// While armed, releases the wake-up lock when dropped: when the wait ends woken, or is
/// dropped while parked (the relay stopping).
struct Hold<'a> {
    live: &'a Arc<Live>,
    armed: bool,
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.live.release();
        }
    }
}
