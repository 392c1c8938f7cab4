//! Reading the binlog: a `COM_BINLOG_DUMP` session from a GTID position, its events
//! grouped into commits, and the inserts into `outbox` decoded into messages.

use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::{FutureExt as _, StreamExt as _};
use mysql_async::binlog::EventType;
use mysql_async::binlog::events::{Event, EventData};
use mysql_async::prelude::Queryable as _;
use mysql_async::{BinlogStream, BinlogStreamRequest, Conn, Opts};
use outbox_core::StoredMessage;

use super::GtidPosition;
use super::change::{Layout, image, inserts_into_outbox};
use super::position::{MARIADB_GTID_EVENT, MariadbGtid};
use crate::{CdcError, Result};

/// The server error of a dump whose position the binlog no longer holds (purged), or
/// which it cannot serve otherwise (`ER_MASTER_FATAL_ERROR_READING_BINLOG`).
const ER_MASTER_FATAL_ERROR_READING_BINLOG: u16 = 1236;

/// MariaDB's compressed event types (`log_bin_compress`), which mysql_common cannot read.
const MARIADB_COMPRESSED_EVENTS: std::ops::RangeInclusive<u8> = 166..=171;

/// A transaction read from the binlog.
pub(crate) struct Commit {
    /// The position once this transaction is published.
    pub(crate) after: GtidPosition,
    /// When it committed (the GTID event's timestamp, whole seconds).
    pub(crate) time: DateTime<Utc>,
    pub(crate) messages: Vec<StoredMessage>,
    /// Rows that cannot be read: id, why. They become DEAD.
    pub(crate) unreadable: Vec<(i64, String)>,
    /// About how much memory `messages` take.
    pub(crate) bytes: usize,
    /// Once the transaction outgrew [`CdcConfig::transaction_memory`]: the ids of its
    /// rows in insert order (those of `messages` and `unreadable` moved here), read back
    /// from the table when it is published.
    ///
    /// [`CdcConfig::transaction_memory`]: crate::CdcConfig::transaction_memory
    pub(crate) spilled: Option<Vec<i64>>,
}

/// The transaction being read: its GTID and what it inserted so far.
struct Open {
    gtid: MariadbGtid,
    server: u32,
    commit: Commit,
}

/// A binlog dump from a position.
pub(crate) struct Binlog {
    stream: BinlogStream,
    /// The outbox's database (the relay's URL's).
    database: String,
    /// The position after the last transaction closed.
    position: GtidPosition,
    /// Where the dump started (for the error of a purged position).
    from: GtidPosition,
    open: Option<Open>,
    /// [`CdcConfig::transaction_memory`](crate::CdcConfig::transaction_memory).
    memory: usize,
}

impl Binlog {
    /// Starts a dump as replica `server_id` right after `from`, with a heartbeat event
    /// every `heartbeat` while the binlog is idle; a transaction past `memory` bytes is
    /// spilled.
    pub(crate) async fn open(
        opts: &Opts,
        server_id: u32,
        from: &GtidPosition,
        heartbeat: Duration,
        memory: usize,
    ) -> Result<Self> {
        let replication = |e: mysql_async::Error| CdcError::Replication(Box::new(e));
        let mut conn = Conn::new(opts.clone()).await.map_err(replication)?;
        // MariaDB's own events (GTID) instead of their MySQL stand-ins, and the start by
        // GTID: the server starts the dump after the transactions of `from`.
        conn.query_drop("SET @mariadb_slave_capability = 4")
            .await
            .map_err(replication)?;
        conn.exec_drop("SET @slave_connect_state = ?", (from.to_string(),))
            .await
            .map_err(replication)?;
        let nanos = u64::try_from(heartbeat.as_nanos()).unwrap_or(u64::MAX);
        conn.query_drop(format!("SET @master_heartbeat_period = {nanos}"))
            .await
            .map_err(replication)?;
        // The server's spelling of the URL's database, which the binlog's table maps
        // carry: under lower_case_table_names = 1 a URL's `Shop` is `shop` there, and a
        // comparison with the URL's spelling would pass every row by.
        let database: Option<String> = conn
            .query_first("SELECT DATABASE()")
            .await
            .map_err(replication)?
            .flatten();
        let database = database.unwrap_or_else(|| opts.db_name().unwrap_or_default().to_owned());
        let request = BinlogStreamRequest::new(server_id)
            .with_filename(b"")
            .with_pos(4);
        let stream = conn
            .get_binlog_stream(request)
            .await
            .map_err(|e| stream_error(e, from))?;
        Ok(Self {
            stream,
            database,
            position: from.clone(),
            from: from.clone(),
            open: None,
            memory,
        })
    }

    /// Waits for the next event and adds the transactions it closes to `ready`.
    pub(crate) async fn read(&mut self, ready: &mut Vec<Commit>) -> Result<()> {
        let ev = self.stream.next().await;
        self.handle(ev, ready)
    }

    /// Reads the events already received, without waiting, until `ready` holds `limit`
    /// messages or a spilled commit (published alone, read back from the table).
    pub(crate) fn read_ready(&mut self, ready: &mut Vec<Commit>, limit: usize) -> Result<()> {
        while ready.iter().map(|c| c.messages.len()).sum::<usize>() < limit
            && ready.last().is_none_or(|c| c.spilled.is_none())
        {
            let Some(ev) = self.stream.next().now_or_never() else {
                break;
            };
            self.handle(ev, ready)?;
        }
        Ok(())
    }

    /// The position after the last transaction read to its end.
    pub(crate) fn position(&self) -> &GtidPosition {
        &self.position
    }

    /// The time of the transaction being read, if one is.
    pub(crate) fn open_since(&self) -> Option<DateTime<Utc>> {
        self.open.as_ref().map(|o| o.commit.time)
    }

    fn handle(
        &mut self,
        ev: Option<mysql_async::Result<Event>>,
        ready: &mut Vec<Commit>,
    ) -> Result<()> {
        let ev = match ev {
            None => return Err(CdcError::Replication("the binlog dump ended".into())),
            Some(Err(e)) => return Err(stream_error(e, &self.from)),
            Some(Ok(ev)) => ev,
        };
        let header = ev.header();
        let raw = header.event_type_raw();
        if raw == MARIADB_GTID_EVENT {
            self.close_standalone(ready);
            self.refuse_unended()?;
            let gtid = MariadbGtid::read(ev.data())?;
            self.open = Some(Open {
                gtid,
                server: header.server_id(),
                commit: Commit {
                    after: GtidPosition::default(),
                    time: DateTime::from_timestamp(i64::from(header.timestamp()), 0)
                        .unwrap_or_default(),
                    messages: Vec::new(),
                    unreadable: Vec::new(),
                    bytes: 0,
                    spilled: None,
                },
            });
            return Ok(());
        }
        if MARIADB_COMPRESSED_EVENTS.contains(&raw) {
            return Err(CdcError::Decode(
                "a compressed binlog event (log_bin_compress = ON): set log_bin_compress = OFF"
                    .into(),
            ));
        }
        match header.event_type() {
            Ok(EventType::XID_EVENT) => self.close(ready),
            Ok(EventType::QUERY_EVENT) => match ev.read_data() {
                Ok(Some(EventData::QueryEvent(q))) => {
                    let query = q.query();
                    if query.trim().eq_ignore_ascii_case("COMMIT") {
                        self.close(ready);
                    } else if query.trim().eq_ignore_ascii_case("ROLLBACK") {
                        self.open = None; // rolled back: nothing of it is published
                    } else if inserts_into_outbox(&query, &q.schema(), &self.database) {
                        return Err(self.statement_logged());
                    }
                }
                Ok(_) => {}
                Err(e) => return Err(CdcError::Decode(format!("a query event: {e}"))),
            },
            Ok(EventType::HEARTBEAT_EVENT) => self.close_standalone(ready),
            Ok(
                EventType::WRITE_ROWS_EVENT
                | EventType::WRITE_ROWS_EVENT_V1
                | EventType::UPDATE_ROWS_EVENT
                | EventType::UPDATE_ROWS_EVENT_V1
                | EventType::DELETE_ROWS_EVENT
                | EventType::DELETE_ROWS_EVENT_V1,
            ) => self.rows(&ev)?,
            _ => {}
        }
        Ok(())
    }

    /// A group that wrote the outbox and was not ended by an XID or a `COMMIT` (an `XA
    /// PREPARE`, whose `XA COMMIT` comes later as a group of its own) is refused: its
    /// rows must not be skipped, and the relay cannot tell yet whether they commit. The
    /// position stays before it, so the relay stops here until switched to polling.
    fn refuse_unended(&self) -> Result<()> {
        match &self.open {
            Some(o) if o.commit.wrote_outbox() => Err(CdcError::Decode(format!(
                "transaction {}-{}-{} wrote the outbox and ended without a COMMIT the \
                     binlog relay can follow (an XA transaction?): it is not supported; its \
                     rows stay in the table: switch to polling to relay them",
                o.gtid.domain, o.server, o.gtid.seq
            ))),
            _ => Ok(()),
        }
    }

    /// The error of an insert into the outbox logged as a statement: its rows cannot
    /// be read from the binlog. The position stays before it.
    fn statement_logged(&self) -> CdcError {
        let gtid = self.open.as_ref().map_or_else(String::new, |o| {
            format!(" {}-{}-{}", o.gtid.domain, o.server, o.gtid.seq)
        });
        CdcError::Decode(format!(
            "transaction{gtid} inserted into the outbox in statement format (a session set \
             binlog_format to STATEMENT or MIXED): the binlog relay reads rows only; its \
             rows stay in the table: switch to polling to relay them"
        ))
    }

    /// Closes the open transaction: the position moves past it.
    fn close(&mut self, ready: &mut Vec<Commit>) {
        if let Some(Open {
            gtid,
            server,
            mut commit,
        }) = self.open.take()
        {
            self.position.advance(gtid.domain, server, gtid.seq);
            commit.after = self.position.clone();
            ready.push(commit);
        }
    }

    /// A standalone statement (DDL) has no XID or COMMIT: it ends where the next group
    /// starts, or at a heartbeat (the binlog is idle).
    fn close_standalone(&mut self, ready: &mut Vec<Commit>) {
        if self.open.as_ref().is_some_and(|o| o.gtid.standalone) {
            self.close(ready);
        }
    }

    /// The row changes of `outbox` in this database, folded into the open
    /// transaction (see [`Commit::apply`]).
    fn rows(&mut self, ev: &Event) -> Result<()> {
        let decode = |e: std::io::Error| CdcError::Decode(e.to_string());
        let Some(EventData::RowsEvent(rows)) = ev.read_data().map_err(decode)? else {
            return Ok(());
        };
        let tme = self.stream.get_tme(rows.table_id()).ok_or_else(|| {
            CdcError::Decode(format!(
                "rows of table {} before its table map",
                rows.table_id()
            ))
        })?;
        if tme.table_name() != "outbox" || tme.database_name() != self.database.as_str() {
            return Ok(());
        }
        let open = self
            .open
            .as_mut()
            .ok_or_else(|| CdcError::Decode("outbox rows outside a transaction".into()))?;
        let deletes = matches!(
            ev.header().event_type(),
            Ok(EventType::DELETE_ROWS_EVENT | EventType::DELETE_ROWS_EVENT_V1)
        );
        if deletes && !open.commit.wrote_outbox() {
            // A purge: none of the rows is one this transaction inserted.
            return Ok(());
        }
        let gtid = format!("{}-{}-{}", open.gtid.domain, open.server, open.gtid.seq);
        let (mut before_layout, mut after_layout) = (None, None);
        for row in rows.rows(tme) {
            let (before, after) = row.map_err(decode)?;
            let before_layout = before
                .as_ref()
                .map(|b| &*before_layout.get_or_insert_with(|| Layout::of(b)));
            let after_layout = after
                .as_ref()
                .map(|a| &*after_layout.get_or_insert_with(|| Layout::of(a)));
            let (before, after) = (before.map(image), after.map(image));
            open.commit.apply(
                &gtid,
                before_layout.zip(before.as_ref()),
                after_layout.zip(after.as_ref()),
                self.memory,
            )?;
        }
        Ok(())
    }

    /// Ends the dump.
    pub(crate) async fn close_stream(self) {
        let _ = tokio::time::timeout(Duration::from_secs(5), self.stream.close()).await;
    }
}

/// A dump's error: [`CdcError::PositionLost`] when the server says the binlog holding
/// the position is gone (error 1236 with MariaDB's "purged" text), another error 1236
/// (an event over `max_allowed_packet`, a truncated binlog, a position ahead of the
/// server) [`CdcError::BinlogUnreadable`] with the server's message, else a replication
/// outage.
fn stream_error(e: mysql_async::Error, from: &GtidPosition) -> CdcError {
    match &e {
        mysql_async::Error::Server(s) if s.code == ER_MASTER_FATAL_ERROR_READING_BINLOG => {
            fatal_read_error(&s.message, from)
        }
        _ => CdcError::Replication(Box::new(e)),
    }
}

/// Error 1236 by its message: only MariaDB's "Could not find GTID state requested by
/// slave in any binlog files. Probably ... required binlog files have been purged." (and
/// the file-position dump's "purged" text) means the position is gone for good.
fn fatal_read_error(message: &str, from: &GtidPosition) -> CdcError {
    let lower = message.to_ascii_lowercase();
    let purged = lower.contains("could not find gtid state") || lower.contains("purged");
    if purged {
        CdcError::PositionLost {
            position: from.to_string(),
            reason: message.to_owned(),
        }
    } else {
        CdcError::BinlogUnreadable {
            position: from.to_string(),
            reason: message.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fatal(message: &str) -> CdcError {
        let from: GtidPosition = "0-1-5".parse().expect("a GTID position");
        stream_error(
            mysql_async::Error::Server(mysql_async::ServerError {
                code: ER_MASTER_FATAL_ERROR_READING_BINLOG,
                message: message.into(),
                state: "HY000".into(),
            }),
            &from,
        )
    }

    #[test]
    fn only_a_purged_binlog_is_a_lost_position() {
        let purged = fatal(
            "Could not find GTID state requested by slave in any binlog files. Probably the \
             slave state is too old and required binlog files have been purged.",
        );
        assert!(matches!(purged, CdcError::PositionLost { .. }), "{purged}");
        for other in [
            "log event entry exceeded max_allowed_packet; Increase max_allowed_packet on master",
            "binlog truncated in the middle of event; consider out of disk space on master",
            "Error: connecting slave requested to start from GTID 0-1-99, which is not in \
             the master's binlog",
        ] {
            let e = fatal(other);
            match &e {
                CdcError::BinlogUnreadable { reason, .. } => assert_eq!(reason, other),
                _ => panic!("{other}: {e:?}"),
            }
            assert!(!e.is_outage(), "{other}");
        }
    }
}
