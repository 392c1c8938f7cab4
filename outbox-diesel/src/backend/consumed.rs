//! The consumers' dedup insert: one statement type for every database, worded by each.

use diesel::RunQueryDsl;
use diesel::backend::Backend;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::result::QueryResult;
use diesel::serialize::ToSql;
use diesel::sql_types::{HasSqlType, Text};

/// The dedup row of one message for one group, inserted unless it is there: 1 row
/// inserted, or 0 and no error, so the consumer's transaction goes on. Its text is the
/// same for every message, so each connection prepares (or caches) it once.
pub(crate) struct ConsumedInsert<'a> {
    pub(crate) group: &'a str,
    pub(crate) msg_id: &'a str,
}

/// How a database words [`ConsumedInsert`] around its two binds (the group, then the
/// msg_id).
pub(crate) trait ConsumedSql {
    /// Up to the first bind.
    const HEAD: &'static str;
    /// After the second bind.
    const TAIL: &'static str;
}

impl QueryId for ConsumedInsert<'_> {
    type QueryId = ConsumedInsert<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<DB> QueryFragment<DB> for ConsumedInsert<'_>
where
    DB: Backend + ConsumedSql + HasSqlType<Text>,
    str: ToSql<Text, DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql(DB::HEAD);
        out.push_bind_param::<Text, str>(self.group)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, str>(self.msg_id)?;
        out.push_sql(DB::TAIL);
        Ok(())
    }
}

impl<Conn> RunQueryDsl<Conn> for ConsumedInsert<'_> {}
