//! Run with: cargo run -p outbox-harness --bin chaos_consumer -- --backend postgres --database-url URL --redis-url URL --stream-prefix PREFIX
//!
//! The consumer process of the chaos run (`bin/chaos/` starts several of them;
//! `outbox_harness::process` runs it): a
//! [`Consumer`] with the default [`ConsumerConfig`] (only
//! the stream prefix is set, and with `--partitions` / `--ordered` the partitions and
//! ordered mode), a diesel inbox (with `--async-inbox` the async inbox on diesel-async),
//! and the [`ApplyTick`] handler, which adds
//! each message's sequence number to a per-key sum in the dedup transaction. It stops on
//! SIGTERM or SIGINT, finishing the messages in hand, and then exits with 0. With
//! `--admin-addr` it serves the consumer's probes (`outbox_redis::health_router`).
//!
//! With `--nats-url` (instead of `--redis-url`) it is the NATS consumer
//! (`outbox_nats::Consumer`, a durable pull consumer of the group) with the same handler
//! and inbox; its connection is named `chaos-consumer-<pid>-nats`, which the run's
//! check that every consumer reads looks for. `--ordered` is its ordered mode.

use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use diesel::r2d2::R2D2Connection;
use diesel::{MysqlConnection, PgConnection};
use outbox_core::{OutboxEvent as _, Partitions};
use outbox_diesel::{AsyncPgInbox, DieselInbox, OutboxConnection};
use outbox_harness::chaos::{ApplyTick, ApplyTickAsync, ChaosDb, Tick};
use outbox_harness::process::{self, BoxError, Stop};
use outbox_redis::{Consumer, ConsumerConfig, ConsumerStats, OrderedConfig};

/// The chaos run's consumer process.
#[derive(Debug, Parser)]
struct Args {
    /// The database's kind.
    #[arg(long, value_enum)]
    backend: Backend,
    /// The database holding `consumed_msg` and the chaos tables.
    #[arg(long)]
    database_url: String,
    /// The Redis the relays publish to.
    #[arg(
        long,
        required_unless_present = "nats_url",
        conflicts_with = "nats_url"
    )]
    redis_url: Option<String>,
    /// The NATS server the relays publish to (`outbox relay --broker nats://…`).
    #[arg(long)]
    nats_url: Option<String>,
    /// NATS: copies of each message in the streams (the relays' `--replicas`).
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// NATS: the relays' `--subject-prefix`.
    #[arg(long, default_value = outbox_nats::DEFAULT_SUBJECT_PREFIX)]
    subject_prefix: String,
    /// The relays' `--stream-prefix`.
    #[arg(long)]
    stream_prefix: String,
    /// The consumer group.
    #[arg(long, default_value = "chaos")]
    group: String,
    /// About one message in N fails, and another one in N panics, on its first delivery
    /// (0: none).
    #[arg(long, default_value_t = 0)]
    fault_one_in: u64,
    /// Connections in the inbox's pool.
    #[arg(long, default_value_t = 4)]
    pool_size: u32,
    /// The relays' partition count of `chaos.tick` (1: one stream).
    #[arg(long, default_value_t = 1)]
    partitions: u32,
    /// An ordered consumer: one holder per partition, each key's messages in order.
    #[arg(long)]
    ordered: bool,
    /// The async inbox (`AsyncPgInbox` on diesel-async's pool) and an async handler
    /// instead of the blocking inbox: no blocking thread per message (PostgreSQL only).
    #[arg(long)]
    async_inbox: bool,
    /// Batch mode: up to N messages per transaction (`ConsumerConfig::batch_size`).
    #[arg(long)]
    batch_size: Option<usize>,
    /// Serve the consumer's `/healthz` (liveness) and `/readyz` (readiness) here
    /// (`outbox_redis::health_router`).
    #[arg(long, value_name = "ADDR")]
    admin_addr: Option<std::net::SocketAddr>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Backend {
    Postgres,
    Mysql,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.nats_url.is_some() {
        return process::main("chaos_consumer", |stop| async move {
            match (args.backend, args.async_inbox) {
                (Backend::Postgres, false) => nats::serve::<PgConnection>(&args, stop).await,
                (Backend::Mysql, false) => nats::serve::<MysqlConnection>(&args, stop).await,
                (Backend::Postgres, true) => nats::serve_async(&args, stop).await,
                (Backend::Mysql, true) => Err("--async-inbox runs on PostgreSQL only".into()),
            }
        });
    }
    process::main("chaos_consumer", |stop| async move {
        match (args.backend, args.async_inbox) {
            (Backend::Postgres, false) => serve::<PgConnection>(&args, stop).await,
            (Backend::Mysql, false) => serve::<MysqlConnection>(&args, stop).await,
            (Backend::Postgres, true) => serve_async(&args, stop).await,
            (Backend::Mysql, true) => Err("--async-inbox runs on PostgreSQL only".into()),
        }
    })
}

async fn serve<C>(args: &Args, stop: Stop) -> Result<ConsumerStats, BoxError>
where
    C: ChaosDb + OutboxConnection + R2D2Connection,
{
    let pool = process::pool::<C>(&args.database_url, args.pool_size).await?;
    let consumer = Consumer::builder(redis_url(args), args.group.as_str())
        .with_config(config(args)?)
        .handle::<Tick, _>(ApplyTick::<C>::new(args.fault_one_in))
        .idempotency(DieselInbox::new(pool))
        .build()?;
    process::run(&consumer, args.admin_addr, stop).await
}

/// [`serve`] on the async inbox: handlers await their statements on the dedup
/// transaction's `AsyncPgConnection`.
async fn serve_async(args: &Args, stop: Stop) -> Result<ConsumerStats, BoxError> {
    let inbox = AsyncPgInbox::connect(&args.database_url, args.pool_size as usize)?;
    let consumer = Consumer::builder(redis_url(args), args.group.as_str())
        .with_config(config(args)?)
        .handle_tx::<Tick, _>(ApplyTickAsync::new(args.fault_one_in))
        .idempotency_async(inbox)
        .build()?;
    process::run(&consumer, args.admin_addr, stop).await
}

fn redis_url(args: &Args) -> &str {
    args.redis_url.as_deref().unwrap_or_default()
}

/// The NATS consumer: the same handler and inboxes.
mod nats {
    use outbox_nats::{Consumer, ConsumerConfig, ConsumerStats, Naming};

    use super::*;

    pub(super) async fn serve<C>(args: &Args, stop: Stop) -> Result<ConsumerStats, BoxError>
    where
        C: ChaosDb + OutboxConnection + R2D2Connection,
    {
        let pool = process::pool::<C>(&args.database_url, args.pool_size).await?;
        let consumer = Consumer::builder(client(args).await?, args.group.as_str())
            .with_config(config(args)?)
            .handle::<Tick, _>(ApplyTick::<C>::new(args.fault_one_in))
            .idempotency(DieselInbox::new(pool))
            .build()?;
        process::run_nats(&consumer, args.admin_addr, stop).await
    }

    pub(super) async fn serve_async(args: &Args, stop: Stop) -> Result<ConsumerStats, BoxError> {
        let inbox = AsyncPgInbox::connect(&args.database_url, args.pool_size as usize)?;
        let consumer = Consumer::builder(client(args).await?, args.group.as_str())
            .with_config(config(args)?)
            .handle_tx::<Tick, _>(ApplyTickAsync::new(args.fault_one_in))
            .idempotency_async(inbox)
            .build()?;
        process::run_nats(&consumer, args.admin_addr, stop).await
    }

    /// A client that keeps (re)connecting, named after this process.
    async fn client(args: &Args) -> Result<outbox_nats::async_nats::Client, BoxError> {
        // `nats://h:p,h:p`: each server of a cluster.
        let url = args.nats_url.as_deref().unwrap_or_default();
        let hosts = url.strip_prefix("nats://").unwrap_or(url);
        let servers = hosts
            .split(',')
            .map(|h| format!("nats://{h}").parse())
            .collect::<Result<Vec<outbox_nats::async_nats::ServerAddr>, _>>()?;
        Ok(outbox_nats::async_nats::ConnectOptions::new()
            .name(format!("chaos-consumer-{}-nats", std::process::id()))
            .retry_on_initial_connect()
            .connect(servers)
            .await?)
    }

    /// The default config but for the prefixes, the partitions, ordered and batch mode.
    fn config(args: &Args) -> Result<ConsumerConfig, BoxError> {
        let naming = Naming::new(args.subject_prefix.as_str(), args.stream_prefix.as_str())?;
        let streams = outbox_nats::StreamSettings::default().with_replicas(args.replicas);
        let config = ConsumerConfig::default()
            .with_naming(naming)
            .with_streams(streams)
            .with_partitions(Tick::TOPICS[0], Partitions::new(args.partitions)?)
            .with_ordered(args.ordered);
        Ok(match args.batch_size {
            Some(n) => config.with_batch_size(n),
            None => config,
        })
    }
}

/// The default config but for the stream prefix, the partitions, ordered and batch mode.
fn config(args: &Args) -> Result<ConsumerConfig, BoxError> {
    let mut config = ConsumerConfig::default()
        .with_stream_prefix(args.stream_prefix.as_str())
        .with_partitions(Tick::TOPICS[0], Partitions::new(args.partitions)?)
        .with_batch_size(args.batch_size);
    if args.ordered {
        config = config.with_ordered(OrderedConfig::default());
    }
    Ok(config)
}
