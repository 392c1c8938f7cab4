//! The LISTEN side of the PostgreSQL relay store: the parked relay's mark in
//! `outbox_relay_idle` and its dedicated `tokio-postgres` connection.

use std::future::poll_fn;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Poll, ready};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tokio_postgres::{AsyncMessage, Client, NoTls, Statement};

use crate::backend::NOTIFY_IDLE_SLACK;

/// How long opening the LISTEN connection may take at least, even when the wait that
/// opens it is shorter (it goes on in the background after that wait ends).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Marks this relay parked for `$2` milliseconds; also clears the rows that relays gone
/// for an hour left behind (crashed, or stopped: see [`CLEAR_SQL`]).
///
/// A relay's row is inserted once and updated from then on: see [`CLEAR_SQL`].
const MARK_SQL: &str = "WITH stale AS (DELETE FROM outbox_relay_idle \
     WHERE idle_until < now() - interval '1 hour' AND relay_id <> $1) \
     INSERT INTO outbox_relay_idle (relay_id, idle_until) \
     VALUES ($1, now() + $2::int8 * interval '1 millisecond') \
     ON CONFLICT (relay_id) DO UPDATE SET idle_until = EXCLUDED.idle_until";

/// Due NEW rows above id `$1`.
const DUE_SQL: &str = "SELECT EXISTS (SELECT 1 FROM outbox WHERE status = 0 \
     AND next_retry_at <= now() AND id > $1::int8)";

/// This relay is busy (or stopping): emitters stop paying for NOTIFY.
///
/// An UPDATE that moves the mark into the past, not a DELETE. Every `WhenRelayIdle` emit
/// scans this table, and a relay parks and wakes hundreds of times a second under load:
/// a DELETE per wake-up and an INSERT per park leave a dead row version and a dead line
/// pointer per turn, which only VACUUM reclaims, and where nothing vacuums the table
/// (autovacuum off or lagging) emits walked them all (11 pages after 3,000 turns: 0.04 ms
/// per emit instead of 0.003). Updating the one row, whose indexed column never changes,
/// is a HOT update: PostgreSQL prunes the old versions in place as it reads the page, and
/// the table stays at one page. A minute in the past, so that an
/// emitting transaction that began before this statement does not take the mark for a
/// live one (`idle_until > now()` compares with its start); rows left by stopped relays
/// go an hour later ([`MARK_SQL`]).
const CLEAR_SQL: &str = "UPDATE outbox_relay_idle SET idle_until = now() - interval '1 minute' \
     WHERE relay_id = $1";

/// A store's LISTEN side: its id in `outbox_relay_idle` and its dedicated connection.
pub(super) struct Listener {
    url: String,
    /// This store's row in `outbox_relay_idle`.
    relay_id: String,
    /// Held by the one wait in progress.
    state: tokio::sync::Mutex<State>,
    /// A wait that timed out left this relay's mark in place (it expires
    /// `NOTIFY_IDLE_SLACK` after the timeout): cleared when the relay finds work.
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
            .field("relay_id", &self.relay_id)
            .field("connected", &connected)
            .finish_non_exhaustive()
    }
}

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

impl Listener {
    /// A listener on `url` with a fresh relay id; it connects on the first wait.
    pub(super) fn new(url: String) -> Self {
        Self {
            url,
            relay_id: format!("pid{}-{:016x}", std::process::id(), fastrand::u64(..)),
            state: tokio::sync::Mutex::default(),
            standing: AtomicBool::new(false),
        }
    }

    /// The relay has claimed rows: if a wait that timed out left its mark in place,
    /// removes it now. Otherwise every emit in `WhenRelayIdle` mode would go on sending
    /// a NOTIFY (which serializes their commits) until the mark expires, up to
    /// `NOTIFY_IDLE_SLACK` past the poll interval, while the relay is busy and needs none.
    ///
    /// The UPDATE goes in the background and the relay does not wait for it: the LISTEN
    /// connection may be dead without a word (a failover, a cut network path: no
    /// keepalives reach it), and the claimed batch must not wait on it. The next wait
    /// awaits it before marking again, within its own deadline.
    pub(super) fn busy(&self) {
        if !self.standing.swap(false, Ordering::SeqCst) {
            return;
        }
        // No wait runs while the relay claims; if one did, its own mark handling applies.
        let Ok(state) = self.state.try_lock() else {
            return;
        };
        if let Some(live) = &state.live {
            live.clear(&self.relay_id);
        }
    }

    /// Parks until a notification, due work above id `seen`, or `timeout`. Never
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
        // Bounded also when the server stops answering mid-statement.
        let parked =
            tokio::time::timeout_at(deadline, live.park(&self.relay_id, timeout, deadline, seen));
        let parked = parked.await;
        if let Ok(Ok(Some(standing))) = parked {
            self.standing.store(standing, Ordering::SeqCst);
        }
        if let Ok(Err(e)) = parked {
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
    /// The last clearing of this relay's mark, sent in the background: the next mark
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
    /// notification or `deadline`. Whether the relay's mark is left in place (it timed
    /// out), or `None` if it went back to work without touching the mark.
    async fn park(
        self: &Arc<Self>,
        relay_id: &str,
        timeout: Duration,
        deadline: Instant,
        seen: i64,
    ) -> Result<Option<bool>, Lost> {
        // The last wait's clearing goes first, or it would end the mark below.
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
            return Ok(None);
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
        // Woken: busy from here on (the clearing goes on while the relay claims). Timed
        // out: the mark stays, and expires NOTIFY_IDLE_SLACK after the timeout.
        mark.armed = woke;
        Ok(Some(!woke))
    }

    /// Clears this relay's mark ([`CLEAR_SQL`]) in the background.
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
