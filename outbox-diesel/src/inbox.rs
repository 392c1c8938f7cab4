use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use outbox_core::{HandlerError, Inbox, MsgId, Processed};

use crate::backend::check_group;
use crate::{Error, OutboxConnection};

/// The consumer's idempotency store over a pool: records `(consumer_group, msg_id)` in
/// `consumed_msg` in the same transaction as the handler's writes.
///
/// The dedup insert cannot fail on a duplicate (PostgreSQL and SQLite
/// `ON CONFLICT DO NOTHING`, MySQL `INSERT IGNORE`): "0 rows" means already consumed, and
/// the handler is not run. Otherwise the handler runs with the transaction's connection
/// (`&mut PgConnection` and so on), and its error rolls back the dedup row with its
/// writes. A panicking handler unwinds through here; its connection is discarded by the
/// pool, which rolls the transaction back.
///
/// Use the alias of your backend: [`PgInbox`](crate::PgInbox),
/// [`MysqlInbox`](crate::MysqlInbox), [`SqliteInbox`](crate::SqliteInbox).
pub struct DieselInbox<C: R2D2Connection + 'static> {
    pool: Pool<ConnectionManager<C>>,
}

impl<C: R2D2Connection + 'static> Clone for DieselInbox<C> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
        }
    }
}

impl<C: R2D2Connection + 'static> std::fmt::Debug for DieselInbox<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DieselInbox").finish_non_exhaustive()
    }
}

impl<C: R2D2Connection + 'static> DieselInbox<C> {
    /// An inbox over `pool`.
    pub fn new(pool: Pool<ConnectionManager<C>>) -> Self {
        Self { pool }
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<ConnectionManager<C>> {
        &self.pool
    }
}

enum TxError {
    Store(Error),
    Handler(HandlerError),
}

impl From<diesel::result::Error> for TxError {
    fn from(e: diesel::result::Error) -> Self {
        Self::Store(e.into())
    }
}

impl From<Error> for TxError {
    fn from(e: Error) -> Self {
        Self::Store(e)
    }
}

impl<C: OutboxConnection + R2D2Connection> Inbox for DieselInbox<C> {
    type Conn = C;

    fn process<F>(
        &self,
        group: &str,
        msg_id: &MsgId,
        handle: F,
    ) -> Result<Processed, outbox_core::Error>
    where
        F: FnOnce(&mut C) -> Result<(), HandlerError>,
    {
        check_group(group, msg_id)?;
        let mut conn = self.pool.get().map_err(Error::from)?;
        let c: &mut C = &mut conn;
        let processed = c.transaction(|c| {
            if !c.__insert_consumed(group, msg_id.as_str())? {
                return Ok(Processed::Duplicate);
            }
            handle(c).map_err(TxError::Handler)?;
            Ok::<_, TxError>(Processed::Applied)
        });
        match processed {
            Ok(p) => Ok(p),
            Err(TxError::Handler(e)) => Err(e.into()),
            Err(TxError::Store(e)) => Err(e.into()),
        }
    }
}
