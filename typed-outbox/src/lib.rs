//! Typed transactional outbox for Rust: emit events in your diesel transaction, relay them
//! to Redis Streams, apply each one exactly once in effect in typed handlers.
//!
//! This crate is the one dependency an application adds; it re-exports the parts behind
//! features:
//!
//! ```sh
//! cargo add typed-outbox --features postgres,redis
//! ```
//!
//! The crate root is [`outbox_core`] (events, the [`Relay`], [`Handler`] and typed
//! dispatch), [`diesel`] is `outbox_diesel` (emit, migrations, relay stores, inboxes) and
//! [`redis`] is `outbox_redis` (publisher and consumers).
//!
//! # Example
//!
//! An event, and a message that commits with the business row or not at all:
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use diesel::prelude::*;
//! use outbox::OutboxEvent;
//! use outbox::diesel::Emit as _;
//!
//! diesel::table! { orders (id) { id -> Text, paid -> Bool } }
//!
//! #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
//! struct OrderPaid { #[outbox(id)] order_id: String, amount_cents: i64 }
//!
//! let mut conn = PgConnection::establish("postgres://postgres@127.0.0.1/test")?;
//! outbox::diesel::migrate(&mut conn)?;
//! conn.transaction(|c| {
//!     diesel::update(orders::table.find("order-42")).set(orders::paid.eq(true)).execute(c)?;
//!     c.emit(OrderPaid { order_id: "order-42".into(), amount_cents: 1999 })?;
//!     Ok::<_, diesel::result::Error>(())
//! })?;
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "postgres"))]
//! # fn main() {}
//! ```
//!
//! The README's example adds the relay and a consumer.
//!
//! # Features
//!
//! | feature | default | what it gives |
//! |---|---|---|
//! | `derive` | yes | `#[derive(OutboxEvent)]` |
//! | `postgres` | no | [`diesel`] on PostgreSQL: emit, migrations, relay store with LISTEN/NOTIFY wake-up, inbox, operations (links libpq) |
//! | `mysql` | no | [`diesel`] on MySQL / MariaDB (links libmysqlclient) |
//! | `sqlite` | no | [`diesel`] on SQLite, one relay per database file (links libsqlite3) |
//! | `async-postgres`, `async-mysql` | no | emit and the inbox on diesel-async connections |
//! | `redis` | no | [`redis`]: the Redis Streams publisher and the consumer runner |
//! | `redis-cluster` | no | Redis Cluster for both |
//! | `redis-sentinel` | no | Redis Sentinel for both, failovers followed |
//! | `nats` | no | [`nats`]: the NATS JetStream publisher and the consumer runner |
//! | `cdc` | no | [`cdc`]: the CDC relay, PostgreSQL logical decoding of the outbox's inserts in commit order, no UPDATE per message (implies `postgres`) |
//! | `http` | no | a consumer's `/healthz` and `/readyz` as an axum `Router` (`redis::health_router`, `nats::health_router`; with `redis` or `nats`) |
//! | `opentelemetry` | no | W3C trace context from emit through the relay to the handler |
//! | `memory` | no | in-memory database and broker for unit tests without services (a dev-dependency's feature) |
//!
//! Name at least one of `postgres`, `mysql`, `sqlite` for the database side, and `redis`
//! or `nats` for the broker. The parts are also published on their own (`typed-outbox-core`,
//! `-derive`, `-diesel`, `-redis`, each with its own features) for crates that need one
//! of them only.
#![doc(test(attr(deny(warnings))))]

#[doc(inline)]
pub use outbox_core::*;

/// Derives [`OutboxEvent`](trait@OutboxEvent): the attributes and what it generates are
/// documented on [`outbox_core`'s derive](macro@outbox_core::OutboxEvent). Its code reaches this crate as `::outbox`; a
/// crate that renames the dependency names its path with `#[outbox(crate = "...")]`.
#[cfg(feature = "derive")]
#[doc(inline)]
pub use outbox_derive::FacadeOutboxEvent as OutboxEvent;

/// The database side on diesel (`typed-outbox-diesel`): emit in your transaction,
/// migrations, relay stores, inboxes and operations queries.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod diesel {
    #[doc(inline)]
    pub use outbox_diesel::*;
}

/// The broker side on Redis Streams (`typed-outbox-redis`): the relay's publisher and the
/// consumer runner.
#[cfg(feature = "redis")]
pub mod redis {
    #[doc(inline)]
    pub use outbox_redis::*;
}

/// The broker side on NATS JetStream (`typed-outbox-nats`): the relay's publisher and
/// the consumer runner, with the same handlers and inboxes as the Redis side.
#[cfg(feature = "nats")]
pub mod nats {
    #[doc(inline)]
    pub use outbox_nats::*;
}

/// The CDC relay (`typed-outbox-cdc`): the outbox's committed inserts read from
/// PostgreSQL's logical decoding and published in commit order, with no UPDATE per
/// message.
#[cfg(feature = "cdc")]
pub mod cdc {
    #[doc(inline)]
    pub use outbox_cdc::*;
}

// The workspace README's example, compiled (not run: it needs the services) as a doc test.
// Only rustdoc's doc-test pass sees this item, so the packaged crate, which has no
// `../../README.md`, still builds.
#[cfg(all(doctest, feature = "postgres", feature = "redis"))]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
