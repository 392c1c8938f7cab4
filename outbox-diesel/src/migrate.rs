use diesel::QueryableByName;
use diesel::sql_types::{Integer, Nullable};

use crate::backend::{Database, is_missing_table};
use crate::{OutboxConnection, Result};

/// A shipped migration: the SQL of one backend's `up.sql` and `down.sql`, the same text
/// as the files under `outbox-diesel/migrations/<backend>/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    /// The directory name of the migration (diesel's `<version>_<name>` form).
    pub name: &'static str,
    /// Creates the tables and indexes. Idempotent.
    pub up: &'static str,
    /// Drops them.
    pub down: &'static str,
}

pub(crate) const POSTGRES_UP: &str =
    include_str!("../migrations/postgres/2025-01-01-000000_outbox/up.sql");
pub(crate) const MYSQL_UP: &str =
    include_str!("../migrations/mysql/2025-01-01-000000_outbox/up.sql");
pub(crate) const SQLITE_UP: &str =
    include_str!("../migrations/sqlite/2025-01-01-000000_outbox/up.sql");

/// The PostgreSQL migration (`migrations/postgres/`).
pub const POSTGRES_MIGRATION: Migration = Migration {
    name: "2025-01-01-000000_outbox",
    up: POSTGRES_UP,
    down: include_str!("../migrations/postgres/2025-01-01-000000_outbox/down.sql"),
};

/// The MySQL / MariaDB migration (`migrations/mysql/`).
pub const MYSQL_MIGRATION: Migration = Migration {
    name: "2025-01-01-000000_outbox",
    up: MYSQL_UP,
    down: include_str!("../migrations/mysql/2025-01-01-000000_outbox/down.sql"),
};

/// The SQLite migration (`migrations/sqlite/`).
pub const SQLITE_MIGRATION: Migration = Migration {
    name: "2025-01-01-000000_outbox",
    up: SQLITE_UP,
    down: include_str!("../migrations/sqlite/2025-01-01-000000_outbox/down.sql"),
};

/// The migration version of the tables this release creates and works with. The
/// migration records it in the `outbox_migrations` table (one row per version); a later
/// release that changes the tables ships a migration that records a higher one.
pub const MIGRATION_VERSION: i32 = 1;

/// Creates the outbox tables and indexes on `conn`'s database (PostgreSQL: in the first
/// schema of the `search_path`) if they do not exist yet, and records
/// [`MIGRATION_VERSION`]. Safe to run at every start.
///
/// Tables migrated by a newer release (a higher version recorded) are left alone:
/// [`Error::SchemaTooNew`](crate::Error::SchemaTooNew), before any statement that could
/// change them (an older migration would, for instance, re-create an index the newer one
/// dropped).
///
/// The same SQL ships as plain files under `migrations/<backend>/` for users who
/// prefer to copy them into their own diesel migrations.
///
/// On PostgreSQL tables already partitioned by
/// [`migrate_partitioned`](crate::migrate_partitioned) get the partitioned migration
/// instead (idempotent as well), so a relay that migrates at start keeps the layout.
pub fn migrate<C: OutboxConnection>(conn: &mut C) -> Result<()> {
    check_version(conn)?;
    let sql = conn.db().migration_sql()?;
    conn.batch_execute(sql)?;
    Ok(())
}

/// Refuses tables a newer release migrated ([`Error::SchemaTooNew`](crate::Error::SchemaTooNew)).
pub(crate) fn check_version<C: OutboxConnection>(conn: &mut C) -> Result<()> {
    match migration_version(conn.db())? {
        Some(found) if found > MIGRATION_VERSION => Err(crate::Error::SchemaTooNew {
            found,
            supported: MIGRATION_VERSION,
        }),
        _ => Ok(()),
    }
}

/// The highest migration version recorded in `outbox_migrations`; `None` when the table
/// is missing (never migrated, or migrated before the table existed) or empty.
fn migration_version<D: Database>(conn: &mut D) -> Result<Option<i32>> {
    // In a transaction (a savepoint inside the caller's): on PostgreSQL a failed
    // statement would otherwise abort a transaction the caller has open.
    let version = conn.transaction(|c| {
        c.load_one::<VersionRow>("SELECT MAX(version) AS version FROM outbox_migrations")
    });
    match version {
        Ok(row) => Ok(row.version),
        Err(e) if is_missing_table(&e, "outbox_migrations") => Ok(None),
        Err(e) => Err(e.into()),
    }
}

#[derive(QueryableByName)]
struct VersionRow {
    #[diesel(sql_type = Nullable<Integer>)]
    version: Option<i32>,
}
