//! Run with: cargo run -p outbox-examples --bin transfer
//!
//! The reference scenario on real services: PostgreSQL and Redis (pass `--sqlite` for
//! SQLite and Redis). A transfer commits the balance change and its message together; a
//! refused transfer leaves none; the relay's first two publish attempts fail and the third
//! succeeds; the message reaches the consumer twice and is applied once.
//!
//! `DATABASE_URL` and `REDIS_URL` override the local defaults. The example works in its
//! own schema (`outbox_example`) or temporary SQLite file and its own streams
//! (`outbox-example:*`), which it resets on each run.

use diesel::connection::SimpleConnection as _;
use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use diesel::{Connection as _, PgConnection};
use outbox_diesel::{OutboxConnection, PgRelayStore, SqliteRelayStore};
use outbox_examples::scenario::{self, BoxError};
use outbox_examples::sql::{Bank, SETUP_SQL};

const SCHEMA: &str = "outbox_example";
const STREAM_PREFIX: &str = "outbox-example:";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    reset_streams(&redis_url).await?;
    let say = |line: String| println!("{line}");
    if std::env::args().any(|a| a == "--sqlite") {
        let path = std::env::temp_dir().join("outbox-example.db");
        let _ = std::fs::remove_file(&path);
        let pool = outbox_diesel::sqlite_pool(&path.to_string_lossy(), 4)?;
        prepare(&pool)?;
        println!("SQLite {} + Redis {redis_url}\n", path.display());
        let store = SqliteRelayStore::new(pool.clone())?;
        scenario::run(pool, store, &redis_url, STREAM_PREFIX, say).await?;
    } else {
        let base = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        PgConnection::establish(&base)?.batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; CREATE SCHEMA {SCHEMA}"
        ))?;
        let sep = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{sep}options=-c%20search_path%3D{SCHEMA}");
        let pool = Pool::builder()
            .max_size(4)
            .build(ConnectionManager::<PgConnection>::new(&url))?;
        prepare(&pool)?;
        println!("PostgreSQL (schema {SCHEMA}) + Redis {redis_url}\n");
        let store = PgRelayStore::new(pool.clone()).with_listener(url);
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
    let mut conn = redis::Client::open(redis_url)?
        .get_multiplexed_async_connection()
        .await?;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{STREAM_PREFIX}*"))
        .query_async(&mut conn)
        .await?;
    if !keys.is_empty() {
        let () = redis::cmd("DEL").arg(keys).query_async(&mut conn).await?;
    }
    Ok(())
}
