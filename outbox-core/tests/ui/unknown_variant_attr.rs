use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(id = "{order_id}")]
enum OrderEvent {
    Paid { order_id: String },
    #[outbox(version = 2, skip(serializing))]
    Refunded { order_id: String },
}

fn main() {}
