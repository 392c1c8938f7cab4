//! The reference scenario of the design chapter, in memory: a transfer commits its
//! balance change and its message together; the first two publish attempts fail and the
//! third succeeds; a duplicate delivery is applied once; a refused transfer leaves no
//! message.

use std::time::Duration;

use outbox_core::{
    Delivery, Dispatcher, MemoryBroker, MemoryDb, Processed, Relay, RelayConfig, RetryPolicy,
    Status,
};
use outbox_examples::memory::{NoteTransfer, Notes, opening_balances, transfer};
use outbox_examples::{AccountTransferred, TransferError};

fn transfer_event(id: &str, from: &str, to: &str, amount: i64) -> AccountTransferred {
    AccountTransferred::new(id, from, to, amount)
}

#[tokio::test]
async fn transfer_retries_twice_then_applies_once() {
    let bank = MemoryDb::new(opening_balances());
    let msg_id = transfer(&bank, transfer_event("m-1", "alice", "bob", 100)).unwrap();
    assert_eq!(msg_id.as_str(), "m-1:AccountTransferred");

    let rows = bank.rows();
    assert_eq!(rows.len(), 1, "the message committed with the transfer");
    assert_eq!((rows[0].status, rows[0].retries), (Status::New, 0));

    let broker = MemoryBroker::new();
    broker.reject_next(2);
    let retry = RetryPolicy::default()
        .with_max_attempts(3)
        .with_base_delay(Duration::ZERO)
        .with_jitter(0.0);
    let relay = Relay::new(bank.clone(), broker.clone())
        .with_config(RelayConfig::default().with_retry(retry))
        .unwrap();
    let mut sent = Vec::new();
    for _round in 0..4 {
        sent.push(relay.run_once().await.unwrap().sent);
    }
    assert_eq!(
        sent,
        [0, 0, 1, 0],
        "fails twice, succeeds on the third round, then nothing is left"
    );

    let row = bank.row(msg_id.as_str()).unwrap();
    assert_eq!((row.status, row.retries), (Status::Sent, 2));
    assert_eq!(row.last_error.as_deref(), Some("injected failure"));

    let published = broker.published(AccountTransferred::TOPIC);
    assert_eq!(published.len(), 1);

    let notes = MemoryDb::new(Notes::new());
    let mut dispatcher = Dispatcher::new();
    dispatcher
        .register::<AccountTransferred, _>(NoteTransfer)
        .unwrap();
    let delivery = Delivery {
        envelope: published[0].clone(),
        delivery_count: 1,
        entry_id: None,
    };
    let redelivery = Delivery {
        delivery_count: 2,
        ..delivery.clone()
    };
    assert_eq!(
        dispatcher.consume(&notes, "notes", &delivery).unwrap(),
        Processed::Applied
    );
    assert_eq!(
        dispatcher.consume(&notes, "notes", &redelivery).unwrap(),
        Processed::Duplicate
    );

    assert_eq!(notes.read(Clone::clone), ["alice→bob 100"]);
    bank.read(|a| assert_eq!((a["alice"], a["bob"]), (900, 100)));
}

#[test]
fn insufficient_funds_leaves_no_message_and_no_change() {
    let bank = MemoryDb::new(opening_balances());
    let err = transfer(&bank, transfer_event("m-2", "bob", "alice", 5000)).unwrap_err();
    assert!(
        matches!(err, TransferError::InsufficientFunds(ref who) if who == "bob"),
        "{err}"
    );
    assert!(bank.rows().is_empty());
    bank.read(|a| assert_eq!((a["alice"], a["bob"]), (1000, 0)));
}

#[test]
fn the_same_transfer_twice_is_a_duplicate() {
    let bank = MemoryDb::new(opening_balances());
    transfer(&bank, transfer_event("m-1", "alice", "bob", 100)).unwrap();
    let err = transfer(&bank, transfer_event("m-1", "alice", "bob", 100)).unwrap_err();
    assert!(err.is_duplicate(), "{err}");
    assert_eq!(bank.rows().len(), 1);
    bank.read(|a| assert_eq!((a["alice"], a["bob"]), (900, 100)));
}
