//! Routing a delivered message to the typed handler of its event type, inside the
//! consumer's dedup transaction: handlers and what they are given ([`handler`]), the
//! routes ([`dispatcher`]), the schema upgrades on the way ([`upgrade`]), a decoded
//! message ready to run ([`prepared`]) and the transactions that run it ([`consume`]);
//! what a consumer builder collects before it builds ([`routes`]).

mod consume;
mod dispatcher;
mod handler;
mod prepared;
mod routes;
mod upgrade;

pub use dispatcher::Dispatcher;
pub use handler::{AsyncHandler, AsyncTxHandler, Delivery, Handler};
pub use prepared::{Prepared, panic_message};
pub use routes::{Routed, Routes};

/// `envelope` delivered for the first time: the deliveries of the tests.
#[cfg(all(test, feature = "memory"))]
fn first_delivery(envelope: crate::Envelope) -> Delivery {
    Delivery {
        envelope,
        delivery_count: 1,
        entry_id: None,
    }
}
