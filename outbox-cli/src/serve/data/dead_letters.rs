//! The dead letters of both sources (the outbox's DEAD rows, the consumers'
//! dead-letter streams): the selection of one, the filters, the pages and the details.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_diesel::OutboxRow;
use serde::{Deserialize, Serialize};

use super::{Failure, entry_ms, redis_conn, streams};
use crate::backend::with_conn;
use crate::output::RowJson;
use crate::serve::App;

/// The most dead letters of one source read to filter and page (the newest are shown
/// first; past this many the list says it is cut).
const SCAN_LIMIT: usize = 5000;
/// Rows per query while scanning.
const SCAN_PAGE: usize = 500;

/// The dead-letter list's filters and page, from the query string.
#[derive(Debug, Default, Clone, Deserialize, Serialize)]
#[serde(default)]
pub(crate) struct Filter {
    /// Only this topic (exact).
    pub(crate) topic: String,
    /// Only this event type (exact).
    #[serde(rename = "type")]
    pub(crate) event_type: String,
    /// Only errors containing this text (case-insensitive).
    pub(crate) error: String,
    /// Only messages older than this (`30m`, `2d`).
    pub(crate) older_than: String,
    /// The page, from 0.
    pub(crate) page: usize,
    /// Per page and source (default 50, at most 500).
    pub(crate) per_page: Option<usize>,
}

impl Filter {
    /// Entries per page.
    pub(crate) fn per_page(&self) -> usize {
        self.per_page.unwrap_or(50).clamp(1, 500)
    }

    fn min_age(&self) -> Result<Option<Duration>, Failure> {
        if self.older_than.trim().is_empty() {
            return Ok(None);
        }
        humantime::parse_duration(self.older_than.trim())
            .map(Some)
            .map_err(|e| Failure::bad_request(format!("older_than `{}`: {e}", self.older_than)))
    }

    fn matches(&self, topic: &str, event_type: &str, error: &str, age: Duration) -> bool {
        let min_age = self.min_age().ok().flatten().unwrap_or_default();
        (self.topic.is_empty() || topic == self.topic)
            && (self.event_type.is_empty() || event_type == self.event_type)
            && (self.error.is_empty() || error.to_lowercase().contains(&self.error.to_lowercase()))
            && age >= min_age
    }
}

/// One page of dead letters of both sources.
#[derive(Debug, Serialize)]
pub(crate) struct DeadPage {
    /// The outbox's DEAD rows on this page, newest first.
    pub(crate) outbox: Vec<OutboxDead>,
    /// Matching DEAD rows in all.
    pub(crate) outbox_total: usize,
    /// The consumers' dead letters on this page, newest first.
    pub(crate) consumers: Vec<ConsumerDead>,
    /// Matching consumer dead letters in all.
    pub(crate) consumers_total: usize,
    /// Whether a source had more than could be scanned (the oldest are left out).
    pub(crate) truncated: bool,
    /// Whether the consumers' dead letters were read (`--broker` given, Redis or NATS:
    /// the name is the API's since before NATS).
    pub(crate) redis: bool,
    /// The broker they were read from: `Redis` or `NATS` (`null` without `--broker`).
    pub(crate) broker: Option<&'static str>,
    /// Why the consumers' dead letters could not be read (the broker down, say): the
    /// outbox's are shown all the same.
    pub(crate) redis_error: Option<String>,
}

/// An outbox DEAD row.
#[derive(Debug, Serialize)]
pub(crate) struct OutboxDead {
    /// What selects it: `outbox:<id>`.
    pub(crate) item: String,
    /// The row as `outbox dead show --json` prints it (with `unreadable`, the reason,
    /// for a row whose fields do not decode).
    #[serde(flatten)]
    pub(crate) record: serde_json::Value,
    /// Seconds since it was emitted.
    pub(crate) age_seconds: f64,
}

/// A consumer's dead letter: an entry of `<stream>:dead` (Redis), a message of the
/// dead-letter stream `<prefix>DEAD` (NATS: its id is the sequence there).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ConsumerDead {
    /// What selects it: `consumer:<entry id>:<dead-letter stream>`.
    pub(crate) item: String,
    /// The dead-letter stream.
    pub(crate) dead_stream: String,
    /// Its id there.
    pub(crate) id: String,
    /// The stream it came from.
    pub(crate) stream: String,
    /// The consumer group that gave up on it.
    pub(crate) group: String,
    /// Its id on that stream.
    pub(crate) entry_id: String,
    /// Why it was dead-lettered.
    pub(crate) reason: String,
    /// Deliveries before it was.
    pub(crate) delivery_count: Option<u64>,
    /// The message's topic, type and msg_id (empty if the entry had none).
    pub(crate) topic: String,
    /// The event type.
    #[serde(rename = "type")]
    pub(crate) event_type: String,
    /// The msg_id.
    pub(crate) msg_id: String,
    /// Seconds since it was dead-lettered.
    pub(crate) age_seconds: f64,
    /// The original entry's fields (payload, headers, …) as text.
    pub(crate) fields: BTreeMap<String, String>,
}

/// A selected dead letter: `outbox:<id>` or `consumer:<entry id>:<dead-letter stream>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Item {
    /// An outbox row.
    Outbox(i64),
    /// An entry of a dead-letter stream.
    Consumer {
        /// The dead-letter stream.
        dead_stream: String,
        /// The entry's id there.
        id: String,
    },
}

impl Item {
    /// Parses a selection value.
    pub(crate) fn parse(text: &str) -> Result<Self, Failure> {
        let bad = || {
            Failure::bad_request(format!(
                "not a dead letter: `{text}` (give `outbox:<row id>` or \
                 `consumer:<entry id>:<dead-letter stream>`)"
            ))
        };
        if let Some(id) = text.strip_prefix("outbox:") {
            return id.parse().map(Self::Outbox).map_err(|_| bad());
        }
        let rest = text.strip_prefix("consumer:").ok_or_else(bad)?;
        let (id, dead_stream) = rest.split_once(':').ok_or_else(bad)?;
        // A Redis entry id, or a NATS sequence.
        if (entry_ms(id).is_none() && id.parse::<u64>().is_err()) || dead_stream.is_empty() {
            return Err(bad());
        }
        Ok(Self::Consumer {
            dead_stream: dead_stream.to_owned(),
            id: id.to_owned(),
        })
    }
}

impl App {
    /// Parses a selection value that must name a dead letter this server serves: an
    /// outbox row, or an entry of a dead-letter stream under `--stream-prefix` (400
    /// otherwise, so the API reads no other key of the Redis server).
    pub(crate) fn item(&self, text: &str) -> Result<Item, Failure> {
        let item = Item::parse(text)?;
        if let Item::Consumer { dead_stream, .. } = &item
            && !self.serves(dead_stream)
        {
            return Err(Failure::bad_request(format!(
                "`{dead_stream}` is not a dead-letter stream of this server (`{}…{}`)",
                self.prefix, self.dead_suffix
            )));
        }
        Ok(item)
    }

    /// `Redis` or `NATS`, if `--broker` was given.
    pub(crate) fn broker_name(&self) -> Option<&'static str> {
        self.broker.as_ref().map(|b| match b.kind() {
            crate::broker::BrokerKind::Redis(_) => "Redis",
            crate::broker::BrokerKind::Nats(_) => "NATS",
        })
    }

    /// Whether `dead_stream` is one of the dead-letter streams this server serves (on
    /// NATS, the one).
    pub(super) fn serves(&self, dead_stream: &str) -> bool {
        match &self.nats {
            Some(nats) => dead_stream == nats.dead_stream(),
            None => {
                dead_stream.starts_with(&self.prefix) && dead_stream.ends_with(&self.dead_suffix)
            }
        }
    }
}

fn age_of(time: DateTime<Utc>) -> Duration {
    (Utc::now() - time).to_std().unwrap_or_default()
}

/// The outbox's DEAD rows that match, newest first (blocking). Rows whose fields do not
/// decode are among them, as stored.
fn outbox_dead(app: &App, filter: &Filter) -> Result<(Vec<OutboxRow>, bool), Failure> {
    filter.min_age()?;
    let mut conn = app.db.connect(false)?;
    let mut all = Vec::new();
    let mut after = 0;
    loop {
        let page = with_conn!(&mut conn, c => outbox_diesel::dead_letters(c, after, SCAN_PAGE))?;
        let Some(last) = page.last() else { break };
        after = last.id();
        all.extend(page);
    }
    let truncated = all.len() > SCAN_LIMIT;
    all.reverse();
    all.truncate(SCAN_LIMIT);
    all.retain(|row| {
        let (topic, event_type, error) = match row {
            OutboxRow::Readable(r) => (&r.envelope.topic, &r.envelope.event_type, &r.last_error),
            OutboxRow::Unreadable(u) => (&u.topic, &u.event_type, &u.last_error),
        };
        filter.matches(
            topic,
            event_type,
            error.as_deref().unwrap_or_default(),
            age_of(created_at(row)),
        )
    });
    Ok((all, truncated))
}

/// When the row was created; an unreadable row's out-of-range time (`infinity`) as now.
fn created_at(row: &OutboxRow) -> DateTime<Utc> {
    match row {
        OutboxRow::Readable(r) => r.envelope.created_at,
        OutboxRow::Unreadable(u) => u.created_at.unwrap_or_else(Utc::now),
    }
}

/// An outbox row for the API and the pages.
pub(crate) fn outbox_item(row: &OutboxRow) -> OutboxDead {
    OutboxDead {
        item: format!("outbox:{}", row.id()),
        record: serde_json::to_value(RowJson::from(row)).unwrap_or_default(),
        age_seconds: age_of(created_at(row)).as_secs_f64(),
    }
}

/// One outbox row by id, whatever its status, readable or not (blocking).
pub(crate) fn outbox_row(app: &App, id: i64) -> Result<Option<OutboxRow>, Failure> {
    let mut conn = app.db.connect(false)?;
    let page =
        with_conn!(&mut conn, c => outbox_diesel::list_rows(c, None, id.saturating_sub(1), 1))?;
    Ok(page.into_iter().find(|r| r.id() == id))
}

fn consumer_dead(dead_stream: &str, d: &outbox_redis::DeadLetter) -> ConsumerDead {
    let field = |name: &str| d.field(name).unwrap_or_default().to_owned();
    let age_ms = entry_ms(&d.id).map_or(0, |ms| Utc::now().timestamp_millis().saturating_sub(ms));
    ConsumerDead {
        item: format!("consumer:{}:{dead_stream}", d.id),
        dead_stream: dead_stream.to_owned(),
        id: d.id.clone(),
        stream: d.stream.clone(),
        group: d.group.clone(),
        entry_id: d.entry_id.clone(),
        reason: d.reason.clone(),
        delivery_count: d.delivery_count,
        topic: field("topic"),
        event_type: field("type"),
        msg_id: field("msg_id"),
        age_seconds: age_ms.max(0) as f64 / 1000.0,
        fields: d
            .fields
            .iter()
            .map(|(k, v)| (k.clone(), String::from_utf8_lossy(v).into_owned()))
            .collect(),
    }
}

/// The consumers' dead letters that match, newest first.
async fn consumers_dead(app: &App, filter: &Filter) -> Result<(Vec<ConsumerDead>, bool), Failure> {
    filter.min_age()?;
    let (mut all, truncated) = match &app.nats {
        Some(nats) => nats.dead_letters(SCAN_LIMIT).await?,
        None => redis_dead(app).await?,
    };
    all.retain(|d| {
        filter.matches(
            &d.topic,
            &d.event_type,
            &d.reason,
            Duration::from_secs_f64(d.age_seconds),
        )
    });
    Ok((all, truncated))
}

/// The dead letters of every Redis dead-letter stream of the prefix, newest first.
async fn redis_dead(app: &App) -> Result<(Vec<ConsumerDead>, bool), Failure> {
    let Some(mut conn) = redis_conn(app).await? else {
        return Ok((Vec::new(), false));
    };
    let (dead_streams, _) = streams(app, &mut conn).await?;
    let mut all = Vec::new();
    let mut truncated = false;
    for dead in &dead_streams {
        let letters = outbox_redis::dead_letters(&mut conn, dead, SCAN_LIMIT + 1)
            .await
            .map_err(|e| Failure::of(&e))?;
        truncated |= letters.len() > SCAN_LIMIT;
        all.extend(
            letters
                .iter()
                .take(SCAN_LIMIT)
                .map(|d| consumer_dead(dead, d)),
        );
    }
    all.sort_by(|a, b| a.age_seconds.total_cmp(&b.age_seconds));
    Ok((all, truncated))
}

/// One page of both sources' dead letters.
pub(crate) async fn dead_page(
    app: &std::sync::Arc<App>,
    filter: &Filter,
) -> Result<DeadPage, Failure> {
    let (app2, filter2) = (app.clone(), filter.clone());
    let (outbox, outbox_cut) = tokio::task::spawn_blocking(move || outbox_dead(&app2, &filter2))
        .await
        .map_err(|e| Failure::server(e.to_string()))??;
    filter.min_age()?;
    let (consumers, consumers_cut, redis_error) = match consumers_dead(app, filter).await {
        Ok((consumers, cut)) => (consumers, cut, None),
        Err(f) => (Vec::new(), false, Some(f.message)),
    };
    let (per, page) = (filter.per_page(), filter.page);
    let slice = |len: usize| (page.saturating_mul(per).min(len), per);
    let (skip, take) = slice(outbox.len());
    let outbox_page = outbox
        .iter()
        .skip(skip)
        .take(take)
        .map(outbox_item)
        .collect();
    let (skip, take) = slice(consumers.len());
    Ok(DeadPage {
        outbox: outbox_page,
        outbox_total: outbox.len(),
        consumers_total: consumers.len(),
        consumers: consumers.into_iter().skip(skip).take(take).collect(),
        truncated: outbox_cut || consumers_cut,
        redis: app.broker.is_some(),
        broker: app.broker_name(),
        redis_error,
    })
}

/// One consumer dead letter.
pub(crate) async fn consumer_entry(
    app: &App,
    dead_stream: &str,
    id: &str,
) -> Result<Option<ConsumerDead>, Failure> {
    if let Some(nats) = &app.nats {
        return nats.dead_letter(id).await;
    }
    let Some(mut conn) = redis_conn(app).await? else {
        return Ok(None);
    };
    let found = outbox_redis::dead_letter(&mut conn, dead_stream, id)
        .await
        .map_err(|e| Failure::of(&e))?;
    Ok(found.map(|d| consumer_dead(dead_stream, &d)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selections_parse() {
        assert_eq!(Item::parse("outbox:17").unwrap(), Item::Outbox(17));
        assert_eq!(
            Item::parse("consumer:1700-0:outbox:a.b:dead").unwrap(),
            Item::Consumer {
                dead_stream: "outbox:a.b:dead".into(),
                id: "1700-0".into()
            }
        );
        assert_eq!(
            Item::parse("consumer:17:OUTBOX_DEAD").unwrap(),
            Item::Consumer {
                dead_stream: "OUTBOX_DEAD".into(),
                id: "17".into()
            }
        );
        for bad in [
            "outbox:x",
            "consumer:x:s",
            "consumer:1-0:",
            "consumer:-1:S",
            "17",
            "",
        ] {
            assert!(Item::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn filters_match_exact_names_and_error_text() {
        let f = Filter {
            topic: "a".into(),
            error: "wrongtype".into(),
            older_than: "1m".into(),
            ..Filter::default()
        };
        let old = Duration::from_secs(120);
        assert!(f.matches("a", "T", "WRONGTYPE x", old));
        assert!(!f.matches("ab", "T", "WRONGTYPE x", old));
        assert!(!f.matches("a", "T", "timeout", old));
        assert!(!f.matches("a", "T", "WRONGTYPE x", Duration::from_secs(5)));
    }
}
