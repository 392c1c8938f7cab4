//! Outbox rows on MySQL / MariaDB, from the binlog or from SQL, as the text tuples that
//! the PostgreSQL decoder reads ([`OutboxColumns`]): one validation of a row for both
//! sources.

use mysql_async::Value;
use outbox_core::StoredMessage;

use crate::decode::{NEEDED, OutboxColumns, Relation};
use crate::{CdcError, Result};

/// A column value as the text PostgreSQL's text output would give: numbers in decimal,
/// strings as they are, `DATETIME(6)` (UTC, as outbox-diesel writes it) as
/// `2024-05-01 12:00:00.123456+00`, NULL as `None`.
pub(crate) fn value_text(value: Value) -> Option<String> {
    match value {
        Value::NULL => None,
        Value::Bytes(b) => Some(String::from_utf8_lossy(&b).into_owned()),
        Value::Int(i) => Some(i.to_string()),
        Value::UInt(u) => Some(u.to_string()),
        Value::Float(f) => Some(f.to_string()),
        Value::Double(f) => Some(f.to_string()),
        Value::Date(y, mo, d, h, mi, s, us) => Some(format!(
            "{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}.{us:06}+00"
        )),
        Value::Time(neg, days, h, mi, s, us) => Some(format!(
            "{}{days} {h:02}:{mi:02}:{s:02}.{us:06}",
            if neg { "-" } else { "" }
        )),
    }
}

/// The columns of a table named by `names` (a table map's, or [`SELECT_COLUMNS`]'s).
pub(crate) fn columns(names: Vec<String>) -> Result<OutboxColumns> {
    OutboxColumns::of(&Relation {
        id: 0,
        namespace: String::new(),
        name: "outbox".into(),
        columns: names,
    })
}

/// The select list reading an outbox row `o` as text, in [`NEEDED`]'s order.
pub(crate) const SELECT_COLUMNS: &str = "CAST(o.id AS CHAR), o.msg_id, o.topic, o.event_type, \
     o.msg_key, CAST(o.schema_version AS CHAR), o.payload, o.headers, \
     CAST(o.retries AS CHAR), DATE_FORMAT(o.created_at, '%Y-%m-%d %H:%i:%s.%f+00')";

/// Rows as messages: the readable ones, and the unreadable ones (id, why), which become
/// DEAD.
pub(crate) type Rows = (Vec<StoredMessage>, Vec<(i64, String)>);

/// Rows read with [`SELECT_COLUMNS`], split into [`Rows`].
pub(crate) fn split_rows(rows: Vec<mysql_async::Row>) -> Result<Rows> {
    let columns = columns(NEEDED.iter().map(|&c| c.to_owned()).collect())?;
    let mut messages = Vec::with_capacity(rows.len());
    let mut unreadable = Vec::new();
    for row in rows {
        let values: Vec<Option<String>> = row
            .unwrap_raw()
            .into_iter()
            .map(|v| v.and_then(value_text))
            .collect();
        match columns.message(&values) {
            Ok(m) => messages.push(m),
            Err(e) => match columns.id(&values) {
                Some(id) => unreadable.push((id, e.to_string())),
                None => return Err(CdcError::Decode(e.to_string())),
            },
        }
    }
    Ok((messages, unreadable))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_read_as_the_decoder_expects() {
        assert_eq!(value_text(Value::NULL), None);
        assert_eq!(value_text(Value::Int(-3)).as_deref(), Some("-3"));
        assert_eq!(
            value_text(Value::Bytes("{\"n\":\"é\"}".into())).as_deref(),
            Some("{\"n\":\"é\"}")
        );
        assert_eq!(
            value_text(Value::Date(2026, 12, 5, 11, 2, 3, 45)).as_deref(),
            Some("2026-12-05 11:02:03.000045+00")
        );
    }

    #[test]
    fn a_row_of_text_becomes_a_message() {
        let names = NEEDED.iter().map(|&c| c.to_owned()).collect();
        let cols = columns(names).unwrap();
        let row: Vec<Option<String>> = [
            "7",
            "k:1",
            "t",
            "Ping",
            "k",
            "1",
            "{}",
            "{}",
            "0",
            "2026-12-05 11:02:03.000045+00",
        ]
        .iter()
        .map(|v| Some((*v).to_owned()))
        .collect();
        let m = cols.message(&row).unwrap();
        assert_eq!((m.id, m.envelope.key.as_str()), (7, "k"));
        assert_eq!(m.envelope.created_at.timestamp_subsec_micros(), 45);
    }
}
