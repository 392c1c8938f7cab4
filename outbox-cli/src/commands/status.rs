//! `outbox status`.

use std::io::Write;

use crate::args::StatusArgs;
use crate::backend::{Database, with_conn};
use crate::error::CliError;
use crate::output;

/// Prints the backlog.
pub(super) fn run(db: &Database, args: &StatusArgs, out: &mut impl Write) -> Result<(), CliError> {
    let mut conn = db.connect(false)?;
    let backlog = with_conn!(&mut conn, c => outbox_diesel::backlog(c))?;
    if args.json {
        output::json(out, &output::BacklogJson::from(backlog))?;
    } else {
        output::backlog(out, &backlog)?;
    }
    Ok(())
}
