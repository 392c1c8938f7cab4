use crate::backend::Backend;

/// A diesel connection this crate works with: `PgConnection`, `MysqlConnection`,
/// `SqliteConnection` (per enabled feature), and r2d2 pooled connections of them.
///
/// Sealed: the backend-specific SQL behind [`Emit`](crate::Emit), the stores and the
/// operations functions is in a crate-private supertrait, so this trait can be named in
/// bounds but neither implemented nor have that SQL called outside this crate.
// `private_bounds`: the crate-private supertrait is the seal.
#[allow(private_bounds)]
pub trait OutboxConnection: diesel::Connection + Backend + Send + 'static {}

impl<C> OutboxConnection for diesel::r2d2::PooledConnection<diesel::r2d2::ConnectionManager<C>> where
    C: OutboxConnection + diesel::r2d2::R2D2Connection
{
}

#[cfg(feature = "postgres")]
impl OutboxConnection for diesel::PgConnection {}
#[cfg(feature = "mysql")]
impl OutboxConnection for diesel::MysqlConnection {}
#[cfg(feature = "sqlite")]
impl OutboxConnection for diesel::SqliteConnection {}
