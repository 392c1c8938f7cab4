use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
struct OrderPaid<const N: usize> {
    #[outbox(id)]
    order_id: String,
}

fn main() {}
