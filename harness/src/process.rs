//! The consumer process, once for the harness's two: `bin/chaos_consumer.rs` (the chaos
//! run's, handler [`ApplyTick`](crate::chaos::ApplyTick)) and `bin/ordered_consumer.rs`
//! (with `tests/tests/ordered_consumers.rs`, handler
//! [`ApplyInOrder`](crate::ordered::ApplyInOrder)). What differs is a parameter: the
//! handler, the inbox and the [`ConsumerConfig`](outbox_redis::ConsumerConfig); the rest
//! is here: the runtime, the stop on SIGTERM or SIGINT, the inbox's pool, the probes,
//! the wait for Redis at start.

use std::future::Future;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use outbox_redis::{Consumer, ConsumerStats, ConsumerStore};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

/// The error of a consumer process.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Turns true at the process's first SIGTERM or SIGINT.
#[derive(Debug, Clone)]
pub struct Stop {
    stopped: watch::Receiver<bool>,
    /// The process's name, for its log.
    name: &'static str,
}

impl Stop {
    /// Installs the handlers (before anything else, so that an early signal is not
    /// lost).
    pub fn on_signal(name: &'static str) -> Result<Self, BoxError> {
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let (tx, rx) = watch::channel(false);
        tokio::spawn(async move {
            let signal = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            eprintln!("{name}: {signal}: stopping");
            let _ = tx.send(true);
        });
        Ok(Self { stopped: rx, name })
    }

    /// Completes at the signal.
    pub async fn wait(mut self) {
        let _ = self.stopped.wait_for(|&s| s).await;
    }
}

/// A consumer process's `main`: logs to stderr, runs `serve` until it returns on a
/// two-thread runtime, then exits with 0, or 1 on an error (printed).
pub fn main<F, Fut, T>(name: &'static str, serve: F) -> ExitCode
where
    F: FnOnce(Stop) -> Fut,
    Fut: Future<Output = Result<T, BoxError>>,
    T: std::fmt::Debug,
{
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
    let result = runtime.block_on(async { serve(Stop::on_signal(name)?).await });
    // Blocking database work still running (a handler stuck on a dead session) must not
    // hold the exit up for long.
    runtime.shutdown_timeout(Duration::from_secs(5));
    match result {
        Ok(stats) => {
            eprintln!("{name}: stopped cleanly: {stats:?}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {}", outbox_core::error_chain(&*e));
            ExitCode::FAILURE
        }
    }
}

/// The inbox's r2d2 pool of `size` connections to `url`. r2d2 opens its first
/// connections while building, off the runtime; a chaos run starts no consumer while its
/// database is down (its sessions get killed, its server may crash and come back).
pub async fn pool<C: R2D2Connection + 'static>(
    url: &str,
    size: u32,
) -> Result<Pool<ConnectionManager<C>>, BoxError> {
    let manager = ConnectionManager::<C>::new(url);
    Ok(
        tokio::task::spawn_blocking(move || Pool::builder().max_size(size).build(manager))
            .await??,
    )
}

/// Runs `consumer` until `stop`, serving its probes on `admin_addr`; its counts.
pub async fn run<S>(
    consumer: &Consumer<S>,
    admin_addr: Option<SocketAddr>,
    stop: Stop,
) -> Result<ConsumerStats, BoxError>
where
    S: ConsumerStore + 'static,
    S::Conn: 'static,
    Consumer<S>: Send + Sync,
{
    if let Some(addr) = admin_addr {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let app = outbox_redis::health_router(consumer.clone());
        let name = stop.name;
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("{name}: the admin endpoint stopped: {e}");
            }
        });
    }
    if wait_for_redis(consumer, &stop).await? {
        consumer.run_until(stop.wait()).await?;
    }
    Ok(consumer.stats())
}

/// Runs the NATS `consumer` until `stop`, serving its probes on `admin_addr`
/// (`/healthz`: live, `/readyz`: ready, as [`outbox_nats::ConsumerHealth`] says); its
/// counts. The NATS consumer waits for the server by itself.
pub async fn run_nats<I>(
    consumer: &outbox_nats::Consumer<I>,
    admin_addr: Option<SocketAddr>,
    stop: Stop,
) -> Result<outbox_nats::ConsumerStats, BoxError>
where
    I: ConsumerStore + 'static,
    I::Conn: 'static,
    outbox_nats::Consumer<I>: Send + Sync,
{
    if let Some(addr) = admin_addr {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let app = outbox_nats::health_router(consumer.clone());
        let name = stop.name;
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("{name}: the admin endpoint stopped: {e}");
            }
        });
    }
    consumer.run_until(stop.wait()).await?;
    Ok(consumer.stats())
}

/// `run_until` fails when Redis is unreachable at start (it creates the groups first);
/// a deployment restarts the process, here it waits for Redis itself. False if stopped
/// meanwhile.
async fn wait_for_redis<S>(consumer: &Consumer<S>, stop: &Stop) -> Result<bool, BoxError>
where
    S: ConsumerStore + 'static,
{
    loop {
        let attempt = tokio::select! {
            () = stop.clone().wait() => return Ok(false),
            r = consumer.ensure_groups() => r,
        };
        match attempt {
            Ok(()) => return Ok(true),
            Err(e) if e.is_outage() => {
                eprintln!(
                    "{}: Redis unreachable at start, retrying: {}",
                    stop.name,
                    outbox_core::error_chain(&e)
                );
                tokio::select! {
                    () = stop.clone().wait() => return Ok(false),
                    () = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}
