use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "")]
pub struct OrderPaid {
    #[outbox(id)]
    pub order_id: String,
}

fn publish<E: OutboxEvent>(event: &E) -> String {
    format!("{}:{:?}", event.topic(), event.msg_id())
}

// Code using the event reports nothing beyond the derive's own error.
fn main() {
    let e = OrderPaid { order_id: "o-1".into() };
    let _ = (OrderPaid::TOPIC, OrderPaid::EVENT_TYPE, <OrderPaid as OutboxEvent>::TOPICS);
    let _ = publish(&e);
}
