//! The consumer's own trimming of its streams.

use super::ConsumerStore;

use super::Consumer;
use super::stats::Count;
use crate::trim::{TrimReport, trim_acknowledged};
use crate::{Error, Result};

impl<I, C> Consumer<I, C>
where
    I: ConsumerStore<Conn = C>,
    C: 'static,
{
    /// Trims each of this consumer's streams to what some group still needs; see
    /// [`trim_acknowledged`].
    pub async fn trim_acknowledged(&self) -> Result<Vec<TrimReport>> {
        let mut conn = self.inner.commands.get().await?;
        let mut reports = Vec::with_capacity(self.inner.streams.len());
        for stream in &self.inner.streams {
            reports.push(trim_acknowledged(&mut conn, stream).await?);
        }
        Ok(reports)
    }

    /// One round of [`ConsumerConfig::trim_interval`]: trims, logs, never fails.
    pub(super) async fn periodic_trim(&self) {
        match self.trim_acknowledged().await {
            Ok(reports) => {
                for r in reports.iter().filter(|r| r.removed > 0) {
                    tracing::debug!(stream = %r.stream, removed = r.removed, min_id = ?r.min_id, "trimmed acknowledged entries");
                }
            }
            Err(e) => {
                if let Error::Redis(e) = &e {
                    self.inner.commands.check(e).await;
                }
                self.count(Count::RedisError, None);
                tracing::warn!(error = %outbox_core::error_chain(&e), "trimming acknowledged entries failed; trying again next interval");
            }
        }
    }
}
