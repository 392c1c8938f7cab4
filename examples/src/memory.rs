//! The bank on `outbox-core`'s in-memory database.

use std::collections::BTreeMap;

use outbox_core::{Delivery, Handler, HandlerError, MemoryDb, MemoryTx, MsgId};

use crate::{AccountTransferred, TransferError};

/// Balances by account name.
pub type Accounts = BTreeMap<String, i64>;

/// The consumer's record: one note per transfer applied.
pub type Notes = Vec<String>;

/// Alice holds 1000, Bob nothing.
pub fn opening_balances() -> Accounts {
    Accounts::from([("alice".to_owned(), 1000), ("bob".to_owned(), 0)])
}

/// Debits, credits and emits the event in one transaction: all of it commits, or none.
pub fn transfer(
    db: &MemoryDb<Accounts>,
    event: AccountTransferred,
) -> Result<MsgId, TransferError> {
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

/// Downstream handler: notes each transfer (award points, send a notice, ...).
#[derive(Debug, Clone, Copy)]
pub struct NoteTransfer;

impl Handler<AccountTransferred> for NoteTransfer {
    type Conn = MemoryTx<Notes>;

    fn handle(
        &self,
        e: AccountTransferred,
        tx: &mut MemoryTx<Notes>,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        tx.data().push(e.note());
        Ok(())
    }
}
