//! `outbox relay`: the relay engine of `outbox-core` over the backend's relay store and
//! the broker URL's publisher (Redis Streams on one server, a cluster or through
//! Sentinel; NATS JetStream), until SIGINT or SIGTERM.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use diesel::{MysqlConnection, PgConnection};
use outbox_core::{Publisher, Relay, RelayConfig, RelayStore, RetryPolicy};
use outbox_diesel::{MysqlRelayStore, PgRelayStore, SqliteRelayStore};
use outbox_redis::{PublisherConfig, RedisPublisher};
use tokio::runtime::Runtime;
use tokio::signal::unix::{SignalKind, signal};

use crate::args::RelayArgs;
use crate::backend::{BackendKind, Database, with_conn};
use crate::broker::{Broker, BrokerKind, NatsServers};
use crate::error::CliError;

mod cdc;
mod nats;

/// How long the pool waits for a connection before reporting the database down.
const POOL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long blocking database work may take to finish once the relay has stopped.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Runs the relay until a signal; returns the error that stopped it otherwise.
pub(super) fn run(db: &Database, broker: &Broker, args: &RelayArgs) -> Result<(), CliError> {
    // Usage errors, reported before anything connects.
    if args.cdc && db.kind == BackendKind::Sqlite {
        return Err(CliError::CdcNotOnSqlite);
    }
    let publisher = Chosen::of(broker, args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    // Before anything that may take a while (connecting, building pools): a supervisor's
    // SIGTERM during start-up must end the relay with exit 0, not kill it.
    let started = Arc::new(AtomicBool::new(false));
    let stop = runtime
        .block_on(async { watch_signals(Arc::clone(&started)) })
        .map_err(CliError::Runtime)?;
    // One plain connection first: an unreachable database fails at once, not after the
    // pool's timeout, and --migrate runs on it.
    let mut conn = db.connect(args.migrate)?;
    if args.migrate {
        with_conn!(&mut conn, c => outbox_diesel::migrate(c))?;
    }
    // Missing tables fail here, with the hint to migrate, rather than as an outage the
    // relay would wait out forever.
    with_conn!(&mut conn, c => outbox_diesel::backlog(c))?;
    drop(conn);
    let stop = Stop { started, stop };
    let result = match publisher {
        Chosen::Redis(publisher) => relay_with(*publisher, &runtime, db, broker, args, stop),
        Chosen::Nats(servers, config) => runtime
            .block_on(nats::publisher(&servers, config, broker))
            .and_then(|publisher| relay_with(publisher, &runtime, db, broker, args, stop)),
    };
    runtime.shutdown_timeout(SHUTDOWN_GRACE);
    result
}

/// The publisher the broker URL asks for, checked before anything connects.
enum Chosen {
    /// To Redis, ready (boxed: it is large beside the other).
    Redis(Box<RedisPublisher>),
    /// To NATS, once connected (the client needs the runtime).
    Nats(NatsServers, outbox_nats::PublisherConfig),
}

impl Chosen {
    /// The publisher for `broker` with the options of `args`; options the broker
    /// cannot take are usage errors.
    fn of(broker: &Broker, args: &RelayArgs) -> Result<Self, CliError> {
        match broker.kind() {
            BrokerKind::Redis(_) => {
                let publisher =
                    broker
                        .publisher(publisher_config(broker, args)?)
                        .map_err(|source| CliError::BrokerConfig {
                            url: broker.display().to_owned(),
                            source,
                        })?;
                Ok(Self::Redis(Box::new(publisher)))
            }
            BrokerKind::Nats(servers) => Ok(Self::Nats(
                servers.clone(),
                nats::publisher_config(broker, args)?,
            )),
        }
    }
}

/// Runs the relay of the database's backend with `publisher` until a signal.
fn relay_with<P: Publisher>(
    publisher: P,
    runtime: &Runtime,
    db: &Database,
    broker: &Broker,
    args: &RelayArgs,
    stop: Stop,
) -> Result<(), CliError> {
    let config = config(args);
    log_start(db, broker, args);
    let parts = Parts {
        runtime,
        publisher,
        config,
        db,
        broker,
        args,
        stop,
    };
    match db.kind {
        BackendKind::Postgres if args.cdc => cdc::serve(parts),
        BackendKind::Postgres => {
            // Keepalives: a relay cut off from its database notices within a minute.
            let url = outbox_diesel::with_keepalives(&db.target);
            let store = PgRelayStore::new(pool::<PgConnection>(db, &url, args.pool_size)?)
                .with_listener(db.target.clone())
                .with_order(args.order.into())
                .with_stall_timeout(args.stall_timeout);
            serve(store, parts)
        }
        BackendKind::Mysql if args.cdc => cdc::serve_binlog(parts),
        BackendKind::Mysql => {
            let store =
                MysqlRelayStore::new(pool::<MysqlConnection>(db, &db.target, args.pool_size)?)
                    .with_order(args.order.into())
                    .with_stall_timeout(args.stall_timeout);
            serve(store, parts)
        }
        BackendKind::Sqlite => {
            let pool = outbox_diesel::sqlite_pool(&db.target, args.pool_size)
                .map_err(|source| pool_error(db, source))?;
            let store = SqliteRelayStore::new(pool)
                .map_err(|e| CliError::RelayStart(e.into()))?
                .with_order(args.order.into());
            serve(store, parts)
        }
    }
}

fn log_start(db: &Database, broker: &Broker, args: &RelayArgs) {
    tracing::info!(
        backend = %db.kind,
        database = %db.display(),
        broker = %broker.display(),
        topology = broker.topology_name(),
        durability = ?args.durability,
        stream_prefix = args.stream_prefix.as_deref().unwrap_or("(default)"),
        batch_size = args.batch_size,
        poll_interval = ?args.poll_interval,
        max_attempts = args.max_attempts,
        order = ?args.order,
        partitions = %partitions(args),
        "starting the relay"
    );
}

/// The `--partitions` given, as `a=2,b=4` (empty without any).
fn partitions(args: &RelayArgs) -> String {
    let given: Vec<String> = args
        .partitions
        .iter()
        .map(|p| format!("{}={}", p.topic, p.partitions))
        .collect();
    given.join(",")
}

/// Runs `store` → `publisher` on `runtime` until SIGINT or SIGTERM. The store is dropped
/// on return (which gives up the SQLite relay lock).
fn serve<S: RelayStore, P: Publisher>(store: S, parts: Parts<'_, P>) -> Result<(), CliError> {
    let Parts {
        runtime,
        publisher,
        config,
        db,
        broker,
        args,
        stop,
    } = parts;
    let relay = Relay::new(store, publisher)
        .with_config(config)
        .map_err(CliError::RelayStart)?;
    // A batch stuck in a lock wait or on a broker that does not answer must not hold the
    // process past its supervisor's grace period: dropping the batch rolls its claim
    // back, so its rows stay NEW for the next relay.
    let served = Served {
        runtime,
        db,
        broker,
        args,
        stop,
        running: "relay running; stop it with SIGINT or SIGTERM",
        given_up: "shutdown timeout reached; the batch in hand is released and stays NEW",
    };
    served.run(|shutdown| async move { relay.run_until(shutdown).await.map_err(CliError::Relay) })
}

/// What a relay (polling or CDC) is served with: the admin endpoint, the signals, and
/// the shutdown timeout.
struct Served<'a> {
    runtime: &'a Runtime,
    db: &'a Database,
    broker: &'a Broker,
    args: &'a RelayArgs,
    stop: Stop,
    /// Logged once the relay runs.
    running: &'static str,
    /// Logged when the shutdown timeout ends a relay that did not stop by itself: what
    /// becomes of the work in hand.
    given_up: &'static str,
}

impl Served<'_> {
    /// Starts the admin endpoint (with `--admin-addr`), then runs `relay`, which is
    /// handed the stop request (SIGINT or SIGTERM), until it returns, or until
    /// `--shutdown-timeout` after the stop request if it does not.
    fn run<F, R>(self, relay: F) -> Result<(), CliError>
    where
        F: FnOnce(std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) -> R,
        R: Future<Output = Result<(), CliError>>,
    {
        let Self {
            runtime,
            db,
            broker,
            args,
            stop,
            running,
            given_up,
        } = self;
        runtime.block_on(async {
            #[cfg(feature = "admin")]
            if let Some(addr) = args.admin_addr {
                crate::admin::serve(addr, db.clone(), broker.clone(), args.ready_max_age).await?;
            }
            #[cfg(not(feature = "admin"))]
            let _ = (db, broker);
            let mut stopping = stop.stop.clone();
            let mut stopped = stop.stop;
            let shutdown = Box::pin(async move {
                let _ = stopping.wait_for(|s| *s).await;
            });
            stop.started.store(true, Ordering::SeqCst);
            let timeout = args.shutdown_timeout;
            let deadline = async move {
                let _ = stopped.wait_for(|s| *s).await;
                tokio::time::sleep(timeout).await;
            };
            tracing::info!("{running}");
            tokio::select! {
                result = relay(shutdown) => result,
                () = deadline => {
                    tracing::warn!(?timeout, "{given_up}");
                    Ok(())
                }
            }
        })
    }
}

/// The Redis publisher's config from the arguments; refuses a topic given two counts,
/// and the NATS-only options.
fn publisher_config(broker: &Broker, args: &RelayArgs) -> Result<PublisherConfig, CliError> {
    let nats_only = [
        (args.subject_prefix.is_some(), "--subject-prefix"),
        (args.replicas.is_some(), "--replicas (Redis: --durability)"),
        (args.duplicate_window.is_some(), "--duplicate-window"),
        (args.max_age.is_some(), "--max-age"),
    ];
    if let Some((_, option)) = nats_only.into_iter().find(|(given, _)| *given) {
        return Err(CliError::BrokerOption {
            option,
            url: broker.display().to_owned(),
            applies_to: "NATS",
        });
    }
    let prefix = args.stream_prefix.as_deref();
    let mut config = PublisherConfig::default()
        .with_stream_prefix(prefix.unwrap_or(outbox_redis::DEFAULT_STREAM_PREFIX))
        .with_max_len(
            args.max_stream_len
                .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        )
        .with_durability(args.durability);
    for p in &args.partitions {
        // Two counts for one topic would leave which one wins to the order of the flags.
        if config.partitions.contains_key(&p.topic) {
            return Err(CliError::PartitionsTwice(p.topic.clone()));
        }
        config = config.with_partitions(p.topic.clone(), p.partitions);
    }
    Ok(config)
}

fn config(args: &RelayArgs) -> RelayConfig {
    RelayConfig::default()
        .with_batch_size(args.batch_size as usize)
        .with_poll_interval(args.poll_interval)
        .with_retry(RetryPolicy::default().with_max_attempts(args.max_attempts))
}

/// A pool of `size` connections to `url` (the database's, perhaps with parameters
/// added); errors name `db` with its password hidden. Connections are not tested on
/// check-out (a `SELECT 1` before each batch): one the server dropped fails its batch
/// instead, which the relay backs off from as from an outage, and the pool discards it.
///
/// A start that timed out without a single failed attempt is tried once more before it
/// is reported: the process itself was stopped (SIGSTOP, a paused VM) or starved while
/// its connections were being made, and the time ran out under it (the chaos run's
/// SIGSTOP during start-up made the relay exit). A database that refuses or fails the
/// attempts is reported after the first timeout, with what it said.
fn pool<C: R2D2Connection + 'static>(
    db: &Database,
    url: &str,
    size: u32,
) -> Result<Pool<ConnectionManager<C>>, CliError> {
    let build = || {
        Pool::builder()
            .max_size(size)
            .test_on_check_out(false)
            .connection_timeout(POOL_TIMEOUT)
            .build(ConnectionManager::new(url))
    };
    build()
        .or_else(|e| {
            // r2d2 tells a bare timeout only by its text: its error's cause is private.
            if e.to_string() != "timed out waiting for connection" {
                return Err(e);
            }
            tracing::warn!(
                "no connection to the database within {POOL_TIMEOUT:?}; trying once more"
            );
            build()
        })
        .map_err(|e| pool_error(db, e.into()))
}

fn pool_error(db: &Database, source: outbox_diesel::Error) -> CliError {
    CliError::Pool {
        backend: db.kind,
        url: db.display(),
        source,
    }
}

/// What the relay runs with, whatever its store and its broker.
struct Parts<'a, P> {
    runtime: &'a Runtime,
    publisher: P,
    config: RelayConfig,
    db: &'a Database,
    broker: &'a Broker,
    args: &'a RelayArgs,
    stop: Stop,
}

/// The stop request, and whether the relay has started (claims may be in hand).
struct Stop {
    started: Arc<AtomicBool>,
    stop: tokio::sync::watch::Receiver<bool>,
}

/// Installs the SIGINT and SIGTERM handlers (call it inside the runtime) and watches for
/// the first: before `started`, nothing is claimed yet and the process exits 0 at once
/// (it may be blocked connecting to a database that does not answer); after, the
/// returned channel turns true and the relay finishes the batch in hand.
fn watch_signals(started: Arc<AtomicBool>) -> std::io::Result<tokio::sync::watch::Receiver<bool>> {
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = interrupt.recv() => "SIGINT",
            _ = terminate.recv() => "SIGTERM",
        };
        if !started.load(Ordering::SeqCst) {
            tracing::info!(
                signal = name,
                "stopping during start-up; nothing was claimed"
            );
            std::process::exit(0);
        }
        tracing::info!(signal = name, "stopping: finishing the batch in hand");
        let _ = stop.send(true);
    });
    Ok(stopped)
}
