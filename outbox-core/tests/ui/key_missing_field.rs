use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(key = account)]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
    customer: String,
}

fn main() {}
