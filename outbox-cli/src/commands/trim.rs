//! `outbox trim`: [`outbox_redis::trim_acknowledged`] on every stream of a prefix,
//! partition streams included (dead-letter streams and keys of other types are skipped),
//! on every primary of a cluster. Refused on NATS ([`CliError::TrimOnNats`]), whose
//! streams lose messages by their own retention.

use std::io::Write;

use crate::args::TrimArgs;
use crate::broker::{Broker, BrokerKind};
use crate::error::CliError;
use crate::{output, scan};

/// Finds the prefix's streams and trims each to what some consumer group still needs.
pub(super) fn run(broker: &Broker, args: &TrimArgs, out: &mut impl Write) -> Result<(), CliError> {
    if let BrokerKind::Nats(_) = broker.kind() {
        return Err(CliError::TrimOnNats {
            url: broker.display().to_owned(),
        });
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    let reports = runtime.block_on(async {
        let mut conn = scan::connect(broker).await?;
        let streams = scan::streams(&mut conn, &args.stream_prefix)
            .await
            .map_err(|e| CliError::Redis(e.into()))?;
        let mut reports = Vec::with_capacity(streams.len());
        for stream in streams
            .iter()
            .filter(|s| !s.ends_with(&args.dead_letter_suffix))
        {
            let report = outbox_redis::trim_acknowledged(&mut conn, stream)
                .await
                .map_err(CliError::Redis)?;
            tracing::debug!(stream, removed = report.removed, min_id = ?report.min_id, "trimmed");
            reports.push(report);
        }
        Ok::<_, CliError>(reports)
    })?;
    if args.json {
        let json: Vec<_> = reports.iter().map(output::TrimJson::from).collect();
        output::json(out, &json)?;
    } else {
        output::trim_reports(out, &reports, &args.stream_prefix)?;
    }
    Ok(())
}
