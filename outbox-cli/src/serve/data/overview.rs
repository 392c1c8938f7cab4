//! The overview page: backlog, per-topic counts, the publish chart and the relays.

use super::Failure;
use crate::backend::{Conn, with_conn};
use crate::serve::App;
use serde::Serialize;

/// Minutes of history the publish chart covers.
pub(crate) const CHART_MINUTES: u32 = 15;

/// The overview page.
#[derive(Debug, Serialize)]
pub(crate) struct Overview {
    /// The database URL, password hidden.
    pub(crate) database: String,
    /// The broker URL, passwords hidden (`null` without `--broker`).
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
    /// CDC mode (`outbox migrate --cdc`): the slot's state, which is then the backlog
    /// (`due` and the NEW counts include the messages the CDC relay published, whose rows
    /// stay NEW); `null` with the polling relay.
    pub(crate) cdc: Option<crate::cdc::CdcStatus>,
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
        redis: app.broker.as_ref().map(|b| b.display().to_owned()),
        due: backlog.due,
        oldest_due_age_seconds: backlog.oldest_due_age.map(|d| d.as_secs_f64()),
        dead: backlog.dead,
        topics: topics.into_iter().map(TopicCounts::from).collect(),
        published: minutes.into_iter().map(Minute::from).collect(),
        relays: relays(app, &mut conn)?,
        cdc: match &mut conn {
            Conn::Pg(c) => crate::cdc::status(c).map_err(|e| Failure::server(e.to_string()))?,
            Conn::Mysql(c) => crate::cdc::binlog_status(c, &app.db.target)
                .map_err(|e| Failure::server(e.to_string()))?,
            _ => None,
        },
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
