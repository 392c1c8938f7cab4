//! Dead letters: the entry copied to `<stream>:dead` and acknowledged, atomically.

use super::ConsumerStore;
use redis::RedisResult;

use super::AfterDeadLetter;
use super::lanes::entry_key;
use super::stats::Count;
use super::{Consumer, Job, Outcome};
use crate::conn::blocked_key;
use crate::entry::value_bytes;

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// Copies the entry to the dead-letter stream and acks it, in one transaction (on a
    /// cluster the dead-letter stream shares the stream's hash slot, which `MULTI` needs).
    /// If Redis failed, the entry stays pending.
    pub(super) async fn dead_letter(&self, job: &Job, reason: &str) -> Outcome {
        let inner = &self.inner;
        let dead = self.dead_letter_stream(&job.stream);
        let mut pipe = redis::pipe();
        pipe.atomic();
        let xadd = pipe.cmd("XADD").arg(&dead);
        if let Some(max_len) = inner.config.dead_letter_max_len {
            xadd.arg("MAXLEN").arg(max_len);
        }
        xadd.arg("*")
            .arg("reason")
            .arg(reason)
            .arg("delivery_count")
            .arg(job.delivery_count)
            .arg("group")
            .arg(&inner.group)
            .arg("stream")
            .arg(&*job.stream)
            .arg("entry_id")
            .arg(&job.entry.id);
        let mut fields: Vec<_> = job
            .entry
            .map
            .iter()
            .filter(|(k, _)| !DEAD_LETTER_FIELDS.contains(&k.as_str()))
            .collect();
        fields.sort_by(|a, b| a.0.cmp(b.0));
        for (field, value) in fields {
            xadd.arg(field).arg(value_bytes(value));
        }
        xadd.ignore();
        if inner
            .config
            .ordered
            .as_ref()
            .is_some_and(|o| o.after_dead_letter == AfterDeadLetter::Block)
        {
            // In the same transaction: the key can never move on unblocked.
            pipe.cmd("HSET")
                .arg(blocked_key(&job.stream, &inner.group))
                .arg(entry_key(&job.entry))
                .arg(&job.entry.id)
                .ignore();
        }
        pipe.cmd("XACK")
            .arg(&*job.stream)
            .arg(&inner.group)
            .arg(&job.entry.id)
            .ignore();
        let written: RedisResult<()> = async {
            let mut conn = inner.commands.get().await?;
            pipe.query_async(&mut conn).await
        }
        .await;
        let failed = self
            .redis_done(written, "dead-lettering failed; the entry stays pending")
            .await;
        if failed {
            return Outcome::Pending { outage: true };
        }
        tracing::warn!(dead_letter_stream = %dead, %reason, "entry dead-lettered");
        self.count(Count::DeadLettered, Some(&job.stream));
        Outcome::DeadLettered
    }
}

/// Fields a dead-letter entry sets before the original entry's fields.
pub(crate) const DEAD_LETTER_FIELDS: [&str; 5] =
    ["reason", "delivery_count", "group", "stream", "entry_id"];
