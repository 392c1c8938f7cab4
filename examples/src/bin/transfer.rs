//! Run with: cargo run -p outbox-examples --bin transfer
//!
//! The reference scenario on real services: SQLite and Redis by default, so the local
//! Redis is the one server it needs (pass `--postgres` for PostgreSQL and Redis). A
//! transfer commits the balance change and its message together; a refused transfer
//! leaves none; the relay's first two publish attempts fail and the third succeeds; the
//! message reaches the consumer twice and is applied once.
//!
//! `REDIS_URL` and (with `--postgres`) `DATABASE_URL` override the local defaults. The
//! example works in its own temporary SQLite file or PostgreSQL schema (`outbox_example`)
//! and its own streams (`outbox-example:*`), which it resets on each run. A service that
//! cannot be reached is named with its address and how to start it.

use std::process::ExitCode;

use diesel::PgConnection;
use diesel::connection::SimpleConnection as _;
use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use outbox_diesel::{OutboxConnection, PgRelayStore, SqliteRelayStore};
use outbox_examples::scenario::{self, BoxError};
use outbox_examples::services;
use outbox_examples::sql::{Bank, SETUP_SQL};

const SCHEMA: &str = "outbox_example";
const STREAM_PREFIX: &str = "outbox-example:";

#[tokio::main]
async fn main() -> ExitCode {
    let postgres = std::env::args().skip(1).any(|a| a == "--postgres");
    match run(postgres).await {
        Ok(()) => ExitCode::SUCCESS,
        // Display, not Debug: the service errors are written to be read.
        Err(e) => {
            eprintln!("error: {}", outbox_core::error_chain(&*e));
            ExitCode::FAILURE
        }
    }
}

async fn run(postgres: bool) -> Result<(), BoxError> {
    let redis_url = services::redis_url();
    reset_streams(&redis_url).await?;
    let say = |line: String| println!("{line}");
    if postgres {
        let base = services::database_url();
        services::postgres(&base)?.batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; CREATE SCHEMA {SCHEMA}"
        ))?;
        let sep = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{sep}options=-c%20search_path%3D{SCHEMA}");
        let pool = Pool::builder()
            .max_size(4)
            .build(ConnectionManager::<PgConnection>::new(&url))?;
        prepare(&pool)?;
        println!(
            "PostgreSQL (schema {SCHEMA}) + Redis {}\n",
            outbox_core::redact_url(&redis_url)
        );
        let store = PgRelayStore::new(pool.clone()).with_listener(url);
        scenario::run(pool, store, &redis_url, STREAM_PREFIX, say).await?;
    } else {
        let path = std::env::temp_dir().join("outbox-example.db");
        let _ = std::fs::remove_file(&path);
        let pool = outbox_diesel::sqlite_pool(&path.to_string_lossy(), 4)?;
        prepare(&pool)?;
        println!(
            "SQLite {} + Redis {}\n",
            path.display(),
            outbox_core::redact_url(&redis_url)
        );
        let store = SqliteRelayStore::new(pool.clone())?;
        scenario::run(pool, store, &redis_url, STREAM_PREFIX, say).await?;
    }
    Ok(())
}

fn prepare<C: Bank + OutboxConnection + R2D2Connection>(
    pool: &Pool<ConnectionManager<C>>,
) -> Result<(), BoxError> {
    let mut conn = pool.get()?;
    outbox_diesel::migrate(&mut *conn)?;
    conn.batch_execute(SETUP_SQL)?;
    Ok(())
}

async fn reset_streams(redis_url: &str) -> Result<(), BoxError> {
    let mut conn = services::redis(redis_url).await?;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{STREAM_PREFIX}*"))
        .query_async(&mut conn)
        .await?;
    if !keys.is_empty() {
        let () = redis::cmd("DEL").arg(keys).query_async(&mut conn).await?;
    }
    Ok(())
}
