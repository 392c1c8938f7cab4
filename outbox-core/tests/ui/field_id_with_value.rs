use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
struct OrderPaid {
    #[outbox(id = "order")]
    order_id: String,
}

fn main() {}
