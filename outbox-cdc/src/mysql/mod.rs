//! The CDC relay on MySQL's and MariaDB's binlog (feature `mysql`): the same contract as
//! the PostgreSQL relay, read from a binlog dump instead of a replication slot.
//!
//! What it shares with the PostgreSQL relay: the publishing in commit order through the
//! [`Publisher`](outbox_core::Publisher) with the failure path (refused messages parked
//! per key in `outbox_cdc_parked`, retried with backoff, DEAD past the limit), the
//! validation of a row into a message, the `outbox_cdc` tables (CDC mode, the backfill,
//! the report) and the polling relay's refusal to run in CDC mode
//! (`outbox_diesel::MysqlRelayStore`).
//!
//! What differs, because the binlog has no slot:
//!
//! - **The position is the relay's.** The GTID position after the last transaction whose
//!   messages the broker took is stored in `outbox_cdc.gtid_position` (at-least-once, as
//!   the slot's confirmation is); a relay resumes from it with `@slave_connect_state`.
//! - **One reader** by a named lock (`GET_LOCK`, [`CdcConfig::slot`](crate::CdcConfig)
//!   names it) held on a session of its own, which the server releases when the
//!   holder's connection dies; a waiting relay ends the session of a holder silent for
//!   `takeover_after`. Each relay reads as a replica with its own `server_id`.
//! - **Retention is the server's**: a binlog purged before the relay read it is
//!   [`CdcError::PositionLost`](crate::CdcError::PositionLost), recovered by
//!   [`recover_lost_position`] with a backfill.
//!
//! MariaDB 10.5+ only for now: MySQL 8's GTIDs (`uuid:n` sets) are not read yet.
//!
//! ## Why mysql_async 0.36
//!
//! Its `binlog` feature (mysql_common's binlog parser) is the one maintained Rust reader
//! of the row-based binlog, and the findings of docs/cdc.md ("MySQL and MariaDB") were
//! made with it. 0.36.2 is the release diesel-async 0.9 (this workspace's async MySQL
//! emit) already depends on, so the workspace builds one MySQL client, not two; its
//! binlog API is the same as 0.37's. MariaDB's own events that mysql_common does not
//! parse (the GTID event) are read from the raw event (`position.rs`).
//!
//! ## One URL for the emit and the relay
//!
//! diesel's MySQL connection (libmysqlclient) reads TLS and the socket from `ssl_mode`,
//! `ssl_ca`, `ssl_cert`, `ssl_key` and `unix_socket`; mysql_async, which reads the
//! binlog, names them differently (`require_ssl`, `verify_ca`, `socket`, ...) and refuses
//! a parameter it does not know. The relay takes diesel's, so the application's one URL
//! (its emit's, `outbox relay`'s) serves here too; mysql_async's own still pass through.
//! TLS runs on rustls with aws-lc-rs (installed as the process's crypto provider unless the
//! application installed one first). `ssl_mode` as libmysqlclient means it:
//!
//! | `ssl_mode`        | The relay's sessions                                               |
//! |-------------------|--------------------------------------------------------------------|
//! | `DISABLED`        | no TLS                                                             |
//! | `PREFERRED`       | no TLS: mysql_async cannot fall back, so ask for `REQUIRED`         |
//! | `REQUIRED`        | TLS, the server's certificate not checked                          |
//! | `VERIFY_CA`       | TLS, the certificate checked against `ssl_ca` (or the web's roots) |
//! | `VERIFY_IDENTITY` | as `VERIFY_CA`, and the host name too                              |
//!
//! `ssl_ca` alone means `VERIFY_CA`, as MariaDB's client library takes it; a bad value is
//! [`CdcError::Url`](crate::CdcError::Url).

mod binlog;
mod change;
mod lag;
mod park;
mod position;
mod relay;
mod retention;
mod rows;
mod setup;
mod url;
mod watermark;

pub use lag::{BinlogLag, connect, lag};
pub use position::GtidPosition;
pub use relay::MysqlCdcRelay;
pub use retention::purge_relayed;
pub use setup::{
    MYSQL_CDC_TABLES_SQL, cdc_mode, check_server, recover_lost_position, setup, switch_to_polling,
};
