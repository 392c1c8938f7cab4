//! `outbox relay --cdc`: the CDC relay of `outbox-cdc` (PostgreSQL logical decoding of the
//! outbox's inserts, or MariaDB's binlog, published in commit order) over the same
//! publisher, admin endpoint and signals as the polling relay. The relays of one database
//! share the slot (PostgreSQL) or the readers' lock (MariaDB): one reads, the others wait
//! and take over when it dies, stops or freezes.

use diesel::PgConnection;
use outbox_cdc::mysql::MysqlCdcRelay;
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

/// Runs the binlog CDC relay (`outbox_cdc::mysql`) on `parts` until SIGINT or SIGTERM,
/// or an error that is not an outage (CDC mode not set up, a server that cannot serve
/// it: MySQL, the binlog settings, the privileges; a purged position).
pub(super) fn serve_binlog<P: Publisher>(parts: Parts<'_, P>) -> Result<(), CliError> {
    let Parts {
        runtime,
        publisher,
        db,
        broker,
        args,
        stop,
        ..
    } = parts;
    let url = db.target.as_str();
    let config = CdcConfig::default()
        .with_batch_size(args.batch_size as usize)
        .with_retry(RetryPolicy::default().with_max_attempts(args.max_attempts));
    // What cannot serve the relay fails here, with its hint, rather than inside the run.
    runtime.block_on(async {
        let mut conn = outbox_cdc::mysql::connect(url).await?;
        if args.migrate {
            outbox_cdc::mysql::setup(&mut conn, &config).await?;
        }
        outbox_cdc::mysql::check_server(&mut conn).await?;
        let (mode, position) = outbox_cdc::mysql::cdc_mode(&mut conn)
            .await?
            .ok_or(outbox_cdc::CdcError::NotSetUp)?;
        tracing::info!(lock = %mode.slot, %position, "CDC mode on the binlog");
        Ok::<_, CliError>(())
    })?;
    let relay = MysqlCdcRelay::new(url, publisher)?.with_config(config)?;
    tracing::info!(server_id = relay.server_id(), "binlog CDC relay starting");
    // Nothing is lost by giving up: what was published and not stored is read again
    // from the stored position by the next holder of the lock.
    let served = Served {
        runtime,
        db,
        broker,
        args,
        stop,
        running: "binlog CDC relay running; stop it with SIGINT or SIGTERM",
        given_up: "shutdown timeout reached; the next holder of the lock reads again from the stored position",
    };
    served.run(|shutdown| async move { relay.run_until(shutdown).await.map_err(CliError::from) })
}
