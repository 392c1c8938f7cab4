//! Run with: cargo run -p outbox-examples --features async-service --bin async_service [-- --serve]
//!
//! An async service in one process, on diesel-async end to end: an axum endpoint
//! (`POST /orders/{id}/pay`) marks an order paid and emits `OrderPaid` in one
//! diesel-async transaction; a relay publishes it to Redis; a consumer on the async inbox
//! (`AsyncPgInbox`) creates the shipment in the dedup transaction, with the handler's
//! writes on the transaction's `&mut AsyncPgConnection` — no blocking thread per message.
//!
//! Without `--serve` it sends one demo request to itself, waits for the shipment, shuts
//! everything down and exits with 0 (so CI can run it). With `--serve` it serves on
//! `--addr` until Ctrl-C. Needs PostgreSQL (`DATABASE_URL`) and Redis (`REDIS_URL`).

use std::process::ExitCode;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use clap::Parser;
use diesel::sql_types::Text;
use diesel_async::{AsyncConnection as _, AsyncPgConnection, RunQueryDsl as _};
use outbox_core::{AsyncTxHandler, Delivery, HandlerError, OutboxEvent, Relay};
use outbox_diesel::{AsyncEmit as _, AsyncPgInbox, AsyncPool, PgRelayStore};
use outbox_examples::services::{self, database_url, redis_url};
use outbox_redis::{Consumer, ConsumerConfig, PublisherConfig, RedisPublisher};
use tokio::sync::watch;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The stream prefix and consumer group of this example, apart from the others'.
const PREFIX: &str = "async_service:";
const GROUP: &str = "shipping";

#[derive(Parser)]
struct Args {
    /// Serve until Ctrl-C instead of running one demo request.
    #[arg(long)]
    serve: bool,
    /// Where to serve with `--serve` (the demo binds a free local port).
    #[arg(long, default_value = "127.0.0.1:3000")]
    addr: String,
}

#[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "order.paid")]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
}

/// The endpoint: the business update and the emit in one diesel-async transaction.
async fn pay(
    State(pool): State<AsyncPool<AsyncPgConnection>>,
    Path(order_id): Path<String>,
) -> Result<StatusCode, (StatusCode, String)> {
    let failed = |e: &dyn std::fmt::Display| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    let mut conn = pool.get().await.map_err(|e| failed(&e))?;
    let paid = conn
        .transaction(async |c| {
            let updated = diesel::sql_query(
                "UPDATE orders SET status = 'paid' WHERE id = $1 AND status = 'new'",
            )
            .bind::<Text, _>(&order_id)
            .execute(c)
            .await?;
            if updated == 1 {
                c.emit(OrderPaid {
                    order_id: order_id.clone(),
                })
                .await?;
            }
            Ok::<_, outbox_diesel::Error>(updated == 1)
        })
        .await
        .map_err(|e| failed(&outbox_core::error_chain(&e)))?;
    if paid {
        Ok(StatusCode::ACCEPTED)
    } else {
        Err((StatusCode::CONFLICT, "no such unpaid order".into()))
    }
}

/// The consumer's handler: the shipment, written in the dedup transaction.
struct Ship;

impl AsyncTxHandler<OrderPaid> for Ship {
    type Conn = AsyncPgConnection;

    async fn handle(
        &self,
        e: OrderPaid,
        conn: &mut AsyncPgConnection,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        diesel::sql_query("INSERT INTO shipments (order_id) VALUES ($1)")
            .bind::<Text, _>(&e.order_id)
            .execute(conn)
            .await?;
        tracing::info!(order = %e.order_id, "shipment created");
        Ok(())
    }
}

/// The outbox tables and the example's own, on a blocking connection at start-up.
fn prepare(url: &str) -> Result<(), BoxError> {
    use diesel::connection::SimpleConnection as _;
    let mut conn = services::postgres(url)?;
    outbox_diesel::migrate(&mut conn)?;
    conn.batch_execute(
        "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, status TEXT NOT NULL);
         CREATE TABLE IF NOT EXISTS shipments (order_id TEXT PRIMARY KEY);",
    )?;
    Ok(())
}

async fn run(args: Args) -> Result<(), BoxError> {
    let (db, redis) = (database_url(), redis_url());
    {
        let db = db.clone();
        tokio::task::spawn_blocking(move || prepare(&db)).await??;
    }
    // One diesel-async pool for the endpoint and the consumer's inbox.
    let inbox = AsyncPgInbox::connect(&db, 8)?;
    let pool = inbox.pool().clone();
    let (stop, stopped) = watch::channel(false);
    let until_stopped = move || {
        let mut stopped = stopped.clone();
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        }
    };

    let publisher = RedisPublisher::new(redis.as_str())?
        .with_config(PublisherConfig::default().with_stream_prefix(PREFIX))?;
    let relay = Relay::new(PgRelayStore::connect(&db, 2)?, publisher);
    let relay = tokio::spawn({
        let until = until_stopped();
        async move { relay.run_until(until).await }
    });

    let consumer = Consumer::builder(redis.as_str(), GROUP)
        .with_config(ConsumerConfig::default().with_stream_prefix(PREFIX))
        .handle_tx::<OrderPaid, _>(Ship)
        .idempotency_async(inbox)
        .build()?;
    let consuming = tokio::spawn({
        let (consumer, until) = (consumer.clone(), until_stopped());
        async move { consumer.run_until(until).await }
    });

    let app = Router::new()
        .route("/orders/{id}/pay", post(pay))
        .with_state(pool.clone());
    let addr = if args.serve {
        args.addr.as_str()
    } else {
        "127.0.0.1:0"
    };
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let serving = tokio::spawn({
        let until = until_stopped();
        async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(until)
                .await
        }
    });
    println!("serving on http://{local}");

    if args.serve {
        tokio::signal::ctrl_c().await?;
    } else {
        demo(&pool, local).await?;
    }
    let _ = stop.send(true);
    serving.await??;
    consuming.await??;
    relay.await??;
    println!("stopped cleanly: {:?}", consumer.stats());
    Ok(())
}

/// One order, paid through the endpoint; returns once its shipment exists.
async fn demo(
    pool: &AsyncPool<AsyncPgConnection>,
    addr: std::net::SocketAddr,
) -> Result<(), BoxError> {
    let order = format!("o-{:08x}", fastrand::u32(..));
    let mut conn = pool.get().await?;
    diesel::sql_query("INSERT INTO orders (id, status) VALUES ($1, 'new')")
        .bind::<Text, _>(&order)
        .execute(&mut conn)
        .await?;
    let status = post_empty(addr, &format!("/orders/{order}/pay")).await?;
    println!("POST /orders/{order}/pay -> {status}");
    if !status.starts_with("HTTP/1.1 202") {
        return Err(format!("the endpoint answered {status}").into());
    }
    let shipped = async {
        loop {
            let n = diesel::sql_query("SELECT order_id FROM shipments WHERE order_id = $1")
                .bind::<Text, _>(&order)
                .execute(&mut conn)
                .await?;
            if n == 1 {
                return Ok::<_, diesel::result::Error>(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), shipped)
        .await
        .map_err(|_| "no shipment within 30 s: is the relay or the consumer stuck?")??;
    println!("order {order}: paid, relayed, shipped");
    Ok(())
}

/// A bodiless `POST` over a plain TCP connection; returns the status line.
async fn post_empty(addr: std::net::SocketAddr, path: &str) -> Result<String, BoxError> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    Ok(response.lines().next().unwrap_or_default().to_owned())
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
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: no runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", outbox_core::error_chain(&*e));
            ExitCode::FAILURE
        }
    }
}
