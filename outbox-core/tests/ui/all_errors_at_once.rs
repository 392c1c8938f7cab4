use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(colour = "red", topic = "")]
struct OrderPaid {
    order_id: String,
    amount_cents: i64,
}

fn main() {}
