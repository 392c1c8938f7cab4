//! `outbox purge sent|consumed`.

use std::io::Write;

use crate::args::PurgeCommand;
use crate::backend::{Conn, Database, with_conn};
use crate::error::CliError;
use crate::output;

/// Deletes rows past their retention, in bounded batches.
pub(super) fn run(db: &Database, cmd: PurgeCommand, out: &mut impl Write) -> Result<(), CliError> {
    let mut conn = db.connect(false)?;
    match cmd {
        PurgeCommand::Sent(a) => {
            // CDC mode: the relayed rows stay NEW; the CDC library knows which are done.
            if let Conn::Pg(c) = &mut conn
                && outbox_cdc::cdc_mode(c)?.is_some()
            {
                let mut n = 0;
                loop {
                    let deleted = outbox_cdc::purge_relayed(c, a.older_than, a.batch_size)?;
                    n += deleted;
                    if deleted < u64::from(a.batch_size) {
                        break;
                    }
                }
                let age = output::age(a.older_than);
                writeln!(
                    out,
                    "deleted {n} message(s) the CDC relay published, emitted more than {age} ago"
                )?;
                return Ok(());
            }
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
