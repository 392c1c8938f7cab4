use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
struct OrderPaid {
    order_id: String,
    amount_cents: i64,
}

fn main() {}
