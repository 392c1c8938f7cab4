//! The operations queries: what an operator (or `outbox status`) reads and repairs.
//! Each query is a function generic over [`OutboxConnection`](crate::OutboxConnection),
//! written once for every database: its SQL takes what differs from the database's
//! [`Dialect`](crate::backend::Dialect), and it loads its own row type. A new query is
//! a file here and its line below.

mod dead;
mod parked;
mod retention;
mod retrying;
mod rows;
mod stats;

pub use dead::{purge_dead, redrive, redrive_all};
pub use parked::{ParkedRelay, parked_relays};
pub use retention::{purge_consumed, purge_sent};
pub use retrying::{Retrying, retrying};
pub use rows::{
    OutboxRecord, OutboxRow, UnreadableRecord, dead_letters, find_message, find_row, list_messages,
    list_rows,
};
pub use stats::{PublishedMinute, TopicCounts, backlog, published_per_minute, topic_counts};
