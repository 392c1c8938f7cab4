//! Reading the replication stream: pgoutput's transactions decoded into complete
//! commits of messages, ready to publish. The session reads the next commits while the
//! broker answers the current ones (see [`Reader::read_while`]), so that decoding and
//! publishing overlap; it confirms a commit only once it was published.

use std::collections::HashMap;
use std::pin::pin;
use std::task::Poll;

use chrono::{DateTime, Utc};
use outbox_core::StoredMessage;
use pgwire_replication::{Lsn, ReplicationClient, ReplicationEvent};

use crate::decode::{Message, OutboxColumns, Tuple, decode};
use crate::{CdcError, Result};

/// The transaction being read from the stream.
pub(crate) struct Open {
    pub(crate) commit_time: DateTime<Utc>,
    messages: Vec<StoredMessage>,
    /// Rows that cannot be read: id, why. They become DEAD.
    unreadable: Vec<(i64, String)>,
    /// About how much memory `messages` take.
    bytes: usize,
    /// Once the transaction outgrew [`CdcConfig::transaction_memory`]: the ids of its
    /// rows in insert order (those of `messages` and `unreadable` moved here), read back
    /// from the table when it is published.
    ///
    /// [`CdcConfig::transaction_memory`]: crate::CdcConfig::transaction_memory
    spilled: Option<Vec<i64>>,
}

impl Open {
    fn new(commit_time: DateTime<Utc>) -> Self {
        Self {
            commit_time,
            messages: Vec::new(),
            unreadable: Vec::new(),
            bytes: 0,
            spilled: None,
        }
    }

    /// Adds an inserted row: a message, or an unreadable row (id, why). A row inserted
    /// as SENT or DEAD is no message (the polling relay and the backfill skip it too).
    /// Past `memory` bytes, the transaction is spilled: only ids are kept.
    fn insert<V: AsRef<[u8]>>(
        &mut self,
        columns: &OutboxColumns,
        values: &[Option<V>],
        memory: usize,
    ) -> Result<()> {
        if !columns.is_new(values) {
            return Ok(());
        }
        if let Some(ids) = &mut self.spilled {
            let id = columns
                .id(values)
                .ok_or_else(|| CdcError::Decode("an inserted outbox row without its id".into()))?;
            ids.push(id);
            return Ok(());
        }
        match columns.message(values) {
            Ok(m) => {
                self.bytes += size_of(&m);
                self.messages.push(m);
                if self.bytes > memory {
                    self.spill("it outgrew the relay's transaction_memory");
                }
            }
            Err(e) => match columns.id(values) {
                Some(id) => self.unreadable.push((id, e.to_string())),
                None => return Err(e),
            },
        }
        Ok(())
    }

    /// Keeps only the ids (`why`): the rows are read back from the table when
    /// published.
    fn spill(&mut self, why: &str) {
        if self.spilled.is_none() {
            self.spilled = Some(spill(&mut self.messages, &mut self.unreadable, why));
        }
    }

    /// An update: of a row this transaction inserted, its committed version replaces
    /// the inserted one in its place (or drops it, no longer NEW). A row of an earlier
    /// transaction (the relay's own parking and DEAD writes, a mass UPDATE) is not
    /// published again, as the polling relay would not.
    fn update(&mut self, columns: &OutboxColumns, old: Option<&Tuple<'_>>, new: &Tuple<'_>) {
        let Some(id) = old
            .and_then(|o| columns.id(&o.values))
            .or_else(|| columns.id(&new.values))
        else {
            return;
        };
        if let Some(ids) = &mut self.spilled {
            // The committed version is what the table gives back; only a row of this
            // transaction that moved to a new id needs noting (the scan is rare).
            if let Some(moved) = columns.id(&new.values).filter(|&n| n != id)
                && ids.contains(&id)
                && !ids.contains(&moved)
            {
                ids.push(moved);
            }
            return;
        }
        let Some(at) = self.messages.iter().rposition(|m| m.id == id) else {
            self.update_unreadable(columns, id, new);
            return;
        };
        let filled;
        let refs: Vec<Option<&[u8]>>;
        let values: &[Option<&[u8]>] = if new.unchanged.is_empty() {
            &new.values
        } else {
            filled = columns.fill_unchanged(&new.values, &new.unchanged, &self.messages[at]);
            refs = filled.iter().map(Option::as_deref).collect();
            &refs
        };
        if !columns.is_new(values) {
            self.messages.remove(at);
            return;
        }
        match columns.message(values) {
            Ok(m) if m.id == id => self.messages[at] = m,
            // The key changed: the row committed under its new id.
            Ok(m) => {
                self.messages.remove(at);
                self.messages.push(m);
            }
            Err(e) => {
                self.messages.remove(at);
                self.unreadable
                    .push((columns.id(values).unwrap_or(id), e.to_string()));
            }
        }
    }

    /// An update of row `id` if this transaction inserted it unreadable: read again
    /// when the update sends it whole; else (some values unchanged, not in hand) it
    /// stays unreadable, unless no longer NEW.
    fn update_unreadable(&mut self, columns: &OutboxColumns, id: i64, new: &Tuple<'_>) {
        if !self.unreadable.iter().any(|u| u.0 == id) {
            return;
        }
        if new.unchanged.is_empty() {
            self.unreadable.retain(|u| u.0 != id);
            // Unreadable with no id: recorded under the old one.
            if let Err(e) = self.insert(columns, &new.values, usize::MAX) {
                self.unreadable.push((id, e.to_string()));
            }
        } else if !columns.is_new(&new.values) {
            self.unreadable.retain(|u| u.0 != id);
        }
    }

    /// A `TRUNCATE` of the outbox: the rows this transaction inserted so far are gone,
    /// so what the table holds at its commit is read back (rows it inserts after the
    /// truncate are kept). A truncate before any insert (a purge) changes nothing.
    fn truncate(&mut self) {
        if !self.messages.is_empty() || !self.unreadable.is_empty() {
            self.spill("a TRUNCATE");
        }
    }

    /// A delete: a row this transaction inserted never committed (a spilled
    /// transaction's is not found when read back).
    fn delete(&mut self, columns: &OutboxColumns, old: &Tuple<'_>) {
        if let Some(id) = columns.id(&old.values) {
            if let Some(at) = self.messages.iter().rposition(|m| m.id == id) {
                self.messages.remove(at);
            }
            self.unreadable.retain(|u| u.0 != id);
        }
    }
}

/// Spills a transaction's rows read so far (both relays): their ids, in insert order
/// (the unreadable ones after), the messages' memory freed; says so, and why.
pub(crate) fn spill(
    messages: &mut Vec<StoredMessage>,
    unreadable: &mut Vec<(i64, String)>,
    why: &str,
) -> Vec<i64> {
    let mut ids: Vec<i64> = messages.drain(..).map(|m| m.id).collect();
    ids.extend(unreadable.drain(..).map(|u| u.0));
    *messages = Vec::new();
    tracing::info!(
        rows = ids.len(),
        "a transaction's rows are read back from the table when published: {why}"
    );
    metrics::counter!("outbox_cdc_spilled_transactions_total").increment(1);
    ids
}

/// In the order of `ids`: rows read back by id (a database returns them in its own).
pub(crate) fn in_order_of<T>(ids: &[i64], rows: &mut [T], id: impl Fn(&T) -> i64) {
    let at: HashMap<i64, usize> = ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    rows.sort_by_key(|r| at.get(&id(r)).copied());
}

/// About how much memory message `m` takes: its strings and a fixed part.
pub(crate) fn size_of(m: &StoredMessage) -> usize {
    let e = &m.envelope;
    let headers: usize = e.headers.iter().map(|(k, v)| k.len() + v.len() + 64).sum();
    std::mem::size_of::<StoredMessage>()
        + e.msg_id.as_str().len()
        + e.topic.len()
        + e.event_type.len()
        + e.key.len()
        + e.payload.len()
        + headers
}

/// Complete commits read and not yet confirmed, their messages in one run in commit
/// order: published together in calls of up to `batch_size` across commits (a backlog
/// of small commits goes out in full pipelines), and confirmed at the last one's end.
#[derive(Default)]
pub(crate) struct InHand {
    pub(crate) messages: Vec<StoredMessage>,
    /// Rows that cannot be read: id, why. They become DEAD.
    pub(crate) unreadable: Vec<(i64, String)>,
    /// The commits in hand (some may have no outbox row).
    commits: usize,
    /// The last commit's end.
    pub(crate) end_lsn: Lsn,
    /// When the first commit in hand committed.
    pub(crate) oldest: Option<DateTime<Utc>>,
    /// The ids of a spilled commit (see [`Open::spilled`]), the last in hand: published
    /// after `messages`, read back from the table a batch at a time.
    pub(crate) spilled: Vec<i64>,
    /// How many of `spilled` were published.
    pub(crate) spilled_done: usize,
    /// Whether `messages` were published (the spilled rows may still be being).
    pub(crate) messages_done: bool,
}

impl InHand {
    fn add(&mut self, open: Open, end_lsn: Lsn) {
        let Open {
            commit_time,
            mut messages,
            mut unreadable,
            spilled,
            ..
        } = open;
        self.messages.append(&mut messages);
        self.unreadable.append(&mut unreadable);
        if let Some(ids) = spilled {
            self.spilled = ids;
        }
        self.commits += 1;
        self.end_lsn = end_lsn;
        self.oldest.get_or_insert(commit_time);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.commits == 0
    }

    /// Whether no more commits go in: `limit` messages, or a spilled commit.
    fn is_full(&self, limit: usize) -> bool {
        self.messages.len() >= limit || !self.spilled.is_empty()
    }

    /// Whether every message in hand was published.
    pub(crate) fn is_published(&self) -> bool {
        self.messages_done && self.spilled_done >= self.spilled.len()
    }

    /// The next ids of the spilled commit to publish, up to `limit`.
    pub(crate) fn next_spilled(&self, limit: usize) -> &[i64] {
        let rest = &self.spilled[self.spilled_done.min(self.spilled.len())..];
        &rest[..rest.len().min(limit)]
    }

    /// Empties it, keeping the allocation.
    pub(crate) fn clear(&mut self) {
        self.messages.clear();
        self.unreadable.clear();
        self.commits = 0;
        self.oldest = None;
        self.spilled = Vec::new();
        self.spilled_done = 0;
        self.messages_done = false;
    }
}

/// The replication session's stream and what decoding it needs to remember.
pub(crate) struct Reader {
    pub(crate) client: ReplicationClient,
    relations: HashMap<u32, Option<OutboxColumns>>,
    pub(crate) open: Option<Open>,
    /// A keepalive's position, confirmable once nothing is in hand.
    pub(crate) idle_ack: Option<Lsn>,
    /// [`CdcConfig::transaction_memory`](crate::CdcConfig::transaction_memory).
    memory: usize,
}

/// Microseconds between the Unix epoch and PostgreSQL's (2000-01-01).
const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;

fn pg_time(micros: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(micros.saturating_add(PG_EPOCH_MICROS)).unwrap_or_default()
}

impl Reader {
    pub(crate) fn new(client: ReplicationClient, memory: usize) -> Self {
        Self {
            client,
            relations: HashMap::new(),
            open: None,
            idle_ack: None,
            memory,
        }
    }

    /// Takes the events already received, without waiting, until `into` holds `limit`
    /// messages.
    pub(crate) fn read_ready(&mut self, into: &mut InHand, limit: usize) -> Result<()> {
        while !into.is_full(limit) {
            let ev = {
                let recv = self.client.recv();
                let mut recv = pin!(recv);
                match futures_now(recv.as_mut()) {
                    Some(ev) => ev,
                    None => break,
                }
            };
            self.handle(ev?, into)?;
        }
        Ok(())
    }

    /// Runs `work` (a publish of the commits in hand) to its end, and once it has sent
    /// its first pipeline, takes the events already received into `into` (up to `limit`
    /// messages): the stream is decoded while the broker answers. Only what has
    /// arrived: waiting for each event would wake this task once per row. An error of
    /// the stream stops the reading, not `work`: it is returned beside `work`'s output,
    /// for the caller to confirm what `work` published first.
    pub(crate) async fn read_while<T>(
        &mut self,
        work: impl Future<Output = T>,
        into: &mut InHand,
        limit: usize,
    ) -> (T, Result<()>) {
        let mut work = pin!(work);
        let polled = std::future::poll_fn(|cx| match work.as_mut().poll(cx) {
            Poll::Ready(done) => Poll::Ready(Some(done)),
            Poll::Pending => Poll::Ready(None),
        })
        .await;
        if let Some(done) = polled {
            return (done, Ok(()));
        }
        let read = self.read_ready(into, limit);
        (work.await, read)
    }

    /// One event of the stream: a complete commit goes into `into`.
    pub(crate) fn handle(&mut self, ev: Option<ReplicationEvent>, into: &mut InHand) -> Result<()> {
        let Some(ev) = ev else {
            return Err(CdcError::Replication("the replication stream ended".into()));
        };
        match ev {
            ReplicationEvent::Begin {
                commit_time_micros, ..
            } => {
                self.open = Some(Open::new(pg_time(commit_time_micros)));
            }
            ReplicationEvent::XLogData { data, .. } => self.row(&data)?,
            ReplicationEvent::Commit { end_lsn, .. } => {
                let open = self
                    .open
                    .take()
                    .ok_or_else(|| CdcError::Decode("a Commit without its Begin".into()))?;
                self.idle_ack = None;
                into.add(open, end_lsn);
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                // Everything before the keepalive's position was sent before it: with
                // nothing in hand and no transaction open, it is all confirmed.
                if self.open.is_none() {
                    self.idle_ack = Some(wal_end);
                }
            }
            ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => {}
        }
        Ok(())
    }

    /// A pgoutput row message inside a transaction.
    fn row(&mut self, data: &[u8]) -> Result<()> {
        match decode(data)? {
            Message::Relation(rel) => {
                let columns = if rel.name == "outbox" {
                    Some(OutboxColumns::of(&rel)?)
                } else {
                    None
                };
                self.relations.insert(rel.id, columns);
            }
            Message::Insert { relation, values } => {
                let memory = self.memory;
                if let Some((columns, open)) = self.target(relation, "an Insert")? {
                    open.insert(columns, &values, memory)?;
                }
            }
            Message::Update { relation, old, new } => {
                if let Some((columns, open)) = self.target(relation, "an Update")? {
                    open.update(columns, old.as_ref(), &new);
                }
            }
            Message::Delete { relation, old } => {
                if let Some((columns, open)) = self.target(relation, "a Delete")? {
                    open.delete(columns, &old);
                }
            }
            Message::Truncate { relations } => {
                for relation in relations {
                    if let Some((_, open)) = self.target(relation, "a Truncate")? {
                        open.truncate();
                    }
                }
            }
            Message::Other(_) => {}
        }
        Ok(())
    }

    /// The outbox columns of `relation` and the open transaction, for a row message
    /// (`what`); `None` for another table.
    fn target(&mut self, relation: u32, what: &str) -> Result<Option<(&OutboxColumns, &mut Open)>> {
        let Some(columns) = self.relations.get(&relation) else {
            return Err(CdcError::Decode(format!(
                "{what} of relation {relation} before its Relation message"
            )));
        };
        let Some(columns) = columns else {
            return Ok(None);
        };
        let open = self
            .open
            .as_mut()
            .ok_or_else(|| CdcError::Decode(format!("{what} outside a transaction")))?;
        Ok(Some((columns, open)))
    }
}

/// Polls `fut` once: its output if it is ready now.
fn futures_now<F: Future>(fut: std::pin::Pin<&mut F>) -> Option<F::Output> {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    match fut.poll(&mut cx) {
        std::task::Poll::Ready(v) => Some(v),
        std::task::Poll::Pending => None,
    }
}
