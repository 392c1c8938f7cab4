use redis::aio::ConnectionLike;
use redis::streams::{StreamInfoGroupsReply, StreamPendingReply};

use crate::Result;

/// What [`trim_acknowledged`] did to one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrimReport {
    /// The stream.
    pub stream: String,
    /// The MINID trimmed to: every entry below it was acknowledged by every group.
    /// `None` when nothing could be trimmed safely (no stream, or no consumer group).
    pub min_id: Option<String>,
    /// Entries removed.
    pub removed: usize,
}

/// A stream entry id `ms-seq`, ordered numerically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct EntryId(u64, u64);

impl EntryId {
    pub(crate) fn parse(id: &str) -> Option<Self> {
        let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
        Some(Self(ms.parse().ok()?, seq.parse().ok()?))
    }

    fn successor(self) -> Self {
        match self.1.checked_add(1) {
            Some(seq) => Self(self.0, seq),
            None => Self(self.0.saturating_add(1), 0),
        }
    }
}

impl std::fmt::Display for EntryId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.0, self.1)
    }
}

/// Removes the entries of `stream` that every consumer group has acknowledged, and
/// nothing else.
///
/// For each group the bound is the smaller of its oldest pending entry (delivered, not
/// yet acknowledged: `XPENDING`) and the entry after its last-delivered id (everything
/// later has not been read yet: `XINFO GROUPS`). The stream is trimmed with
/// `XTRIM <stream> MINID <the smallest bound>`, so an entry still pending for some
/// group, or not yet read by some group, is never removed. A stream without groups is
/// left alone: nothing says who will read it.
///
/// Safe to run at any time, from any process: `outbox trim` runs it on every stream of
/// a prefix, and [`ConsumerConfig::trim_interval`](crate::ConsumerConfig::trim_interval)
/// has a consumer run it periodically on its own streams. A group created later that
/// starts from `0` sees only what is left. Dead-letter streams have no groups and are
/// bounded by [`ConsumerConfig::dead_letter_max_len`](crate::ConsumerConfig::dead_letter_max_len)
/// instead; a stream nobody has created a group on is bounded only by the publisher's
/// [`max_len`](crate::PublisherConfig::max_len), if set. Needs Redis 6.2+ (MINID).
/// Any async connection works, a cluster connection included (each command names only
/// `stream`).
///
/// ```no_run
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let client = outbox_redis::Client::open("redis://127.0.0.1:6379")?;
/// let mut conn = client.get_multiplexed_async_connection().await?;
/// let report = outbox_redis::trim_acknowledged(&mut conn, "outbox:order.paid").await?;
/// println!("removed {} entries below {:?}", report.removed, report.min_id);
/// # Ok::<_, outbox_redis::Error>(()) }).unwrap();
/// ```
pub async fn trim_acknowledged<C>(conn: &mut C, stream: &str) -> Result<TrimReport>
where
    C: ConnectionLike + Send,
{
    let mut report = TrimReport {
        stream: stream.to_owned(),
        min_id: None,
        removed: 0,
    };
    let exists: bool = redis::cmd("EXISTS").arg(stream).query_async(conn).await?;
    if !exists {
        return Ok(report);
    }
    // Read the groups before their pending lists: an entry delivered in between is newer
    // than the last-delivered id read here, so it is kept either way.
    let groups: StreamInfoGroupsReply = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(conn)
        .await?;
    let mut bound: Option<EntryId> = None;
    for group in &groups.groups {
        let mut group_bound = EntryId::parse(&group.last_delivered_id)
            .unwrap_or(EntryId(0, 0))
            .successor();
        let pending: StreamPendingReply = redis::cmd("XPENDING")
            .arg(stream)
            .arg(&group.name)
            .query_async(conn)
            .await?;
        if let StreamPendingReply::Data(data) = pending
            && data.count > 0
            && let Some(oldest) = EntryId::parse(&data.start_id)
        {
            group_bound = group_bound.min(oldest);
        }
        bound = Some(bound.map_or(group_bound, |b| b.min(group_bound)));
    }
    let Some(bound) = bound else {
        return Ok(report);
    };
    let min_id = bound.to_string();
    report.removed = redis::cmd("XTRIM")
        .arg(stream)
        .arg("MINID")
        .arg("=")
        .arg(&min_id)
        .query_async(conn)
        .await?;
    report.min_id = Some(min_id);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::EntryId;

    #[test]
    fn entry_ids_order_numerically() {
        let a = EntryId::parse("9-5").unwrap();
        let b = EntryId::parse("10-0").unwrap();
        assert!(a < b);
        assert_eq!(a.successor().to_string(), "9-6");
        assert_eq!(EntryId::parse("7").unwrap().to_string(), "7-0");
        assert_eq!(
            EntryId(1, u64::MAX).successor(),
            EntryId::parse("2-0").unwrap()
        );
        assert!(EntryId::parse("x-1").is_none());
    }
}
