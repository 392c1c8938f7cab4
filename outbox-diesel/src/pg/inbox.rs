//! The consumers' dedup rows (`consumed_msg`).

use diesel::RunQueryDsl;
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::result::QueryResult;
use diesel::sql_types::{Array, Text};

use crate::backend::ConsumedSql;

/// `INSERT INTO consumed_msg .. ON CONFLICT DO NOTHING`, prepared once per connection.
impl ConsumedSql for Pg {
    const HEAD: &'static str = "INSERT INTO consumed_msg (consumer_group, msg_id) VALUES (";
    const TAIL: &'static str = ") ON CONFLICT DO NOTHING";
}

/// The dedup rows of a whole batch in one statement, prepared once per connection (the
/// ids travel as one array, so the text is the same for every batch size):
/// `INSERT .. SELECT $1, unnest($2) ON CONFLICT DO NOTHING RETURNING msg_id`, the new
/// ones. The caller passes the ids sorted: two consumers inserting overlapping batches
/// then take the rows' locks in the same order and cannot deadlock on them.
pub(super) struct ConsumedInsertBatch<'a> {
    pub(super) group: &'a str,
    pub(super) msg_ids: &'a [&'a str],
}

impl QueryId for ConsumedInsertBatch<'_> {
    type QueryId = ConsumedInsertBatch<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl Query for ConsumedInsertBatch<'_> {
    type SqlType = Text;
}

impl QueryFragment<Pg> for ConsumedInsertBatch<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("INSERT INTO consumed_msg (consumer_group, msg_id) SELECT ");
        out.push_bind_param::<Text, str>(self.group)?;
        out.push_sql(", m FROM unnest(");
        out.push_bind_param::<Array<Text>, [&str]>(self.msg_ids)?;
        out.push_sql(") AS m ON CONFLICT DO NOTHING RETURNING msg_id");
        Ok(())
    }
}

impl<Conn> RunQueryDsl<Conn> for ConsumedInsertBatch<'_> {}

/// `DELETE FROM consumed_msg ..` of one dedup row, prepared once per connection.
pub(super) struct ConsumedDelete<'a> {
    pub(super) group: &'a str,
    pub(super) msg_id: &'a str,
}

impl QueryId for ConsumedDelete<'_> {
    type QueryId = ConsumedDelete<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl QueryFragment<Pg> for ConsumedDelete<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("DELETE FROM consumed_msg WHERE consumer_group = ");
        out.push_bind_param::<Text, str>(self.group)?;
        out.push_sql(" AND msg_id = ");
        out.push_bind_param::<Text, str>(self.msg_id)?;
        Ok(())
    }
}

impl<Conn> RunQueryDsl<Conn> for ConsumedDelete<'_> {}
