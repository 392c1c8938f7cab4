//! `outbox status`.

use std::io::Write;

use crate::args::StatusArgs;
use crate::backend::{Conn, Database, with_conn};
use crate::error::CliError;
use crate::{cdc, output};

/// Prints the backlog; in CDC mode (after `outbox migrate --cdc`) the slot's lag
/// (PostgreSQL) or the binlog position's (MariaDB) instead of the NEW rows, which the CDC relay leaves NEW.
pub(super) fn run(db: &Database, args: &StatusArgs, out: &mut impl Write) -> Result<(), CliError> {
    let mut conn = db.connect(false)?;
    let backlog = with_conn!(&mut conn, c => outbox_diesel::backlog(c))?;
    let cdc = match &mut conn {
        Conn::Pg(c) => cdc::status(c)?,
        Conn::Mysql(c) => cdc::binlog_status(c, &db.target)?,
        _ => None,
    };
    if args.json {
        let mut json = serde_json::to_value(output::BacklogJson::from(backlog))
            .map_err(std::io::Error::other)?;
        if let Some(cdc) = &cdc {
            // The NEW rows are not a backlog under the CDC relay: `due` would count
            // every message ever relayed.
            json["due"] = serde_json::Value::Null;
            json["oldest_due_age_seconds"] = serde_json::Value::Null;
            json["cdc"] = serde_json::to_value(cdc).map_err(std::io::Error::other)?;
        }
        output::json(out, &json)?;
    } else if let Some(cdc) = &cdc {
        cdc::print(out, cdc)?;
        writeln!(out, "DEAD messages:     {}", backlog.dead)?;
    } else {
        output::backlog(out, &backlog)?;
    }
    Ok(())
}
