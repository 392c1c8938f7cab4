//! What every broker's consumer runner shares and no broker shapes: the idempotency
//! store it runs transactions on ([`ConsumerStore`], [`AsyncStore`]) and where it runs
//! them ([`Executor`]). Moved here unchanged from outbox-redis so that outbox-nats takes
//! the same stores. Also what a consumer reports to probes ([`ConsumerHealth`]).

mod executor;
mod health;
mod store;

pub use executor::{Executor, block_on, waker};
#[cfg(feature = "http")]
pub use health::health_router;
pub use health::{ConsumerHealth, HealthState, ReaderHealth};
pub use store::{AsyncStore, ConsumerStore, StoreRun, Transactions};
