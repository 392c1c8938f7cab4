//! The one test-support library of the workspace: every crate's tests (and the
//! end-to-end suites in `tests/tests/`) take their generic helpers from here. It depends
//! on no outbox crate, so each of them can dev-depend on it; helpers that need a crate's
//! types (diesel pools, Redis connections, test events) stay in that crate's
//! `tests/fixtures/` module.
//!
//! - [`services`]: the URLs of the shared PostgreSQL, MariaDB and Redis (environment,
//!   or the local defaults).
//! - [`names`]: [`unique`] names for schemas, databases, files, streams and groups.
//! - [`isolated`]: an [`Isolated`] PostgreSQL schema, MariaDB database or SQLite file
//!   per test, removed on drop; a [`MariadbUser`] with a password.
//! - [`scratch_redis`]: private `redis-server`s: [`ScratchRedis`] to stop and restart
//!   (a broker outage), [`PasswordRedis`] to refuse a wrong password.
//! - [`scratch_postgres`]: [`ScratchPostgres`], a private PostgreSQL that requires a
//!   password.
//! - [`secrets`]: [`assert_hidden`], no password in an error or its sources.
//! - [`http`]: [`http_get`], a plain HTTP/1.1 GET for the relay's admin endpoints.
//! - [`ports`]: free loopback ports, waiting for a server to listen.
//! - [`wait`]: [`wait_until`] / [`eventually`] (async), polling a condition with a timeout and a
//!   message that says what never happened.
//! - [`plans`]: reading `EXPLAIN` output, for the tests that check a query's index.
//! - [`on_every_backend!`]: one `#[test]` per backend for each scenario, in a module
//!   named after the backend.
//!
//! Service tests fail, never skip, when a service is unreachable.

pub mod backends;
pub mod http;
pub mod isolated;
pub mod names;
pub mod plans;
pub mod ports;
pub mod scratch_postgres;
pub mod scratch_redis;
pub mod secrets;
pub mod services;
pub mod wait;

pub use http::{HttpResponse, http_get};
pub use isolated::{Engine, Isolated, MariadbUser, mariadb, psql};
pub use names::{unique, unique_prefix};
pub use scratch_postgres::ScratchPostgres;
pub use scratch_redis::{PasswordRedis, ScratchRedis};
pub use secrets::assert_hidden;
pub use services::{database_url, mysql_url, redis_url};
pub use wait::{
    PATIENCE, eventually, eventually_within, wait_until, wait_until_explained, wait_until_within,
};
