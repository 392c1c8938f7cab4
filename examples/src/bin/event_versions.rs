//! Run with: cargo run -p outbox-examples --bin event_versions
//!
//! Event schema versions, in memory: a consumer whose `OrderPaid` is at version 3 reads
//! messages other services still write at versions 1 and 2, upgraded step by step before
//! its handler sees them, and refuses one written by a newer service at version 4.
//! With Redis, the same steps go on the consumer's builder:
//! `Consumer::builder(..).handle::<OrderPaid, _>(h).upgrade::<OrderPaid>(1, step)`.

use outbox_core::{
    Delivery, Dispatcher, Envelope, Handler, HandlerError, MemoryDb, MemoryTx, OutboxEvent,
};
use serde_json::{Value, json};

/// v1 was `{order_id, cents}`; v2 renamed `cents` to `amount_cents`; v3 added `currency`.
#[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(version = 3)]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
    amount_cents: i64,
    currency: String,
}

struct Revenue;

impl Handler<OrderPaid> for Revenue {
    type Conn = MemoryTx<Vec<String>>;
    fn handle(&self, e: OrderPaid, tx: &mut Self::Conn, _: &Delivery) -> Result<(), HandlerError> {
        tx.data()
            .push(format!("{}: {} {}", e.order_id, e.amount_cents, e.currency));
        Ok(())
    }
}

/// v1 → v2: `cents` became `amount_cents`.
fn rename_cents(mut v: Value) -> Result<Value, outbox_core::BoxError> {
    let cents = v
        .get_mut("cents")
        .map(Value::take)
        .ok_or("a v1 payload without `cents`")?;
    v["amount_cents"] = cents;
    Ok(v)
}

/// v2 → v3: `currency` was added; every order before it was in euros.
fn add_currency(mut v: Value) -> Result<Value, outbox_core::BoxError> {
    v["currency"] = json!("EUR");
    Ok(v)
}

/// A message as a producer at `version` would have written it.
fn message(version: u32, payload: Value) -> Result<Delivery, outbox_core::Error> {
    let order_id = payload["order_id"].as_str().unwrap_or_default().to_owned();
    let mut envelope = Envelope::from_event(
        &OrderPaid {
            order_id,
            amount_cents: 0,
            currency: String::new(),
        },
        1024,
    )?;
    envelope.schema_version = version;
    envelope.payload = payload.to_string();
    Ok(Delivery {
        envelope,
        delivery_count: 1,
        entry_id: None,
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut dispatcher = Dispatcher::new();
    dispatcher.register::<OrderPaid, _>(Revenue)?;
    dispatcher
        .upgrade::<OrderPaid>(1, rename_cents)?
        .upgrade::<OrderPaid>(2, add_currency)?;

    let db = MemoryDb::new(Vec::new());
    let messages = [
        message(1, json!({"order_id": "o-1", "cents": 1999}))?,
        message(2, json!({"order_id": "o-2", "amount_cents": 500}))?,
        message(
            3,
            json!({"order_id": "o-3", "amount_cents": 700, "currency": "USD"}),
        )?,
        message(
            4,
            json!({"order_id": "o-4", "amount_cents": 900, "currency": "USD", "vat_cents": 171}),
        )?,
    ];
    for m in &messages {
        let v = m.envelope.schema_version;
        match dispatcher.consume(&db, "revenue", m) {
            Ok(processed) => println!("v{v}: {processed:?}"),
            // What a Redis consumer writes as the dead letter's reason.
            Err(e) if e.is_poison() => {
                println!("v{v}: dead-lettered: {}", outbox_core::error_chain(&e))
            }
            Err(e) => return Err(e.into()),
        }
    }
    println!("the handler saw:");
    for line in db.read(Clone::clone) {
        println!("  {line}");
    }
    Ok(())
}
