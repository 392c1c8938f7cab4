use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(partitions = 0)]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
}

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(partitions = 1025)]
struct OrderShipped {
    #[outbox(id)]
    order_id: String,
}

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(partitions = "8")]
struct OrderPacked {
    #[outbox(id)]
    order_id: String,
}

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(id = "{order_id}")]
enum OrderEvent {
    #[outbox(partitions = 4)]
    Placed { order_id: String },
}

fn main() {}
