use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize)]
struct OrderNo(u64);

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
struct OrderPaid {
    #[outbox(id)]
    order_no: OrderNo,
}

fn main() {}
