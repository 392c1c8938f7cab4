//! Reaching the services the examples run on, with an error that says which one is down,
//! where, and how to start it, instead of the driver's bare `Connection refused`.

use std::fmt;

use diesel::{Connection as _, PgConnection};
use outbox_core::redact_url;

/// `REDIS_URL`, or the local Redis.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// `DATABASE_URL`, or the local PostgreSQL database `test`.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A service the example needs that did not answer.
#[derive(Debug)]
pub struct Unreachable {
    /// The service: `Redis` or `PostgreSQL`.
    pub service: &'static str,
    /// Where it was looked for, password hidden.
    pub url: String,
    /// The environment variable that overrides the address.
    pub env: &'static str,
    /// What the driver said (first line only: the rest repeats it).
    pub cause: String,
}

impl fmt::Display for Unreachable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let service = match self.service {
            "PostgreSQL" => "postgres",
            _ => "redis",
        };
        write!(
            f,
            "{} is not reachable at {} ({})\n  start it with `bash scripts/services.sh` \
             (Debian/Ubuntu) or `docker compose up -d {service}`, or point {} at yours",
            self.service, self.url, self.cause, self.env
        )
    }
}

impl std::error::Error for Unreachable {}

fn first_line(e: &dyn fmt::Display) -> String {
    let text = e.to_string();
    text.lines().next().unwrap_or_default().trim().to_owned()
}

/// Connects to the Redis at `url` and checks that it answers a `PING`.
pub async fn redis(url: &str) -> Result<redis::aio::MultiplexedConnection, Unreachable> {
    let unreachable = |e: redis::RedisError| Unreachable {
        service: "Redis",
        url: redact_url(url),
        env: "REDIS_URL",
        cause: first_line(&e),
    };
    let mut conn = redis::Client::open(url)
        .map_err(unreachable)?
        .get_multiplexed_async_connection()
        .await
        .map_err(unreachable)?;
    let _: String = redis::cmd("PING")
        .query_async(&mut conn)
        .await
        .map_err(unreachable)?;
    Ok(conn)
}

/// Connects to the PostgreSQL database at `url`.
pub fn postgres(url: &str) -> Result<PgConnection, Unreachable> {
    PgConnection::establish(url).map_err(|e| Unreachable {
        service: "PostgreSQL",
        url: redact_url(url),
        env: "DATABASE_URL",
        cause: first_line(&e),
    })
}
