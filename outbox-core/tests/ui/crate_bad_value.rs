use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(crate = outbox_core)]
struct NotAString {
    #[outbox(id)]
    order_id: String,
}

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(crate = "outbox core")]
struct NotAPath {
    #[outbox(id)]
    order_id: String,
}

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(crate = "outbox_core::OutboxEvent<u8>")]
struct WithGenerics {
    #[outbox(id)]
    order_id: String,
}

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(crate = "outbox_core", crate = "outbox_core")]
struct Duplicate {
    #[outbox(id)]
    order_id: String,
}

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(id = "{order_id}")]
enum OnAVariant {
    #[outbox(crate = "outbox_core")]
    Paid { order_id: String },
}

fn main() {}
