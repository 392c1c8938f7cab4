//! For operators: the consumers' dead letters (`<stream>:dead`, as
//! [`Consumer`](crate::Consumer) writes them) and the consumer groups of a stream.
//! `outbox serve` shows and acts on them through these functions. Any async connection
//! works; each call names one stream (a dead letter's redrive names its stream and its
//! dead-letter stream, which share a hash slot on a cluster).

use std::collections::BTreeMap;

use redis::aio::ConnectionLike;
use redis::streams::{
    StreamId, StreamInfoConsumersReply, StreamInfoGroupsReply, StreamPendingReply, StreamRangeReply,
};

use crate::Result;
use crate::consumer::DEAD_LETTER_FIELDS;
use crate::entry::{REDRIVE_GROUP_FIELD, value_bytes};
use crate::lease::eval;

/// An entry of a dead-letter stream: why the consumer gave up, and the original entry.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Its id in the dead-letter stream.
    pub id: String,
    /// The stream the entry came from.
    pub stream: String,
    /// The consumer group that gave up on it.
    pub group: String,
    /// The entry's id on `stream`.
    pub entry_id: String,
    /// Why (the handler's error, or a malformed entry).
    pub reason: String,
    /// Deliveries before it was dead-lettered.
    pub delivery_count: Option<u64>,
    /// The original entry's fields (`msg_id`, `type`, `payload`, …), byte for byte.
    pub fields: BTreeMap<String, Vec<u8>>,
}

impl DeadLetter {
    /// An original field as text (`None` if missing or not UTF-8).
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .get(name)
            .and_then(|v| std::str::from_utf8(v).ok())
    }

    fn from_entry(entry: &StreamId) -> Self {
        let text = |name: &str| {
            entry
                .map
                .get(name)
                .map(|v| String::from_utf8_lossy(&value_bytes(v)).into_owned())
                .unwrap_or_default()
        };
        Self {
            id: entry.id.clone(),
            stream: text("stream"),
            group: text("group"),
            entry_id: text("entry_id"),
            reason: text("reason"),
            delivery_count: text("delivery_count").parse().ok(),
            fields: entry
                .map
                .iter()
                .filter(|(k, _)| !DEAD_LETTER_FIELDS.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), value_bytes(v)))
                .collect(),
        }
    }
}

/// The newest `count` dead letters of `dead_stream`, newest first (`XREVRANGE`).
pub async fn dead_letters<C>(
    conn: &mut C,
    dead_stream: &str,
    count: usize,
) -> Result<Vec<DeadLetter>>
where
    C: ConnectionLike + Send,
{
    let reply: StreamRangeReply = redis::cmd("XREVRANGE")
        .arg(dead_stream)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(count)
        .query_async(conn)
        .await?;
    Ok(reply.ids.iter().map(DeadLetter::from_entry).collect())
}

/// The dead letter `id` of `dead_stream`, if it is there.
pub async fn dead_letter<C>(conn: &mut C, dead_stream: &str, id: &str) -> Result<Option<DeadLetter>>
where
    C: ConnectionLike + Send,
{
    let reply: StreamRangeReply = redis::cmd("XRANGE")
        .arg(dead_stream)
        .arg(id)
        .arg(id)
        .query_async(conn)
        .await?;
    Ok(reply.ids.first().map(DeadLetter::from_entry))
}

/// Puts a dead letter back on its stream for the group that gave up on it: its original
/// fields are added as a new entry (`XADD`), with [`REDRIVE_GROUP_FIELD`] naming that
/// group, and the dead letter deleted (`XDEL`), in one script that appends only if its
/// delete removed the dead letter: of two operators redriving the same dead letter at
/// once, one appends and the other gets `false`. Returns `false` if it was not there
/// (redriven or purged already).
///
/// Every group of the stream reads the new entry, but only the group named applies it:
/// the others acknowledge it without running a handler or asking their inbox, so a
/// group that applied the message long ago, its dedup row purged since, does not apply
/// it again. A dead letter that names no stream or no group is refused
/// ([`Error::MalformedEntry`](crate::Error::MalformedEntry)).
pub async fn redrive_dead_letter<C>(conn: &mut C, dead_stream: &str, id: &str) -> Result<bool>
where
    C: ConnectionLike + Send,
{
    let Some(dead) = dead_letter(conn, dead_stream, id).await? else {
        return Ok(false);
    };
    if dead.stream.is_empty() || dead.group.is_empty() {
        return Err(crate::Error::MalformedEntry(format!(
            "dead letter {id} of {dead_stream} names no stream or no group"
        )));
    }
    let mut redrive = eval(REDRIVE, 2);
    redrive.arg(&dead.stream).arg(dead_stream).arg(id);
    // A dead letter of an entry redriven before carries the field already.
    let original = dead
        .fields
        .iter()
        .filter(|(f, _)| *f != REDRIVE_GROUP_FIELD);
    for (field, value) in original {
        redrive.arg(field).arg(value.as_slice());
    }
    redrive.arg(REDRIVE_GROUP_FIELD).arg(&dead.group);
    let appended: bool = redrive.query_async(conn).await?;
    Ok(appended)
}

/// The redrive's one atomic step: `KEYS[1]` the stream, `KEYS[2]` the dead-letter stream
/// (one hash slot, see [`conn`](crate::conn)); `ARGV[1]` the dead letter's id, then the
/// entry's fields and values. The delete decides: a second redrive of the same dead
/// letter, read before the first one ran, finds it gone and appends nothing.
const REDRIVE: &str = r"
if redis.call('XDEL', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
return 1
";

/// Deletes a dead letter; returns whether it was there.
pub async fn purge_dead_letter<C>(conn: &mut C, dead_stream: &str, id: &str) -> Result<bool>
where
    C: ConnectionLike + Send,
{
    let removed: usize = redis::cmd("XDEL")
        .arg(dead_stream)
        .arg(id)
        .query_async(conn)
        .await?;
    Ok(removed > 0)
}

/// A consumer group of a stream, as [`consumer_groups`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupInfo {
    /// The group.
    pub name: String,
    /// Entries not yet delivered to the group (Redis 7+; `None` when Redis cannot tell).
    pub lag: Option<usize>,
    /// Entries delivered and not acknowledged.
    pub pending: usize,
    /// The last entry delivered.
    pub last_delivered_id: String,
    /// The oldest pending entry, if any.
    pub oldest_pending_id: Option<String>,
    /// The group's consumers.
    pub consumers: Vec<GroupConsumer>,
}

/// A consumer of a group.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupConsumer {
    /// Its name.
    pub name: String,
    /// Entries it holds unacknowledged.
    pub pending: usize,
    /// Milliseconds since it last read or claimed.
    pub idle_ms: usize,
}

/// Every consumer group of `stream` with its consumers and oldest pending entry
/// (`XINFO GROUPS`, `XINFO CONSUMERS`, `XPENDING`).
pub async fn consumer_groups<C>(conn: &mut C, stream: &str) -> Result<Vec<GroupInfo>>
where
    C: ConnectionLike + Send,
{
    let info: StreamInfoGroupsReply = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(conn)
        .await?;
    let mut groups = Vec::with_capacity(info.groups.len());
    for g in info.groups {
        let consumers: StreamInfoConsumersReply = redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(stream)
            .arg(&g.name)
            .query_async(conn)
            .await?;
        let pending: StreamPendingReply = redis::cmd("XPENDING")
            .arg(stream)
            .arg(&g.name)
            .query_async(conn)
            .await?;
        let oldest_pending_id = match pending {
            StreamPendingReply::Data(d) if d.count > 0 => Some(d.start_id),
            _ => None,
        };
        groups.push(GroupInfo {
            name: g.name,
            lag: g.lag,
            pending: g.pending,
            last_delivered_id: g.last_delivered_id,
            oldest_pending_id,
            consumers: consumers
                .consumers
                .into_iter()
                .map(|c| GroupConsumer {
                    name: c.name,
                    pending: c.pending,
                    idle_ms: c.idle,
                })
                .collect(),
        });
    }
    Ok(groups)
}

/// The keys an ordered consumer of `group` keeps blocked on `stream` after a dead letter
/// (with [`AfterDeadLetter::Block`](crate::AfterDeadLetter::Block)), each with the id
/// of the dead-lettered entry, sorted by key (`HGETALL <stream>:blocked:<group>`).
pub async fn blocked_keys<C>(
    conn: &mut C,
    stream: &str,
    group: &str,
) -> Result<Vec<(String, String)>>
where
    C: ConnectionLike + Send,
{
    let mut keys: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(crate::conn::blocked_key(stream, group))
        .query_async(conn)
        .await?;
    keys.sort();
    Ok(keys)
}

/// Lets an ordered consumer of `group` go on with `key` on `stream` after it was blocked
/// by a dead letter: its later entries are then handled, in order, within a lease
/// renewal period (a third of [`lease_ttl`](crate::OrderedConfig::lease_ttl)). The
/// dead-lettered entry itself stays in the dead-letter stream; redrive it first if it
/// must be applied (it then comes after the key's entries that waited). Returns whether
/// the key was blocked.
pub async fn unblock_key<C>(conn: &mut C, stream: &str, group: &str, key: &str) -> Result<bool>
where
    C: ConnectionLike + Send,
{
    let removed: usize = redis::cmd("HDEL")
        .arg(crate::conn::blocked_key(stream, group))
        .arg(key)
        .query_async(conn)
        .await?;
    Ok(removed == 1)
}
