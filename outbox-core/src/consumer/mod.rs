//! What every broker's consumer runner shares and no broker shapes: the idempotency
//! store it runs transactions on ([`ConsumerStore`], [`AsyncStore`]) and where it runs
//! them ([`Executor`]). Moved here unchanged from outbox-redis so that outbox-nats takes
//! the same stores.

mod executor;
mod store;

pub use executor::{Executor, block_on, waker};
pub use store::{AsyncStore, ConsumerStore, StoreRun, Transactions};
