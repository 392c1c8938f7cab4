//! DEAD rows: back to NEW, or deleted.

use outbox_core::Status;

use super::{OutboxRow, list_rows};
use crate::backend::{Database, RecordRow, in_list};
use crate::{Error, OutboxConnection, Result};

/// Re-drives DEAD rows: back to NEW with retries reset, due now, last error cleared.
/// Ids that are not DEAD are left alone. Returns how many rows changed.
///
/// On PostgreSQL each row gets a new id from the id sequence (in the order of the old
/// ones; find it again by its msg_id): the relay's claim walks from a floor that has
/// passed the old ids, and claims the rows at its next claim, after the messages emitted
/// before them. Their keys moved on when they went DEAD. Elsewhere the ids stay.
///
/// Fails with [`Error::UnreadableRow`](crate::Error::UnreadableRow), and changes nothing,
/// if one of them does not decode ([`OutboxRow::Unreadable`]): the relay would only
/// dead-letter it again. Fix such a row, or [`purge_dead`] it.
pub fn redrive<C: OutboxConnection>(conn: &mut C, ids: &[i64]) -> Result<usize> {
    if ids.is_empty() {
        return Ok(0);
    }
    let sql = format!(
        "SELECT {} FROM outbox WHERE status = 2 AND id IN ({})",
        C::Db::DIALECT.columns,
        in_list(ids)
    );
    let rows: Vec<RecordRow> = conn.db().load(&sql, None)?;
    for row in rows {
        if let OutboxRow::Unreadable(raw) = row.into_row() {
            return Err(Error::UnreadableRow {
                id: raw.id,
                reason: raw.reason,
            });
        }
    }
    redrive_rows(conn.db(), ids)
}

/// Re-drives every DEAD row that decodes (see [`redrive`]), a page of rows at a time;
/// unreadable rows stay DEAD. Returns how many rows changed.
pub fn redrive_all<C: OutboxConnection>(conn: &mut C) -> Result<usize> {
    const PAGE: usize = 1000;
    let (mut after, mut total) = (0, 0);
    loop {
        let page = list_rows(conn, Some(Status::Dead), after, PAGE)?;
        let Some(last) = page.last() else {
            return Ok(total);
        };
        after = last.id();
        let readable: Vec<i64> = page
            .iter()
            .filter_map(|r| match r {
                OutboxRow::Readable(r) => Some(r.id),
                OutboxRow::Unreadable(_) => None,
            })
            .collect();
        total += redrive_rows(conn.db(), &readable)?;
    }
}

/// DEAD → NEW for these ids ([`Dialect::redrive`](crate::backend::Dialect::redrive)).
fn redrive_rows<D: Database>(conn: &mut D, ids: &[i64]) -> Result<usize> {
    if ids.is_empty() {
        return Ok(0);
    }
    let sql = conn.redrive_sql(&in_list(ids))?;
    Ok(conn.execute(&sql, None)?)
}

/// Deletes these DEAD rows (others are left alone). Returns how many were deleted.
pub fn purge_dead<C: OutboxConnection>(conn: &mut C, ids: &[i64]) -> Result<usize> {
    if ids.is_empty() {
        return Ok(0);
    }
    let sql = format!(
        "DELETE FROM outbox WHERE status = 2 AND id IN ({})",
        in_list(ids)
    );
    Ok(conn.db().execute(&sql, None)?)
}
