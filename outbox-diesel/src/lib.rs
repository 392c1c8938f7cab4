#![doc = include_str!("../README.md")]
//!
//! ## Errors and transactions
//!
//! The errors emit detects itself (duplicate or invalid msg_id, payload too large or not
//! serializable, field too long) leave your transaction usable: nothing was written, and
//! `?` rolls back as usual. A database error aborts a PostgreSQL transaction like any
//! failed statement. On PostgreSQL a failing statement would abort the transaction, so a
//! duplicate msg_id is detected with `ON CONFLICT DO NOTHING` and "0 rows";
//! MySQL and SQLite roll back only the failing statement. [`Error`] converts into
//! [`diesel::result::Error`] (a duplicate becomes a `UniqueViolation` on
//! [`MSG_ID_CONSTRAINT`]; test it with [`is_duplicate`]) and into
//! [`outbox_core::Error`].
//!
//! ## Order per key and many relays
//!
//! [`PgRelayStore`] and [`MysqlRelayStore`] claim with row locks (`FOR UPDATE SKIP
//! LOCKED`), so any number of relay instances can share one outbox: each row is in one
//! batch at a time, a batch is marked SENT in the transaction that locked it, and a
//! crashed instance's locks go with its connection, so its rows are claimed again by
//! the others without an operator (only its batch in flight may be published twice).
//! By default the claim keeps messages that share a key in id order across instances and
//! retries ([`ClaimOrder`], [order per key](outbox_core::Relay#order-per-key)).
//!
//! ## SQLite
//!
//! SQLite has one writer at a time, and a transaction begun with a plain `BEGIN`
//! (diesel's [`Connection::transaction`](diesel::Connection::transaction)) asks for the
//! write lock only at its first write. If another connection wrote, or held the write
//! lock, between such a transaction's first read and its first write, SQLite fails it
//! with `database is locked` at once: the busy timeout does not apply to that upgrade
//! (waiting could deadlock, or the transaction's snapshot is already stale). The other
//! writer may be the relay marking a batch SENT, or another thread of yours. So on SQLite:
//!
//! - run each transaction that reads and then writes (most business transactions,
//!   emitting ones included) with
//!   [`SqliteConnection::immediate_transaction`](diesel::SqliteConnection::immediate_transaction):
//!   it takes the write lock at `BEGIN`, where the busy timeout makes it wait for the
//!   other writer instead of failing;
//! - give every connection a busy timeout ([`sqlite_pool`] installs [`SqliteCustomizer`]:
//!   5 s, and WAL mode so that readers and the writer do not block each other); a
//!   transaction whose first statement writes needs nothing more;
//! - or retry a transaction that failed with `database is locked`.
//!
//! The relay writes only when it has work: an idle relay polls with reads and takes no
//! write lock. [`SqliteRelayStore`] runs one relay per database file, held by an OS lock
//! on `<database file>.outbox-relay.lock` that goes with the process, so a relay killed
//! with SIGKILL can be restarted at once.
//!
//! ## Wake-up on PostgreSQL
//!
//! Emit can `NOTIFY` the relay inside your transaction (delivered at commit):
//! [`Notify::WhenRelayIdle`] (the default) notifies only while a relay is parked waiting
//! for work, decided inside the INSERT statement, so a busy system pays nothing;
//! [`Notify::Always`] and [`Notify::Never`] are the alternatives (see [`EmitOptions`]).
//! The parked relay sleeps on its own LISTEN connection (opened with `tokio-postgres`,
//! without TLS: see [`PgRelayStore`]) and wakes as soon as the notification arrives.
#![doc(test(attr(deny(warnings))))]

#[cfg(not(any(feature = "postgres", feature = "mysql", feature = "sqlite")))]
compile_error!("outbox-diesel needs at least one of the features `postgres`, `mysql`, `sqlite`");

#[cfg(any(feature = "async-postgres", feature = "async-mysql"))]
mod async_emit;
#[cfg(any(feature = "async-postgres", feature = "async-mysql"))]
mod async_inbox;
mod backend;
mod conn;
mod emit;
mod error;
mod inbox;
mod inbox_ahead;
mod migrate;
#[cfg(feature = "mysql")]
mod mysql;
mod ops;
#[cfg(feature = "postgres")]
mod pg;
pub mod schema;
#[cfg(feature = "sqlite")]
mod sqlite;
mod store;

#[cfg(any(feature = "async-postgres", feature = "async-mysql"))]
pub use async_emit::AsyncEmit;
#[cfg(any(feature = "async-postgres", feature = "async-mysql"))]
pub use async_inbox::AsyncDieselInbox;
#[cfg(feature = "postgres")]
pub use backend::PgMessageRow;
pub use conn::OutboxConnection;
pub use emit::{Emit, EmitOptions, Notify, wake_lock_key};
pub use error::{Error, MSG_ID_CONSTRAINT, Result, is_duplicate, is_transient};
pub use inbox::DieselInbox;
pub use migrate::{
    MIGRATION_VERSION, MYSQL_MIGRATION, Migration, POSTGRES_MIGRATION, SQLITE_MIGRATION, migrate,
};
#[cfg(feature = "mysql")]
pub use mysql::{MysqlRelayStore, mysql_cdc_lock};
pub use ops::*;
#[cfg(feature = "postgres")]
pub use pg::{
    POSTGRES_PARTITIONED_MIGRATION, Partition, PartitionPolicy, PartitionReport, PgRelayStore,
    maintain_partitions, migrate_partitioned, partition_policy, partitions, with_keepalives,
};
#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteBatch, SqliteCustomizer, SqliteRelayStore, sqlite_pool};
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub use store::DEFAULT_STALL_TIMEOUT;
pub use store::{ClaimOrder, LockedBatch};

/// The claim statements as text, for the EXPLAIN tests under `tests/`: not part of the
/// API (the connection methods that build them are crate-private).
#[doc(hidden)]
pub mod __private {
    use crate::OutboxConnection;
    use crate::backend::Database as _;

    /// The unordered claim's statement.
    pub fn claim_sql<C: OutboxConnection>(limit: usize) -> String {
        C::Db::claim_sql(limit)
    }

    /// The per-key claim's statement (on MySQL its first, locking one).
    pub fn claim_per_key_sql<C: OutboxConnection>(limit: usize) -> String {
        C::Db::claim_per_key_sql(limit, &[])
    }

    /// Opens a claim's transaction on `conn` as a relay store does (isolation, commit
    /// and planner settings, stall bounds), for tests of the claim as the relay runs it
    /// and the bench's pure-SQL drain.
    pub fn begin_claim<C: OutboxConnection>(
        conn: &mut C,
        stall: std::time::Duration,
    ) -> crate::Result<()> {
        conn.db().begin_claim(stall)
    }

    /// Records a claimed batch's outcome on `conn` in the claim's transaction (see
    /// [`begin_claim`]), without committing it: as a relay store records a batch with
    /// retries or dead letters (on PostgreSQL one sent in full is marked by the string
    /// that commits it).
    pub fn complete<C: OutboxConnection>(
        conn: &mut C,
        outcome: &outbox_core::RelayBatchOutcome,
    ) -> crate::Result<()> {
        crate::backend::complete(conn.db(), outcome)
    }

    /// MySQL's second per-key statement for the locked ids `ids` (empty elsewhere).
    pub fn key_probe_sql<C: OutboxConnection>(ids: &[i64]) -> String {
        C::Db::key_probe_sql(ids)
    }
}

/// The default PostgreSQL `NOTIFY` channel: `outbox`.
pub const DEFAULT_CHANNEL: &str = "outbox";

/// An r2d2 pool of PostgreSQL connections.
#[cfg(feature = "postgres")]
pub type PgPool = diesel::r2d2::Pool<diesel::r2d2::ConnectionManager<diesel::PgConnection>>;
/// An r2d2 pool of MySQL / MariaDB connections.
#[cfg(feature = "mysql")]
pub type MysqlPool = diesel::r2d2::Pool<diesel::r2d2::ConnectionManager<diesel::MysqlConnection>>;
/// An r2d2 pool of SQLite connections (build it with [`sqlite_pool`]).
#[cfg(feature = "sqlite")]
pub type SqlitePool = diesel::r2d2::Pool<diesel::r2d2::ConnectionManager<diesel::SqliteConnection>>;

/// The consumer's idempotency store on PostgreSQL; handlers get `&mut PgConnection`.
#[cfg(feature = "postgres")]
pub type PgInbox = DieselInbox<diesel::PgConnection>;
/// The consumer's idempotency store on MySQL / MariaDB; handlers get `&mut MysqlConnection`.
#[cfg(feature = "mysql")]
pub type MysqlInbox = DieselInbox<diesel::MysqlConnection>;
/// The consumer's idempotency store on SQLite; handlers get `&mut SqliteConnection`.
#[cfg(feature = "sqlite")]
pub type SqliteInbox = DieselInbox<diesel::SqliteConnection>;

/// The consumer's idempotency store on diesel-async's PostgreSQL connections; handlers
/// ([`AsyncTxHandler`](outbox_core::AsyncTxHandler)) get `&mut AsyncPgConnection`.
#[cfg(feature = "async-postgres")]
pub type AsyncPgInbox = AsyncDieselInbox<diesel_async::AsyncPgConnection>;
/// The consumer's idempotency store on diesel-async's MySQL / MariaDB connections;
/// handlers ([`AsyncTxHandler`](outbox_core::AsyncTxHandler)) get
/// `&mut AsyncMysqlConnection`.
#[cfg(feature = "async-mysql")]
pub type AsyncMysqlInbox = AsyncDieselInbox<diesel_async::AsyncMysqlConnection>;
/// diesel-async's deadpool pool of `C` connections, as [`AsyncDieselInbox::new`] takes it.
#[cfg(any(feature = "async-postgres", feature = "async-mysql"))]
pub type AsyncPool<C> = diesel_async::pooled_connection::deadpool::Pool<C>;

/// The batch type of [`PgRelayStore`].
#[cfg(feature = "postgres")]
pub type PgBatch = LockedBatch<diesel::PgConnection>;
/// The batch type of [`MysqlRelayStore`].
#[cfg(feature = "mysql")]
pub type MysqlBatch = LockedBatch<diesel::MysqlConnection>;
