//! `outbox purge sent|consumed`.

use std::io::Write;

use crate::args::PurgeCommand;
use crate::backend::{Database, with_conn};
use crate::error::CliError;
use crate::output;

/// Deletes rows past their retention, in bounded batches.
pub(super) fn run(db: &Database, cmd: PurgeCommand, out: &mut impl Write) -> Result<(), CliError> {
    let mut conn = db.connect(false)?;
    match cmd {
        PurgeCommand::Sent(a) => {
            let batch = a.batch_size as usize;
            let n = with_conn!(&mut conn, c => outbox_diesel::purge_sent(c, a.older_than, batch))?;
            let age = output::age(a.older_than);
            writeln!(
                out,
                "deleted {n} SENT message(s) published more than {age} ago"
            )?;
        }
        PurgeCommand::Consumed(a) => {
            let batch = a.batch_size as usize;
            let n =
                with_conn!(&mut conn, c => outbox_diesel::purge_consumed(c, a.older_than, batch))?;
            let age = output::age(a.older_than);
            writeln!(out, "deleted {n} consumed_msg record(s) older than {age}")?;
        }
    }
    Ok(())
}
