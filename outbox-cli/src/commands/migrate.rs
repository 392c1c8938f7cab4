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
    } else {
        with_conn!(&mut conn, c => outbox_diesel::migrate(c))?;
        writeln!(
            out,
            "outbox tables are up to date ({}: {})",
            db.kind,
            db.display()
        )?;
    }
    if args.cdc || args.to_polling {
        match &mut conn {
            Conn::Pg(c) if args.to_polling => {
                let r = outbox_cdc::switch_to_polling(c)?;
                print_switch(out, &r, "the slot and the publication are dropped")?;
            }
            Conn::Pg(c) => cdc_setup(c, args.recover_slot, out)?,
            Conn::Mysql(_) => binlog_cdc(&db.target, args, out)?,
            Conn::Sqlite(_) => return Err(CliError::CdcNotOnSqlite),
        }
    }
    Ok(())
}

fn print_switch(
    out: &mut impl Write,
    r: &outbox_cdc::SwitchReport,
    dropped: &str,
) -> Result<(), CliError> {
    writeln!(
        out,
        "CDC mode off: {} relayed messages marked SENT (relayed through id {}), {} \
         parked ones left NEW; {dropped}: start the polling relays",
        r.marked_sent, r.relayed_through, r.parked
    )?;
    Ok(())
}

/// `--cdc`, `--recover-slot` and `--to-polling` on MariaDB: CDC mode on the binlog
/// (`outbox_cdc::mysql`), on a session of the async client the binlog relay uses.
fn binlog_cdc(url: &str, args: &MigrateArgs, out: &mut impl Write) -> Result<(), CliError> {
    use outbox_cdc::mysql;
    let to_polling = args.to_polling;
    let recover = args.recover_slot;
    let done = crate::cdc::block_on(async move {
        let mut conn = mysql::connect(url).await?;
        if to_polling {
            return mysql::switch_to_polling(&mut conn)
                .await
                .map(Binlog::Switched);
        }
        let report = if recover {
            mysql::recover_lost_position(&mut conn).await?
        } else {
            mysql::setup(&mut conn, &outbox_cdc::CdcConfig::default()).await?
        };
        let (mode, position) = mysql::cdc_mode(&mut conn)
            .await?
            .ok_or(outbox_cdc::CdcError::NotSetUp)?;
        Ok(Binlog::SetUp(report, mode.slot, position))
    })??;
    match done {
        Binlog::Switched(r) => print_switch(out, &r, "the binlog position is forgotten")?,
        Binlog::SetUp(report, lock, position) => {
            let (from, upto) = report.backfill;
            writeln!(
                out,
                "CDC relay set up on the binlog: lock {lock}, position {}{}; {}",
                if position.to_string().is_empty() {
                    "(empty binlog)".to_owned()
                } else {
                    format!("`{position}`")
                },
                if recover { " (recovered)" } else { "" },
                backfill(from, upto)
            )?;
        }
    }
    Ok(())
}

/// What `binlog_cdc` did.
enum Binlog {
    /// CDC mode is off.
    Switched(outbox_cdc::SwitchReport),
    /// CDC mode is on: the report, the readers' lock, the stored position.
    SetUp(
        outbox_cdc::SetupReport,
        String,
        outbox_cdc::mysql::GtidPosition,
    ),
}

fn backfill(from: i64, upto: i64) -> String {
    if upto > from {
        format!(
            "NEW rows with ids {} to {upto} are published first (backfill)",
            from + 1
        )
    } else {
        "nothing to backfill".to_owned()
    }
}

/// `--cdc`: the publication and the slot (or, with `recover_slot`, a new slot for a lost
/// one), after the tables.
fn cdc_setup(
    c: &mut diesel::PgConnection,
    recover_slot: bool,
    out: &mut impl Write,
) -> Result<(), CliError> {
    let report = if recover_slot {
        outbox_cdc::recover_lost_slot(c)?
    } else {
        outbox_cdc::setup(c, &outbox_cdc::CdcConfig::default())?
    };
    let (from, upto) = report.backfill;
    writeln!(
        out,
        "CDC relay set up: publication {}, slot {}{}; {}",
        if report.publication_created {
            "created"
        } else {
            "in place"
        },
        if report.slot_created {
            "created"
        } else {
            "in place"
        },
        if report.partitioned {
            " (partitioned table)"
        } else {
            ""
        },
        backfill(from, upto)
    )?;
    // A slot that exists but cannot serve (invalidated) is reported now, not at the
    // relay's start.
    outbox_cdc::check(c)?;
    Ok(())
}
