//! Run with: cargo run -p outbox-harness --bin chaos_consumer -- --backend postgres --database-url URL --redis-url URL --stream-prefix PREFIX
//!
//! The consumer process of the chaos run (`bin/chaos/` starts several of them): a
//! [`Consumer`] with the default [`ConsumerConfig`] (only
//! the stream prefix is set, and with `--partitions` / `--ordered` the partitions and
//! ordered mode), a diesel inbox (with `--async-inbox` the async inbox on diesel-async),
//! and the [`ApplyTick`] handler, which adds
//! each message's sequence number to a per-key sum in the dedup transaction. It stops on
//! SIGTERM or SIGINT, finishing the messages in hand, and then exits with 0. With
//! `--admin-addr` it serves the consumer's probes (`outbox_redis::health_router`).

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use diesel::{MysqlConnection, PgConnection};
use outbox_core::{OutboxEvent as _, Partitions};
use outbox_diesel::{AsyncPgInbox, DieselInbox, OutboxConnection};
use outbox_harness::chaos::{ApplyTick, ApplyTickAsync, ChaosDb, Tick};
use outbox_redis::{Consumer, ConsumerConfig, ConsumerStore, OrderedConfig};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

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
    #[arg(long)]
    redis_url: String,
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
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: no runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let stopped = stop_signal()?;
        match (args.backend, args.async_inbox) {
            (Backend::Postgres, false) => serve::<PgConnection>(&args, stopped).await,
            (Backend::Mysql, false) => serve::<MysqlConnection>(&args, stopped).await,
            (Backend::Postgres, true) => serve_async(&args, stopped).await,
            (Backend::Mysql, true) => Err("--async-inbox runs on PostgreSQL only".into()),
        }
    });
    // Blocking database work still running (a handler stuck on a dead session) must not
    // hold the exit up for long.
    runtime.shutdown_timeout(Duration::from_secs(5));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", outbox_core::error_chain(&*e));
            ExitCode::FAILURE
        }
    }
}

/// A channel that turns true at the first SIGTERM or SIGINT. The handlers are installed
/// before anything else, so an early signal is not lost.
fn stop_signal() -> Result<watch::Receiver<bool>, BoxError> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        eprintln!("chaos_consumer: {name}: stopping");
        let _ = tx.send(true);
    });
    Ok(rx)
}

async fn wait_stop(mut stopped: watch::Receiver<bool>) {
    let _ = stopped.wait_for(|&s| s).await;
}

async fn serve<C>(args: &Args, stopped: watch::Receiver<bool>) -> Result<(), BoxError>
where
    C: ChaosDb + OutboxConnection + R2D2Connection,
{
    let manager = ConnectionManager::<C>::new(args.database_url.as_str());
    // r2d2 opens its first connections while building; a chaos run starts no consumer
    // while its database is down (its sessions get killed, its server may crash and
    // come back, with `--db-restart`).
    let size = args.pool_size;
    let pool = tokio::task::spawn_blocking(move || Pool::builder().max_size(size).build(manager))
        .await??;
    let consumer = Consumer::builder(args.redis_url.as_str(), args.group.as_str())
        .with_config(config(args)?)
        .handle::<Tick, _>(ApplyTick::<C>::new(args.fault_one_in))
        .idempotency(DieselInbox::new(pool))
        .build()?;
    run(&consumer, args, stopped).await
}

/// [`serve`] on the async inbox: handlers await their statements on the dedup
/// transaction's `AsyncPgConnection`.
async fn serve_async(args: &Args, stopped: watch::Receiver<bool>) -> Result<(), BoxError> {
    let inbox = AsyncPgInbox::connect(&args.database_url, args.pool_size as usize)?;
    let consumer = Consumer::builder(args.redis_url.as_str(), args.group.as_str())
        .with_config(config(args)?)
        .handle_tx::<Tick, _>(ApplyTickAsync::new(args.fault_one_in))
        .idempotency_async(inbox)
        .build()?;
    run(&consumer, args, stopped).await
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

/// Runs `consumer` until `stopped`, serving its probes on `--admin-addr`.
async fn run<S>(
    consumer: &Consumer<S>,
    args: &Args,
    stopped: watch::Receiver<bool>,
) -> Result<(), BoxError>
where
    S: ConsumerStore + 'static,
    S::Conn: 'static,
    Consumer<S>: Send + Sync,
{
    if let Some(addr) = args.admin_addr {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let app = outbox_redis::health_router(consumer.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("chaos_consumer: the admin endpoint stopped: {e}");
            }
        });
    }
    // `run_until` fails when Redis is unreachable at start (it creates the groups
    // first); a deployment restarts the process, here it waits for Redis itself.
    loop {
        let attempt = tokio::select! {
            () = wait_stop(stopped.clone()) => return Ok(()),
            r = consumer.ensure_groups() => r,
        };
        match attempt {
            Ok(()) => break,
            Err(e) if e.is_outage() => {
                eprintln!(
                    "chaos_consumer: Redis unreachable at start, retrying: {}",
                    outbox_core::error_chain(&e)
                );
                tokio::select! {
                    () = wait_stop(stopped.clone()) => return Ok(()),
                    () = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    consumer.run_until(wait_stop(stopped)).await?;
    eprintln!("chaos_consumer: stopped cleanly: {:?}", consumer.stats());
    Ok(())
}
