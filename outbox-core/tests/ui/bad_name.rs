use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(name = "Order:Paid")]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
}

fn main() {}
