//! outbox-redis (in progress).
