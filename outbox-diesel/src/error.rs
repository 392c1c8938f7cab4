use diesel::result::{DatabaseErrorInformation, DatabaseErrorKind};
use outbox_core::{BoxError, InvalidMsgId, MsgId};

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The name of the unique constraint on `outbox.msg_id`, reported by a duplicate emit.
pub const MSG_ID_CONSTRAINT: &str = "outbox_msg_id_key";

/// Everything that can go wrong in `outbox-diesel`.
///
/// Its `Display` says only what failed at this layer; the cause, if any, is its
/// [`source`](std::error::Error::source). Show both with [`outbox_core::error_chain`].
///
/// It converts into [`diesel::result::Error`] so that `?` works inside an ordinary
/// `conn.transaction(|c| ..)` closure; [`is_duplicate`] recognises a duplicate emit after
/// that conversion. It also converts into [`outbox_core::Error`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error `outbox-core` defines, as this crate reports it too: a duplicate msg_id
    /// ([`outbox_core::Error::Duplicate`]: the same business fact emitted twice, or twice
    /// in one [`emit_all`](crate::Emit::emit_all); nothing was written, the first message
    /// is untouched and the transaction is still usable), an invalid msg_id, an event that
    /// does not serialize, a payload over
    /// [`EmitOptions::max_payload_bytes`](crate::EmitOptions::max_payload_bytes), and the
    /// like.
    #[error(transparent)]
    Core(#[from] outbox_core::Error),
    /// A text field is longer than its column.
    #[error("event `{msg_id}`: {field} is {len} characters; the column holds {limit}")]
    FieldTooLong {
        /// The event's msg_id.
        msg_id: MsgId,
        /// The field: `topic`, `event_type`, `key` or `consumer_group`.
        field: &'static str,
        /// Its length in characters.
        len: usize,
        /// The column's limit.
        limit: usize,
    },
    /// A query or transaction failed.
    #[error("database error")]
    Database(#[from] diesel::result::Error),
    /// A connection could not be established.
    #[error("cannot connect")]
    Connection(#[from] diesel::ConnectionError),
    /// No pooled connection could be obtained in time.
    #[error("connection pool")]
    Pool(#[from] diesel::r2d2::PoolError),
    /// Another relay holds this SQLite database. SQLite has no row locks, so one relay
    /// runs per database file; a second one gets this error while the holder's process
    /// lives (a killed holder frees the database at once).
    #[error(
        "another relay ({owner}) holds the outbox of this SQLite database ({lock}); one relay per database"
    )]
    RelayAlreadyRunning {
        /// The holder's owner token, `pid<process id>-<random>` (`unknown` if it has
        /// not written it yet).
        owner: String,
        /// What it holds: the lock file's path, or the lease row of an in-memory database.
        lock: String,
    },
    /// This relay's SQLite lock file was removed or replaced while it ran, so another
    /// relay may be running on the same database. Stop this relay.
    #[error(
        "the SQLite relay lock file is no longer this relay's (now: {owner:?}); another relay may run"
    )]
    LeaseLost {
        /// The owner token now in the lock file (empty if the file is gone or empty).
        owner: String,
    },
    /// The SQLite relay's lock file could not be created, read or locked.
    #[error("cannot use the SQLite relay lock file {}", path.display())]
    RelayLock {
        /// The lock file: the database file's path plus `.outbox-relay.lock`.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A stored row holds a value this crate cannot read (unknown status, bad headers).
    #[error("corrupt outbox row {id}: {reason}")]
    CorruptRow {
        /// The row id.
        id: i64,
        /// What is wrong.
        reason: String,
    },
    /// A re-drive ([`redrive`](crate::redrive)) selected a DEAD row whose stored fields do
    /// not decode ([`OutboxRow::Unreadable`](crate::OutboxRow::Unreadable)): the relay would
    /// dead-letter it again at once. Nothing was re-driven; fix the row or purge it.
    #[error(
        "outbox row {id} cannot be re-driven: it is unreadable ({reason}); nothing was \
         re-driven: fix the row or purge it"
    )]
    UnreadableRow {
        /// The row id.
        id: i64,
        /// Why the row does not decode.
        reason: String,
    },
    /// The outbox tables were migrated by a newer release: the version recorded in
    /// `outbox_migrations` is above [`MIGRATION_VERSION`](crate::MIGRATION_VERSION).
    /// [`migrate`](crate::migrate) refuses to run this release's migration over them and
    /// changes nothing; run the newer release (or its `outbox` command) instead.
    #[error(
        "the outbox tables are at migration version {found}, newer than this release knows \
         ({supported}): nothing was changed; use the release that migrated them"
    )]
    SchemaTooNew {
        /// The highest version recorded in the database.
        found: i32,
        /// The highest version this release knows ([`MIGRATION_VERSION`](crate::MIGRATION_VERSION)).
        supported: i32,
    },
    /// A [`PartitionPolicy`](crate::PartitionPolicy) out of range.
    #[cfg(feature = "postgres")]
    #[error("invalid partition policy: {reason}")]
    InvalidPartitionPolicy {
        /// What is wrong.
        reason: String,
    },
    /// [`migrate_partitioned`](crate::migrate_partitioned) could not make a partition
    /// (a lock not granted in time, say); it changed nothing.
    #[cfg(feature = "postgres")]
    #[error("cannot create partition {name}: {error}")]
    PartitionNotCreated {
        /// The partition.
        name: String,
        /// Why, as the database said it.
        error: String,
    },
    /// No connection could be obtained from diesel-async's pool (or the pool could not
    /// be built): [`AsyncDieselInbox`](crate::AsyncDieselInbox).
    #[cfg(any(feature = "async-postgres", feature = "async-mysql"))]
    #[error("connection pool")]
    AsyncPool(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A blocking database task panicked or was cancelled.
    #[error("database task failed: {0}")]
    Task(String),
    /// A redrive while MariaDB's binlog CDC relay owns the outbox: that relay publishes
    /// inserts only, so the redrive's UPDATE would leave the row NEW and never published.
    /// Refused, and the row stays DEAD.
    #[error(
        "cannot redrive while the binlog CDC relay (lock `{relay}`, table outbox_cdc) owns \
         this outbox: it publishes inserts only; switch to polling first \
         (outbox_cdc::mysql::switch_to_polling), redrive, then set CDC mode up again"
    )]
    RedriveInCdcMode {
        /// The CDC relay's lock name.
        relay: String,
    },
}

impl Error {
    /// The same business fact was emitted twice ([`outbox_core::Error::Duplicate`]).
    pub fn is_duplicate(&self) -> bool {
        match self {
            Self::Core(e) => e.is_duplicate(),
            Self::Database(e) => is_duplicate(e),
            _ => false,
        }
    }

    /// The event itself is unusable (bad msg_id, unserializable, too large, field too
    /// long): retrying will not help.
    pub fn is_invalid_event(&self) -> bool {
        matches!(
            self,
            Self::Core(
                outbox_core::Error::InvalidMsgId(_)
                    | outbox_core::Error::Serialize { .. }
                    | outbox_core::Error::PayloadTooLarge { .. }
            ) | Self::FieldTooLong { .. }
        )
    }

    /// A transient conflict between transactions: a deadlock, a serialization failure,
    /// a lock wait that gave up (see [`is_transient`]). Running the transaction again is
    /// expected to succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Database(e) => is_transient(e),
            Self::Core(e) => e.is_transient(),
            _ => false,
        }
    }

    /// A second relay on one SQLite database ([`Error::RelayAlreadyRunning`] or
    /// [`Error::LeaseLost`]).
    pub fn is_relay_conflict(&self) -> bool {
        matches!(
            self,
            Self::RelayAlreadyRunning { .. } | Self::LeaseLost { .. }
        )
    }

    /// Recovers this crate's error from a [`diesel::result::Error`] produced by the
    /// conversion `From<Error> for diesel::result::Error`, if it carried one.
    pub fn from_diesel_ref(e: &diesel::result::Error) -> Option<&Self> {
        match e {
            diesel::result::Error::SerializationError(inner) => inner.downcast_ref::<Self>(),
            _ => None,
        }
    }
}

/// Whether a diesel error reports a duplicate msg_id in the outbox: what
/// [`Emit::emit`](crate::Emit::emit) returns, converted by `?` into
/// [`diesel::result::Error`], when the same business fact is emitted twice.
///
/// ```
/// use diesel::result::Error as DieselError;
/// let duplicate = outbox_core::Error::Duplicate("order-42:OrderPaid".try_into()?);
/// let e: DieselError = outbox_diesel::Error::from(duplicate).into();
/// assert!(outbox_diesel::is_duplicate(&e));
/// assert!(!outbox_diesel::is_duplicate(&DieselError::NotFound));
/// # Ok::<_, Box<dyn std::error::Error>>(())
/// ```
pub fn is_duplicate(e: &diesel::result::Error) -> bool {
    match e {
        diesel::result::Error::DatabaseError(DatabaseErrorKind::UniqueViolation, info) => {
            info.constraint_name() == Some(MSG_ID_CONSTRAINT)
        }
        other => Error::from_diesel_ref(other).is_some_and(Error::is_duplicate),
    }
}

/// Whether a diesel error is a transient conflict between transactions, one that running
/// the transaction again is expected to resolve:
///
/// | | PostgreSQL | MySQL / MariaDB |
/// |---|---|---|
/// | deadlock | `40P01` deadlock_detected | 1213 `ER_LOCK_DEADLOCK` (rolls back the whole transaction) |
/// | serialization failure | `40001` serialization_failure | — |
/// | lock wait gave up | `55P03` lock_not_available (`NOWAIT`, `lock_timeout`) | 1205 `ER_LOCK_WAIT_TIMEOUT` |
///
/// diesel reports `40001` (and MySQL's 1213 from a prepared statement) as
/// [`DatabaseErrorKind::SerializationFailure`]; it gives no code for the others, which are
/// recognised by the server's message in English, the default (`lc_messages`). The
/// consumer's inbox uses this to report a handler's conflict as
/// [`outbox_core::Error::Transient`], to be retried soon, instead of a handler failure.
///
/// ```
/// use diesel::result::{DatabaseErrorKind, Error as DieselError};
/// let deadlock = DieselError::DatabaseError(
///     DatabaseErrorKind::Unknown,
///     Box::new("Deadlock found when trying to get lock; try restarting transaction".to_owned()),
/// );
/// assert!(outbox_diesel::is_transient(&deadlock));
/// assert!(!outbox_diesel::is_transient(&DieselError::NotFound));
/// ```
pub fn is_transient(e: &diesel::result::Error) -> bool {
    /// The leading words of each transient error's message.
    const MESSAGES: [&str; 6] = [
        "deadlock detected",                       // PostgreSQL 40P01
        "could not serialize access",              // PostgreSQL 40001
        "could not obtain lock on",                // PostgreSQL 55P03 (NOWAIT)
        "canceling statement due to lock timeout", // PostgreSQL 55P03 (lock_timeout)
        "Deadlock found when trying to get lock",  // MySQL 1213
        "Lock wait timeout exceeded",              // MySQL 1205
    ];
    match e {
        diesel::result::Error::DatabaseError(DatabaseErrorKind::SerializationFailure, _) => true,
        diesel::result::Error::DatabaseError(DatabaseErrorKind::Unknown, info) => {
            MESSAGES.iter().any(|m| info.message().starts_with(m))
        }
        other => Error::from_diesel_ref(other).is_some_and(Error::is_transient),
    }
}

/// Whether `e`, or an error in its `source()` chain, is a transient diesel error
/// ([`is_transient`]): how a handler's error is classified, whatever it wrapped it in.
pub(crate) fn has_transient_cause(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        let transient = match (
            e.downcast_ref::<diesel::result::Error>(),
            e.downcast_ref::<Error>(),
            e.downcast_ref::<outbox_core::Error>(),
        ) {
            (Some(d), _, _) => is_transient(d),
            (_, Some(o), _) => o.is_transient(),
            (_, _, Some(c)) => c.is_transient(),
            _ => false,
        };
        if transient {
            return true;
        }
        next = e.source();
    }
    false
}

/// The details of a duplicate emit as diesel sees them: a unique violation of
/// [`MSG_ID_CONSTRAINT`] on `outbox.msg_id`.
#[derive(Debug)]
struct DuplicateInfo {
    message: String,
}

impl DatabaseErrorInformation for DuplicateInfo {
    fn message(&self) -> &str {
        &self.message
    }
    fn details(&self) -> Option<&str> {
        None
    }
    fn hint(&self) -> Option<&str> {
        None
    }
    fn table_name(&self) -> Option<&str> {
        Some("outbox")
    }
    fn column_name(&self) -> Option<&str> {
        Some("msg_id")
    }
    fn constraint_name(&self) -> Option<&str> {
        Some(MSG_ID_CONSTRAINT)
    }
    fn statement_position(&self) -> Option<i32> {
        None
    }
}

impl From<Error> for diesel::result::Error {
    /// A duplicate becomes a `UniqueViolation` on [`MSG_ID_CONSTRAINT`]; a database error
    /// is passed through; anything else is carried in a `SerializationError`
    /// (recover it with [`Error::from_diesel_ref`]).
    fn from(e: Error) -> Self {
        match e {
            Error::Core(outbox_core::Error::Duplicate(_)) => diesel::result::Error::DatabaseError(
                DatabaseErrorKind::UniqueViolation,
                Box::new(DuplicateInfo {
                    message: e.to_string(),
                }),
            ),
            Error::Database(e) => e,
            other => diesel::result::Error::SerializationError(Box::new(other)),
        }
    }
}

impl From<Error> for outbox_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Core(e) => e,
            e @ (Error::RelayAlreadyRunning { .. } | Error::LeaseLost { .. }) => {
                Self::RelayConflict(Box::new(e))
            }
            other => Self::Store(Box::new(other) as BoxError),
        }
    }
}

impl From<outbox_core::InvalidConfig> for Error {
    fn from(e: outbox_core::InvalidConfig) -> Self {
        Self::Core(e.into())
    }
}

impl From<InvalidMsgId> for Error {
    fn from(e: InvalidMsgId) -> Self {
        Self::Core(e.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_keep_the_kind() {
        let id = MsgId::new("a:B").unwrap();
        let d: diesel::result::Error =
            Error::from(outbox_core::Error::Duplicate(id.clone())).into();
        assert!(is_duplicate(&d));
        let e = Error::Database(d);
        assert!(e.is_duplicate());

        let big: diesel::result::Error = Error::from(outbox_core::Error::PayloadTooLarge {
            msg_id: id.clone(),
            size: 2,
            limit: 1,
        })
        .into();
        assert!(!is_duplicate(&big));
        assert!(matches!(
            Error::from_diesel_ref(&big),
            Some(Error::Core(outbox_core::Error::PayloadTooLarge {
                size: 2,
                ..
            }))
        ));

        let core: outbox_core::Error = Error::from(outbox_core::Error::Duplicate(id)).into();
        assert!(core.is_duplicate());
        let store: outbox_core::Error = Error::Task("boom".into()).into();
        assert!(store.is_outage());
    }

    fn db(kind: DatabaseErrorKind, message: &str) -> diesel::result::Error {
        diesel::result::Error::DatabaseError(kind, Box::new(message.to_owned()))
    }

    #[test]
    fn transient_errors_are_recognised_by_kind_and_message() {
        use DatabaseErrorKind::{SerializationFailure, UniqueViolation, Unknown};
        for transient in [
            db(SerializationFailure, "anything"),
            db(Unknown, "deadlock detected"),
            db(
                Unknown,
                "could not serialize access due to concurrent update",
            ),
            db(
                Unknown,
                "could not obtain lock on row in relation \"accounts\"",
            ),
            db(Unknown, "canceling statement due to lock timeout"),
            db(
                Unknown,
                "Deadlock found when trying to get lock; try restarting transaction",
            ),
            db(
                Unknown,
                "Lock wait timeout exceeded; try restarting transaction",
            ),
        ] {
            assert!(is_transient(&transient), "{transient}");
            assert!(Error::Database(transient).is_transient());
        }
        for other in [
            db(UniqueViolation, "deadlock detected"),
            db(Unknown, "relation \"x\" does not exist"),
            db(Unknown, "SAVEPOINT diesel_savepoint_1 does not exist"),
            diesel::result::Error::NotFound,
        ] {
            assert!(!is_transient(&other), "{other}");
        }
        // Wrapped, as a handler's `?` or its own error type would carry it.
        let wrapped: BoxError = Box::new(Error::Database(db(Unknown, "deadlock detected")));
        assert!(has_transient_cause(&*wrapped));
        let plain: BoxError = "deadlock detected".into();
        assert!(!has_transient_cause(&*plain));
    }
}
