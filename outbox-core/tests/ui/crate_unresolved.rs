use outbox_core::OutboxEvent;

// A path that names nothing is reported at the string that wrote it.
#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(crate = "my_app::outbox", key = customer)]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
    customer: String,
}

fn main() {}
