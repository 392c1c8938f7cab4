//! The relayed watermark on MySQL / MariaDB: an id such that every NEW row up to it was
//! published (but the parked and DEAD ones), in the same three steps as on PostgreSQL
//! (see `src/watermark.rs`): (1) note `X`, the highest id committed now, and `T`, the
//! time; (2) once no transaction that started before `T` is open
//! (`information_schema.INNODB_TRX`, XA-prepared ones included), note `L`, the binlog's
//! GTID position now, past all their commits; (3) once the stored position covers `L`,
//! `X` is the watermark.
//!
//! `INNODB_TRX.trx_started` has whole seconds, so a transaction started within the
//! second after `T` is waited for too: the watermark only comes later. The relay's user
//! needs the `PROCESS` privilege to see other users' transactions.

use mysql_async::Conn;
use mysql_async::prelude::Queryable as _;

use super::GtidPosition;
use super::setup::binlog_position;
use crate::{CdcError, Result};

/// Where the watermark's steps stand.
#[derive(Debug, Default)]
pub(crate) enum Watermark {
    /// Step 1 next.
    #[default]
    Idle,
    /// Waiting for the transactions open at `at` (the server's `NOW(6)`) to end.
    Noted { id: i64, at: String },
    /// Waiting for the stored position to cover `position`.
    Ended { id: i64, position: GtidPosition },
}

impl Watermark {
    /// Takes the next step that is due, given the stored position; the new watermark
    /// when step 3 completes.
    pub(crate) async fn advance(
        &mut self,
        conn: &mut Conn,
        stored: &GtidPosition,
    ) -> Result<Option<i64>> {
        match self {
            Self::Idle => {
                let noted: Option<(i64, String)> = conn
                    .query_first("SELECT COALESCE(MAX(id), 0), CAST(NOW(6) AS CHAR) FROM outbox")
                    .await
                    .map_err(CdcError::db)?;
                if let Some((id, at)) = noted {
                    *self = Self::Noted { id, at };
                }
                Ok(None)
            }
            Self::Noted { id, at } => {
                let (id, at) = (*id, at.clone());
                let open: Option<i64> = conn
                    .exec_first(
                        "SELECT COUNT(*) FROM information_schema.INNODB_TRX \
                         WHERE trx_started <= ? AND trx_mysql_thread_id <> CONNECTION_ID()",
                        (at,),
                    )
                    .await
                    .map_err(CdcError::db)?;
                if open.unwrap_or(1) == 0 {
                    let position = binlog_position(conn).await?;
                    *self = Self::Ended { id, position };
                }
                Ok(None)
            }
            Self::Ended { id, position } => {
                if !stored.covers(position) {
                    return Ok(None);
                }
                let id = *id;
                *self = Self::Idle;
                Ok(Some(id))
            }
        }
    }
}
