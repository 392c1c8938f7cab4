use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(name = "OrderEvent", id = "{order_id}")]
enum OrderEvent {
    Paid { order_id: String },
    Refunded { order_id: String },
}

fn main() {}
