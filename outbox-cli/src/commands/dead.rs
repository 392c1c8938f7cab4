//! `outbox dead list|show|redrive|purge`.

use std::io::Write;

use outbox_core::Status;
use outbox_diesel::OutboxRecord;

use crate::args::{DeadCommand, DeadListArgs, DeadShowArgs, Selection};
use crate::backend::{Conn, Database, with_conn};
use crate::error::CliError;
use crate::output;

/// Rows deleted per statement by `dead purge --all`.
const PURGE_PAGE: usize = 1000;

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
    let records = with_conn!(conn, c => outbox_diesel::dead_letters(c, args.after, limit))?;
    if args.json {
        let json: Vec<_> = records.iter().map(output::RecordJson::from).collect();
        output::json(out, &json)?;
    } else {
        output::record_table(out, &records, limit)?;
    }
    Ok(())
}

fn show(conn: &mut Conn, args: &DeadShowArgs, out: &mut impl Write) -> Result<(), CliError> {
    let record = find(conn, &args.target)?;
    if args.json {
        output::json(out, &output::RecordJson::from(&record))?;
    } else {
        output::record_detail(out, &record)?;
    }
    Ok(())
}

fn redrive(conn: &mut Conn, sel: &Selection, out: &mut impl Write) -> Result<(), CliError> {
    let n = if sel.all {
        with_conn!(conn, c => outbox_diesel::redrive_all(c))?
    } else {
        let ids = dead_ids(conn, &sel.targets)?;
        with_conn!(conn, c => outbox_diesel::redrive(c, &ids))?
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

/// Deletes every DEAD row, a page of ids at a time.
fn purge_all(conn: &mut Conn) -> Result<usize, CliError> {
    let mut total = 0;
    let mut after = 0;
    loop {
        let page = with_conn!(&mut *conn, c => outbox_diesel::dead_letters(c, after, PURGE_PAGE))?;
        let Some(last) = page.last() else {
            return Ok(total);
        };
        after = last.id;
        let ids: Vec<i64> = page.iter().map(|r| r.id).collect();
        total += with_conn!(&mut *conn, c => outbox_diesel::purge_dead(c, &ids))?;
    }
}

/// Resolves ids and msg_ids to row ids, failing on unknown ones before anything changes
/// and warning about (and leaving out) messages that are not DEAD.
fn dead_ids(conn: &mut Conn, targets: &[String]) -> Result<Vec<i64>, CliError> {
    let mut ids = Vec::with_capacity(targets.len());
    for target in targets {
        let r = find(conn, target)?;
        if r.status == Status::Dead {
            ids.push(r.id);
        } else {
            eprintln!(
                "warning: message {} ({}) is {}, not DEAD: left alone",
                r.id, r.envelope.msg_id, r.status
            );
        }
    }
    Ok(ids)
}

/// The message with this row id or msg_id, whatever its status.
fn find(conn: &mut Conn, target: &str) -> Result<OutboxRecord, CliError> {
    if let Ok(id) = target.parse::<i64>() {
        let page = with_conn!(&mut *conn, c => outbox_diesel::list_messages(c, None, id.saturating_sub(1), 1))?;
        if let Some(r) = page.into_iter().find(|r| r.id == id) {
            return Ok(r);
        }
    }
    with_conn!(conn, c => outbox_diesel::find_message(c, target))?
        .ok_or_else(|| CliError::NotFound(format!("id or msg_id `{target}`")))
}
