//! Human and JSON renderings of what the commands read.

use std::io::{self, Write};
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use outbox_core::Backlog;
use outbox_diesel::{OutboxRecord, OutboxRow, UnreadableRecord};
use outbox_redis::TrimReport;
use serde::Serialize;

/// The backlog as `outbox status --json` prints it.
#[derive(Debug, Serialize)]
pub(crate) struct BacklogJson {
    /// Due NEW messages.
    pub(crate) due: u64,
    /// Age of the oldest due NEW message in seconds, `null` when nothing is due.
    pub(crate) oldest_due_age_seconds: Option<f64>,
    /// DEAD messages.
    pub(crate) dead: u64,
}

impl From<Backlog> for BacklogJson {
    fn from(b: Backlog) -> Self {
        Self {
            due: b.due,
            oldest_due_age_seconds: b.oldest_due_age.map(|d| d.as_secs_f64()),
            dead: b.dead,
        }
    }
}

/// A message as the JSON outputs print it.
#[derive(Debug, Serialize)]
pub(crate) struct RecordJson<'a> {
    id: i64,
    msg_id: &'a str,
    status: String,
    topic: &'a str,
    event_type: &'a str,
    key: &'a str,
    schema_version: u32,
    retries: u32,
    created_at: String,
    next_retry_at: String,
    sent_at: Option<String>,
    last_error: Option<&'a str>,
    headers: &'a outbox_core::Headers,
    /// The payload as JSON, or as a string if it does not parse.
    payload: serde_json::Value,
}

impl<'a> From<&'a OutboxRecord> for RecordJson<'a> {
    fn from(r: &'a OutboxRecord) -> Self {
        let e = &r.envelope;
        Self {
            id: r.id,
            msg_id: e.msg_id.as_str(),
            status: r.status.to_string(),
            topic: &e.topic,
            event_type: &e.event_type,
            key: &e.key,
            schema_version: e.schema_version,
            retries: r.retries,
            created_at: rfc3339(e.created_at),
            next_retry_at: rfc3339(r.next_retry_at),
            sent_at: r.sent_at.map(rfc3339),
            last_error: r.last_error.as_deref(),
            headers: &e.headers,
            payload: serde_json::from_str(&e.payload)
                .unwrap_or_else(|_| serde_json::Value::String(e.payload.clone())),
        }
    }
}

/// A row whose fields do not decode, as the JSON outputs print it: the keys of
/// [`RecordJson`], each as stored (headers and payload as JSON if they parse, else as
/// text; timestamps `null` when out of range), and `unreadable`, the reason.
#[derive(Debug, Serialize)]
pub(crate) struct UnreadableJson<'a> {
    id: i64,
    msg_id: &'a str,
    status: String,
    topic: &'a str,
    event_type: &'a str,
    key: &'a str,
    schema_version: i32,
    retries: i32,
    created_at: Option<String>,
    next_retry_at: Option<String>,
    sent_at: Option<String>,
    last_error: Option<&'a str>,
    headers: serde_json::Value,
    payload: serde_json::Value,
    /// Why the row does not decode.
    unreadable: &'a str,
}

impl<'a> From<&'a UnreadableRecord> for UnreadableJson<'a> {
    fn from(u: &'a UnreadableRecord) -> Self {
        Self {
            id: u.id,
            msg_id: &u.msg_id,
            status: stored_status(u),
            topic: &u.topic,
            event_type: &u.event_type,
            key: &u.key,
            schema_version: u.schema_version,
            retries: u.retries,
            created_at: u.created_at.map(rfc3339),
            next_retry_at: u.next_retry_at.map(rfc3339),
            sent_at: u.sent_at.map(rfc3339),
            last_error: u.last_error.as_deref(),
            headers: json_or_text(&u.headers),
            payload: json_or_text(&u.payload),
            unreadable: &u.reason,
        }
    }
}

/// Any row as the JSON outputs print it: [`RecordJson`] or [`UnreadableJson`].
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(crate) enum RowJson<'a> {
    /// A row that decodes.
    Readable(RecordJson<'a>),
    /// A row that does not.
    Unreadable(UnreadableJson<'a>),
}

impl<'a> From<&'a OutboxRow> for RowJson<'a> {
    fn from(row: &'a OutboxRow) -> Self {
        match row {
            OutboxRow::Readable(r) => Self::Readable(r.into()),
            OutboxRow::Unreadable(u) => Self::Unreadable(u.into()),
        }
    }
}

/// The status's name, or the stored number if it is none.
fn stored_status(u: &UnreadableRecord) -> String {
    u.status()
        .map_or_else(|| format!("unknown ({})", u.status), |s| s.to_string())
}

fn json_or_text(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|_| serde_json::Value::String(text.to_owned()))
}

/// One stream as `outbox trim --json` prints it.
#[derive(Debug, Serialize)]
pub(crate) struct TrimJson<'a> {
    stream: &'a str,
    removed: usize,
    /// Entries below this id were removed; `null` when the stream has no consumer group.
    min_id: Option<&'a str>,
}

impl<'a> From<&'a TrimReport> for TrimJson<'a> {
    fn from(r: &'a TrimReport) -> Self {
        Self {
            stream: &r.stream,
            removed: r.removed,
            min_id: r.min_id.as_deref(),
        }
    }
}

/// `outbox trim`, for people: one line per stream, then the total.
pub(crate) fn trim_reports(
    w: &mut impl Write,
    reports: &[TrimReport],
    prefix: &str,
) -> io::Result<()> {
    if reports.is_empty() {
        return writeln!(w, "no streams named {prefix}*");
    }
    let width = reports
        .iter()
        .map(|r| r.stream.chars().count())
        .max()
        .unwrap_or(0);
    for r in reports {
        let stream = &r.stream;
        match &r.min_id {
            Some(min_id) => writeln!(
                w,
                "{stream:<width$}  removed {} (acknowledged below {min_id})",
                r.removed
            )?,
            None => writeln!(w, "{stream:<width$}  left alone: no consumer group")?,
        }
    }
    let total: usize = reports.iter().map(|r| r.removed).sum();
    writeln!(
        w,
        "removed {total} entries from {} stream(s)",
        reports.len()
    )
}

/// One topic: what publishers recorded of it and the streams found.
#[derive(Debug, Serialize)]
pub(crate) struct TopicStreams {
    /// The topic.
    pub(crate) topic: String,
    /// The partition count publishers recorded in `<prefix>partitions`, if any did.
    pub(crate) recorded_partitions: Option<u32>,
    /// Its stream, or its partition streams in partition order.
    pub(crate) streams: Vec<StreamReport>,
}

/// One stream of a topic.
#[derive(Debug, Serialize)]
pub(crate) struct StreamReport {
    /// The stream's key.
    pub(crate) stream: String,
    /// Its partition, `None` for a topic's one stream.
    pub(crate) partition: Option<u32>,
    /// Entries in it (`XLEN`).
    pub(crate) length: u64,
    /// Entries in its dead-letter stream.
    pub(crate) dead_letters: u64,
    /// Its consumer groups.
    pub(crate) groups: Vec<GroupReport>,
}

/// One consumer group of a stream.
#[derive(Debug, Serialize)]
pub(crate) struct GroupReport {
    /// The group.
    pub(crate) group: String,
    /// Entries delivered and not acknowledged.
    pub(crate) pending: usize,
    /// Entries not delivered yet (Redis 7+; `None` when Redis cannot tell).
    pub(crate) lag: Option<usize>,
    /// Consumers the group knows.
    pub(crate) consumers: usize,
    /// On a partition stream, the group's consumer holding the partition (ordered
    /// consumers); `None` when none does, and always on a topic's one stream.
    pub(crate) lease: Option<LeaseReport>,
}

/// A partition's lease holder.
#[derive(Debug, Serialize)]
pub(crate) struct LeaseReport {
    /// The consumer.
    pub(crate) holder: String,
    /// The lease's epoch (one more at each acquisition).
    pub(crate) epoch: Option<u64>,
    /// Milliseconds left unless renewed; `None` when no expiry is set.
    pub(crate) ttl_ms: Option<u64>,
}

/// `outbox streams`, for people: each topic, then each of its streams with its groups.
pub(crate) fn streams(w: &mut impl Write, topics: &[TopicStreams], prefix: &str) -> io::Result<()> {
    if topics.is_empty() {
        return writeln!(w, "no streams named {prefix}*");
    }
    for t in topics {
        match t.recorded_partitions {
            Some(n) => writeln!(w, "{}: {n} partition(s) recorded", t.topic)?,
            None => writeln!(w, "{}", t.topic)?,
        }
        if t.streams.is_empty() {
            writeln!(w, "  no stream yet")?;
        }
        for s in &t.streams {
            stream_lines(w, s)?;
        }
    }
    Ok(())
}

fn stream_lines(w: &mut impl Write, s: &StreamReport) -> io::Result<()> {
    let dead = match s.dead_letters {
        0 => String::new(),
        n => format!(", {n} dead letter(s)"),
    };
    writeln!(w, "  {}  length {}{dead}", s.stream, s.length)?;
    if s.groups.is_empty() {
        return writeln!(w, "    no consumer group");
    }
    for g in &s.groups {
        let lag = g.lag.map_or_else(|| "?".to_owned(), |n| n.to_string());
        let lease = match (&g.lease, s.partition) {
            // An unpartitioned stream without a lease: an unordered group, as usual.
            (None, None) => String::new(),
            (None, Some(_)) => ", no lease holder".to_owned(),
            (Some(l), _) => {
                let epoch = l.epoch.map(|e| format!("epoch {e}, ")).unwrap_or_default();
                let ttl = l.ttl_ms.map_or_else(
                    || "no expiry".to_owned(),
                    |ms| format!("{:.1}s left", ms as f64 / 1000.0),
                );
                format!(", held by {} ({epoch}{ttl})", l.holder)
            }
        };
        writeln!(
            w,
            "    group {}: pending {}, lag {lag}, {} consumer(s){lease}",
            g.group, g.pending, g.consumers
        )?;
    }
    Ok(())
}

/// Writes `value` as pretty JSON and a newline.
pub(crate) fn json(w: &mut impl Write, value: &impl Serialize) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *w, value)?;
    writeln!(w)
}

/// `outbox status`, for people.
pub(crate) fn backlog(w: &mut impl Write, b: &Backlog) -> io::Result<()> {
    let age = b.oldest_due_age.map_or_else(|| "-".to_owned(), age);
    writeln!(w, "due NEW messages:  {}", b.due)?;
    writeln!(w, "oldest due age:    {age}")?;
    writeln!(w, "DEAD messages:     {}", b.dead)
}

/// `outbox dead list`, for people: a table, and how to see the next page when full. A
/// row whose fields do not decode is shown as stored, escaped, with the reason in place
/// of its last error, and a note says what can be done with it.
pub(crate) fn record_table(w: &mut impl Write, rows: &[OutboxRow], limit: usize) -> io::Result<()> {
    if rows.is_empty() {
        return writeln!(w, "no dead letters");
    }
    let cells: Vec<[String; 6]> = rows
        .iter()
        .map(|row| match row {
            OutboxRow::Readable(r) => [
                r.id.to_string(),
                r.envelope.msg_id.to_string(),
                r.envelope.topic.clone(),
                r.retries.to_string(),
                short_time(r.envelope.created_at),
                one_line(r.last_error.as_deref().unwrap_or("-"), 80),
            ],
            OutboxRow::Unreadable(u) => [
                u.id.to_string(),
                format!("{:?}", u.msg_id),
                visible(&u.topic),
                u.retries.to_string(),
                u.created_at.map_or_else(|| "?".to_owned(), short_time),
                one_line(&format!("UNREADABLE: {}", visible(&u.reason)), 80),
            ],
        })
        .collect();
    let header = [
        "ID",
        "MSG_ID",
        "TOPIC",
        "RETRIES",
        "CREATED (UTC)",
        "LAST ERROR",
    ];
    let mut widths = header.map(str::len);
    for row in &cells {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    table_row(w, &header.map(str::to_owned), &widths)?;
    for row in &cells {
        table_row(w, row, &widths)?;
    }
    let unreadable = rows
        .iter()
        .filter(|r| matches!(r, OutboxRow::Unreadable(_)))
        .count();
    if unreadable > 0 {
        writeln!(
            w,
            "({unreadable} UNREADABLE: fields that do not decode, shown as stored; \
             `outbox dead show ID` shows them in full; fix such a row before a redrive, \
             or `outbox dead purge ID`)"
        )?;
    }
    if rows.len() >= limit
        && let Some(last) = rows.last()
    {
        writeln!(
            w,
            "(more may follow: outbox dead list --after {})",
            last.id()
        )?;
    }
    Ok(())
}

fn table_row(w: &mut impl Write, cells: &[String; 6], widths: &[usize; 6]) -> io::Result<()> {
    let mut line = String::new();
    for (i, (cell, width)) in cells.iter().zip(widths).enumerate() {
        if i + 1 == cells.len() {
            line.push_str(cell);
        } else {
            line.push_str(&format!("{cell:<width$}  "));
        }
    }
    writeln!(w, "{}", line.trim_end())
}

/// `outbox dead show`, for people.
pub(crate) fn record_detail(w: &mut impl Write, r: &OutboxRecord) -> io::Result<()> {
    let e = &r.envelope;
    writeln!(w, "id:             {}", r.id)?;
    writeln!(w, "msg_id:         {}", e.msg_id)?;
    writeln!(w, "status:         {}", r.status)?;
    writeln!(w, "topic:          {}", e.topic)?;
    writeln!(
        w,
        "event type:     {} (schema version {})",
        e.event_type, e.schema_version
    )?;
    writeln!(w, "key:            {}", e.key)?;
    writeln!(w, "retries:        {}", r.retries)?;
    writeln!(w, "created at:     {}", rfc3339(e.created_at))?;
    writeln!(w, "next retry at:  {}", rfc3339(r.next_retry_at))?;
    writeln!(
        w,
        "sent at:        {}",
        r.sent_at.map_or_else(|| "-".to_owned(), rfc3339)
    )?;
    writeln!(
        w,
        "last error:     {}",
        r.last_error.as_deref().unwrap_or("-")
    )?;
    writeln!(w, "headers:        {}", serde_json::to_string(&e.headers)?)?;
    let payload = serde_json::from_str::<serde_json::Value>(&e.payload)
        .and_then(|v| serde_json::to_string_pretty(&v))
        .unwrap_or_else(|_| e.payload.clone());
    writeln!(w, "payload:\n{payload}")
}

/// `outbox dead show` of a row whose fields do not decode: every field as stored,
/// escaped, and why it does not decode.
pub(crate) fn unreadable_detail(w: &mut impl Write, u: &UnreadableRecord) -> io::Result<()> {
    let time = |t: Option<DateTime<Utc>>| t.map_or_else(|| "out of range".to_owned(), rfc3339);
    writeln!(w, "id:             {}", u.id)?;
    writeln!(w, "UNREADABLE:     {}", visible(&u.reason))?;
    writeln!(
        w,
        "                (shown as stored; fix the row before a redrive, or purge it)"
    )?;
    writeln!(w, "msg_id:         {:?}", u.msg_id)?;
    writeln!(w, "status:         {}", stored_status(u))?;
    writeln!(w, "topic:          {}", visible(&u.topic))?;
    writeln!(
        w,
        "event type:     {} (schema version {})",
        visible(&u.event_type),
        u.schema_version
    )?;
    writeln!(w, "key:            {}", visible(&u.key))?;
    writeln!(w, "retries:        {}", u.retries)?;
    writeln!(w, "created at:     {}", time(u.created_at))?;
    writeln!(w, "next retry at:  {}", time(u.next_retry_at))?;
    writeln!(
        w,
        "sent at:        {}",
        u.sent_at.map_or_else(|| "-".to_owned(), rfc3339)
    )?;
    writeln!(
        w,
        "last error:     {}",
        u.last_error
            .as_deref()
            .map_or_else(|| "-".to_owned(), visible)
    )?;
    writeln!(w, "headers:        {}", visible(&u.headers))?;
    writeln!(w, "payload:\n{}", visible(&u.payload))
}

/// `text` with its control characters escaped (`\n`, `\u{1b}`): a stored value cannot
/// move the terminal's cursor or fake lines of the output.
fn visible(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// An age rounded to the second: `2h 5m 3s`.
pub(crate) fn age(d: Duration) -> String {
    humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn short_time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S").to_string()
}

/// The first line of `text`, cut to `max` characters with an ellipsis.
fn one_line(text: &str, max: usize) -> String {
    let line = text.lines().next().unwrap_or("");
    if line.chars().count() > max || line.len() < text.trim_end().len() {
        let cut: String = line.chars().take(max.saturating_sub(1)).collect();
        format!("{cut}…")
    } else {
        line.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_shown_escaped() {
        assert_eq!(visible("a b\n\u{1b}[2Jc\t"), "a b\\n\\u{1b}[2Jc\\t");
        assert_eq!(visible("plain é"), "plain é");
    }

    #[test]
    fn ages_are_rounded_to_seconds() {
        assert_eq!(age(Duration::from_millis(7_325_900)), "2h 2m 5s");
        assert_eq!(age(Duration::ZERO), "0s");
    }

    #[test]
    fn errors_are_cut_to_one_line() {
        assert_eq!(one_line("short", 10), "short");
        assert_eq!(one_line("a long error text", 7), "a long…");
        assert_eq!(one_line("first\nsecond", 80), "first…");
    }

    #[test]
    fn trim_prints_a_line_per_stream_and_the_total() {
        let reports = [
            TrimReport {
                stream: "outbox:a".into(),
                min_id: Some("5-0".into()),
                removed: 4,
            },
            TrimReport {
                stream: "outbox:bb".into(),
                min_id: None,
                removed: 0,
            },
        ];
        let mut out = Vec::new();
        trim_reports(&mut out, &reports, "outbox:").unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "outbox:a   removed 4 (acknowledged below 5-0)\n\
             outbox:bb  left alone: no consumer group\n\
             removed 4 entries from 2 stream(s)\n"
        );
        let mut out = Vec::new();
        trim_reports(&mut out, &[], "x:").unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "no streams named x:*\n");
        let j = serde_json::to_value(TrimJson::from(&reports[1])).unwrap();
        assert_eq!(
            j,
            serde_json::json!({"stream": "outbox:bb", "removed": 0, "min_id": null})
        );
    }

    #[test]
    fn streams_print_topics_partitions_groups_and_holders() {
        let group = |lease| GroupReport {
            group: "billing".into(),
            pending: 2,
            lag: Some(5),
            consumers: 1,
            lease,
        };
        let topics = [
            TopicStreams {
                topic: "order.paid".into(),
                recorded_partitions: Some(2),
                streams: vec![
                    StreamReport {
                        stream: "outbox:order.paid:0".into(),
                        partition: Some(0),
                        length: 7,
                        dead_letters: 1,
                        groups: vec![group(Some(LeaseReport {
                            holder: "host-1".into(),
                            epoch: Some(3),
                            ttl_ms: Some(4_250),
                        }))],
                    },
                    StreamReport {
                        stream: "outbox:order.paid:1".into(),
                        partition: Some(1),
                        length: 0,
                        dead_letters: 0,
                        groups: vec![group(None)],
                    },
                ],
            },
            TopicStreams {
                topic: "order.shipped".into(),
                recorded_partitions: None,
                streams: vec![StreamReport {
                    stream: "outbox:order.shipped".into(),
                    partition: None,
                    length: 3,
                    dead_letters: 0,
                    groups: Vec::new(),
                }],
            },
            TopicStreams {
                topic: "order.packed".into(),
                recorded_partitions: Some(4),
                streams: Vec::new(),
            },
        ];
        let mut out = Vec::new();
        streams(&mut out, &topics, "outbox:").unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "order.paid: 2 partition(s) recorded\n\
             \x20 outbox:order.paid:0  length 7, 1 dead letter(s)\n\
             \x20   group billing: pending 2, lag 5, 1 consumer(s), held by host-1 (epoch 3, 4.2s left)\n\
             \x20 outbox:order.paid:1  length 0\n\
             \x20   group billing: pending 2, lag 5, 1 consumer(s), no lease holder\n\
             order.shipped\n\
             \x20 outbox:order.shipped  length 3\n\
             \x20   no consumer group\n\
             order.packed: 4 partition(s) recorded\n\
             \x20 no stream yet\n"
        );
        let mut out = Vec::new();
        streams(&mut out, &[], "x:").unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "no streams named x:*\n");
        let j = serde_json::to_value(&topics[0].streams[0]).unwrap();
        assert_eq!(
            j,
            serde_json::json!({
                "stream": "outbox:order.paid:0", "partition": 0, "length": 7, "dead_letters": 1,
                "groups": [{"group": "billing", "pending": 2, "lag": 5, "consumers": 1,
                            "lease": {"holder": "host-1", "epoch": 3, "ttl_ms": 4250}}],
            })
        );
    }

    #[test]
    fn status_prints_the_three_numbers() {
        let mut out = Vec::new();
        let b = Backlog {
            due: 3,
            oldest_due_age: Some(Duration::from_secs(125)),
            dead: 1,
        };
        backlog(&mut out, &b).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            "due NEW messages:  3\noldest due age:    2m 5s\nDEAD messages:     1\n"
        );
        let j = serde_json::to_value(BacklogJson::from(b)).unwrap();
        assert_eq!(
            j,
            serde_json::json!({"due": 3, "oldest_due_age_seconds": 125.0, "dead": 1})
        );
    }
}
