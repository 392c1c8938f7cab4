//! The bank on PostgreSQL or SQLite through diesel and `outbox-diesel`.

use std::marker::PhantomData;

use diesel::prelude::*;
use outbox_core::{Delivery, Handler, HandlerError, MsgId};
use outbox_diesel::Emit as _;

use crate::{AccountTransferred, TransferError};

diesel::table! {
    /// Balances by account name.
    accounts (id) {
        /// Account name.
        id -> Text,
        /// Balance.
        balance -> BigInt,
    }
}

diesel::table! {
    /// The consumer's record: one note per transfer applied.
    transfer_notes (msg_id) {
        /// The transfer's msg_id.
        msg_id -> Text,
        /// What was noted.
        note -> Text,
    }
}

/// Creates (or resets) the example's tables: alice holds 1000, bob nothing. The same SQL
/// serves PostgreSQL and SQLite.
pub const SETUP_SQL: &str = "
    CREATE TABLE IF NOT EXISTS accounts (id TEXT PRIMARY KEY, balance BIGINT NOT NULL);
    CREATE TABLE IF NOT EXISTS transfer_notes (msg_id TEXT PRIMARY KEY, note TEXT NOT NULL);
    DELETE FROM accounts;
    DELETE FROM transfer_notes;
    INSERT INTO accounts (id, balance) VALUES ('alice', 1000), ('bob', 0);
";

/// The bank's operations on one diesel connection type.
pub trait Bank: diesel::Connection {
    /// Debits, credits and emits the event in one transaction: all of it commits, or none.
    fn transfer(&mut self, event: AccountTransferred) -> Result<MsgId, TransferError>;
    /// Alice's and Bob's balances.
    fn balances(&mut self) -> QueryResult<(i64, i64)>;
    /// Records a note (the consumer's write).
    fn add_note(&mut self, msg_id: &str, note: &str) -> QueryResult<()>;
    /// Every note, in msg_id order.
    fn notes(&mut self) -> QueryResult<Vec<String>>;
}

macro_rules! impl_bank {
    ($($conn:ty),*) => {$(
        impl Bank for $conn {
            fn transfer(&mut self, e: AccountTransferred) -> Result<MsgId, TransferError> {
                self.transaction(|c| {
                    let balance: i64 = accounts::table.find(&e.from).select(accounts::balance).first(c)?;
                    if balance < e.amount {
                        return Err(TransferError::InsufficientFunds(e.from.clone()));
                    }
                    diesel::update(accounts::table.find(&e.from))
                        .set(accounts::balance.eq(accounts::balance - e.amount))
                        .execute(c)?;
                    diesel::update(accounts::table.find(&e.to))
                        .set(accounts::balance.eq(accounts::balance + e.amount))
                        .execute(c)?;
                    Ok(c.emit(e)?)
                })
            }

            fn balances(&mut self) -> QueryResult<(i64, i64)> {
                let of = |c: &mut Self, who: &str| accounts::table.find(who.to_owned()).select(accounts::balance).first(c);
                Ok((of(self, "alice")?, of(self, "bob")?))
            }

            fn add_note(&mut self, msg_id: &str, note: &str) -> QueryResult<()> {
                diesel::insert_into(transfer_notes::table)
                    .values((transfer_notes::msg_id.eq(msg_id), transfer_notes::note.eq(note)))
                    .execute(self)
                    .map(drop)
            }

            fn notes(&mut self) -> QueryResult<Vec<String>> {
                transfer_notes::table.order(transfer_notes::msg_id).select(transfer_notes::note).load(self)
            }
        }
    )*};
}

impl_bank!(diesel::PgConnection, diesel::SqliteConnection);

/// Downstream handler: notes each transfer in the consumer's database, inside the dedup
/// transaction.
pub struct NoteTransfer<C>(PhantomData<fn() -> C>);

impl<C> NoteTransfer<C> {
    /// The handler for connection type `C`.
    pub fn new() -> Self {
        Self(PhantomData)
    }
}

impl<C> Default for NoteTransfer<C> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: Bank + 'static> Handler<AccountTransferred> for NoteTransfer<C> {
    type Conn = C;

    fn handle(
        &self,
        e: AccountTransferred,
        conn: &mut C,
        d: &Delivery,
    ) -> Result<(), HandlerError> {
        conn.add_note(d.envelope.msg_id.as_str(), &e.note())?;
        Ok(())
    }
}
