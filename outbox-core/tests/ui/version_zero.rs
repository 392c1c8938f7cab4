use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(version = 0)]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
}

fn main() {}
