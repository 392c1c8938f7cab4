use outbox_core::OutboxEvent;

// The default topic and event type come from the identifier, which must then be ASCII.
#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
struct CaféOuvert {
    #[outbox(id)]
    id: String,
}

// Setting both is enough.
#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "cafe.ouvert", name = "CafeOuvert")]
struct CaféFermé {
    #[outbox(id)]
    id: String,
}

fn main() {}
