//! The relay's upkeep of partitioned tables: [`maintain_partitions`] in the background,
//! at the first claim and then every quarter partition interval (at most every 10
//! minutes), so that partitions are made ahead and dropped with no job of the user's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::partition::{PartitionReport, maintain_partitions, partition_policy};
use crate::store::blocking;
use crate::{PgPool, Result};

/// Longest time between two runs, and between two looks at an unpartitioned table (it
/// may be converted while the relay runs).
const MAX_EVERY: Duration = Duration::from_secs(600);

/// When the next run is due, and whether one is running.
#[derive(Debug, Default)]
pub(super) struct Maintenance {
    /// `None`: at the next claim.
    next: Mutex<Option<Instant>>,
    running: AtomicBool,
}

impl Maintenance {
    /// Starts a run on the runtime if one is due and none is running; never waits for it.
    pub(super) fn start_if_due(self: &Arc<Self>, pool: &PgPool) {
        let now = Instant::now();
        {
            let next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
            if next.is_some_and(|at| now < at) {
                return;
            }
        }
        if self.running.swap(true, Ordering::AcqRel) {
            return;
        }
        let (this, pool) = (Arc::clone(self), pool.clone());
        tokio::spawn(async move {
            let ran = blocking(move || run(&pool)).await;
            let every = match ran {
                Ok(every) => every,
                Err(e) => {
                    tracing::warn!(
                        error = %outbox_core::error_chain(&e),
                        "partition maintenance failed; the relay tries again in a minute"
                    );
                    Duration::from_secs(60)
                }
            };
            *this.next.lock().unwrap_or_else(PoisonError::into_inner) =
                Some(Instant::now() + every);
            this.running.store(false, Ordering::Release);
        });
    }
}

/// One run; the time until the next.
fn run(pool: &PgPool) -> Result<Duration> {
    let mut conn = pool.get()?;
    let Some(policy) = partition_policy(&mut conn)? else {
        return Ok(MAX_EVERY);
    };
    log(&maintain_partitions(&mut conn)?);
    Ok((policy.interval / 4).clamp(Duration::from_secs(1), MAX_EVERY))
}

fn log(report: &PartitionReport) {
    for name in &report.created {
        tracing::info!(partition = %name, "partition created");
    }
    for name in &report.dropped {
        tracing::info!(partition = %name, "expired partition detached and dropped");
    }
    for (name, reason) in &report.kept {
        tracing::warn!(partition = %name, "expired partition kept: {reason}");
    }
    for (name, error) in &report.failed {
        tracing::warn!(partition = %name, %error, "partition maintenance step failed; tried again at the next run");
    }
}
