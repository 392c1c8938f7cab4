//! The log's own limit: the same backlog streamed from a slot of its own to a client
//! that only counts the inserted rows, with the relay's replication client and settings,
//! no decoding and no broker. No relay reading this server's log over this connection
//! drains faster; the CDC relay's drain is read against it.

use std::time::Instant;

use diesel::{PgConnection, RunQueryDsl as _};
use pgwire_replication::{ReplicationClient, ReplicationConfig, ReplicationEvent};

use crate::BoxError;

/// The slot the log is read from alone, beside the relay's.
pub(super) const SLOT: &str = "bench_log_alone";

/// Creates [`SLOT`] (dropping one a failed run left): the log from here on is read
/// again by [`read_alone`].
pub(super) fn mark(conn: &mut PgConnection) -> Result<(), BoxError> {
    release(conn)?;
    diesel::sql_query(format!(
        "SELECT 1 FROM pg_create_logical_replication_slot('{SLOT}', 'pgoutput')"
    ))
    .execute(conn)?;
    Ok(())
}

/// Drops [`SLOT`] if it exists, once its reader let it go.
pub(super) fn release(conn: &mut PgConnection) -> Result<(), BoxError> {
    for _ in 0..100 {
        let dropped = diesel::sql_query(format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE slot_name = '{SLOT}'"
        ))
        .execute(conn);
        match dropped {
            Ok(_) => return Ok(()),
            // Still active: the WAL sender of the last read is exiting.
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(50)),
        }
    }
    Err(format!("the slot {SLOT} stayed active").into())
}

/// Streams [`SLOT`] through `publication` until `n` inserted rows arrived: rows/s, from
/// the first row to the last (as the relay's drain is timed from its first publish).
pub(super) async fn read_alone(url: &str, publication: &str, n: usize) -> Result<f64, BoxError> {
    let url = url::Url::parse(url)?;
    let config = ReplicationConfig::new(
        url.host_str().unwrap_or("localhost"),
        url.username(),
        url.password().unwrap_or_default(),
        url.path().trim_start_matches('/'),
        SLOT,
        publication,
    )
    .with_port(url.port().unwrap_or(5432))
    .with_options("-c datestyle=ISO -c timezone=UTC");
    let mut client = ReplicationClient::connect(config).await?;
    let (mut rows, mut first) = (0, None);
    while rows < n {
        match client.recv().await? {
            Some(ReplicationEvent::XLogData { data, .. }) if data.first() == Some(&b'I') => {
                first.get_or_insert_with(Instant::now);
                rows += 1;
            }
            Some(_) => {}
            None => return Err("the log's stream ended before the backlog did".into()),
        }
    }
    let took = first.map_or(0.0, |t| t.elapsed().as_secs_f64());
    let _ = client.shutdown().await;
    Ok(n as f64 / took)
}
