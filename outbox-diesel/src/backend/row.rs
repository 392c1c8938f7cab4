//! Writing rows: an envelope checked against the column limits and made ready to bind,
//! the `VALUES` tuples every backend's insert shares, and the split of `emit_all` into
//! statements of bounded size.

use std::borrow::Cow;

use diesel::sql_types::{Integer, Text};
use outbox_core::{Envelope, MsgId};

use crate::{Error, Result};

/// Column limits of the shipped tables (characters).
pub(crate) const TOPIC_LEN: usize = 128;
pub(crate) const EVENT_TYPE_LEN: usize = 128;
pub(crate) const KEY_LEN: usize = 255;
pub(crate) const GROUP_LEN: usize = 64;
/// Rows per INSERT statement in `emit_all`; well under every backend's bind limit.
const CHUNK_ROWS: usize = 1000;
/// Payload bytes per INSERT statement in `emit_all` (MySQL's max_allowed_packet).
const CHUNK_BYTES: usize = 4 << 20;

/// One outbox row ready to bind.
pub(crate) struct Row<'a> {
    pub(crate) msg_id: &'a str,
    pub(crate) topic: &'a str,
    pub(crate) event_type: &'a str,
    pub(crate) key: &'a str,
    pub(crate) schema_version: i32,
    pub(crate) payload: &'a str,
    pub(crate) headers: Cow<'a, str>,
}

fn check_len(msg_id: &MsgId, field: &'static str, value: &str, limit: usize) -> Result<()> {
    // Byte length bounds the character count from above: count only when it may be over.
    if value.len() > limit {
        let len = value.chars().count();
        if len > limit {
            return Err(Error::FieldTooLong {
                msg_id: msg_id.clone(),
                field,
                len,
                limit,
            });
        }
    }
    Ok(())
}

pub(crate) fn check_group(group: &str, msg_id: &MsgId) -> Result<()> {
    check_len(msg_id, "consumer_group", group, GROUP_LEN)
}

impl<'a> Row<'a> {
    pub(crate) fn new(e: &'a Envelope) -> Result<Self> {
        check_len(&e.msg_id, "topic", &e.topic, TOPIC_LEN)?;
        check_len(&e.msg_id, "event_type", &e.event_type, EVENT_TYPE_LEN)?;
        check_len(&e.msg_id, "key", &e.key, KEY_LEN)?;
        let headers = if e.headers.is_empty() {
            Cow::Borrowed("{}")
        } else {
            Cow::Owned(serde_json::to_string(&e.headers).map_err(|source| {
                outbox_core::Error::Serialize {
                    msg_id: e.msg_id.clone(),
                    source,
                }
            })?)
        };
        Ok(Self {
            msg_id: e.msg_id.as_str(),
            topic: &e.topic,
            event_type: &e.event_type,
            key: &e.key,
            schema_version: i32::try_from(e.schema_version).unwrap_or(i32::MAX),
            payload: &e.payload,
            headers,
        })
    }
}

/// Splits rows into statements of bounded size.
pub(crate) fn chunks<'r, 'a>(rows: &'r [Row<'a>]) -> impl Iterator<Item = &'r [Row<'a>]> {
    let mut rest = rows;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut bytes = 0;
        let mut n = 0;
        while n < rest.len()
            && n < CHUNK_ROWS
            && (n == 0 || bytes + rest[n].payload.len() <= CHUNK_BYTES)
        {
            bytes += rest[n].payload.len();
            n += 1;
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Some(head)
    })
}

/// The `VALUES` tuples of an outbox insert, the same on every backend: `(msg_id, topic,
/// event_type, msg_key, schema_version, payload{json}, headers{json}{tail})`, where `json`
/// casts the JSON columns (PostgreSQL) and `tail` adds columns the backend fills itself.
pub(crate) fn push_values<'b, DB>(
    rows: &'b [Row<'_>],
    out: &mut diesel::query_builder::AstPass<'_, 'b, DB>,
    json: &'static str,
    tail: &'static str,
) -> diesel::QueryResult<()>
where
    DB: diesel::backend::Backend
        + diesel::sql_types::HasSqlType<Text>
        + diesel::sql_types::HasSqlType<Integer>,
    str: diesel::serialize::ToSql<Text, DB>,
    i32: diesel::serialize::ToSql<Integer, DB>,
{
    for (i, r) in rows.iter().enumerate() {
        out.push_sql(if i == 0 { "(" } else { ", (" });
        push_before_headers(r, out, json)?;
        out.push_bind_param::<Text, str>(&r.headers)?;
        out.push_sql(json);
        out.push_sql(tail);
        out.push_sql(")");
    }
    Ok(())
}

/// A `VALUES` tuple of [`push_values`] up to its headers, without the opening
/// parenthesis: `msg_id, topic, event_type, msg_key, schema_version, payload{json}, `.
pub(crate) fn push_before_headers<'b, DB>(
    r: &'b Row<'_>,
    out: &mut diesel::query_builder::AstPass<'_, 'b, DB>,
    json: &'static str,
) -> diesel::QueryResult<()>
where
    DB: diesel::backend::Backend
        + diesel::sql_types::HasSqlType<Text>
        + diesel::sql_types::HasSqlType<Integer>,
    str: diesel::serialize::ToSql<Text, DB>,
    i32: diesel::serialize::ToSql<Integer, DB>,
{
    for text in [r.msg_id, r.topic, r.event_type, r.key] {
        out.push_bind_param::<Text, str>(text)?;
        out.push_sql(", ");
    }
    out.push_bind_param::<Integer, i32>(&r.schema_version)?;
    out.push_sql(", ");
    out.push_bind_param::<Text, str>(r.payload)?;
    out.push_sql(json);
    out.push_sql(", ");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_bound_rows_and_bytes() {
        let big = "x".repeat(3 << 20);
        let row = |payload: &'static str| Row {
            msg_id: "a:B",
            topic: "t",
            event_type: "B",
            key: "a",
            schema_version: 1,
            payload,
            headers: Cow::Borrowed("{}"),
        };
        let small: Vec<Row<'_>> = (0..2500).map(|_| row("{}")).collect();
        let sizes: Vec<usize> = chunks(&small).map(<[_]>::len).collect();
        assert_eq!(sizes, [1000, 1000, 500]);
        let big: &'static str = Box::leak(big.into_boxed_str());
        let large = vec![row(big), row(big), row("{}")];
        let sizes: Vec<usize> = chunks(&large).map(<[_]>::len).collect();
        assert_eq!(sizes, [1, 2]);
    }
}
