//! Run with: cargo run -p outbox-examples --bin transfer_memory
//!
//! The reference scenario, in memory: a transfer commits the balance change and its message
//! together; the broker fails twice, then takes the message; it is delivered twice and
//! applied once.

use std::time::Duration;

use outbox_core::{Delivery, Dispatcher, MemoryBroker, MemoryDb, Relay, RelayConfig, RetryPolicy};
use outbox_examples::AccountTransferred;
use outbox_examples::memory::{Accounts, NoteTransfer, Notes, opening_balances, transfer};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let bank = MemoryDb::new(opening_balances());
    let event = AccountTransferred::new("m-1", "alice", "bob", 100);
    let msg_id = transfer(&bank, event)?;
    println!("local transaction committed: balances and message {msg_id} together");
    show(&bank);

    let refused = AccountTransferred::new("m-2", "bob", "alice", 5000);
    println!(
        "transfer m-2 refused: {}",
        transfer(&bank, refused).unwrap_err()
    );

    println!("\nrelay: the broker times out twice");
    let broker = MemoryBroker::new();
    broker.reject_next(2);
    let retry = RetryPolicy::default()
        .with_max_attempts(3)
        .with_base_delay(Duration::ZERO)
        .with_jitter(0.0);
    let relay = Relay::new(bank.clone(), broker.clone())
        .with_config(RelayConfig::default().with_retry(retry))?;
    for round in 1..=4 {
        let report = relay.run_once().await?;
        println!(
            "round {round}: claimed {}, sent {}, retrying {}",
            report.claimed, report.sent, report.retried
        );
    }

    println!("\nconsumer: the broker delivers the message twice");
    let notes = MemoryDb::new(Notes::new());
    let mut dispatcher = Dispatcher::new();
    dispatcher.register::<AccountTransferred, _>(NoteTransfer)?;
    for envelope in broker.published(AccountTransferred::TOPIC) {
        for delivery_count in 1..=2 {
            let delivery = Delivery {
                envelope: envelope.clone(),
                delivery_count,
                entry_id: None,
            };
            let processed = dispatcher.consume(&notes, "notes", &delivery)?;
            println!(
                "delivery {delivery_count} of {}: {processed:?}",
                envelope.msg_id
            );
        }
    }
    println!();
    show(&bank);
    println!("downstream applied: {:?}", notes.read(Clone::clone));
    Ok(())
}

fn show(bank: &MemoryDb<Accounts>) {
    bank.read(|a| println!("balances: alice={} bob={}", a["alice"], a["bob"]));
    for row in bank.rows() {
        println!(
            "message {} status={} retries={}",
            row.envelope.msg_id, row.status, row.retries
        );
    }
}
