//! Shared domain code for the runnable examples: the bank transfer of the reference
//! scenario (a transfer commits the balance change and its `AccountTransferred` event in
//! one transaction; a consumer records each transfer once).

use std::collections::BTreeMap;

use outbox_core::{Delivery, Handler, HandlerError, MemoryDb, MemoryTx, MsgId, OutboxEvent};
use serde::{Deserialize, Serialize};

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

/// Balances by account name.
pub type Accounts = BTreeMap<String, i64>;

/// Why a transfer was refused.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The debited account holds less than the amount.
    #[error("insufficient funds in `{0}`")]
    InsufficientFunds(String),
    /// Writing the event failed.
    #[error(transparent)]
    Outbox(#[from] outbox_core::Error),
}

/// Debits, credits and emits the event in one transaction: all of it commits, or none.
pub fn transfer(db: &MemoryDb<Accounts>, event: AccountTransferred) -> Result<MsgId, TransferError> {
    db.transaction(|tx| {
        let accounts = tx.data();
        let balance = accounts.get(&event.from).copied().unwrap_or_default();
        if balance < event.amount {
            return Err(TransferError::InsufficientFunds(event.from.clone()));
        }
        *accounts.entry(event.from.clone()).or_default() -= event.amount;
        *accounts.entry(event.to.clone()).or_default() += event.amount;
        Ok(tx.emit(event)?)
    })
}

/// The consumer's record: one note per transfer applied.
pub type Notes = Vec<String>;

/// Downstream handler: notes each transfer (award points, send a notice, ...).
#[derive(Debug, Clone, Copy)]
pub struct NoteTransfer;

impl Handler<AccountTransferred> for NoteTransfer {
    type Conn = MemoryTx<Notes>;

    fn handle(&self, e: AccountTransferred, tx: &mut MemoryTx<Notes>, _: &Delivery) -> Result<(), HandlerError> {
        tx.data().push(format!("{}→{} {}", e.from, e.to, e.amount));
        Ok(())
    }
}

/// Alice holds 1000, Bob nothing.
pub fn opening_balances() -> Accounts {
    Accounts::from([("alice".to_owned(), 1000), ("bob".to_owned(), 0)])
}
