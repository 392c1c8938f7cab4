//! What the pages and the API show, read from the database and Redis, and the redrive
//! and purge they do. Everything here is plain data (serialized as the API's JSON); the
//! pages render the same values.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use outbox_diesel::OutboxRow;
use outbox_redis::redis::aio::MultiplexedConnection;
use outbox_redis::redis::{self, AsyncConnectionConfig};
use serde::{Deserialize, Serialize};

use super::App;
use crate::backend::{Conn, redact, with_conn};
use crate::output::RowJson;

/// Minutes of history the publish chart covers.
pub(crate) const CHART_MINUTES: u32 = 15;
/// The most dead letters of one source read to filter and page (the newest are shown
/// first; past this many the list says it is cut).
const SCAN_LIMIT: usize = 5000;
/// Rows per query while scanning.
const SCAN_PAGE: usize = 500;
/// How long connecting to Redis may take.
const REDIS_TIMEOUT: Duration = Duration::from_secs(5);

/// A failure the page shows and the API returns with `{"error": …}`: its HTTP status
/// (500 unless the request itself was wrong) and the innermost cause, never a URL (which
/// may carry a password).
#[derive(Debug)]
pub(crate) struct Failure {
    /// The status to answer with.
    pub(crate) status: StatusCode,
    /// What went wrong.
    pub(crate) message: String,
}

impl Failure {
    /// A failure of the server or of a service behind it: 500.
    pub(crate) fn server(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
        }
    }

    /// A request that cannot be served as asked: 400.
    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    fn of(e: &(dyn std::error::Error + 'static)) -> Self {
        let mut cause = e;
        while let Some(c) = cause.source() {
            cause = c;
        }
        Self::server(cause.to_string().lines().next().unwrap_or_default())
    }
}

impl From<crate::error::CliError> for Failure {
    fn from(e: crate::error::CliError) -> Self {
        Self::of(&e)
    }
}
impl From<outbox_diesel::Error> for Failure {
    fn from(e: outbox_diesel::Error) -> Self {
        match e {
            // The selection holds a row that cannot be re-driven as it is: 409.
            outbox_diesel::Error::UnreadableRow { .. } => Self {
                status: StatusCode::CONFLICT,
                message: e.to_string(),
            },
            e => Self::of(&e),
        }
    }
}
impl From<diesel::result::Error> for Failure {
    fn from(e: diesel::result::Error) -> Self {
        Self::of(&e)
    }
}
impl From<redis::RedisError> for Failure {
    fn from(e: redis::RedisError) -> Self {
        Self::of(&e)
    }
}

/// The overview page.
#[derive(Debug, Serialize)]
pub(crate) struct Overview {
    /// The database URL, password hidden.
    pub(crate) database: String,
    /// The Redis URL, password hidden (`null` without `--redis-url`).
    pub(crate) redis: Option<String>,
    /// Due NEW messages.
    pub(crate) due: u64,
    /// Age of the oldest due message in seconds.
    pub(crate) oldest_due_age_seconds: Option<f64>,
    /// DEAD messages.
    pub(crate) dead: u64,
    /// NEW and DEAD messages per topic.
    pub(crate) topics: Vec<TopicCounts>,
    /// Published messages per minute, oldest minute first.
    pub(crate) published: Vec<Minute>,
    /// Relays seen.
    pub(crate) relays: Relays,
}

/// One topic's counts.
#[derive(Debug, Serialize)]
pub(crate) struct TopicCounts {
    /// The topic.
    pub(crate) topic: String,
    /// NEW messages (due or waiting for a retry).
    pub(crate) new: u64,
    /// DEAD messages.
    pub(crate) dead: u64,
}

impl From<outbox_diesel::TopicCounts> for TopicCounts {
    fn from(c: outbox_diesel::TopicCounts) -> Self {
        Self {
            topic: c.topic,
            new: c.new,
            dead: c.dead,
        }
    }
}

/// One minute of publishing.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Minute {
    /// How many minutes ago it began (0: the current minute).
    pub(crate) minutes_ago: i64,
    /// Messages published in it.
    pub(crate) published: u64,
    /// Messages per second over it.
    pub(crate) per_second: f64,
    /// Average commit→publish latency of them, in seconds.
    pub(crate) avg_latency_seconds: Option<f64>,
}

/// The relays the database knows of.
#[derive(Debug, Serialize)]
pub(crate) struct Relays {
    /// Whether this backend keeps track of relays at all.
    pub(crate) tracked: bool,
    /// What the entries are.
    pub(crate) note: String,
    /// One line per relay seen.
    pub(crate) seen: Vec<String>,
}

/// Reads the overview (blocking).
pub(crate) fn overview(app: &App) -> Result<Overview, Failure> {
    let mut conn = app.db.connect(false)?;
    let backlog = with_conn!(&mut conn, c => outbox_diesel::backlog(c))?;
    let topics = with_conn!(&mut conn, c => outbox_diesel::topic_counts(c))?;
    let minutes =
        with_conn!(&mut conn, c => outbox_diesel::published_per_minute(c, CHART_MINUTES))?;
    Ok(Overview {
        database: app.db.display(),
        redis: app.redis_display.clone(),
        due: backlog.due,
        oldest_due_age_seconds: backlog.oldest_due_age.map(|d| d.as_secs_f64()),
        dead: backlog.dead,
        topics: topics.into_iter().map(TopicCounts::from).collect(),
        published: minutes.into_iter().map(Minute::from).collect(),
        relays: relays(app, &mut conn)?,
    })
}

impl From<outbox_diesel::PublishedMinute> for Minute {
    fn from(m: outbox_diesel::PublishedMinute) -> Self {
        Self {
            minutes_ago: i64::from(m.minutes_ago),
            published: m.published,
            per_second: m.published as f64 / 60.0,
            avg_latency_seconds: m.avg_latency_seconds,
        }
    }
}

/// PostgreSQL: the relays parked now (the sessions holding a wake-up lock,
/// [`outbox_diesel::wake_lock_key`]; a relay at work holds none); SQLite: the lock
/// file's last holder; MySQL: nothing to read.
fn relays(app: &App, conn: &mut Conn) -> Result<Relays, Failure> {
    match conn {
        Conn::Pg(c) => {
            let parked = outbox_diesel::parked_relays(c)?.unwrap_or_default();
            Ok(Relays {
                tracked: true,
                note: "relays parked now, waiting for work (their LISTEN sessions, holding the \
                       wake-up lock; a relay at work holds none)"
                    .into(),
                seen: parked.iter().map(parked_line).collect(),
            })
        }
        Conn::Sqlite(_) => {
            let lock = format!(
                "{}{}",
                app.db.target,
                outbox_diesel::SqliteRelayStore::LOCK_FILE_SUFFIX
            );
            let holder = std::fs::read_to_string(&lock).ok();
            Ok(Relays {
                tracked: true,
                note: "one relay per SQLite file; its lock file names the last relay that \
                       took it (whether it still runs is not checked: testing the lock \
                       could keep a starting relay out)"
                    .into(),
                seen: holder
                    .map(|h| h.trim().to_owned())
                    .filter(|h| !h.is_empty())
                    .into_iter()
                    .collect(),
            })
        }
        Conn::Mysql(_) => Ok(Relays {
            tracked: false,
            note: "not tracked on MySQL / MariaDB".into(),
            seen: Vec::new(),
        }),
    }
}

/// A parked relay as the overview lists it: `pid 42 from 10.0.0.7 relay-a (parked, last
/// statement at …)`.
fn parked_line(r: &outbox_diesel::ParkedRelay) -> String {
    let mut line = format!(
        "pid {} from {}",
        r.pid,
        r.client_addr.as_deref().unwrap_or("local")
    );
    if let Some(name) = &r.application_name {
        line.push(' ');
        line.push_str(name);
    }
    let since = r.state_change.as_deref().unwrap_or_default();
    format!("{line} (parked, last statement at {since})")
}

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
    /// Whether the consumers' dead letters were read (`--redis-url` given).
    pub(crate) redis: bool,
    /// Why the consumers' dead letters could not be read (Redis down, say): the
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

/// A consumer's dead letter: an entry of `<stream>:dead`.
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
        if entry_ms(id).is_none() || dead_stream.is_empty() {
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

    /// Whether `dead_stream` is one of the dead-letter streams this server serves.
    fn serves(&self, dead_stream: &str) -> bool {
        dead_stream.starts_with(&self.prefix) && dead_stream.ends_with(&self.dead_suffix)
    }
}

/// The millisecond time of a stream entry id `<ms>-<seq>`.
fn entry_ms(id: &str) -> Option<i64> {
    let (ms, seq) = id.split_once('-')?;
    seq.parse::<u64>().ok()?;
    ms.parse().ok()
}

fn age_of(time: DateTime<Utc>) -> Duration {
    (Utc::now() - time).to_std().unwrap_or_default()
}

/// The outbox's DEAD rows that match, newest first (blocking). Rows whose fields do not
/// decode are among them, as stored.
pub(crate) fn outbox_dead(app: &App, filter: &Filter) -> Result<(Vec<OutboxRow>, bool), Failure> {
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

/// A Redis connection, if `--redis-url` was given.
pub(crate) async fn redis_conn(app: &App) -> Result<Option<MultiplexedConnection>, Failure> {
    let Some(client) = &app.redis else {
        return Ok(None);
    };
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(REDIS_TIMEOUT))
        .set_response_timeout(Some(REDIS_TIMEOUT));
    Ok(Some(
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await?,
    ))
}

/// The streams named `<prefix>…`, sorted, dead-letter streams and the others apart.
async fn streams(
    app: &App,
    conn: &mut MultiplexedConnection,
) -> Result<(Vec<String>, Vec<String>), Failure> {
    Ok(crate::scan::streams(conn, &app.prefix)
        .await?
        .into_iter()
        .partition(|s| s.ends_with(&app.dead_suffix)))
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
pub(crate) async fn consumers_dead(
    app: &App,
    filter: &Filter,
) -> Result<(Vec<ConsumerDead>, bool), Failure> {
    filter.min_age()?;
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
        redis: app.redis.is_some(),
        redis_error,
    })
}

/// One consumer dead letter.
pub(crate) async fn consumer_entry(
    app: &App,
    dead_stream: &str,
    id: &str,
) -> Result<Option<ConsumerDead>, Failure> {
    let Some(mut conn) = redis_conn(app).await? else {
        return Ok(None);
    };
    let found = outbox_redis::dead_letter(&mut conn, dead_stream, id)
        .await
        .map_err(|e| Failure::of(&e))?;
    Ok(found.map(|d| consumer_dead(dead_stream, &d)))
}

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
    let mut conn = redis_conn(app).await?.ok_or_else(|| {
        Failure::bad_request("no --redis-url: consumer dead letters are not served")
    })?;
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

/// A consumer group of a stream.
#[derive(Debug, Serialize)]
pub(crate) struct Group {
    /// The stream.
    pub(crate) stream: String,
    /// The group.
    pub(crate) group: String,
    /// Entries not yet delivered to the group (Redis 7+; `null` when Redis cannot tell).
    pub(crate) lag: Option<usize>,
    /// Entries delivered and not acknowledged.
    pub(crate) pending: usize,
    /// The last entry delivered.
    pub(crate) last_delivered_id: String,
    /// The oldest pending entry's id.
    pub(crate) oldest_pending_id: Option<String>,
    /// Its age in seconds (from its id).
    pub(crate) oldest_pending_age_seconds: Option<f64>,
    /// The group's consumers.
    pub(crate) consumers: Vec<GroupConsumer>,
}

/// A consumer of a group.
#[derive(Debug, Serialize)]
pub(crate) struct GroupConsumer {
    /// Its name.
    pub(crate) name: String,
    /// Entries it holds unacknowledged.
    pub(crate) pending: usize,
    /// Milliseconds since it last read or claimed.
    pub(crate) idle_ms: usize,
}

/// Every group of every stream of the prefix (dead-letter streams have none).
pub(crate) async fn groups(app: &App) -> Result<Option<Vec<Group>>, Failure> {
    let Some(mut conn) = redis_conn(app).await? else {
        return Ok(None);
    };
    let (_, streams) = streams(app, &mut conn).await?;
    let mut out = Vec::new();
    for stream in streams {
        let now = Utc::now().timestamp_millis();
        let infos = outbox_redis::consumer_groups(&mut conn, &stream)
            .await
            .map_err(|e| Failure::of(&e))?;
        for g in infos {
            out.push(Group {
                stream: stream.clone(),
                group: g.name,
                lag: g.lag,
                pending: g.pending,
                last_delivered_id: g.last_delivered_id,
                oldest_pending_age_seconds: g
                    .oldest_pending_id
                    .as_deref()
                    .and_then(entry_ms)
                    .map(|ms| now.saturating_sub(ms).max(0) as f64 / 1000.0),
                oldest_pending_id: g.oldest_pending_id,
                consumers: g
                    .consumers
                    .into_iter()
                    .map(|c| GroupConsumer {
                        name: c.name,
                        pending: c.pending,
                        idle_ms: c.idle_ms,
                    })
                    .collect(),
            });
        }
    }
    Ok(Some(out))
}

/// A Redis URL fit to show.
pub(crate) fn redis_display(url: &str) -> String {
    redact(url)
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
        for bad in ["outbox:x", "consumer:x:s", "consumer:1-0:", "17", ""] {
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
