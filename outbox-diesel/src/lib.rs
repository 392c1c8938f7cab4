//! outbox-diesel (in progress).
