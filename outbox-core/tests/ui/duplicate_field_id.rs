use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
struct OrderPaid {
    #[outbox(id)]
    #[outbox(id)]
    order_id: String,
}

fn main() {}
