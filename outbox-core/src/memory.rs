//! In-memory database and broker for unit tests of handlers and emitting code, without
//! services. They keep the contract of the real backends (atomic emit, duplicate msg_ids
//! rejected, dedup in the handler's transaction) but are not durable and not fast.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::pin::pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::{
    AsyncInbox, Backlog, ClaimedBatch, DEFAULT_MAX_PAYLOAD_BYTES, DeadRow, Envelope, Error,
    HandlerError, Inbox, InboxBatchOutcomes, MsgId, OutboxEvent, Processed, PublishOutcomes,
    Publisher, Rejected, RelayBatchOutcome, RelayStore, Status, StoredMessage, TxFuture,
};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking transaction never left partial state behind (it worked on a copy), so a
    // poisoned lock is safe to keep using.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An outbox row as the in-memory database holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRow {
    /// The row id.
    pub id: i64,
    /// NEW, SENT or DEAD.
    pub status: Status,
    /// Failed publish attempts.
    pub retries: u32,
    /// When the row is due (again).
    pub next_retry_at: DateTime<Utc>,
    /// The last publish error.
    pub last_error: Option<String>,
    /// The message.
    pub envelope: Envelope,
}

struct State<S> {
    data: S,
    rows: BTreeMap<i64, OutboxRow>,
    msg_ids: HashSet<MsgId>,
    consumed: HashSet<(String, MsgId)>,
    claimed: HashSet<i64>,
    next_id: i64,
}

/// Held for a whole transaction: transactions are serial, like SERIALIZABLE. Blocking
/// transactions wait on a condition variable, async ones ([`AsyncInbox`]) on a `Notify`,
/// so that an async transaction can hold it across its handler's awaits (a std
/// `MutexGuard` cannot be held across an await in a `Send` future).
#[derive(Default)]
struct Gate {
    held: Mutex<bool>,
    freed: Condvar,
    freed_async: tokio::sync::Notify,
}

/// The gate, held; released on drop (also when a handler panics).
struct GateGuard<'a>(&'a Gate);

impl Gate {
    fn lock(&self) -> GateGuard<'_> {
        let mut held = lock(&self.held);
        while *held {
            held = self
                .freed
                .wait(held)
                .unwrap_or_else(PoisonError::into_inner);
        }
        *held = true;
        GateGuard(self)
    }

    async fn lock_async(&self) -> GateGuard<'_> {
        loop {
            // Registered before the check, so that a release in between is not missed.
            let mut freed = pin!(self.freed_async.notified());
            freed.as_mut().enable();
            if !std::mem::replace(&mut *lock(&self.held), true) {
                return GateGuard(self);
            }
            freed.await;
        }
    }
}

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        *lock(&self.0.held) = false;
        // One waiter of each kind: whichever takes the gate first, the other waits again.
        self.0.freed.notify_one();
        self.0.freed_async.notify_one();
    }
}

struct Shared<S> {
    gate: Gate,
    state: Mutex<State<S>>,
    wake: tokio::sync::Notify,
}

/// An in-memory database: user data `S`, an outbox and a consumer inbox, with
/// all-or-nothing transactions. Cloning shares the database.
///
/// It is the consumer's store for blocking handlers ([`Inbox`]) and for async ones
/// ([`AsyncInbox`], e.g. an [`AsyncTxHandler`](crate::AsyncTxHandler) with
/// `Conn = MemoryTx<S>` through
/// [`Dispatcher::consume_async`](crate::Dispatcher::consume_async)); where both traits
/// are in scope, call its methods as `Inbox::process(&db, ..)`. An async transaction
/// holds the database across its handler's awaits: on a current-thread runtime, do not
/// call the blocking API ([`transaction`](Self::transaction), [`Inbox`]) from a task
/// while another task's async transaction is in progress; it would block the thread
/// that transaction needs to finish.
///
/// ```
/// use outbox_core::{MemoryDb, OutboxEvent, Status};
///
/// #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
/// struct OrderPaid { #[outbox(id)] order_id: String }
///
/// let db = MemoryDb::new(0_u32); // the user data: here a counter
/// db.transaction(|tx| {
///     *tx.data() += 1;
///     tx.emit(OrderPaid { order_id: "order-42".into() })
/// })?;
/// // An error after emit rolls back the data change and the message together.
/// let failed: Result<(), outbox_core::Error> = db.transaction(|tx| {
///     *tx.data() += 1;
///     tx.emit(OrderPaid { order_id: "order-43".into() })?;
///     Err(outbox_core::Error::Handler("business rule failed".into()))
/// });
/// assert!(failed.is_err());
/// assert_eq!(db.read(|n| *n), 1);
/// assert_eq!(db.rows().len(), 1);
/// assert_eq!(db.rows()[0].status, Status::New);
/// # Ok::<_, outbox_core::Error>(())
/// ```
pub struct MemoryDb<S> {
    shared: Arc<Shared<S>>,
}

impl<S> Clone for MemoryDb<S> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S> std::fmt::Debug for MemoryDb<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryDb")
            .field("rows", &lock(&self.shared.state).rows.len())
            .finish()
    }
}

/// An open in-memory transaction: change the data through [`data`](Self::data), emit
/// events with [`emit`](Self::emit). Nothing is visible to others until it commits.
pub struct MemoryTx<S> {
    shared: Arc<Shared<S>>,
    data: S,
    emitted: Vec<Envelope>,
}

impl<S> std::fmt::Debug for MemoryTx<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryTx")
            .field("emitted", &self.emitted.len())
            .finish()
    }
}

impl<S> MemoryTx<S> {
    /// The transaction's copy of the user data.
    pub fn data(&mut self) -> &mut S {
        &mut self.data
    }

    /// Writes `event` to the outbox in this transaction and returns its msg_id.
    /// A msg_id already in the outbox (or emitted earlier in this transaction) is
    /// [`Error::Duplicate`]. With the `opentelemetry` feature it carries the current
    /// span's trace ([`trace`](crate::trace)).
    pub fn emit<E: OutboxEvent>(&mut self, event: E) -> Result<MsgId, Error> {
        let mut envelope = Envelope::from_event(&event, DEFAULT_MAX_PAYLOAD_BYTES)?;
        crate::trace::add_current(&mut envelope.headers);
        let taken = lock(&self.shared.state).msg_ids.contains(&envelope.msg_id)
            || self.emitted.iter().any(|e| e.msg_id == envelope.msg_id);
        if taken {
            return Err(Error::Duplicate(envelope.msg_id));
        }
        let id = envelope.msg_id.clone();
        self.emitted.push(envelope);
        Ok(id)
    }
}

impl<S: Clone + Send + 'static> MemoryDb<S> {
    /// A database holding `data`.
    pub fn new(data: S) -> Self {
        let state = State {
            data,
            rows: BTreeMap::new(),
            msg_ids: HashSet::new(),
            consumed: HashSet::new(),
            claimed: HashSet::new(),
            next_id: 1,
        };
        Self {
            shared: Arc::new(Shared {
                gate: Gate::default(),
                state: Mutex::new(state),
                wake: tokio::sync::Notify::new(),
            }),
        }
    }

    /// Runs `f` in a transaction: commits its data changes and emitted events if it
    /// returns `Ok`, discards them on `Err` or panic. Do not call the database from
    /// inside `f`; transactions are serial and it would wait on itself.
    pub fn transaction<T, E>(
        &self,
        f: impl FnOnce(&mut MemoryTx<S>) -> Result<T, E>,
    ) -> Result<T, E> {
        let _gate = self.shared.gate.lock();
        let mut tx = self.begin();
        let value = f(&mut tx)?;
        self.commit(tx, Vec::new());
        Ok(value)
    }

    fn begin(&self) -> MemoryTx<S> {
        let data = lock(&self.shared.state).data.clone();
        MemoryTx {
            shared: Arc::clone(&self.shared),
            data,
            emitted: Vec::new(),
        }
    }

    fn commit(&self, tx: MemoryTx<S>, consumed: Vec<(String, MsgId)>) {
        let mut state = lock(&self.shared.state);
        state.data = tx.data;
        let now = Utc::now();
        let emitted = !tx.emitted.is_empty();
        for envelope in tx.emitted {
            let id = state.next_id;
            state.next_id += 1;
            state.msg_ids.insert(envelope.msg_id.clone());
            let row = OutboxRow {
                id,
                status: Status::New,
                retries: 0,
                next_retry_at: now,
                last_error: None,
                envelope,
            };
            state.rows.insert(id, row);
        }
        state.consumed.extend(consumed);
        drop(state);
        if emitted {
            self.shared.wake.notify_one();
        }
    }

    /// Reads the committed user data.
    pub fn read<T>(&self, f: impl FnOnce(&S) -> T) -> T {
        f(&lock(&self.shared.state).data)
    }

    /// A snapshot of every outbox row, in id order.
    pub fn rows(&self) -> Vec<OutboxRow> {
        lock(&self.shared.state).rows.values().cloned().collect()
    }

    /// A snapshot of the row with this msg_id.
    pub fn row(&self, msg_id: &str) -> Option<OutboxRow> {
        lock(&self.shared.state)
            .rows
            .values()
            .find(|r| r.envelope.msg_id.as_str() == msg_id)
            .cloned()
    }
}

impl<S: Clone + Send + 'static> MemoryDb<S> {
    /// The dedup key of `(group, msg_id)`, or `None` if it was consumed.
    fn unconsumed(&self, group: &str, msg_id: &MsgId) -> Option<(String, MsgId)> {
        let key = (group.to_owned(), msg_id.clone());
        (!lock(&self.shared.state).consumed.contains(&key)).then_some(key)
    }

    fn begin_batch(&self, len: usize) -> BatchTx<S> {
        BatchTx {
            tx: self.begin(),
            consumed: Vec::new(),
            outcomes: Vec::with_capacity(len),
        }
    }
}

/// A batch's one transaction, in which each message works like a savepoint.
struct BatchTx<S> {
    tx: MemoryTx<S>,
    consumed: Vec<(String, MsgId)>,
    outcomes: InboxBatchOutcomes,
}

/// What a message's handler may undo: the data and how many events were emitted.
struct Savepoint<S> {
    key: (String, MsgId),
    data: S,
    emitted: usize,
}

impl<S: Clone + Send + 'static> BatchTx<S> {
    /// A savepoint for a new message; `None` (its outcome `Duplicate`) for one consumed
    /// before or earlier in the batch.
    fn savepoint(&mut self, db: &MemoryDb<S>, group: &str, msg_id: &MsgId) -> Option<Savepoint<S>> {
        let key = db
            .unconsumed(group, msg_id)
            .filter(|key| !self.consumed.contains(key));
        let Some(key) = key else {
            self.outcomes.push(Ok(Processed::Duplicate));
            return None;
        };
        Some(Savepoint {
            key,
            data: self.tx.data.clone(),
            emitted: self.tx.emitted.len(),
        })
    }

    /// Keeps the handler's work, or rolls back to `savepoint` if it failed.
    fn settle(&mut self, savepoint: Savepoint<S>, handled: Result<(), HandlerError>) {
        match handled {
            Ok(()) => {
                self.consumed.push(savepoint.key);
                self.outcomes.push(Ok(Processed::Applied));
            }
            Err(e) => {
                self.tx.data = savepoint.data;
                self.tx.emitted.truncate(savepoint.emitted);
                self.outcomes.push(Err(e.into()));
            }
        }
    }

    fn commit(self, db: &MemoryDb<S>) -> InboxBatchOutcomes {
        db.commit(self.tx, self.consumed);
        self.outcomes
    }
}

impl<S: Clone + Send + 'static> Inbox for MemoryDb<S> {
    type Conn = MemoryTx<S>;

    fn process<F>(&self, group: &str, msg_id: &MsgId, handle: F) -> Result<Processed, Error>
    where
        F: FnOnce(&mut MemoryTx<S>) -> Result<(), HandlerError>,
    {
        let _gate = self.shared.gate.lock();
        let Some(key) = self.unconsumed(group, msg_id) else {
            return Ok(Processed::Duplicate);
        };
        let mut tx = self.begin();
        handle(&mut tx)?;
        self.commit(tx, vec![key]);
        Ok(Processed::Applied)
    }

    /// One transaction for the batch; each message works like a savepoint: a failing
    /// handler's data changes, emitted events and dedup row are discarded, the others
    /// commit together. A panic discards the whole batch.
    fn process_batch<F>(
        &self,
        group: &str,
        msg_ids: &[MsgId],
        mut handle: F,
    ) -> Result<InboxBatchOutcomes, Error>
    where
        F: FnMut(usize, &mut MemoryTx<S>) -> Result<(), HandlerError>,
    {
        let _gate = self.shared.gate.lock();
        let mut batch = self.begin_batch(msg_ids.len());
        for (i, msg_id) in msg_ids.iter().enumerate() {
            if let Some(savepoint) = batch.savepoint(self, group, msg_id) {
                let handled = handle(i, &mut batch.tx);
                batch.settle(savepoint, handled);
            }
        }
        Ok(batch.commit(self))
    }
}

/// The same transactions as the blocking [`Inbox`], for async handlers
/// ([`AsyncTxHandler`](crate::AsyncTxHandler) with `Conn = MemoryTx<S>`): a transaction
/// holds the database across its handler's awaits, so transactions stay serial.
impl<S: Clone + Send + 'static> AsyncInbox for MemoryDb<S> {
    type Conn = MemoryTx<S>;

    async fn process<'a, F>(
        &'a self,
        group: &'a str,
        msg_id: &'a MsgId,
        handle: F,
    ) -> Result<Processed, Error>
    where
        F: for<'c> FnOnce(&'c mut MemoryTx<S>) -> TxFuture<'c> + Send + 'a,
    {
        let _gate = self.shared.gate.lock_async().await;
        let Some(key) = self.unconsumed(group, msg_id) else {
            return Ok(Processed::Duplicate);
        };
        let mut tx = self.begin();
        handle(&mut tx).await?;
        self.commit(tx, vec![key]);
        Ok(Processed::Applied)
    }

    /// As [`Inbox::process_batch`]: one transaction, a savepoint per message.
    async fn process_batch<'a, F>(
        &'a self,
        group: &'a str,
        msg_ids: &'a [MsgId],
        mut handle: F,
    ) -> Result<InboxBatchOutcomes, Error>
    where
        F: for<'c> FnMut(usize, &'c mut MemoryTx<S>) -> TxFuture<'c> + Send + 'a,
    {
        let _gate = self.shared.gate.lock_async().await;
        let mut batch = self.begin_batch(msg_ids.len());
        for (i, msg_id) in msg_ids.iter().enumerate() {
            if let Some(savepoint) = batch.savepoint(self, group, msg_id) {
                let handled = handle(i, &mut batch.tx).await;
                batch.settle(savepoint, handled);
            }
        }
        Ok(batch.commit(self))
    }
}

/// Rows claimed from a [`MemoryDb`]; dropping it releases them.
pub struct MemoryBatch<S> {
    shared: Arc<Shared<S>>,
    messages: Vec<StoredMessage>,
}

impl<S> std::fmt::Debug for MemoryBatch<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBatch")
            .field("messages", &self.messages.len())
            .finish()
    }
}

impl<S> Drop for MemoryBatch<S> {
    fn drop(&mut self) {
        let mut state = lock(&self.shared.state);
        for m in &self.messages {
            state.claimed.remove(&m.id);
        }
    }
}

impl<S: Send + 'static> ClaimedBatch for MemoryBatch<S> {
    fn messages(&self) -> &[StoredMessage] {
        &self.messages
    }

    async fn complete(self, outcome: RelayBatchOutcome) -> Result<(), Error> {
        let mut state = lock(&self.shared.state);
        for id in outcome.sent {
            if let Some(row) = state.rows.get_mut(&id) {
                row.status = Status::Sent;
            }
        }
        for retry in outcome.retry {
            if let Some(row) = state.rows.get_mut(&retry.id) {
                row.retries += 1;
                row.next_retry_at = retry.next_retry_at;
                row.last_error = Some(retry.error);
            }
        }
        for DeadRow { id, error } in outcome.dead {
            if let Some(row) = state.rows.get_mut(&id) {
                row.retries += 1;
                row.status = Status::Dead;
                row.last_error = Some(error);
            }
        }
        Ok(()) // the claim is released by Drop
    }
}

impl<S: Clone + Send + 'static> RelayStore for MemoryDb<S> {
    type Batch = MemoryBatch<S>;

    async fn claim(&self, limit: usize) -> Result<MemoryBatch<S>, Error> {
        let mut state = lock(&self.shared.state);
        let now = Utc::now();
        let due: Vec<StoredMessage> = state
            .rows
            .values()
            .filter(|r| {
                r.status == Status::New && r.next_retry_at <= now && !state.claimed.contains(&r.id)
            })
            .take(limit)
            .map(|r| StoredMessage {
                id: r.id,
                retries: r.retries,
                envelope: r.envelope.clone(),
            })
            .collect();
        state.claimed.extend(due.iter().map(|m| m.id));
        Ok(MemoryBatch {
            shared: Arc::clone(&self.shared),
            messages: due,
        })
    }

    async fn wait_for_work(&self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, self.shared.wake.notified()).await;
    }

    async fn backlog(&self) -> Result<Backlog, Error> {
        let state = lock(&self.shared.state);
        let now = Utc::now();
        let mut backlog = Backlog::default();
        for row in state.rows.values() {
            match row.status {
                Status::New if row.next_retry_at <= now => {
                    backlog.due += 1;
                    let age = (now - row.envelope.created_at).to_std().unwrap_or_default();
                    backlog.oldest_due_age =
                        Some(backlog.oldest_due_age.map_or(age, |a| a.max(age)));
                }
                Status::Dead => backlog.dead += 1,
                _ => {}
            }
        }
        Ok(backlog)
    }
}

#[derive(Default)]
struct BrokerState {
    topics: HashMap<String, Vec<Envelope>>,
    reject_next: usize,
    down: bool,
}

/// An in-memory broker: a list of published messages per topic, with failure injection.
/// Cloning shares the broker.
#[derive(Clone, Default)]
pub struct MemoryBroker {
    state: Arc<Mutex<BrokerState>>,
}

impl std::fmt::Debug for MemoryBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBroker").finish_non_exhaustive()
    }
}

impl MemoryBroker {
    /// An empty, healthy broker.
    pub fn new() -> Self {
        Self::default()
    }

    /// The next `n` messages published are rejected, each spending a retry.
    pub fn reject_next(&self, n: usize) {
        lock(&self.state).reject_next = n;
    }

    /// While down, every publish fails as [`Error::BrokerUnavailable`].
    pub fn set_down(&self, down: bool) {
        lock(&self.state).down = down;
    }

    /// Everything published to `topic`, in publish order.
    pub fn published(&self, topic: &str) -> Vec<Envelope> {
        lock(&self.state)
            .topics
            .get(topic)
            .cloned()
            .unwrap_or_default()
    }
}

impl Publisher for MemoryBroker {
    async fn publish(&self, batch: &[StoredMessage]) -> Result<PublishOutcomes, Error> {
        let mut state = lock(&self.state);
        if state.down {
            return Err(Error::broker_unavailable("memory broker is down"));
        }
        let mut results = Vec::with_capacity(batch.len());
        for m in batch {
            if state.reject_next > 0 {
                state.reject_next -= 1;
                results.push(Err(Rejected::new("injected failure")));
            } else {
                state
                    .topics
                    .entry(m.envelope.topic.clone())
                    .or_default()
                    .push(m.envelope.clone());
                results.push(Ok(()));
            }
        }
        Ok(results)
    }
}
