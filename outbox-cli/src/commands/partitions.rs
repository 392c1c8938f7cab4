//! `outbox partitions`: the table partitions of PostgreSQL's partitioned layout.

use std::io::Write;

use outbox_diesel::PartitionReport;

use crate::args::PartitionsCommand;
use crate::backend::{Conn, Database};
use crate::error::CliError;

/// Maintains or lists the partitions.
pub(super) fn run(
    db: &Database,
    cmd: &PartitionsCommand,
    out: &mut impl Write,
) -> Result<(), CliError> {
    let mut conn = db.connect(false)?;
    let Conn::Pg(c) = &mut conn else {
        return Err(CliError::PostgresOnly("outbox partitions"));
    };
    match cmd {
        PartitionsCommand::Maintain => {
            if outbox_diesel::partition_policy(c)?.is_none() {
                writeln!(
                    out,
                    "the outbox table is not partitioned (`outbox migrate --partitioned`)"
                )?;
                return Ok(());
            }
            let report = outbox_diesel::maintain_partitions(c)?;
            print_report(out, &report)?;
            if report.busy {
                writeln!(
                    out,
                    "another maintenance run is in progress; made the partitions ahead only"
                )?;
            }
            match report.failed.len() {
                0 => Ok(()),
                n => Err(CliError::MaintenanceFailed(n)),
            }
        }
        PartitionsCommand::List(args) => {
            let partitions = outbox_diesel::partitions(c)?;
            if args.json {
                let rows: Vec<_> = partitions
                    .iter()
                    .map(|p| {
                        serde_json::json!({
                            "table": p.table, "name": p.name, "from": p.from, "to": p.to,
                            "detaching": p.detaching,
                        })
                    })
                    .collect();
                writeln!(out, "{}", serde_json::Value::Array(rows))?;
                return Ok(());
            }
            let bound = |t: Option<chrono::DateTime<chrono::Utc>>| {
                t.map_or_else(
                    || "-".to_owned(),
                    |t| t.format("%Y-%m-%d %H:%M:%S").to_string(),
                )
            };
            for p in &partitions {
                writeln!(
                    out,
                    "{:<13} {:<32} {} .. {}{}",
                    p.table,
                    p.name,
                    bound(p.from),
                    bound(p.to),
                    if p.detaching { "  (detaching)" } else { "" }
                )?;
            }
            Ok(())
        }
    }
}

/// One line per step of a maintenance run.
pub(super) fn print_report(out: &mut impl Write, report: &PartitionReport) -> std::io::Result<()> {
    for name in &report.created {
        writeln!(out, "created {name}")?;
    }
    for name in &report.dropped {
        writeln!(out, "dropped {name}")?;
    }
    for (name, reason) in &report.kept {
        writeln!(out, "kept {name}: {reason}")?;
    }
    for (name, error) in &report.failed {
        writeln!(out, "failed {name}: {error}")?;
    }
    Ok(())
}
