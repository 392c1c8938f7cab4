//! The crate's error type.

/// Errors of the NATS transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error of the outbox core (configuration, store, dispatch).
    #[error(transparent)]
    Core(#[from] outbox_core::Error),
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
