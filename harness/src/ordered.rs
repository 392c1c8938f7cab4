//! Ordered consumers over partitioned streams, as processes: the handler and the config
//! of `bin/ordered_consumer.rs` and of `tests/tests/ordered_consumers.rs` (the process
//! itself is [`process`]'s, shared with `bin/chaos_consumer.rs`).
//!
//! Each [`Tick`] (topic `chaos.tick`, ordering key `key`) carries its key's sequence
//! number. The [`ApplyInOrder`] handler, in the consumer's PostgreSQL dedup transaction,
//! checks that it follows the last sequence number applied for its key, records a
//! violation when it does not (nothing is hidden), and records the application. Some
//! first deliveries fail (or panic) on purpose.

use std::time::Duration;

use clap::Parser;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use outbox_core::{Delivery, Handler, HandlerError, OutboxEvent, Partitions};
use outbox_diesel::PgInbox;
use outbox_redis::{Consumer, ConsumerConfig, ConsumerStats, OrderedConfig};

use crate::chaos::{HandlerFault, Tick, handler_fault};
use crate::process::{self, BoxError, Stop};

/// The tables of the run (PostgreSQL): the last sequence number applied per key, every
/// application, and every one out of order.
pub const POSTGRES_SETUP: &str = "
    CREATE TABLE ordered_last (k VARCHAR(32) PRIMARY KEY, seq BIGINT NOT NULL);
    CREATE TABLE ordered_log (id BIGSERIAL PRIMARY KEY, k VARCHAR(32) NOT NULL,
                              seq BIGINT NOT NULL, consumer VARCHAR(128) NOT NULL);
    CREATE TABLE ordered_violations (id BIGSERIAL PRIMARY KEY, k VARCHAR(32) NOT NULL,
                                     seq BIGINT NOT NULL, last BIGINT NOT NULL);
";

/// The ordered consumer process's settings.
#[derive(Debug, Clone, Parser)]
pub struct Args {
    /// The PostgreSQL database holding `consumed_msg` and the tables of
    /// [`POSTGRES_SETUP`].
    #[arg(long)]
    pub database_url: String,
    /// The Redis the ticks are published to.
    #[arg(long)]
    pub redis_url: String,
    /// The producers' stream prefix.
    #[arg(long)]
    pub stream_prefix: String,
    /// The consumer group.
    #[arg(long, default_value = "ordered")]
    pub group: String,
    /// The partitions of `chaos.tick`.
    #[arg(long, default_value_t = 8)]
    pub partitions: u32,
    /// About one first delivery in N fails, and another one in N panics (0: none).
    #[arg(long, default_value_t = 0)]
    pub fault_one_in: u64,
    /// The lease TTL.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub lease_ttl: Duration,
    /// Batch mode with this batch size (default: one transaction per message).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Connections in the inbox's pool (and messages in flight).
    #[arg(long, default_value_t = 4)]
    pub pool_size: u32,
}

/// Applies a [`Tick`] in order (see the module's documentation), in the dedup
/// transaction.
pub struct ApplyInOrder {
    fault_one_in: u64,
    consumer: String,
}

#[derive(QueryableByName)]
struct Last {
    #[diesel(sql_type = BigInt)]
    seq: i64,
}

impl Handler<Tick> for ApplyInOrder {
    type Conn = PgConnection;

    fn handle(
        &self,
        tick: Tick,
        conn: &mut PgConnection,
        d: &Delivery,
    ) -> Result<(), HandlerError> {
        let msg_id = d.envelope.msg_id.as_str();
        if d.delivery_count == 1 {
            match handler_fault(msg_id, self.fault_one_in) {
                Some(HandlerFault::Fail) => {
                    return Err(HandlerError::msg(format!(
                        "{msg_id} fails on its first delivery"
                    )));
                }
                Some(HandlerFault::Panic) => panic!("{msg_id} panics on its first delivery"),
                None => {}
            }
        }
        let last = diesel::sql_query("SELECT seq FROM ordered_last WHERE k = $1 FOR UPDATE")
            .bind::<Text, _>(&tick.key)
            .get_result::<Last>(conn)
            .optional()?
            .map_or(0, |l| l.seq);
        if tick.seq != last + 1 {
            diesel::sql_query("INSERT INTO ordered_violations (k, seq, last) VALUES ($1, $2, $3)")
                .bind::<Text, _>(&tick.key)
                .bind::<BigInt, _>(tick.seq)
                .bind::<BigInt, _>(last)
                .execute(conn)?;
        }
        diesel::sql_query(
            "INSERT INTO ordered_last (k, seq) VALUES ($1, $2) \
             ON CONFLICT (k) DO UPDATE SET seq = EXCLUDED.seq",
        )
        .bind::<Text, _>(&tick.key)
        .bind::<BigInt, _>(tick.seq)
        .execute(conn)?;
        diesel::sql_query("INSERT INTO ordered_log (k, seq, consumer) VALUES ($1, $2, $3)")
            .bind::<Text, _>(&tick.key)
            .bind::<BigInt, _>(tick.seq)
            .bind::<Text, _>(&self.consumer)
            .execute(conn)?;
        Ok(())
    }
}

impl Args {
    /// Parses `args` (without the program's name) as the command line would.
    pub fn from_args(args: impl IntoIterator<Item = String>) -> Result<Self, String> {
        Self::try_parse_from(std::iter::once("ordered_consumer".to_owned()).chain(args))
            .map_err(|e| e.to_string())
    }
}

/// Runs an ordered consumer of `chaos.tick` until the first SIGTERM or SIGINT (whose
/// handlers are installed before anything else, so an early signal is not lost), then
/// returns its counts.
pub async fn run_until_signal(args: &Args) -> Result<ConsumerStats, BoxError> {
    serve(args, Stop::on_signal("ordered_consumer")?).await
}

/// Runs an ordered consumer of `chaos.tick` until `stop`, then returns its counts.
pub async fn serve(args: &Args, stop: Stop) -> Result<ConsumerStats, BoxError> {
    let pool = process::pool::<PgConnection>(&args.database_url, args.pool_size).await?;
    let name = consumer_name();
    let consumer = Consumer::builder(args.redis_url.as_str(), args.group.as_str())
        .with_config(config(args)?.with_consumer_name(name.as_str()))
        .handle::<Tick, _>(ApplyInOrder {
            fault_one_in: args.fault_one_in,
            consumer: name,
        })
        .idempotency(PgInbox::new(pool))
        .build()?;
    process::run(&consumer, None, stop).await
}

/// Ordered mode with the lease TTL, the partitions and batch mode, as many messages in
/// flight as the pool has connections, and blocking reads of 0.5 s.
fn config(args: &Args) -> Result<ConsumerConfig, BoxError> {
    Ok(ConsumerConfig::default()
        .with_stream_prefix(args.stream_prefix.as_str())
        .with_partitions(Tick::TOPICS[0], Partitions::new(args.partitions)?)
        .with_batch_size(args.batch_size)
        .with_max_in_flight(args.pool_size as usize)
        .with_block(Duration::from_millis(500))
        .with_ordered(OrderedConfig::default().with_lease_ttl(args.lease_ttl)))
}

/// A consumer name of its own: `ordered-<host>-<pid>-<random>`. The PID alone is 1 in
/// every container, where all consumers would then share one name and count as one
/// member of the group; the host and a random suffix tell them apart.
pub fn consumer_name() -> String {
    format!(
        "ordered-{}-{}-{:08x}",
        host_name(),
        std::process::id(),
        fastrand::u32(..)
    )
}

/// This machine's (or container's) host name, or `host`.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_owned())
}

#[cfg(test)]
mod tests {
    #[test]
    fn consumers_of_one_pid_get_names_of_their_own() {
        let (a, b) = (super::consumer_name(), super::consumer_name());
        assert_ne!(a, b);
        assert!(a.starts_with("ordered-") && a.len() <= 128, "{a}");
    }
}
