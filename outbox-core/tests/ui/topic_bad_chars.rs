use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "order paid")]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
}

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "order/paid")]
struct OrderShipped {
    #[outbox(id)]
    order_id: String,
}

fn main() {}
