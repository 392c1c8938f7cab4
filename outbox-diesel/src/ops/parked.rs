//! The relays parked on PostgreSQL, waiting for work.

use diesel::QueryableByName;
use diesel::sql_types::{Integer, Nullable, Text};

use crate::backend::Database as _;
use crate::{OutboxConnection, Result};

/// A relay parked on PostgreSQL, waiting for work, as [`parked_relays`] returns it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedRelay {
    /// The process id of its LISTEN session.
    pub pid: i32,
    /// The session's client address; `None` over a Unix socket.
    pub client_addr: Option<String>,
    /// The session's `application_name`, if set.
    pub application_name: Option<String>,
    /// When the session last changed state (`pg_stat_activity.state_change`, in
    /// PostgreSQL's text form and the session's time zone).
    pub state_change: Option<String>,
}

/// The relays parked now on this database, in pid order: the sessions holding a
/// [wake-up lock](crate::wake_lock_key) exclusively, which a PostgreSQL relay takes on
/// its LISTEN session while it waits for work (a relay at work holds none, so it is
/// not listed). `None` on MySQL and SQLite, where relays park without such a lock.
///
/// Reads `pg_locks` and `pg_stat_activity`; a role that may not see other roles'
/// sessions (without `pg_read_all_stats`) sees only its own.
pub fn parked_relays<C: OutboxConnection>(conn: &mut C) -> Result<Option<Vec<ParkedRelay>>> {
    if !C::Db::DIALECT.wake_locks {
        return Ok(None);
    }
    // A LISTEN session holds its channel's wake-up lock exclusively (class and
    // `objsubid = 2`, the two-key form) while it is parked; the key is the channel's.
    let (class, _) = crate::wake_lock_key("");
    let sql = format!(
        "SELECT a.pid, host(a.client_addr) AS client_addr, \
           nullif(a.application_name, '') AS application_name, \
           a.state_change::text AS state_change \
         FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.classid = {class} AND l.objsubid = 2 \
           AND l.mode = 'ExclusiveLock' AND l.granted \
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         ORDER BY a.pid"
    );
    let rows: Vec<ParkedRow> = conn.db().load(&sql, None)?;
    Ok(Some(rows.into_iter().map(ParkedRow::into_relay).collect()))
}

/// A row of [`parked_relays`]' statement.
#[derive(QueryableByName)]
struct ParkedRow {
    #[diesel(sql_type = Integer)]
    pid: i32,
    #[diesel(sql_type = Nullable<Text>)]
    client_addr: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    application_name: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    state_change: Option<String>,
}

impl ParkedRow {
    fn into_relay(self) -> ParkedRelay {
        ParkedRelay {
            pid: self.pid,
            client_addr: self.client_addr,
            application_name: self.application_name,
            state_change: self.state_change,
        }
    }
}
