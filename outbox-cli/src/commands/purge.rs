//! `outbox purge sent|consumed`.

use std::io::Write;
use std::time::Duration;

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
            let relayed = match &mut conn {
                Conn::Pg(c) => pg_purge(c, a.older_than, a.batch_size)?,
                Conn::Mysql(_) => binlog_purge(&db.target, a.older_than, a.batch_size)?,
                Conn::Sqlite(_) => None,
            };
            if let Some(n) = relayed {
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

/// `purge sent` on PostgreSQL in CDC mode (`outbox_cdc::purge_relayed`); `None` when
/// CDC mode is off.
fn pg_purge(
    c: &mut diesel::PgConnection,
    older_than: Duration,
    batch: u32,
) -> Result<Option<u64>, CliError> {
    if outbox_cdc::cdc_mode(c)?.is_none() {
        return Ok(None);
    }
    let mut n = 0;
    loop {
        let deleted = outbox_cdc::purge_relayed(c, older_than, batch)?;
        n += deleted;
        if deleted < u64::from(batch) {
            return Ok(Some(n));
        }
    }
}

/// `purge sent` on MariaDB in CDC mode (`outbox_cdc::mysql::purge_relayed`); `None` when
/// CDC mode is off.
fn binlog_purge(url: &str, older_than: Duration, batch: u32) -> Result<Option<u64>, CliError> {
    use outbox_cdc::mysql;
    let deleted = crate::cdc::block_on(async move {
        let mut conn = mysql::connect(url).await?;
        if mysql::cdc_mode(&mut conn).await?.is_none() {
            return Ok(None);
        }
        let mut n = 0;
        loop {
            let deleted = mysql::purge_relayed(&mut conn, older_than, batch).await?;
            n += deleted;
            if deleted < u64::from(batch) {
                return Ok::<_, outbox_cdc::CdcError>(Some(n));
            }
        }
    })??;
    Ok(deleted)
}
