//! SQLite: a single relay per database, enforced by an OS lock on a file next to it.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use diesel::connection::SimpleConnection as _;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool};
use diesel::sql_types::{Nullable, Text};
use diesel::{OptionalExtension as _, QueryableByName, RunQueryDsl as _, SqliteConnection};
use outbox_core::{Backlog, ClaimedBatch, RelayBatchOutcome, RelayStore, StoredMessage};

use super::now;
use crate::backend::{Backend as _, Database as _};
use crate::store::blocking;
use crate::{ClaimOrder, Error, Result, SqlitePool};

/// Per-connection settings SQLite needs under a pool: a busy timeout (so writers wait
/// for each other instead of failing with `SQLITE_BUSY`) and, by default, WAL mode (so
/// readers do not block the writer). The busy timeout does not cover a deferred
/// transaction that read before it writes: use `immediate_transaction` for those (see
/// the crate docs, "SQLite").
///
/// ```
/// use outbox_diesel::SqliteCustomizer;
/// let c = SqliteCustomizer::default();
/// assert_eq!(c.busy_timeout, std::time::Duration::from_secs(5));
/// assert!(c.wal);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqliteCustomizer {
    /// How long a statement waits for a lock held by another connection (default 5 s).
    pub busy_timeout: Duration,
    /// Switch the database to WAL mode with `synchronous = NORMAL` (default true).
    pub wal: bool,
}

impl Default for SqliteCustomizer {
    fn default() -> Self {
        Self {
            busy_timeout: Duration::from_secs(5),
            wal: true,
        }
    }
}

impl SqliteCustomizer {
    /// Sets the busy timeout.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Enables or disables WAL mode.
    pub fn wal(mut self, wal: bool) -> Self {
        self.wal = wal;
        self
    }
}

impl CustomizeConnection<SqliteConnection, diesel::r2d2::Error> for SqliteCustomizer {
    fn on_acquire(&self, conn: &mut SqliteConnection) -> Result<(), diesel::r2d2::Error> {
        let mut sql = format!("PRAGMA busy_timeout = {};", self.busy_timeout.as_millis());
        if self.wal {
            sql.push_str("PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;");
        }
        conn.batch_execute(&sql)
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

/// A pool of `max_size` connections to the SQLite database file `database_url`, with
/// the default [`SqliteCustomizer`]. (`:memory:` would give each connection its own
/// database: use a file.) Connections are not tested on check-out (r2d2's
/// `test_on_check_out`): a file does not drop connections.
pub fn sqlite_pool(database_url: &str, max_size: u32) -> Result<SqlitePool> {
    Ok(Pool::builder()
        .max_size(max_size)
        .test_on_check_out(false)
        .connection_customizer(Box::new(SqliteCustomizer::default()))
        .build(ConnectionManager::<SqliteConnection>::new(database_url))?)
}

/// The relay's store on SQLite. SQLite has no row locks, so one relay runs per database;
/// a second store on the same database fails with
/// [`Error::RelayAlreadyRunning`](crate::Error::RelayAlreadyRunning).
///
/// # How one relay is enforced
///
/// The store takes an exclusive OS lock (`flock`) on `<database file>.outbox-relay.lock`
/// when it is created and holds it until it is dropped. The kernel releases the lock
/// when the process ends, however it ends, so a relay killed with SIGKILL (or crashed)
/// is replaced at once: there is no lease to wait out. The file, which records the
/// holder's owner token for the error message, is created next to the database (its
/// directory must be writable, as WAL mode needs anyway) and left in place: deleting a
/// lock file that a relay holds would let a second relay lock a new file of the same
/// name. If it is removed or replaced all the same, the relay notices at its next claim
/// and stops: `Relay::run_until` returns [`outbox_core::Error::RelayConflict`] with
/// [`Error::LeaseLost`](crate::Error::LeaseLost). The lock works between processes of
/// one host and between stores of one process; SQLite itself needs its file on one host
/// (not a network file system).
///
/// A database without a file (`:memory:`, a `mode=memory` URI) lives in this process
/// only: there the store writes the `outbox_relay_lease` row once when it is created and
/// deletes it when dropped, so two stores of this process on one shared in-memory
/// database still exclude each other.
///
/// # What the relay writes
///
/// Nothing while it is idle: the claim is a plain read (the lock, not a write
/// transaction, keeps other relays away), so a poll that finds nothing takes no write
/// lock and cannot fail the application's transactions (see the crate docs, "SQLite").
/// Completing a batch that was published takes the write lock in a short immediate
/// transaction. The batch holds no database lock while it is being published, so
/// emitters are never blocked by a publish. Waiting for work polls.
#[derive(Debug)]
pub struct SqliteRelayStore {
    pool: SqlitePool,
    owner: String,
    hold: Hold,
    order: ClaimOrder,
}

/// What keeps other relays off the database while the store lives.
#[derive(Debug)]
enum Hold {
    /// The locked lock file (the lock goes with the open file).
    File { path: PathBuf, _file: File },
    /// The `outbox_relay_lease` row of a database without a file.
    Row,
}

impl SqliteRelayStore {
    /// The suffix of the lock file's name: `<database file>.outbox-relay.lock`.
    pub const LOCK_FILE_SUFFIX: &'static str = ".outbox-relay.lock";

    /// Takes the database's relay lock, or fails with
    /// [`Error::RelayAlreadyRunning`](crate::Error::RelayAlreadyRunning) if another
    /// live relay holds it, or [`Error::RelayLock`](crate::Error::RelayLock) if the
    /// lock file cannot be created.
    pub fn new(pool: SqlitePool) -> Result<Self> {
        let owner = format!("pid{}-{:016x}", std::process::id(), fastrand::u64(..));
        let mut conn = pool.get()?;
        let hold = match database_file(&mut conn)? {
            Some(db) => {
                let (path, file) = lock_file(Path::new(&db), &owner)?;
                Hold::File { path, _file: file }
            }
            None => {
                conn.immediate_transaction(|c| take_lease(c, &owner))?;
                Hold::Row
            }
        };
        drop(conn);
        Ok(Self {
            pool,
            owner,
            hold,
            order: ClaimOrder::default(),
        })
    }

    /// Sets the claim order (default [`ClaimOrder::PerKey`]). With one relay per
    /// database, id order is per-key order except across retries: the per-key mode holds
    /// back the later messages of a key whose older message waits for its retry time.
    #[must_use]
    pub fn with_order(mut self, order: ClaimOrder) -> Self {
        self.order = order;
        self
    }

    /// The claim order.
    pub fn order(&self) -> ClaimOrder {
        self.order
    }

    /// This relay's owner token, `pid<process id>-<random>`, as written to the lock file.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The lock file this store holds, or `None` for a database without a file.
    pub fn lock_file(&self) -> Option<&Path> {
        match &self.hold {
            Hold::File { path, .. } => Some(path),
            Hold::Row => None,
        }
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

/// Creates (if need be) and locks the lock file of the database file `db`, and writes
/// `owner` into it.
fn lock_file(db: &Path, owner: &str) -> Result<(PathBuf, File)> {
    // Through symlinks to the real file, so that every relay of the database names the
    // same lock file.
    let db = std::fs::canonicalize(db).unwrap_or_else(|_| db.to_path_buf());
    let mut name = db.into_os_string();
    name.push(SqliteRelayStore::LOCK_FILE_SUFFIX);
    let path = PathBuf::from(name);
    let io_error = |source| Error::RelayLock {
        path: path.clone(),
        source,
    };
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false) // it may be another relay's, still running
        .open(&path)
        .map_err(io_error)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            let holder = holder.trim();
            return Err(Error::RelayAlreadyRunning {
                owner: if holder.is_empty() { "unknown" } else { holder }.to_owned(),
                lock: path.display().to_string(),
            });
        }
        Err(TryLockError::Error(e)) => return Err(io_error(e)),
    }
    file.set_len(0)
        .and_then(|()| file.write_all(owner.as_bytes()))
        .map_err(io_error)?;
    Ok((path, file))
}

/// Whether the lock file at `path` is still the one `owner` locked: a removed or
/// replaced file is [`Error::LeaseLost`], as another relay may have locked its successor.
/// A read, so that an idle relay writes nothing.
fn check_lock(path: &Path, owner: &str) -> Result<()> {
    match std::fs::read_to_string(path) {
        Ok(now) if now == owner => Ok(()),
        Ok(now) => Err(Error::LeaseLost { owner: now }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::LeaseLost {
            owner: String::new(),
        }),
        Err(source) => Err(Error::RelayLock {
            path: path.to_path_buf(),
            source,
        }),
    }
}

impl Drop for SqliteRelayStore {
    fn drop(&mut self) {
        // A lock file is released with the file; the lease row must be deleted.
        if let Hold::Row = self.hold {
            let released = self
                .pool
                .get()
                .map_err(Into::into)
                .and_then(|mut c| release(&mut c, &self.owner));
            if let Err(e) = released {
                tracing::warn!(error = %outbox_core::error_chain(&e), "could not release the SQLite relay lease row");
            }
        }
    }
}

/// A batch claimed by [`SqliteRelayStore`]. It holds no database lock; the relay's lock
/// keeps other relays away. Dropping it leaves the rows NEW.
#[derive(Debug)]
pub struct SqliteBatch {
    pool: SqlitePool,
    messages: Vec<StoredMessage>,
}

impl RelayStore for SqliteRelayStore {
    type Batch = SqliteBatch;

    async fn claim(&self, limit: usize) -> Result<SqliteBatch, outbox_core::Error> {
        let pool = self.pool.clone();
        let lock = self
            .lock_file()
            .map(|p| (p.to_path_buf(), self.owner.clone()));
        let order = self.order;
        let messages = blocking(move || {
            if let Some((path, owner)) = lock {
                check_lock(&path, &owner)?;
            }
            // A plain read, outside any transaction: the relay's lock already keeps other
            // relays away, and a write lock taken here on every poll would fail other
            // connections' deferred transactions while the relay has nothing to do.
            let mut conn = pool.get()?;
            match order {
                ClaimOrder::PerKey => conn.db().claim_per_key(limit, &[], Default::default()),
                ClaimOrder::Unordered => conn.db().claim(limit, &[], 0),
            }
        })
        .await?;
        Ok(SqliteBatch {
            pool: self.pool.clone(),
            messages,
        })
    }

    async fn backlog(&self) -> Result<Backlog, outbox_core::Error> {
        let pool = self.pool.clone();
        Ok(blocking(move || crate::backlog(&mut pool.get()?)).await?)
    }
}

impl ClaimedBatch for SqliteBatch {
    fn messages(&self) -> &[StoredMessage] {
        &self.messages
    }

    async fn complete(self, outcome: RelayBatchOutcome) -> Result<(), outbox_core::Error> {
        if outcome.is_empty() {
            return Ok(());
        }
        let pool = self.pool;
        Ok(blocking(move || {
            pool.get()?
                .immediate_transaction(|c| crate::backend::complete(c.db(), &outcome))
        })
        .await?)
    }
}

#[derive(QueryableByName)]
struct DatabaseFile {
    #[diesel(sql_type = Nullable<Text>)]
    file: Option<String>,
}

/// The file of the connection's main database as SQLite resolved it (absolute), or
/// `None` for a database without one (`:memory:`, a shared-cache memory URI, a temporary
/// database).
fn database_file(conn: &mut SqliteConnection) -> Result<Option<String>> {
    let row = diesel::sql_query("SELECT file FROM pragma_database_list WHERE name = 'main'")
        .get_result::<DatabaseFile>(conn)
        .optional()?;
    Ok(row.and_then(|r| r.file).filter(|f| !f.is_empty()))
}

#[derive(QueryableByName)]
struct LeaseOwner {
    #[diesel(sql_type = Text)]
    owner: String,
}

/// Takes the relay lease row of a database without a file, inside the caller's
/// immediate transaction. Such a database lives and dies with this process, so the row
/// needs no heartbeat and no expiry: it is written once here and deleted by [`release`].
/// A row of another owner is [`Error::RelayAlreadyRunning`].
fn take_lease(conn: &mut SqliteConnection, owner: &str) -> Result<()> {
    let taken = diesel::sql_query(concat!(
        "INSERT INTO outbox_relay_lease (singleton, owner, heartbeat_at) VALUES (1, ?, ",
        now!(),
        ") ON CONFLICT (singleton) DO NOTHING"
    ))
    .bind::<Text, _>(owner)
    .execute(conn)?;
    if taken == 1 {
        return Ok(());
    }
    let holder = diesel::sql_query("SELECT owner FROM outbox_relay_lease WHERE singleton = 1")
        .get_result::<LeaseOwner>(conn)?
        .owner;
    Err(Error::RelayAlreadyRunning {
        owner: holder,
        lock: "the outbox_relay_lease row of this in-memory database".into(),
    })
}

/// Gives the lease up if `owner` holds it.
fn release(conn: &mut SqliteConnection, owner: &str) -> Result<()> {
    diesel::sql_query("DELETE FROM outbox_relay_lease WHERE owner = ?")
        .bind::<Text, _>(owner)
        .execute(conn)?;
    Ok(())
}
