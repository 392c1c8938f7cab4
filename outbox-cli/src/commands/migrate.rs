//! `outbox migrate`.

use std::io::Write;

use crate::args::MigrateArgs;
use crate::backend::with_conn;
use crate::error::CliError;

/// Applies the embedded migration, or prints it.
pub(super) fn run(
    url: Option<&str>,
    args: &MigrateArgs,
    out: &mut impl Write,
) -> Result<(), CliError> {
    if args.print {
        let kind = match args.backend {
            Some(kind) => kind,
            None => super::database(url)?.kind,
        };
        let migration = kind.migration();
        let sql = if args.down {
            migration.down
        } else {
            migration.up
        };
        write!(out, "{sql}")?;
        return Ok(());
    }
    let db = super::database(url)?;
    let mut conn = db.connect(true)?;
    with_conn!(&mut conn, c => outbox_diesel::migrate(c))?;
    writeln!(
        out,
        "outbox tables are up to date ({}: {})",
        db.kind,
        db.display()
    )?;
    Ok(())
}
