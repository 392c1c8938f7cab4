#![doc = include_str!("../README.md")]
//!
//! ## Why pgwire-replication
//!
//! The transport was chosen between `pgwire-replication` 0.5 and `pg_walstream` 0.10:
//!
//! - **Confirming a commit's LSN.** pgwire-replication reports exactly the position we
//!   hand it (`update_applied_lsn`, monotonic) as the standby status update's write,
//!   flush and apply positions, and nothing else: its keepalive replies and idle status
//!   updates repeat that position, never the server's `wal_end`; `with_ack_lsn` keeps a
//!   resumed session from reporting its start position before we confirm anything. That
//!   is the at-least-once rule ("never ahead of Redis") with nothing to work around.
//!   pg_walstream keeps flushed and applied positions of its own that its snapshot and
//!   stream helpers also advance (`fetch_max` from several places), which we would have
//!   to keep away from.
//! - **Keepalives and liveness.** pgwire-replication answers reply requests at once,
//!   sends a status update at least every `status_interval` on an idle stream and while
//!   our side applies back-pressure (its event channel full during a broker outage), so
//!   `pg_stat_replication.reply_time` stays fresh for a live holder: what the takeover of
//!   a frozen holder relies on.
//! - **Holding the slot.** `wait_started` returns once the server accepted
//!   START_REPLICATION: from then on the slot is ours, and "active for PID" is a clean
//!   error before it.
//! - **TLS and auth.** Both have rustls; pgwire-replication's uses `ring` (no C++ or
//!   cmake build), pg_walstream's `aws-lc-rs`. pgwire-replication has SCRAM-SHA-256.
//! - **Maturity and fit.** pg_walstream does more (full decoding, snapshots, its own
//!   retry) at a larger surface; at the time of writing its 0.10 does not even resolve
//!   against this workspace's registry (it needs `webpki-roots` 1.0.11). The decoding
//!   pgwire-replication leaves to us is pgoutput's `Relation`, `Insert`, `Update`,
//!   `Delete` and `Truncate` messages in text format (`src/decode.rs`, unit-tested): the
//!   publication carries inserts, and updates, deletes and truncates so that a row
//!   changed, deleted or truncated by the transaction that inserted it is published as
//!   committed (issue 35).
//!
//! The version is pinned (`=0.5.0`): what a 0.x transport confirms, and when, is the
//! contract, so an upgrade is a reviewed change.
#![doc(test(attr(deny(warnings))))]

mod chores;
mod config;
mod decode;
mod deliver;
mod error;
mod heartbeat;
#[cfg(feature = "mysql")]
pub mod mysql;
mod park;
mod reader;
mod relay;
mod session;
mod setup;
mod store;
mod target;
mod watermark;

pub use config::{CdcConfig, DEFAULT_SLOT, MAX_BATCH_SIZE, MAX_INTERVAL};
pub use error::{CdcError, Result};
pub use relay::CdcRelay;
pub use setup::{
    CDC_TABLES_SQL, CdcMode, Lag, SetupReport, SlotState, SwitchReport, cdc_mode, check,
    check_server, lag, purge_relayed, recover_lost_slot, redrive, setup, switch_to_polling,
};
pub use target::ReplicationTarget;

/// The SQL pool the relay runs its queries on (r2d2 over diesel's `PgConnection`).
pub type PgPool = outbox_diesel::PgPool;
