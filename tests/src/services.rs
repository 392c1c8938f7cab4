//! Where the shared services are: the URLs come from the environment, with the local
//! defaults of `scripts/services.sh` and `compose.yaml`.

/// `DATABASE_URL`, or the local PostgreSQL database `test`.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// `MYSQL_URL`, or the local MariaDB database `test`.
pub fn mysql_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// `REDIS_URL`, or the local Redis.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// `NATS_URL`, or the local NATS server (with JetStream).
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}
