#![doc = include_str!("../README.md")]

use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};

pub mod memory;
pub mod scenario;
pub mod services;
pub mod sql;

/// Money moved from one account to another.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, OutboxEvent)]
pub struct AccountTransferred {
    /// The transfer's business id; the msg_id is `{transfer_id}:AccountTransferred`.
    #[outbox(id)]
    pub transfer_id: String,
    /// Debited account.
    pub from: String,
    /// Credited account.
    pub to: String,
    /// Amount moved.
    pub amount: i64,
}

impl AccountTransferred {
    /// A transfer of `amount` from `from` to `to`, identified by `id`.
    pub fn new(id: &str, from: &str, to: &str, amount: i64) -> Self {
        Self {
            transfer_id: id.into(),
            from: from.into(),
            to: to.into(),
            amount,
        }
    }

    /// What the consumer notes for this transfer.
    pub fn note(&self) -> String {
        format!("{}→{} {}", self.from, self.to, self.amount)
    }
}

/// Why a transfer was refused.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The debited account holds less than the amount.
    #[error("insufficient funds in `{0}`")]
    InsufficientFunds(String),
    /// Writing the event failed (in memory).
    #[error(transparent)]
    Outbox(#[from] outbox_core::Error),
    /// Writing the event failed (diesel).
    #[error(transparent)]
    Emit(#[from] outbox_diesel::Error),
    /// The database failed.
    #[error(transparent)]
    Database(#[from] diesel::result::Error),
}

impl TransferError {
    /// The same transfer was submitted twice.
    pub fn is_duplicate(&self) -> bool {
        match self {
            Self::Outbox(e) => e.is_duplicate(),
            Self::Emit(e) => e.is_duplicate(),
            Self::Database(e) => outbox_diesel::is_duplicate(e),
            Self::InsufficientFunds(_) => false,
        }
    }
}
