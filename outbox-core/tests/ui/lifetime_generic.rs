use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
struct OrderPaid<'a> {
    #[outbox(id)]
    order_id: &'a str,
}

fn main() {}
