//! A transaction's row events on `outbox` folded into what it committed: the binlog
//! holds each statement's rows (an insert, then an UPDATE or DELETE of the same row
//! before the commit; a REPLACE that InnoDB logs as an UPDATE to a new id), while the
//! relay must publish the rows as they are once committed, as the polling relay reads
//! them (issue 35).

use mysql_async::binlog::row::BinlogRow;
use mysql_async::binlog::value::BinlogValue;

use super::binlog::Commit;
use super::rows::{columns, value_text};
use crate::decode::OutboxColumns;
use crate::{CdcError, Result};

/// The outbox's columns in a rows event's before or after images (all of an event's
/// images of one kind have the same columns).
pub(crate) struct Layout {
    /// The columns a message needs, or why this image lacks some: a session that set
    /// `binlog_row_image` to MINIMAL or NOBLOB logs only the columns it changed.
    columns: std::result::Result<OutboxColumns, String>,
    /// Where `id` is, if logged.
    id: Option<usize>,
    /// Where `status` is, if logged (0 NEW / 1 SENT / 2 DEAD).
    status: Option<usize>,
}

/// A row image's values as text.
pub(crate) type Image = Vec<Option<String>>;

impl Layout {
    /// The layout of `row`'s columns (from their names: `binlog_row_metadata = FULL`).
    pub(crate) fn of(row: &BinlogRow) -> Self {
        let names: Vec<String> = row
            .columns_ref()
            .iter()
            .map(|c| c.name_str().into_owned())
            .collect();
        let at = |name: &str| names.iter().position(|n| n == name);
        Self {
            id: at("id"),
            status: at("status"),
            columns: columns(names).map_err(|e| e.to_string()),
        }
    }

    /// The row id in `image`, if logged.
    fn id(&self, image: &Image) -> Option<i64> {
        let text = image.get(self.id?)?.as_deref()?;
        text.parse().ok()
    }

    /// A NEW row: the polling relay's and the backfill's rule too. A row written as
    /// SENT or DEAD (copied back from an archive, say) is not a message to send. A
    /// status not logged is the default (an insert) or unchanged (an update).
    fn is_new(&self, image: &Image) -> bool {
        self.status
            .is_none_or(|at| image.get(at).and_then(Option::as_deref) == Some("0"))
    }

    /// The columns of a message, or the relay stops: a row it cannot read whole must
    /// not be skipped, and is no bad row to mark DEAD (the table holds it whole).
    fn full(&self, gtid: &str) -> Result<&OutboxColumns> {
        self.columns.as_ref().map_err(|why| {
            CdcError::Decode(format!(
                "transaction {gtid} logged an outbox row without all its columns ({why}): \
                 a session set binlog_row_image to other than FULL; the binlog relay \
                 cannot read it: its rows stay in the table: switch to polling to relay \
                 them"
            ))
        })
    }
}

/// `row`'s values as text.
pub(crate) fn image(mut row: BinlogRow) -> Image {
    (0..row.len())
        .map(|i| match row.take(i) {
            Some(BinlogValue::Value(v)) => value_text(v),
            Some(other) => Some(format!("{other:?}")),
            None => None,
        })
        .collect()
}

/// One image of a row change: its layout and values.
pub(crate) type Side<'a> = Option<(&'a Layout, &'a Image)>;

impl Commit {
    /// Applies one row change (`before` None: an insert; `after` None: a delete) of
    /// transaction `gtid` to what it inserted; past `memory` bytes of messages, the
    /// transaction is spilled (see [`Commit::spilled`]).
    pub(crate) fn apply(
        &mut self,
        gtid: &str,
        before: Side<'_>,
        after: Side<'_>,
        memory: usize,
    ) -> Result<()> {
        let old_id = before.and_then(|(l, b)| l.id(b));
        // Spilled, the rows are read back as committed: what it changed of its own
        // rows needs no folding (and no scan of its ids per row event).
        let ours = self.spilled.is_none() && old_id.is_some_and(|id| self.inserted(id));
        let Some((layout, after)) = after.filter(|(l, a)| l.is_new(a)) else {
            // Deleted, or no longer NEW: if this transaction inserted it, it never
            // committed as a message.
            if let Some(id) = old_id.filter(|_| ours) {
                self.forget(id);
            }
            return Ok(());
        };
        // An id not logged in the after image is unchanged.
        let new_id = layout.id(after).or(old_id);
        match old_id {
            // An insert, or a REPLACE logged as an UPDATE to a new id: a new row.
            None if before.is_none() => self.add(gtid, layout, after, memory),
            Some(old) if new_id != Some(old) => {
                if ours {
                    self.forget(old);
                }
                self.add(gtid, layout, after, memory)
            }
            // Spilled: the committed version is what the table gives back.
            Some(_) if self.spilled.is_some() => Ok(()),
            // Changed in place: the committed version of a row inserted here, in its
            // place. A row of an earlier transaction (the relay's own writes among
            // them) is not published again, as the polling relay would not.
            Some(old) if ours => self.replace(gtid, layout, old, after),
            _ => Ok(()),
        }
    }

    /// Adds the inserted row `image`: a message, or an unreadable row (id, why); only
    /// its id once spilled.
    fn add(&mut self, gtid: &str, layout: &Layout, image: &Image, memory: usize) -> Result<()> {
        if let Some(ids) = &mut self.spilled {
            let id = layout.id(image).ok_or_else(|| {
                CdcError::Decode(format!(
                    "transaction {gtid} logged an outbox row without its id"
                ))
            })?;
            ids.push(id);
            return Ok(());
        }
        let columns = layout.full(gtid)?;
        match columns.message(image) {
            Ok(m) => {
                self.bytes += crate::reader::size_of(&m);
                self.messages.push(m);
                if self.bytes > memory {
                    self.spill();
                }
            }
            Err(e) => match columns.id(image) {
                Some(id) => self.unreadable.push((id, e.to_string())),
                None => return Err(e),
            },
        }
        Ok(())
    }

    /// Keeps only the ids: the rows are read back from the table when published.
    fn spill(&mut self) {
        self.spilled = Some(crate::reader::spill(
            &mut self.messages,
            &mut self.unreadable,
            "it outgrew the relay's transaction_memory",
        ));
    }

    /// Whether it wrote any outbox row (a message, an unreadable or a spilled row).
    pub(crate) fn wrote_outbox(&self) -> bool {
        !self.messages.is_empty() || !self.unreadable.is_empty() || self.spilled.is_some()
    }

    /// Replaces the row `id` this transaction inserted by `image`, in its place.
    fn replace(&mut self, gtid: &str, layout: &Layout, id: i64, image: &Image) -> Result<()> {
        let message = match layout.full(gtid)?.message(image) {
            Ok(m) => m,
            Err(e) => {
                self.forget(id);
                self.unreadable.push((id, e.to_string()));
                return Ok(());
            }
        };
        match self.messages.iter_mut().rev().find(|m| m.id == id) {
            Some(slot) => *slot = message,
            None => {
                // It was unreadable and is readable now.
                self.forget(id);
                self.messages.push(message);
            }
        }
        Ok(())
    }

    /// Whether this transaction inserted row `id` (read or unreadable).
    fn inserted(&self, id: i64) -> bool {
        self.messages.iter().rev().any(|m| m.id == id) || self.unreadable.iter().any(|u| u.0 == id)
    }

    /// Drops row `id` from what this transaction inserted.
    fn forget(&mut self, id: i64) {
        self.messages.retain(|m| m.id != id);
        self.unreadable.retain(|u| u.0 != id);
    }
}

/// Whether `statement` (a query event's, run in database `schema`) is an INSERT or
/// REPLACE into `outbox` of `database`: logged as a statement (a session that set
/// `binlog_format` to STATEMENT or MIXED), its rows are not in the binlog, and the
/// relay must stop rather than skip them.
pub(crate) fn inserts_into_outbox(statement: &str, schema: &str, database: &str) -> bool {
    let lower = statement.to_ascii_lowercase();
    let mut words = lower
        .split(|c: char| c.is_ascii_whitespace() || c == '(')
        .filter(|w| !w.is_empty());
    if !matches!(words.next(), Some("insert" | "replace")) {
        return false;
    }
    let modifiers = ["low_priority", "delayed", "high_priority", "ignore", "into"];
    let Some(table) = words.find(|w| !modifiers.contains(w)) else {
        return false;
    };
    let table = table.replace('`', "");
    let (db, name) = table.rsplit_once('.').unwrap_or((schema, &table));
    name == "outbox" && db.eq_ignore_ascii_case(database)
}

#[cfg(test)]
mod tests {
    use super::inserts_into_outbox;

    #[test]
    fn a_statement_inserting_into_the_outbox_is_recognised() {
        for s in [
            "INSERT INTO outbox (msg_id) VALUES ('a')",
            "insert ignore into `test`.`outbox`(msg_id) values ('a')",
            "REPLACE LOW_PRIORITY outbox SELECT * FROM x",
        ] {
            assert!(inserts_into_outbox(s, "test", "test"), "{s}");
        }
        for s in [
            "INSERT INTO outbox_archive SELECT * FROM outbox",
            "INSERT INTO other.outbox VALUES (1)",
            "UPDATE outbox SET status = 1",
            "BEGIN",
            "",
        ] {
            assert!(!inserts_into_outbox(s, "test", "test"), "{s}");
        }
        assert!(!inserts_into_outbox(
            "INSERT INTO outbox VALUES (1)",
            "other",
            "test"
        ));
    }
}
