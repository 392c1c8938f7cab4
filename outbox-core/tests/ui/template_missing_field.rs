use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(id = "{tenant}/{order}")]
struct OrderPaid {
    tenant: String,
    order_id: String,
}

fn main() {}
