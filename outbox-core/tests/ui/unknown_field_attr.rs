use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
    #[outbox(skip)]
    amount_cents: i64,
}

fn main() {}
