use outbox_core::OutboxEvent;

#[derive(OutboxEvent)]
union OrderPaid {
    order_id: u64,
    amount_cents: i64,
}

fn main() {}
