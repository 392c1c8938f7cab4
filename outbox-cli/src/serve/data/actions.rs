//! Redrive and purge of selected dead letters.

use serde::{Deserialize, Serialize};

use super::{Failure, Item, redis_conn};
use crate::backend::with_conn;
use crate::serve::App;

/// What a redrive or purge did.
#[derive(Debug, Default, Serialize)]
pub(crate) struct Done {
    /// Outbox rows changed.
    pub(crate) outbox: usize,
    /// Consumer dead letters handled.
    pub(crate) consumers: usize,
    /// Selected dead letters that were not there (any more) or not DEAD.
    pub(crate) skipped: usize,
}

/// Redrive or purge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Action {
    /// Outbox rows back to NEW; consumer dead letters back on their stream, for the
    /// group that gave up on them.
    Redrive,
    /// Delete them.
    Purge,
}

impl Action {
    /// `redrive` / `purge`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Redrive => "redrive",
            Self::Purge => "purge",
        }
    }
}

/// Applies `action` to the selected dead letters.
pub(crate) async fn apply(
    app: &std::sync::Arc<App>,
    action: Action,
    items: &[Item],
) -> Result<Done, Failure> {
    let mut done = Done::default();
    let ids: Vec<i64> = items
        .iter()
        .filter_map(|i| match i {
            Item::Outbox(id) => Some(*id),
            Item::Consumer { .. } => None,
        })
        .collect();
    if !ids.is_empty() {
        let app2 = app.clone();
        let ids2 = ids.clone();
        let changed = tokio::task::spawn_blocking(move || -> Result<usize, Failure> {
            let mut conn = app2.db.connect(false)?;
            Ok(match action {
                Action::Redrive => with_conn!(&mut conn, c => outbox_diesel::redrive(c, &ids2))?,
                Action::Purge => with_conn!(&mut conn, c => outbox_diesel::purge_dead(c, &ids2))?,
            })
        })
        .await
        .map_err(|e| Failure::server(e.to_string()))??;
        done.outbox = changed;
        done.skipped += ids.len() - changed;
    }
    let consumer: Vec<(&str, &str)> = items
        .iter()
        .filter_map(|i| match i {
            Item::Consumer { dead_stream, id } => Some((dead_stream.as_str(), id.as_str())),
            Item::Outbox(_) => None,
        })
        .collect();
    if consumer.is_empty() {
        return Ok(done);
    }
    if let Some(nats) = &app.nats {
        for (dead_stream, id) in consumer {
            if app.serves(dead_stream) && nats.apply(action, id).await? {
                done.consumers += 1;
            } else {
                done.skipped += 1;
            }
        }
        return Ok(done);
    }
    let mut conn = redis_conn(app)
        .await?
        .ok_or_else(|| Failure::bad_request("no --broker: consumer dead letters are not served"))?;
    for (dead_stream, id) in consumer {
        if !app.serves(dead_stream) {
            done.skipped += 1;
            continue;
        }
        let handled = match action {
            Action::Redrive => outbox_redis::redrive_dead_letter(&mut conn, dead_stream, id).await,
            Action::Purge => outbox_redis::purge_dead_letter(&mut conn, dead_stream, id).await,
        }
        .map_err(|e| Failure::of(&e))?;
        if handled {
            done.consumers += 1;
        } else {
            done.skipped += 1;
        }
    }
    Ok(done)
}
