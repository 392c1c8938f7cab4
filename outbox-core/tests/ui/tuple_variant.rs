use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(id = "{order_id}")]
enum OrderEvent {
    Paid { order_id: String },
    Refunded(String),
}

fn main() {}
