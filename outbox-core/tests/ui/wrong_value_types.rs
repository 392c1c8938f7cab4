use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = orders, key = "customer")]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
    customer: String,
}

fn main() {}
