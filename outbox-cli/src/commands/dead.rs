//! `outbox dead list|show|redrive|purge`.

use std::io::Write;

use outbox_core::Status;
use outbox_diesel::OutboxRow;

use crate::args::{DeadCommand, DeadListArgs, DeadShowArgs, Selection};
use crate::backend::{Conn, Database, with_conn};
use crate::error::CliError;
use crate::output;

/// Rows read (and deleted by `dead purge --all`) per statement.
const PAGE: usize = 1000;

/// Runs one dead-letter command.
pub(super) fn run(db: &Database, cmd: DeadCommand, out: &mut impl Write) -> Result<(), CliError> {
    let mut conn = db.connect(false)?;
    match cmd {
        DeadCommand::List(args) => list(&mut conn, &args, out),
        DeadCommand::Show(args) => show(&mut conn, &args, out),
        DeadCommand::Redrive(sel) => redrive(&mut conn, &sel, out),
        DeadCommand::Purge(sel) => purge(&mut conn, &sel, out),
    }
}

fn list(conn: &mut Conn, args: &DeadListArgs, out: &mut impl Write) -> Result<(), CliError> {
    let limit = args.limit as usize;
    let rows = with_conn!(conn, c => outbox_diesel::dead_letters(c, args.after, limit))?;
    if args.json {
        let json: Vec<_> = rows.iter().map(output::RowJson::from).collect();
        output::json(out, &json)?;
    } else {
        output::record_table(out, &rows, limit)?;
    }
    Ok(())
}

fn show(conn: &mut Conn, args: &DeadShowArgs, out: &mut impl Write) -> Result<(), CliError> {
    let row = find(conn, &args.target)?;
    match (&row, args.json) {
        (row, true) => output::json(out, &output::RowJson::from(row))?,
        (OutboxRow::Readable(r), false) => output::record_detail(out, r)?,
        (OutboxRow::Unreadable(u), false) => output::unreadable_detail(out, u)?,
    }
    Ok(())
}

fn redrive(conn: &mut Conn, sel: &Selection, out: &mut impl Write) -> Result<(), CliError> {
    let n = if sel.all {
        // Unreadable rows stay DEAD (the relay would dead-letter them again): say so.
        for u in unreadable(conn)? {
            eprintln!(
                "warning: message {} ({:?}) is unreadable ({}): left DEAD; fix the row, or purge it",
                u.0, u.1, u.2
            );
        }
        with_conn!(conn, c => outbox_diesel::redrive_all(c))?
    } else {
        let ids = dead_ids(conn, &sel.targets)?;
        with_conn!(conn, c => outbox_diesel::redrive(c, &ids)).map_err(|e| match e {
            e @ outbox_diesel::Error::UnreadableRow { .. } => CliError::Refused(e),
            e => e.into(),
        })?
    };
    writeln!(out, "re-drove {n} DEAD message(s): NEW again, due now")?;
    Ok(())
}

fn purge(conn: &mut Conn, sel: &Selection, out: &mut impl Write) -> Result<(), CliError> {
    let n = if sel.all {
        purge_all(conn)?
    } else {
        let ids = dead_ids(conn, &sel.targets)?;
        with_conn!(conn, c => outbox_diesel::purge_dead(c, &ids))?
    };
    writeln!(out, "deleted {n} DEAD message(s)")?;
    Ok(())
}

/// Pages of DEAD rows, in id order, until `each` has seen them all.
fn each_dead_page(
    conn: &mut Conn,
    mut each: impl FnMut(&mut Conn, &[OutboxRow]) -> Result<(), CliError>,
) -> Result<(), CliError> {
    let mut after = 0;
    loop {
        let page = with_conn!(&mut *conn, c => outbox_diesel::dead_letters(c, after, PAGE))?;
        let Some(last) = page.last() else {
            return Ok(());
        };
        after = last.id();
        each(conn, &page)?;
    }
}

/// The DEAD rows that do not decode: id, stored msg_id, reason.
fn unreadable(conn: &mut Conn) -> Result<Vec<(i64, String, String)>, CliError> {
    let mut found = Vec::new();
    each_dead_page(conn, |_, page| {
        found.extend(page.iter().filter_map(|r| match r {
            OutboxRow::Unreadable(u) => Some((u.id, u.msg_id.clone(), u.reason.clone())),
            OutboxRow::Readable(_) => None,
        }));
        Ok(())
    })?;
    Ok(found)
}

/// Deletes every DEAD row, a page of ids at a time.
fn purge_all(conn: &mut Conn) -> Result<usize, CliError> {
    let mut total = 0;
    each_dead_page(conn, |conn, page| {
        let ids: Vec<i64> = page.iter().map(OutboxRow::id).collect();
        total += with_conn!(conn, c => outbox_diesel::purge_dead(c, &ids))?;
        Ok(())
    })?;
    Ok(total)
}

/// Resolves ids and msg_ids to row ids, failing on unknown ones before anything changes
/// and warning about (and leaving out) messages that are not DEAD.
fn dead_ids(conn: &mut Conn, targets: &[String]) -> Result<Vec<i64>, CliError> {
    let mut ids = Vec::with_capacity(targets.len());
    for target in targets {
        let row = find(conn, target)?;
        match (&row, row.status()) {
            (_, Some(Status::Dead)) => ids.push(row.id()),
            (OutboxRow::Readable(r), _) => eprintln!(
                "warning: message {} ({}) is {}, not DEAD: left alone",
                r.id, r.envelope.msg_id, r.status
            ),
            (OutboxRow::Unreadable(u), _) => eprintln!(
                "warning: message {} ({:?}) is not DEAD (status {}): left alone",
                u.id, u.msg_id, u.status
            ),
        }
    }
    Ok(ids)
}

/// The message with this row id or msg_id (as stored), whatever its status.
fn find(conn: &mut Conn, target: &str) -> Result<OutboxRow, CliError> {
    if let Ok(id) = target.parse::<i64>() {
        let page = with_conn!(&mut *conn, c => outbox_diesel::list_rows(c, None, id.saturating_sub(1), 1))?;
        if let Some(r) = page.into_iter().find(|r| r.id() == id) {
            return Ok(r);
        }
    }
    with_conn!(conn, c => outbox_diesel::find_row(c, target))?
        .ok_or_else(|| CliError::NotFound(format!("id or msg_id `{target}`")))
}
