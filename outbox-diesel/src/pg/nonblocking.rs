//! Emit on diesel-async's PostgreSQL connections: the same statements as above
//! ([`PlainInsert`], [`Insert`] in their NOTIFY modes, the take-back), awaited.

use std::marker::PhantomData;

use diesel::IntoSql as _;
use diesel::connection::{TransactionDepthChange, TransactionManagerStatus};
use diesel::pg::Pg;
use diesel::result::QueryResult;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::Integer;
use diesel_async::pooled_connection::deadpool::{Object, Pool, PoolError};
use diesel_async::{
    AsyncConnection, AsyncConnectionCore, AsyncPgConnection, RunQueryDsl as _,
    SimpleAsyncConnection as _, TransactionManager as _,
};
use outbox_core::Envelope;

use super::emit::{Always, Insert, Inserted, Mode, NoNotify, PlainInsert, Wake, WhenIdle};
use super::emit::{duplicate, note_chunk, one_inserted, take_back};
use crate::backend::{Row, chunks};
use crate::{EmitOptions, Notify, Result};

impl crate::async_emit::AsyncInsert for Pg {
    async fn insert<C>(conn: &mut C, options: &EmitOptions, envelopes: &[Envelope]) -> Result<()>
    where
        C: AsyncConnectionCore<Backend = Pg>,
    {
        let rows = envelopes.iter().map(Row::new).collect::<Result<Vec<_>>>()?;
        if let [row] = rows.as_slice() {
            let new = insert_one(conn, options.notify, row, &options.channel).await?;
            return one_inserted(new, row);
        }
        let mut inserted = Vec::new();
        for chunk in chunks(&rows) {
            let got = load_chunk(conn, options.notify, chunk, &options.channel).await?;
            if let Some(dup) = note_chunk(&mut inserted, chunk, &got) {
                if let Some(take_back) = take_back(&inserted) {
                    take_back.execute(conn).await?;
                }
                return duplicate(dup);
            }
        }
        Ok(())
    }
}

/// The blocking inbox's statements on `AsyncPgConnection`: the same prepared dedup
/// insert and committable check.
impl crate::async_inbox::AsyncInboxConnection for diesel_async::AsyncPgConnection {
    type Pool = Pool<Self>;
    type Pooled = Object<Self>;

    async fn checkout(pool: &Pool<Self>) -> std::result::Result<Object<Self>, PoolError> {
        pool.get().await
    }

    fn max_size(pool: &Pool<Self>) -> usize {
        pool.status().max_size
    }

    fn discard(pooled: Object<Self>) {
        drop(Object::take(pooled));
    }

    async fn insert_consumed(&mut self, group: &str, msg_id: &str) -> Result<bool> {
        Ok(super::ConsumedInsert { group, msg_id }
            .execute(self)
            .await?
            == 1)
    }

    async fn commit_checked(&mut self) -> Result<Result<()>> {
        // The blocking inbox's single round trip: in a simple-query string the
        // statements after a failed one do not run, so an aborted transaction fails
        // the `SELECT 1` and stays open, while a healthy one commits.
        let Err(e) = self.batch_execute("SELECT 1; COMMIT").await else {
            left_transaction(self)?;
            return Ok(Ok(()));
        };
        // diesel-async does not follow the server's transaction status, so ask it: any
        // statement fails in an aborted transaction (the `COMMIT` did not run); one
        // that succeeds means the `COMMIT` itself failed and ended the transaction.
        match diesel::select(1i32.into_sql::<Integer>())
            .execute(self)
            .await
        {
            Err(DieselError::DatabaseError(kind, _))
                if kind != DatabaseErrorKind::ClosedConnection =>
            {
                Ok(Err(e.into()))
            }
            Ok(_) => {
                left_transaction(self)?;
                Err(e.into())
            }
            Err(_) => Err(e.into()),
        }
    }

    async fn transaction_open(&mut self) -> Result<bool> {
        // PostgreSQL keeps an aborted transaction open: `check_committable` sees it.
        Ok(true)
    }
}

/// Tells diesel-async's transaction manager that the transaction it began is over
/// (committed or ended by the server), as its own `commit_transaction` does.
fn left_transaction(c: &mut AsyncPgConnection) -> Result<()> {
    match Tm::transaction_manager_status_mut(c) {
        TransactionManagerStatus::Valid(status) => {
            status.change_transaction_depth(TransactionDepthChange::DecreaseDepth)?;
            Ok(())
        }
        TransactionManagerStatus::InError => Err(DieselError::BrokenTransactionManager.into()),
    }
}

type Tm = <AsyncPgConnection as AsyncConnection>::TransactionManager;

/// [`super::insert_one`], awaited.
async fn insert_one<C: AsyncConnectionCore<Backend = Pg>>(
    conn: &mut C,
    notify: Notify,
    row: &Row<'_>,
    channel: &str,
) -> QueryResult<bool> {
    async fn q<M: Mode, C: AsyncConnectionCore<Backend = Pg>>(
        conn: &mut C,
        row: &Row<'_>,
        channel: &str,
    ) -> QueryResult<bool> {
        let insert = PlainInsert::<M> {
            row,
            wake: Wake::new(channel),
            mode: PhantomData,
        };
        Ok(insert.execute(conn).await? == 1)
    }
    match notify {
        Notify::Never => q::<NoNotify, C>(conn, row, channel).await,
        Notify::Always => q::<Always, C>(conn, row, channel).await,
        Notify::WhenRelayIdle => q::<WhenIdle, C>(conn, row, channel).await,
    }
}

/// [`super::load_chunk`], awaited.
async fn load_chunk<C: AsyncConnectionCore<Backend = Pg>>(
    conn: &mut C,
    notify: Notify,
    rows: &[Row<'_>],
    channel: &str,
) -> QueryResult<Vec<Inserted>> {
    async fn q<M: Mode, C: AsyncConnectionCore<Backend = Pg>>(
        conn: &mut C,
        rows: &[Row<'_>],
        channel: &str,
    ) -> QueryResult<Vec<Inserted>> {
        Insert::<M> {
            rows,
            wake: Wake::new(channel),
            mode: PhantomData,
        }
        .load(conn)
        .await
    }
    match notify {
        Notify::Never => q::<NoNotify, C>(conn, rows, channel).await,
        Notify::Always => q::<Always, C>(conn, rows, channel).await,
        Notify::WhenRelayIdle => q::<WhenIdle, C>(conn, rows, channel).await,
    }
}
