//! [`Backend`] for r2d2's pooled connections: each method runs on the inner connection,
//! so that a backend's own methods (not the defaults) run for its pooled connections.

use std::time::Duration;

use diesel::r2d2::{ConnectionManager, PooledConnection, R2D2Connection};
use diesel::result::QueryResult;
use outbox_core::{Backlog, Envelope, RelayBatchOutcome, Status, StoredMessage};

use super::{Backend, BacklogRow, Dialect, RecordRow, VersionRow};
use crate::{EmitOptions, OutboxRow, Result};

impl<C> Backend for PooledConnection<ConnectionManager<C>>
where
    C: Backend + R2D2Connection + 'static,
{
    const __MIGRATION: &'static str = C::__MIGRATION;
    const DIALECT: Dialect = C::DIALECT;

    fn load_records(&mut self, sql: &str, bind: Option<&str>) -> QueryResult<Vec<RecordRow>> {
        (**self).load_records(sql, bind)
    }
    fn run_sql(&mut self, sql: &str, bind: Option<&str>) -> QueryResult<usize> {
        (**self).run_sql(sql, bind)
    }
    fn backlog_row(&mut self) -> QueryResult<BacklogRow> {
        (**self).backlog_row()
    }
    fn version_row(&mut self) -> QueryResult<VersionRow> {
        (**self).version_row()
    }
    fn topic_rows(&mut self) -> QueryResult<Vec<super::TopicRow>> {
        (**self).topic_rows()
    }
    fn minute_rows(&mut self, minutes: u32) -> QueryResult<Vec<super::MinuteRow>> {
        (**self).minute_rows(minutes)
    }
    fn parked_relay_rows(&mut self) -> QueryResult<Option<Vec<super::ParkedRow>>> {
        (**self).parked_relay_rows()
    }
    fn __insert(&mut self, options: &EmitOptions, envelopes: &[Envelope]) -> Result<()> {
        (**self).__insert(options, envelopes)
    }
    fn __begin_claim(&mut self) -> Result<()> {
        (**self).__begin_claim()
    }
    fn __begin_bounded_claim(&mut self, stall: Duration) -> Result<()> {
        (**self).__begin_bounded_claim(stall)
    }
    fn __claim_per_key_sql(limit: usize, held: &[i64]) -> String {
        C::__claim_per_key_sql(limit, held)
    }
    fn __key_probe_sql(ids: &[i64]) -> String {
        C::__key_probe_sql(ids)
    }
    fn __claim_per_key(
        &mut self,
        limit: usize,
        held: &[i64],
        floor: crate::backend::Floor,
    ) -> Result<Vec<StoredMessage>> {
        (**self).__claim_per_key(limit, held, floor)
    }
    fn __insert_consumed(&mut self, group: &str, msg_id: &str) -> Result<bool> {
        (**self).__insert_consumed(group, msg_id)
    }
    fn __insert_consumed_batch(
        &mut self,
        group: &str,
        msg_ids: &[&str],
    ) -> Result<Option<std::collections::HashSet<String>>> {
        (**self).__insert_consumed_batch(group, msg_ids)
    }
    fn __delete_consumed(&mut self, group: &str, msg_id: &str) -> Result<()> {
        (**self).__delete_consumed(group, msg_id)
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
    fn __forget_if_lost(&mut self) {
        (**self).__forget_if_lost();
    }
    fn __claim_sql(limit: usize) -> String {
        C::__claim_sql(limit)
    }
    fn __claim(&mut self, limit: usize, held: &[i64], floor: i64) -> Result<Vec<StoredMessage>> {
        (**self).__claim(limit, held, floor)
    }
    fn __mark_sent(&mut self, ids: &[i64]) -> Result<()> {
        (**self).__mark_sent(ids)
    }
    fn __complete(&mut self, outcome: &RelayBatchOutcome) -> Result<()> {
        (**self).__complete(outcome)
    }
    fn __mark_sent_and_commit(&mut self, ids: &[i64]) -> Result<()> {
        (**self).__mark_sent_and_commit(ids)
    }
    fn __backlog(&mut self) -> Result<Backlog> {
        (**self).__backlog()
    }
    fn __list(
        &mut self,
        status: Option<Status>,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<OutboxRow>> {
        (**self).__list(status, after_id, limit)
    }
    fn __find(&mut self, msg_id: &str) -> Result<Option<OutboxRow>> {
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
    fn __migration_sql(&mut self) -> Result<&'static str> {
        (**self).__migration_sql()
    }
    fn __migration_version(&mut self) -> Result<Option<i32>> {
        (**self).__migration_version()
    }
}
