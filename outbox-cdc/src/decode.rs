//! pgoutput's row messages (protocol version 1): `Relation`, which describes a table's
//! columns, `Insert`, `Update` and `Delete`, rows in text format, and `Truncate` (an
//! update, delete or truncate of a row its transaction inserted changes what that
//! transaction commits: issue 35). pgwire-replication hands us `Begin` and `Commit`
//! itself and every other message as raw bytes; the others (`Type`, `Origin`) carry
//! nothing the relay needs.
//!
//! See <https://www.postgresql.org/docs/current/protocol-logicalrep-message-formats.html>.

use chrono::{DateTime, Utc};
use outbox_core::{Envelope, Headers, MsgId, StoredMessage};

use crate::{CdcError, Result};

/// A pgoutput message the relay acts on, borrowing the bytes it was decoded from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Message<'a> {
    /// A table's description, sent before its first row of a session and after each
    /// change of its columns.
    Relation(Relation),
    /// A new row of relation `relation`: each column's text (as sent: checked as UTF-8
    /// when a message reads it), `None` for NULL. Only the columns a message needs are
    /// copied, once.
    Insert {
        relation: u32,
        values: Vec<Option<&'a [u8]>>,
    },
    /// A changed row of relation `relation`: its old key (`K` or `O`: sent only when
    /// the key changed, or for a full replica identity) and its new values.
    Update {
        relation: u32,
        old: Option<Tuple<'a>>,
        new: Tuple<'a>,
    },
    /// A deleted row of relation `relation`: its key (the replica identity, the primary
    /// key: the other columns are NULL).
    Delete { relation: u32, old: Tuple<'a> },
    /// A `TRUNCATE` of these relations (of a partitioned table, the root alone: the
    /// publication publishes through it, and a partition truncated alone is not sent).
    Truncate { relations: Vec<u32> },
    /// Anything else: ignored.
    Other(u8),
}

/// A row's values in an update or delete: as [`Message::Insert`]'s, and the positions
/// of the values sent as unchanged (`u`: a value stored out of line, TOAST, that the
/// update did not change: not sent again), NULL in `values`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Tuple<'a> {
    pub(crate) values: Vec<Option<&'a [u8]>>,
    pub(crate) unchanged: Vec<usize>,
}

/// A table as a `Relation` message describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Relation {
    pub(crate) id: u32,
    pub(crate) namespace: String,
    pub(crate) name: String,
    pub(crate) columns: Vec<String>,
}

/// A cursor over one message's bytes; every read checks the length.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(CdcError::Decode(format!(
                "pgoutput message truncated in {what}"
            )));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A NUL-terminated string.
    fn cstr(&mut self, what: &str) -> Result<String> {
        let end = self
            .0
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| CdcError::Decode(format!("unterminated string in {what}")))?;
        let s = String::from_utf8(self.0[..end].to_vec())
            .map_err(|_| CdcError::Decode(format!("{what} is not UTF-8")))?;
        self.0 = &self.0[end + 1..];
        Ok(s)
    }
}

/// Decodes one pgoutput message (the payload of an `XLogData`).
pub(crate) fn decode(data: &[u8]) -> Result<Message<'_>> {
    let mut r = Reader(data);
    match r.u8("message tag")? {
        b'R' => relation(&mut r).map(Message::Relation),
        b'I' => {
            let relation = r.u32("Insert relation")?;
            expect_tag(&mut r, "Insert", b'N')?;
            let Tuple { values, unchanged } = tuple(&mut r)?;
            if !unchanged.is_empty() {
                return Err(CdcError::Decode("an Insert with an unchanged value".into()));
            }
            Ok(Message::Insert { relation, values })
        }
        b'U' => {
            let relation = r.u32("Update relation")?;
            let old = match r.u8("Update tuple tag")? {
                b'K' | b'O' => {
                    let old = tuple(&mut r)?;
                    expect_tag(&mut r, "Update", b'N')?;
                    Some(old)
                }
                b'N' => None,
                other => return Err(bad_tag("Update", other)),
            };
            let new = tuple(&mut r)?;
            Ok(Message::Update { relation, old, new })
        }
        b'D' => {
            let relation = r.u32("Delete relation")?;
            match r.u8("Delete tuple tag")? {
                b'K' | b'O' => Ok(Message::Delete {
                    relation,
                    old: tuple(&mut r)?,
                }),
                other => Err(bad_tag("Delete", other)),
            }
        }
        b'T' => {
            let n = r.u32("Truncate relation count")?;
            let _options = r.u8("Truncate options")?;
            let relations = (0..n)
                .map(|_| r.u32("Truncate relation"))
                .collect::<Result<_>>()?;
            Ok(Message::Truncate { relations })
        }
        other => Ok(Message::Other(other)),
    }
}

fn bad_tag(message: &str, tag: u8) -> CdcError {
    CdcError::Decode(format!("{message} with tuple tag {:?}", tag as char))
}

fn expect_tag(r: &mut Reader<'_>, message: &str, want: u8) -> Result<()> {
    match r.u8(&format!("{message} tuple tag"))? {
        tag if tag == want => Ok(()),
        other => Err(bad_tag(message, other)),
    }
}

fn relation(r: &mut Reader<'_>) -> Result<Relation> {
    let id = r.u32("Relation id")?;
    let namespace = r.cstr("Relation namespace")?;
    let name = r.cstr("Relation name")?;
    let _replica_identity = r.u8("Relation replica identity")?;
    let n = r.u16("Relation column count")?;
    let mut columns = Vec::with_capacity(usize::from(n));
    for _ in 0..n {
        let _flags = r.u8("column flags")?;
        columns.push(r.cstr("column name")?);
        let _type_oid = r.u32("column type")?;
        let _typmod = r.u32("column type modifier")?;
    }
    Ok(Relation {
        id,
        namespace,
        name,
        columns,
    })
}

fn tuple<'a>(r: &mut Reader<'a>) -> Result<Tuple<'a>> {
    let n = r.u16("tuple column count")?;
    let mut values = Vec::with_capacity(usize::from(n));
    let mut unchanged = Vec::new();
    for i in 0..usize::from(n) {
        let value = match r.u8("tuple column kind")? {
            b'n' => None,
            b't' => {
                let len = r.u32("text value length")? as usize;
                Some(r.take(len, "text value")?)
            }
            // Unchanged TOAST: only in updates.
            b'u' => {
                unchanged.push(i);
                None
            }
            // 'b' only in binary mode, which the relay does not ask for.
            other => {
                return Err(CdcError::Decode(format!(
                    "unexpected tuple column kind {:?}",
                    other as char
                )));
            }
        };
        values.push(value);
    }
    Ok(Tuple { values, unchanged })
}

/// The column positions of the outbox table in a relation, by name, so that a table
/// whose columns were added or reordered still decodes.
#[derive(Debug, Clone)]
pub(crate) struct OutboxColumns {
    /// The position of each of [`NEEDED`], in its order.
    at: [usize; NEEDED.len()],
    /// The position of `status`, if published (a publication made before issue 35
    /// lists only [`NEEDED`]).
    status: Option<usize>,
}

/// The columns a message needs.
pub(crate) const NEEDED: [&str; 10] = [
    "id",
    "msg_id",
    "topic",
    "event_type",
    "msg_key",
    "schema_version",
    "payload",
    "headers",
    "retries",
    "created_at",
];

/// Indexes into [`NEEDED`].
const ID: usize = 0;
const MSG_ID: usize = 1;
const TOPIC: usize = 2;
const EVENT_TYPE: usize = 3;
const MSG_KEY: usize = 4;
const SCHEMA_VERSION: usize = 5;
const PAYLOAD: usize = 6;
const HEADERS: usize = 7;
const RETRIES: usize = 8;
const CREATED_AT: usize = 9;

impl OutboxColumns {
    /// The positions of [`NEEDED`] in `relation`, or which is missing.
    pub(crate) fn of(relation: &Relation) -> Result<Self> {
        let mut at = [0; NEEDED.len()];
        for (slot, name) in at.iter_mut().zip(NEEDED) {
            *slot = relation
                .columns
                .iter()
                .position(|c| c == name)
                .ok_or_else(|| {
                    CdcError::Decode(format!(
                        "relation {}.{} has no column `{name}`",
                        relation.namespace, relation.name
                    ))
                })?;
        }
        let status = relation.columns.iter().position(|c| c == "status");
        Ok(Self { at, status })
    }

    /// Whether the row is NEW (status 0): the polling relay's and the backfill's rule.
    /// A row inserted as SENT or DEAD (copied back from an archive, say) is no message
    /// to send. A status not published is taken as NEW.
    pub(crate) fn is_new<V: AsRef<[u8]>>(&self, values: &[Option<V>]) -> bool {
        self.status.is_none_or(|at| {
            values.get(at).and_then(Option::as_ref).map(AsRef::as_ref) == Some(b"0".as_slice())
        })
    }

    /// `values` with the positions in `unchanged` (sent as unchanged by an update)
    /// filled from `before`, the message of the row as its transaction inserted it.
    pub(crate) fn fill_unchanged(
        &self,
        values: &[Option<&[u8]>],
        unchanged: &[usize],
        before: &StoredMessage,
    ) -> Vec<Option<Vec<u8>>> {
        let mut out: Vec<Option<Vec<u8>>> = values.iter().map(|v| v.map(<[u8]>::to_vec)).collect();
        for &at in unchanged {
            if let Some(which) = self.at.iter().position(|&p| p == at)
                && let Some(slot) = out.get_mut(at)
            {
                *slot = Some(text_of(before, which).into_bytes());
            }
        }
        out
    }

    /// Column `NEEDED[which]` of the row, as text.
    fn text<'v, V: AsRef<[u8]>>(&self, values: &'v [Option<V>], which: usize) -> Result<&'v str> {
        let name = NEEDED[which];
        let bytes = values
            .get(self.at[which])
            .and_then(Option::as_ref)
            .map(AsRef::as_ref)
            .ok_or_else(|| CdcError::Decode(format!("column `{name}` is NULL or missing")))?;
        std::str::from_utf8(bytes)
            .map_err(|_| CdcError::Decode(format!("column `{name}` is not UTF-8")))
    }

    /// The row's id, if it can be read: what an unreadable row is recorded under.
    pub(crate) fn id<V: AsRef<[u8]>>(&self, values: &[Option<V>]) -> Option<i64> {
        self.text(values, ID).ok()?.parse().ok()
    }

    /// An inserted outbox row as the relay's message. The values are the server's text
    /// output: the replication session runs with `DateStyle = ISO` and `TimeZone = UTC`
    /// (see the relay's startup options), so `created_at` reads as `2024-05-01
    /// 12:00:00.123456+00`.
    /// Each value is a column's text as bytes (borrowed from a pgoutput message, or
    /// owned).
    pub(crate) fn message<V: AsRef<[u8]>>(&self, values: &[Option<V>]) -> Result<StoredMessage> {
        let t = |which: usize| self.text(values, which);
        let id: i64 = t(ID)?
            .parse()
            .map_err(|_| CdcError::Decode("id is not a number".into()))?;
        let bad = |what: String| CdcError::Decode(format!("row {id}: {what}"));
        let msg_id = MsgId::new(t(MSG_ID)?).map_err(|e| bad(e.to_string()))?;
        let headers: Headers = serde_json::from_str(t(HEADERS)?)
            .map_err(|e| bad(format!("headers are not a JSON object of strings: {e}")))?;
        let created_at = timestamp(t(CREATED_AT)?).ok_or_else(|| bad("bad created_at".into()))?;
        let number = |which: usize| -> Result<u32> {
            let v: i64 = t(which)?
                .parse()
                .map_err(|_| bad(format!("{} is not a number", NEEDED[which])))?;
            Ok(u32::try_from(v).unwrap_or(0))
        };
        Ok(StoredMessage {
            id,
            retries: number(RETRIES)?,
            envelope: Envelope {
                msg_id,
                topic: t(TOPIC)?.to_owned(),
                event_type: t(EVENT_TYPE)?.to_owned(),
                key: t(MSG_KEY)?.to_owned(),
                schema_version: number(SCHEMA_VERSION)?,
                payload: t(PAYLOAD)?.to_owned(),
                headers,
                created_at,
            },
        })
    }
}

/// Column `NEEDED[which]` of `m` as the server's text output would read.
fn text_of(m: &StoredMessage, which: usize) -> String {
    let e = &m.envelope;
    match which {
        ID => m.id.to_string(),
        MSG_ID => e.msg_id.as_str().to_owned(),
        TOPIC => e.topic.clone(),
        EVENT_TYPE => e.event_type.clone(),
        MSG_KEY => e.key.clone(),
        SCHEMA_VERSION => e.schema_version.to_string(),
        PAYLOAD => e.payload.clone(),
        HEADERS => serde_json::to_string(&e.headers).unwrap_or_default(),
        RETRIES => m.retries.to_string(),
        _ => e.created_at.format("%Y-%m-%d %H:%M:%S%.6f+00").to_string(),
    }
}

/// A `timestamptz` in ISO output at UTC: `2024-05-01 12:00:00.123456+00` (fraction
/// optional).
fn timestamp(text: &str) -> Option<DateTime<Utc>> {
    utc_iso(text).or_else(|| {
        DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%#z")
            .ok()
            .map(|t| t.with_timezone(&Utc))
    })
}

/// The form every row's `created_at` takes in the session's settings, read by hand:
/// chrono's format parser (which parses the format string again for every value) took
/// about 0.3 µs a row against 0.02 µs here, some 6 % of the relay process's CPU per
/// message in a backlog drain. Anything else (another offset, a year past 9999) is
/// `None`, for chrono to read.
fn utc_iso(text: &str) -> Option<DateTime<Utc>> {
    let b = text.as_bytes().strip_suffix(b"+00")?;
    if b.len() < 19 || [b[4], b[7], b[10], b[13], b[16]] != *b"-- ::" {
        return None;
    }
    let digits = |d: &[u8]| {
        d.iter().try_fold(0u32, |n, &c| {
            c.is_ascii_digit().then(|| n * 10 + u32::from(c - b'0'))
        })
    };
    let nanos = match &b[19..] {
        [] => 0,
        [b'.', fraction @ ..] if (1..=9).contains(&fraction.len()) => {
            digits(fraction)? * 10u32.pow(9 - fraction.len() as u32)
        }
        _ => return None,
    };
    let year = i32::try_from(digits(&b[0..4])?).ok()?;
    let date = chrono::NaiveDate::from_ymd_opt(year, digits(&b[5..7])?, digits(&b[8..10])?)?;
    let time = chrono::NaiveTime::from_hms_nano_opt(
        digits(&b[11..13])?,
        digits(&b[14..16])?,
        digits(&b[17..19])?,
        nanos,
    )?;
    Some(date.and_time(time).and_utc())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cstr(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }

    fn relation_bytes(id: u32, columns: &[&str]) -> Vec<u8> {
        let mut out = vec![b'R'];
        out.extend_from_slice(&id.to_be_bytes());
        cstr(&mut out, "public");
        cstr(&mut out, "outbox");
        out.push(b'd');
        out.extend_from_slice(&(columns.len() as u16).to_be_bytes());
        for c in columns {
            out.push(0);
            cstr(&mut out, c);
            out.extend_from_slice(&25u32.to_be_bytes());
            out.extend_from_slice(&(-1i32).to_be_bytes());
        }
        out
    }

    fn insert_bytes(id: u32, values: &[Option<&str>]) -> Vec<u8> {
        let mut out = vec![b'I'];
        out.extend_from_slice(&id.to_be_bytes());
        out.push(b'N');
        out.extend_from_slice(&(values.len() as u16).to_be_bytes());
        for v in values {
            match v {
                None => out.push(b'n'),
                Some(s) => {
                    out.push(b't');
                    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
                    out.extend_from_slice(s.as_bytes());
                }
            }
        }
        out
    }

    /// The unpartitioned table's columns, in its order.
    const TABLE: [&str; 14] = [
        "id",
        "msg_id",
        "topic",
        "event_type",
        "msg_key",
        "schema_version",
        "payload",
        "headers",
        "status",
        "retries",
        "next_retry_at",
        "created_at",
        "sent_at",
        "last_error",
    ];

    fn row() -> Vec<Option<&'static str>> {
        vec![
            Some("42"),
            Some("order-1:OrderPaid"),
            Some("order.paid"),
            Some("OrderPaid"),
            Some("order-1"),
            Some("2"),
            Some(r#"{"amount": 5}"#),
            Some(r#"{"traceparent": "00-ab"}"#),
            Some("0"),
            Some("0"),
            Some("2024-05-01 12:00:00.5+00"),
            Some("2024-05-01 12:00:00.123456+00"),
            None,
            None,
        ]
    }

    #[test]
    fn a_relation_and_an_insert_decode_into_the_message() {
        let Message::Relation(rel) = decode(&relation_bytes(7, &TABLE)).unwrap() else {
            panic!("not a relation");
        };
        assert_eq!((rel.id, rel.name.as_str()), (7, "outbox"));
        assert_eq!(rel.columns.len(), 14);
        let cols = OutboxColumns::of(&rel).unwrap();
        let bytes = insert_bytes(7, &row());
        let Message::Insert { relation, values } = decode(&bytes).unwrap() else {
            panic!("not an insert");
        };
        assert_eq!(relation, 7);
        let m = cols.message(&values).unwrap();
        assert_eq!(m.id, 42);
        assert_eq!(m.retries, 0);
        assert_eq!(m.envelope.msg_id.as_str(), "order-1:OrderPaid");
        assert_eq!(m.envelope.key, "order-1");
        assert_eq!(m.envelope.schema_version, 2);
        assert_eq!(m.envelope.payload, r#"{"amount": 5}"#);
        assert_eq!(m.envelope.headers["traceparent"], "00-ab");
        assert_eq!(
            m.envelope.created_at.to_rfc3339(),
            "2024-05-01T12:00:00.123456+00:00"
        );
    }

    #[test]
    fn columns_are_found_by_name_in_any_order() {
        let mut reordered = TABLE;
        reordered.reverse();
        let Message::Relation(rel) = decode(&relation_bytes(9, &reordered)).unwrap() else {
            panic!("not a relation");
        };
        let mut values: Vec<Option<&[u8]>> = row().iter().map(|v| v.map(str::as_bytes)).collect();
        values.reverse();
        let m = OutboxColumns::of(&rel).unwrap().message(&values).unwrap();
        assert_eq!(m.id, 42);
        assert_eq!(m.envelope.topic, "order.paid");
    }

    #[test]
    fn a_relation_without_a_needed_column_is_refused() {
        let Message::Relation(rel) = decode(&relation_bytes(1, &TABLE[..5])).unwrap() else {
            panic!("not a relation");
        };
        let err = OutboxColumns::of(&rel).unwrap_err().to_string();
        assert!(err.contains("schema_version"), "{err}");
    }

    #[test]
    fn truncated_and_unknown_input_is_an_error_not_a_panic() {
        let full = insert_bytes(7, &row());
        for cut in 0..full.len() {
            // Every prefix decodes to an error (or, for the empty one, too): never a panic.
            assert!(decode(&full[..cut]).is_err(), "prefix of {cut} bytes");
        }
        assert_eq!(decode(b"Y\0\0").unwrap(), Message::Other(b'Y'));
        let mut nulls = row();
        nulls[1] = None;
        let Message::Relation(rel) = decode(&relation_bytes(7, &TABLE)).unwrap() else {
            panic!("not a relation");
        };
        let cols = OutboxColumns::of(&rel).unwrap();
        let values: Vec<Option<&[u8]>> = nulls.iter().map(|v| v.map(str::as_bytes)).collect();
        assert!(
            cols.message(&values)
                .unwrap_err()
                .to_string()
                .contains("msg_id")
        );
    }

    /// A tuple of `values`, `None` as NULL ('n'), `Some("\u{0}u")` as unchanged ('u').
    fn tuple_bytes(out: &mut Vec<u8>, values: &[Option<&str>]) {
        out.extend_from_slice(&(values.len() as u16).to_be_bytes());
        for v in values {
            match v {
                None => out.push(b'n'),
                Some("\u{0}u") => out.push(b'u'),
                Some(s) => {
                    out.push(b't');
                    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
                    out.extend_from_slice(s.as_bytes());
                }
            }
        }
    }

    #[test]
    fn updates_and_deletes_decode_with_their_old_key_and_unchanged_values() {
        let mut new = row();
        new[6] = Some("\u{0}u");
        let mut update = vec![b'U'];
        update.extend_from_slice(&7u32.to_be_bytes());
        update.push(b'N');
        tuple_bytes(&mut update, &new);
        let Message::Update { relation, old, new } = decode(&update).unwrap() else {
            panic!("not an update");
        };
        assert_eq!((relation, old), (7, None));
        assert_eq!(new.unchanged, [6]);
        assert_eq!(new.values[6], None);

        let mut key: Vec<Option<&str>> = vec![None; TABLE.len()];
        key[0] = Some("42");
        let mut delete = vec![b'D'];
        delete.extend_from_slice(&7u32.to_be_bytes());
        delete.push(b'K');
        tuple_bytes(&mut delete, &key);
        let Message::Delete { relation, old } = decode(&delete).unwrap() else {
            panic!("not a delete");
        };
        assert_eq!(relation, 7);
        let Message::Relation(rel) = decode(&relation_bytes(7, &TABLE)).unwrap() else {
            panic!("not a relation");
        };
        let cols = OutboxColumns::of(&rel).unwrap();
        assert_eq!(cols.id(&old.values), Some(42));

        // An update whose key changed: old key, then the new tuple.
        let mut moved = vec![b'U'];
        moved.extend_from_slice(&7u32.to_be_bytes());
        moved.push(b'K');
        tuple_bytes(&mut moved, &key);
        moved.push(b'N');
        tuple_bytes(&mut moved, &row());
        let Message::Update { old: Some(old), .. } = decode(&moved).unwrap() else {
            panic!("not an update with its old key");
        };
        assert_eq!(cols.id(&old.values), Some(42));
        for bytes in [&update, &delete, &moved] {
            for cut in 1..bytes.len() {
                assert!(decode(&bytes[..cut]).is_err(), "prefix of {cut} bytes");
            }
        }
        // An insert never carries an unchanged value.
        let mut insert = vec![b'I'];
        insert.extend_from_slice(&7u32.to_be_bytes());
        insert.push(b'N');
        tuple_bytes(&mut insert, &new_with_unchanged());
        assert!(decode(&insert).is_err());
    }

    fn new_with_unchanged() -> Vec<Option<&'static str>> {
        let mut r = row();
        r[7] = Some("\u{0}u");
        r
    }

    #[test]
    fn unchanged_values_are_filled_from_the_insert_and_status_decides_new() {
        let Message::Relation(rel) = decode(&relation_bytes(7, &TABLE)).unwrap() else {
            panic!("not a relation");
        };
        let cols = OutboxColumns::of(&rel).unwrap();
        let values: Vec<Option<&[u8]>> = row().iter().map(|v| v.map(str::as_bytes)).collect();
        let inserted = cols.message(&values).unwrap();
        let mut update = values.clone();
        update[6] = None;
        update[7] = None;
        let filled = cols.fill_unchanged(&update, &[6, 7], &inserted);
        assert_eq!(cols.message(&filled).unwrap(), inserted);
        assert!(cols.is_new(&values));
        let mut sent = values.clone();
        sent[8] = Some(b"1");
        assert!(!cols.is_new(&sent));
    }

    #[test]
    fn timestamps_read_with_and_without_a_fraction() {
        assert!(timestamp("2024-05-01 12:00:00+00").is_some());
        assert!(timestamp("2024-05-01 12:00:00.1+00").is_some());
        assert!(timestamp("not a time").is_none());
    }

    #[test]
    fn the_hand_reader_agrees_with_chrono_and_leaves_it_the_rest() {
        let chrono = |t: &str| {
            DateTime::parse_from_str(t, "%Y-%m-%d %H:%M:%S%.f%#z")
                .ok()
                .map(|t| t.with_timezone(&Utc))
        };
        for t in [
            "2024-05-01 12:00:00+00",
            "2024-05-01 12:00:00.5+00",
            "2024-05-01 12:00:00.123456+00",
            "1999-12-31 23:59:59.000001+00",
            "2024-02-29 00:00:00+00",
        ] {
            assert_eq!(utc_iso(t), chrono(t), "{t}");
            assert!(utc_iso(t).is_some(), "{t}");
        }
        // Not the session's form, or not a time: left to chrono (which reads the first).
        for t in [
            "2024-05-01 12:00:00+05:30",
            "2023-02-29 00:00:00+00",
            "2024-05-01 12:00:60+00",
            "2024-05-01T12:00:00+00",
            "2024-05-01 12:00:00.+00",
            "2024-05-01 12:00:00.1234567890+00",
            "2024-5-01 12:00:00+00",
            "+00",
            "",
        ] {
            assert_eq!(utc_iso(t), None, "{t}");
        }
        assert_eq!(
            timestamp("2024-05-01 12:00:00+05:30"),
            chrono("2024-05-01 12:00:00+05:30")
        );
    }

    #[test]
    fn a_truncate_names_its_relations_and_a_short_one_is_an_error() {
        let mut bytes = vec![b'T'];
        bytes.extend_from_slice(&2u32.to_be_bytes());
        bytes.push(0);
        bytes.extend_from_slice(&7u32.to_be_bytes());
        bytes.extend_from_slice(&9u32.to_be_bytes());
        assert_eq!(
            decode(&bytes).unwrap(),
            Message::Truncate {
                relations: vec![7, 9]
            }
        );
        let err = decode(&bytes[..bytes.len() - 2]).unwrap_err();
        assert!(
            err.to_string().contains("truncated in Truncate relation"),
            "{err}"
        );
    }
}
