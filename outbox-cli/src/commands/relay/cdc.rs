//! `outbox relay --cdc`: the CDC relay of `outbox-cdc` (PostgreSQL logical decoding of the
//! outbox's inserts, published in commit order) over the same publisher, admin endpoint
//! and signals as the polling relay. The relays of one database share the slot: one reads
//! it, the others wait and take it over when it dies, stops or freezes.

use diesel::PgConnection;
use outbox_cdc::{CdcConfig, CdcRelay};
use outbox_core::{Publisher, RetryPolicy};

use super::{Parts, Served, pool};
use crate::error::CliError;

/// Runs the CDC relay on `parts` until SIGINT or SIGTERM, or an error that is not an
/// outage (CDC mode not set up, the server unable to serve it, a lost slot).
pub(super) fn serve<P: Publisher>(parts: Parts<'_, P>) -> Result<(), CliError> {
    let Parts {
        runtime,
        publisher,
        db,
        broker,
        args,
        stop,
        ..
    } = parts;
    let url = outbox_diesel::with_keepalives(&db.target);
    let pool = pool::<PgConnection>(db, &url, args.pool_size)?;
    {
        let mut conn = pool.get().map_err(|e| CliError::Database(e.into()))?;
        if args.migrate {
            outbox_cdc::setup(&mut conn, &CdcConfig::default())?;
        }
        // What cannot serve the relay fails here, with its hint, rather than inside the
        // run: wal_level, the privilege, the mode not set up, a lost slot.
        let (mode, slot) = outbox_cdc::check(&mut conn)?;
        tracing::info!(
            slot = %mode.slot,
            publication = %mode.publication,
            confirmed = slot.confirmed_flush_lsn.as_deref().unwrap_or("-"),
            holder = ?slot.active_pid,
            "CDC mode"
        );
    }
    let config = CdcConfig::default()
        .with_batch_size(args.batch_size as usize)
        .with_retry(RetryPolicy::default().with_max_attempts(args.max_attempts));
    let relay = CdcRelay::new(&db.target, pool, publisher)?.with_config(config)?;
    tracing::info!(name = relay.application_name(), "CDC relay starting");
    // Nothing is lost by giving up: what was published and not confirmed is read again
    // by the next holder of the slot (the consumers' inbox absorbs it).
    let served = Served {
        runtime,
        db,
        broker,
        args,
        stop,
        running: "CDC relay running; stop it with SIGINT or SIGTERM",
        given_up: "shutdown timeout reached; the next holder of the slot reads again from its confirmed position",
    };
    served.run(|shutdown| async move { relay.run_until(shutdown).await.map_err(CliError::from) })
}
