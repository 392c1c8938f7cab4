//! `outbox migrate`.

use std::io::Write;

use outbox_diesel::PartitionPolicy;

use crate::args::MigrateArgs;
use crate::backend::{BackendKind, Conn, with_conn};
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
        let migration = match (args.partitioned, kind) {
            (false, _) => kind.migration(),
            (true, BackendKind::Postgres) => outbox_diesel::POSTGRES_PARTITIONED_MIGRATION,
            (true, _) => return Err(CliError::PostgresOnly("--partitioned")),
        };
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
    if args.partitioned {
        let Conn::Pg(c) = &mut conn else {
            return Err(CliError::PostgresOnly("--partitioned"));
        };
        let policy = PartitionPolicy::default()
            .with_interval(args.partition_interval)
            .with_premake(args.premake)
            .with_retention(args.retention);
        let report = outbox_diesel::migrate_partitioned(c, &policy)?;
        super::partitions::print_report(out, &report)?;
        writeln!(
            out,
            "outbox tables are partitioned by time ({}: {})",
            db.kind,
            db.display()
        )?;
        return Ok(());
    }
    with_conn!(&mut conn, c => outbox_diesel::migrate(c))?;
    writeln!(
        out,
        "outbox tables are up to date ({}: {})",
        db.kind,
        db.display()
    )?;
    Ok(())
}
