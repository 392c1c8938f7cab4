use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(id)]
struct OrderPaid {
    order_id: String,
}

fn main() {}
