use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(version = "2")]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
}

fn main() {}
