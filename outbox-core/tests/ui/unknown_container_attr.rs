use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(colour = "red")]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
}

fn main() {}
