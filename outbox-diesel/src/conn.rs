use outbox_core::{Backlog, BatchOutcome, Envelope, Status};

use crate::{EmitOptions, OutboxRecord, Result};

mod sealed {
    pub trait Sealed {}
}

/// A diesel connection this crate works with: `PgConnection`, `MysqlConnection`,
/// `SqliteConnection` (per enabled feature), and r2d2 pooled connections of them.
///
/// Sealed: its methods are the backend-specific SQL behind [`Emit`](crate::Emit), the
/// stores and the operations functions, and are not part of the public API.
pub trait OutboxConnection: diesel::Connection + sealed::Sealed + Send + 'static {
    /// The embedded migration (the shipped `up.sql`).
    #[doc(hidden)]
    const __MIGRATION: &'static str;

    /// Inserts envelopes (validated by the caller: sizes, in-batch duplicates).
    #[doc(hidden)]
    fn __insert(&mut self, options: &EmitOptions, envelopes: &[Envelope]) -> Result<()>;

    /// Opens the claim transaction (locking where the backend has row locks).
    #[doc(hidden)]
    fn __begin_claim(&mut self) -> Result<()>;

    /// Opens the claim transaction with server-side bounds on how long a stalled holder
    /// keeps its row locks (`Duration::ZERO`: the server's own settings).
    #[doc(hidden)]
    fn __begin_bounded_claim(&mut self, _stall: std::time::Duration) -> Result<()> {
        self.__begin_claim()
    }

    /// The claim statement (exposed for EXPLAIN tests).
    #[doc(hidden)]
    fn __claim_sql(limit: usize) -> String;

    /// Reads up to `limit` due NEW rows in id order, locking them where possible.
    #[doc(hidden)]
    fn __claim(&mut self, limit: usize) -> Result<Vec<OutboxRecord>>;

    /// The per-key claim's statement (exposed for EXPLAIN tests): on PostgreSQL and
    /// SQLite the whole claim; on MySQL its first, locking statement (the second is
    /// [`__key_probe_sql`](Self::__key_probe_sql)).
    #[doc(hidden)]
    fn __claim_per_key_sql(limit: usize) -> String;

    /// MySQL's second per-key statement, for the locked ids `ids` (empty elsewhere).
    #[doc(hidden)]
    fn __key_probe_sql(_ids: &[i64]) -> String {
        String::new()
    }

    /// Like [`__claim`](Self::__claim), keeping only the rows that no unclaimed NEW row
    /// of their key precedes (ARCHITECTURE.md, "Order per key").
    #[doc(hidden)]
    fn __claim_per_key(&mut self, limit: usize) -> Result<Vec<OutboxRecord>>;

    /// Writes a batch outcome (in the caller's transaction).
    #[doc(hidden)]
    fn __complete(&mut self, outcome: &BatchOutcome) -> Result<()>;

    /// Backlog statistics.
    #[doc(hidden)]
    fn __backlog(&mut self) -> Result<Backlog>;

    /// Inserts a dedup row; `false` if it was there.
    #[doc(hidden)]
    fn __insert_consumed(&mut self, group: &str, msg_id: &str) -> Result<bool>;

    /// Fails if the open transaction can no longer commit. PostgreSQL aborts a
    /// transaction at its first failed statement and then turns `COMMIT` into a silent
    /// `ROLLBACK`; MySQL and SQLite roll back only the failed statement, so they have
    /// nothing to check.
    #[doc(hidden)]
    fn __check_committable(&mut self) -> Result<()> {
        Ok(())
    }

    /// Commits the open transaction of a consumer's message if it can commit
    /// ([`__check_committable`](Self::__check_committable)). `Ok(Err(e))`: it cannot (`e`
    /// says why) and is still open, to be rolled back; `Err`: the commit itself failed.
    /// PostgreSQL checks and commits in one round trip.
    #[doc(hidden)]
    fn __commit_checked(&mut self) -> Result<Result<()>> {
        if let Err(e) = self.__check_committable() {
            return Ok(Err(e));
        }
        <Self::TransactionManager as diesel::connection::TransactionManager<Self>>::commit_transaction(self)?;
        Ok(Ok(()))
    }

    /// Whether the transaction this connection began is still open on the server.
    /// MySQL and MariaDB end a transaction themselves on a deadlock (1213), savepoints
    /// included, and run the statements that follow in autocommit mode while diesel
    /// still counts the transaction open; PostgreSQL keeps an aborted transaction open
    /// until it is rolled back ([`__check_committable`](Self::__check_committable)).
    #[doc(hidden)]
    fn __transaction_open(&mut self) -> Result<bool> {
        Ok(true)
    }

    /// Rows with `id > after_id`, optionally of one status, in id order.
    #[doc(hidden)]
    fn __list(
        &mut self,
        status: Option<Status>,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<OutboxRecord>>;

    /// The row with this msg_id.
    #[doc(hidden)]
    fn __find(&mut self, msg_id: &str) -> Result<Option<OutboxRecord>>;

    /// DEAD → NEW (all, or these ids).
    #[doc(hidden)]
    fn __redrive(&mut self, ids: Option<&[i64]>) -> Result<usize>;

    /// Deletes these DEAD rows.
    #[doc(hidden)]
    fn __purge_dead(&mut self, ids: &[i64]) -> Result<usize>;

    /// Deletes up to `batch` SENT rows sent more than `older_than_us` ago.
    #[doc(hidden)]
    fn __purge_sent(&mut self, older_than_us: i64, batch: usize) -> Result<usize>;

    /// Deletes up to `batch` dedup rows older than `older_than_us`.
    #[doc(hidden)]
    fn __purge_consumed(&mut self, older_than_us: i64, batch: usize) -> Result<usize>;

    /// The highest migration version recorded in `outbox_migrations`; `None` when the
    /// table is missing (never migrated, or migrated before the table existed) or empty.
    #[doc(hidden)]
    fn __migration_version(&mut self) -> Result<Option<i32>>;
}

/// Implements the trait for a pooled connection by delegating to the inner connection.
impl<C> sealed::Sealed for diesel::r2d2::PooledConnection<diesel::r2d2::ConnectionManager<C>> where
    C: OutboxConnection + diesel::r2d2::R2D2Connection
{
}

impl<C> OutboxConnection for diesel::r2d2::PooledConnection<diesel::r2d2::ConnectionManager<C>>
where
    C: OutboxConnection + diesel::r2d2::R2D2Connection,
{
    const __MIGRATION: &'static str = C::__MIGRATION;

    fn __claim_sql(limit: usize) -> String {
        C::__claim_sql(limit)
    }

    fn __insert(&mut self, options: &EmitOptions, envelopes: &[Envelope]) -> Result<()> {
        (**self).__insert(options, envelopes)
    }
    fn __begin_claim(&mut self) -> Result<()> {
        (**self).__begin_claim()
    }
    fn __begin_bounded_claim(&mut self, stall: std::time::Duration) -> Result<()> {
        (**self).__begin_bounded_claim(stall)
    }
    fn __claim(&mut self, limit: usize) -> Result<Vec<OutboxRecord>> {
        (**self).__claim(limit)
    }
    fn __claim_per_key_sql(limit: usize) -> String {
        C::__claim_per_key_sql(limit)
    }
    fn __key_probe_sql(ids: &[i64]) -> String {
        C::__key_probe_sql(ids)
    }
    fn __claim_per_key(&mut self, limit: usize) -> Result<Vec<OutboxRecord>> {
        (**self).__claim_per_key(limit)
    }
    fn __complete(&mut self, outcome: &BatchOutcome) -> Result<()> {
        (**self).__complete(outcome)
    }
    fn __backlog(&mut self) -> Result<Backlog> {
        (**self).__backlog()
    }
    fn __insert_consumed(&mut self, group: &str, msg_id: &str) -> Result<bool> {
        (**self).__insert_consumed(group, msg_id)
    }
    fn __check_committable(&mut self) -> Result<()> {
        (**self).__check_committable()
    }
    fn __commit_checked(&mut self) -> Result<Result<()>> {
        (**self).__commit_checked()
    }
    fn __transaction_open(&mut self) -> Result<bool> {
        (**self).__transaction_open()
    }
    fn __list(
        &mut self,
        status: Option<Status>,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<OutboxRecord>> {
        (**self).__list(status, after_id, limit)
    }
    fn __find(&mut self, msg_id: &str) -> Result<Option<OutboxRecord>> {
        (**self).__find(msg_id)
    }
    fn __redrive(&mut self, ids: Option<&[i64]>) -> Result<usize> {
        (**self).__redrive(ids)
    }
    fn __purge_dead(&mut self, ids: &[i64]) -> Result<usize> {
        (**self).__purge_dead(ids)
    }
    fn __purge_sent(&mut self, older_than_us: i64, batch: usize) -> Result<usize> {
        (**self).__purge_sent(older_than_us, batch)
    }
    fn __purge_consumed(&mut self, older_than_us: i64, batch: usize) -> Result<usize> {
        (**self).__purge_consumed(older_than_us, batch)
    }
    fn __migration_version(&mut self) -> Result<Option<i32>> {
        (**self).__migration_version()
    }
}

#[cfg(feature = "postgres")]
impl sealed::Sealed for diesel::PgConnection {}
#[cfg(feature = "mysql")]
impl sealed::Sealed for diesel::MysqlConnection {}
#[cfg(feature = "sqlite")]
impl sealed::Sealed for diesel::SqliteConnection {}
