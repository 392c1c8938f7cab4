//! The crate's error: what the start check refuses, and what stops or pauses the relay.

use outbox_core::BoxError;

/// A result with [`CdcError`].
pub type Result<T, E = CdcError> = std::result::Result<T, E>;

/// Why the CDC relay cannot run, or what interrupted it.
///
/// The start check ([`check`](crate::check), run by [`setup`](crate::setup) and at every
/// start and reconnect of [`CdcRelay`](crate::CdcRelay)) reports a server that cannot
/// serve the relay with one of the configuration variants, each saying what to change.
/// [`is_outage`](Self::is_outage) tells the errors the relay waits out (the database or
/// the broker down) from those that stop it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CdcError {
    /// The server's `wal_level` is not `logical`: logical decoding is off. Set
    /// `wal_level = logical` in postgresql.conf (or the managed service's parameter,
    /// e.g. `rds.logical_replication = 1`) and restart the server.
    #[error(
        "wal_level is `{found}`, the CDC relay needs `logical`: set wal_level = logical and restart PostgreSQL"
    )]
    WalLevelNotLogical {
        /// The server's `wal_level`.
        found: String,
    },
    /// The role may not open a replication connection: it needs the `REPLICATION`
    /// attribute (`ALTER ROLE .. REPLICATION`) or superuser (on managed services a role
    /// such as `rds_replication`), and `pg_hba.conf` must allow it.
    #[error(
        "role `{role}` lacks the REPLICATION attribute: ALTER ROLE \"{role}\" REPLICATION (or grant the managed service's replication role)"
    )]
    MissingReplicationPrivilege {
        /// The role the relay connects as.
        role: String,
    },
    /// CDC mode is not set up in this database (no `outbox_cdc` row): run
    /// [`setup`](crate::setup) (`outbox migrate --cdc`) first.
    #[error(
        "CDC is not set up in this database: run `outbox migrate --cdc` (outbox_cdc::setup) first"
    )]
    NotSetUp,
    /// The relay was configured with a slot other than the one CDC mode was set up with.
    #[error(
        "the relay is configured for slot `{configured}`, but CDC mode was set up with slot `{recorded}`"
    )]
    SlotMismatch {
        /// The slot of the relay's [`CdcConfig`](crate::CdcConfig).
        configured: String,
        /// The slot recorded in `outbox_cdc` by [`setup`](crate::setup).
        recorded: String,
    },
    /// The replication slot is gone (dropped by an operator, or not carried over by a
    /// failover to a standby). The messages committed since its position are not lost
    /// (rows stay NEW): see "Recovering a lost slot" in the crate documentation.
    #[error(
        "replication slot `{slot}` does not exist: recreate it with `outbox_cdc::recover_lost_slot` (`outbox migrate --cdc --recover-slot`), which backfills the messages it missed"
    )]
    SlotMissing {
        /// The slot's name.
        slot: String,
    },
    /// The slot exists but is not a logical `pgoutput` slot of this database.
    #[error("replication slot `{slot}` is not a logical pgoutput slot of this database: {detail}")]
    SlotUnusable {
        /// The slot's name.
        slot: String,
        /// What is wrong with it.
        detail: String,
    },
    /// The server invalidated the slot (`wal_status = 'lost'`, or PostgreSQL 17's
    /// `invalidation_reason`), typically because it fell behind by more than
    /// `max_slot_wal_keep_size`: the WAL it needed is gone, so it can never be read
    /// again. No message is lost (rows stay NEW): see "Recovering a lost slot" in the
    /// crate documentation.
    #[error(
        "replication slot `{slot}` was invalidated ({reason}): recreate it with `outbox_cdc::recover_lost_slot` (`outbox migrate --cdc --recover-slot`), which backfills the messages it missed"
    )]
    SlotInvalidated {
        /// The slot's name.
        slot: String,
        /// Why (`wal_status` or `invalidation_reason`).
        reason: String,
    },
    /// The publication is missing or does not publish the `outbox` table's inserts,
    /// updates, deletes and truncates, or a partition of the table has no replica identity.
    #[error("publication `{publication}` is unusable: {detail}; run `outbox migrate --cdc` again")]
    PublicationUnusable {
        /// The publication's name.
        publication: String,
        /// What is wrong with it.
        detail: String,
    },
    /// The database URL cannot be used for a replication connection.
    #[error("invalid database URL for the replication connection: {0}")]
    Url(String),
    /// A configuration value breaks its rule.
    #[error(transparent)]
    Config(#[from] outbox_core::InvalidConfig),
    /// The replication stream carried something the decoder cannot read.
    #[error("cannot decode the replication stream: {0}")]
    Decode(String),
    /// The SQL connection failed (connection refused, query error): an outage.
    #[error("database error")]
    Database(#[source] BoxError),
    /// The replication connection failed or ended: an outage, reconnected after a pause.
    #[error("replication connection failed")]
    Replication(#[source] BoxError),
    /// The publisher failed as a whole (see [`outbox_core::Publisher`]).
    #[error("publisher failed")]
    Publish(#[source] outbox_core::Error),
    /// A MySQL / MariaDB server setting keeps the binlog relay from running (feature
    /// `mysql`): the binlog off, not in row format, without full row images or column
    /// names, compressed, or a server whose binlog the relay does not read.
    #[error("{setting} is `{found}`, the binlog CDC relay needs {needed}: {fix}")]
    BinlogSetting {
        /// The server variable (or `server` for the server itself).
        setting: String,
        /// Its value.
        found: String,
        /// The value the relay needs.
        needed: String,
        /// What to change.
        fix: String,
    },
    /// The MySQL / MariaDB user lacks a global privilege the binlog relay needs
    /// (`REPLICATION SLAVE` to read the binlog, `BINLOG MONITOR` for its position,
    /// `PROCESS` for the open transactions behind its watermark).
    #[error("user {user} lacks the {privilege} privilege: GRANT {privilege} ON *.* TO {user}")]
    MissingPrivilege {
        /// The user the relay connects as (`CURRENT_USER()`).
        user: String,
        /// The missing privilege.
        privilege: String,
    },
    /// The binlog no longer holds the relay's stored position (error 1236: purged by
    /// `binlog_expire_logs_seconds` or `PURGE BINARY LOGS` while the relay was behind):
    /// the binlog's lost slot. No message is lost (rows stay NEW): recover with
    /// `outbox_cdc::mysql::recover_lost_position`, which backfills what it missed.
    #[error(
        "the binlog no longer holds the relay's position `{position}` ({reason}): stop the relays and run `outbox_cdc::mysql::recover_lost_position`, which backfills the messages it missed"
    )]
    PositionLost {
        /// The stored GTID position.
        position: String,
        /// The server's message.
        reason: String,
    },
    /// The binlog dump failed with error 1236 for a reason other than a purged
    /// position (an event larger than the server's `max_allowed_packet`, a truncated or
    /// corrupt binlog, a position ahead of the server's binlog): waiting does not help,
    /// and recovering the position would hide the cause. The server's message says what
    /// to fix.
    #[error("the server cannot send the binlog from position `{position}`: {reason}")]
    BinlogUnreadable {
        /// The GTID position the dump started from.
        position: String,
        /// The server's message.
        reason: String,
    },
    /// The switch back to the polling relay did not finish in time
    /// ([`switch_to_polling`](crate::switch_to_polling)).
    #[error("switch to polling not finished: {0}")]
    SwitchTimeout(String),
}

impl CdcError {
    /// A failure the relay waits out (backs off and retries): the database, the
    /// replication connection or the broker down. The others stop the relay (a server
    /// that cannot serve it, a lost slot, a bad configuration).
    pub fn is_outage(&self) -> bool {
        match self {
            Self::Database(_) | Self::Replication(_) => true,
            Self::Publish(e) => e.is_outage(),
            _ => false,
        }
    }

    pub(crate) fn db(e: impl Into<BoxError>) -> Self {
        Self::Database(e.into())
    }
}

impl From<diesel::result::Error> for CdcError {
    fn from(e: diesel::result::Error) -> Self {
        Self::db(e)
    }
}

impl From<diesel::r2d2::PoolError> for CdcError {
    fn from(e: diesel::r2d2::PoolError) -> Self {
        Self::db(e)
    }
}

impl From<outbox_diesel::Error> for CdcError {
    fn from(e: outbox_diesel::Error) -> Self {
        Self::db(e)
    }
}

impl From<pgwire_replication::PgWireError> for CdcError {
    fn from(e: pgwire_replication::PgWireError) -> Self {
        Self::Replication(Box::new(e))
    }
}

impl From<CdcError> for outbox_core::Error {
    /// Outages become [`outbox_core::Error::Store`] (or the publisher's own error), so
    /// that [`outbox_core::Error::is_outage`] agrees with [`CdcError::is_outage`]; the
    /// others [`outbox_core::Error::RelayConflict`] (stop, waiting does not help).
    fn from(e: CdcError) -> Self {
        match e {
            CdcError::Publish(e) => e,
            CdcError::Config(e) => outbox_core::Error::Config(e),
            e if e.is_outage() => outbox_core::Error::store(e),
            e => outbox_core::Error::RelayConflict(Box::new(e)),
        }
    }
}
