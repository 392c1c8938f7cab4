//! What `#[derive(OutboxEvent)]` promises: topics, event types, msg_ids, ordering keys and
//! payloads, checked against concrete values.

use outbox_core::{
    DEFAULT_MAX_PAYLOAD_BYTES, Envelope, Error, InvalidMsgId, MAX_PARTITIONS, OutboxEvent,
    Partitions,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
    amount_cents: i64,
}

fn paid(order_id: &str) -> OrderPaid {
    OrderPaid {
        order_id: order_id.into(),
        amount_cents: 1999,
    }
}

#[test]
fn single_id_field() {
    assert_eq!(OrderPaid::TOPIC, "order.paid");
    assert_eq!(OrderPaid::EVENT_TYPE, "OrderPaid");
    assert_eq!(<OrderPaid as OutboxEvent>::TOPICS, ["order.paid"]);
    assert_eq!(<OrderPaid as OutboxEvent>::EVENT_TYPES, ["OrderPaid"]);
    assert_eq!(<OrderPaid as OutboxEvent>::SCHEMA_VERSION, 1);

    let e = paid("order-42");
    assert_eq!(e.topic(), "order.paid");
    assert_eq!(e.event_type(), "OrderPaid");
    assert_eq!(e.business_key(), "order-42");
    assert_eq!(e.msg_id().unwrap().as_str(), "order-42:OrderPaid");
    assert_eq!(
        OrderPaid::msg_id_for("order-42").unwrap(),
        e.msg_id().unwrap()
    );
}

/// Id fields are joined with `:` in the order the fields are declared, whatever their types.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
struct LineShipped {
    #[outbox(id)]
    tenant: String,
    sku: String,
    #[outbox(id)]
    order_no: u64,
    #[outbox(id)]
    line: u16,
}

#[test]
fn several_id_fields_join_with_colon_in_field_order() {
    let e = LineShipped {
        tenant: "acme".into(),
        sku: "SKU-1".into(),
        order_no: 1001,
        line: 3,
    };
    assert_eq!(e.business_key(), "acme:1001:3");
    assert_eq!(e.msg_id().unwrap().as_str(), "acme:1001:3:LineShipped");
    // `msg_id_for` takes the id fields in the same order, each as any `Display` value.
    assert_eq!(
        LineShipped::msg_id_for("acme", 1001_u64, 3).unwrap(),
        e.msg_id().unwrap()
    );
    assert_eq!(
        LineShipped::msg_id_for(String::from("acme"), "1001", 'x')
            .unwrap()
            .as_str(),
        "acme:1001:x:LineShipped"
    );
}

/// A template may use literal braces and name a field twice; `msg_id_for` takes each field once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(id = "{{{tenant}}}/{order_id}/{tenant}")]
struct Templated {
    tenant: String,
    order_id: u64,
    note: String,
}

#[test]
fn template_with_literal_braces() {
    let e = Templated {
        tenant: "acme".into(),
        order_id: 7,
        note: String::new(),
    };
    assert_eq!(e.business_key(), "{acme}/7/acme");
    assert_eq!(e.msg_id().unwrap().as_str(), "{acme}/7/acme:Templated");
    assert_eq!(
        Templated::msg_id_for("acme", 7).unwrap(),
        e.msg_id().unwrap()
    );
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(topic = "billing.v2", name = "InvoiceIssued", version = 3, key = customer)]
struct Invoice {
    #[outbox(id)]
    invoice_no: u64,
    customer: String,
}

#[test]
fn topic_name_version_and_key_attributes() {
    assert_eq!(Invoice::TOPIC, "billing.v2");
    assert_eq!(Invoice::EVENT_TYPE, "InvoiceIssued");
    assert_eq!(<Invoice as OutboxEvent>::TOPICS, ["billing.v2"]);
    assert_eq!(<Invoice as OutboxEvent>::EVENT_TYPES, ["InvoiceIssued"]);
    assert_eq!(<Invoice as OutboxEvent>::SCHEMA_VERSION, 3);

    let e = Invoice {
        invoice_no: 17,
        customer: "cust-1".into(),
    };
    assert_eq!(e.topic(), "billing.v2");
    assert_eq!(e.event_type(), "InvoiceIssued");
    assert_eq!(e.business_key(), "17");
    assert_eq!(e.msg_id().unwrap().as_str(), "17:InvoiceIssued");
    assert_eq!(
        Invoice::msg_id_for(17).unwrap().as_str(),
        "17:InvoiceIssued"
    );
    // `key = customer`: messages of one customer keep their order, whatever the invoice.
    assert_eq!(e.ordering_key(), "cust-1");
}

/// `partitions = N` on a struct or an enum sets `PARTITIONS` for all its topics; without
/// it the trait's default, one stream a topic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(partitions = 8, key = account)]
struct Transfer {
    #[outbox(id)]
    transfer_id: String,
    account: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(id = "{account}", partitions = 1024, topic = "ledger")]
enum Accounts {
    Debited {
        account: String,
    },
    #[outbox(topic = "ledger.credits")]
    Credited {
        account: String,
    },
}

#[test]
fn partitions_attribute_sets_the_count_of_every_topic() {
    assert_eq!(<Transfer as OutboxEvent>::PARTITIONS, 8);
    assert_eq!(
        Partitions::of_event::<Transfer>(),
        Partitions::new(8).unwrap()
    );
    // The derive's upper bound is outbox_core's.
    assert_eq!(<Accounts as OutboxEvent>::PARTITIONS, MAX_PARTITIONS);
    assert_eq!(
        <Accounts as OutboxEvent>::TOPICS,
        ["ledger", "ledger.credits"]
    );
    assert_eq!(<Invoice as OutboxEvent>::PARTITIONS, 1);
    assert_eq!(<HandMade as OutboxEvent>::PARTITIONS, 1);
    assert_eq!(Partitions::of_event::<HandMade>(), Partitions::ONE);
    // The partition follows the ordering key, not the msg_id.
    let t = Transfer {
        transfer_id: "t-1".into(),
        account: "acct-7".into(),
    };
    let eight = Partitions::of_event::<Transfer>();
    assert_eq!(eight.of(&t.ordering_key()), eight.of("acct-7"));
}

#[test]
fn ordering_key_defaults_to_business_key() {
    let e = paid("order-42");
    assert_eq!(e.ordering_key(), "order-42");
    let e = LineShipped {
        tenant: "acme".into(),
        sku: String::new(),
        order_no: 1,
        line: 2,
    };
    assert_eq!(e.ordering_key(), "acme:1:2");
}

/// Each variant is its own event type; variants share the enum's topic unless they set one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(topic = "orders", version = 2)]
enum OrderEvent {
    Placed {
        #[outbox(id)]
        order_id: String,
        total_cents: i64,
    },
    #[outbox(topic = "refunds")]
    Refunded {
        #[outbox(id)]
        order_id: String,
        #[outbox(id)]
        refund_no: u32,
    },
    #[outbox(name = "OrderCancelledV2")]
    Cancelled {
        #[outbox(id)]
        order_id: String,
        reason: String,
    },
}

#[test]
fn enum_variants_are_event_types() {
    assert_eq!(
        <OrderEvent as OutboxEvent>::EVENT_TYPES,
        ["Placed", "Refunded", "OrderCancelledV2"]
    );
    assert_eq!(<OrderEvent as OutboxEvent>::TOPICS, ["orders", "refunds"]);
    assert_eq!(<OrderEvent as OutboxEvent>::SCHEMA_VERSION, 2);

    let placed = OrderEvent::Placed {
        order_id: "o-1".into(),
        total_cents: 500,
    };
    assert_eq!(placed.topic(), "orders");
    assert_eq!(placed.event_type(), "Placed");
    assert_eq!(placed.msg_id().unwrap().as_str(), "o-1:Placed");
    assert_eq!(placed.ordering_key(), "o-1");

    let refunded = OrderEvent::Refunded {
        order_id: "o-1".into(),
        refund_no: 2,
    };
    assert_eq!(refunded.topic(), "refunds");
    assert_eq!(refunded.event_type(), "Refunded");
    assert_eq!(refunded.msg_id().unwrap().as_str(), "o-1:2:Refunded");

    let cancelled = OrderEvent::Cancelled {
        order_id: "o-1".into(),
        reason: "late".into(),
    };
    assert_eq!(cancelled.topic(), "orders");
    assert_eq!(cancelled.event_type(), "OrderCancelledV2");
    assert_eq!(cancelled.msg_id().unwrap().as_str(), "o-1:OrderCancelledV2");
}

/// The enum's template and key apply to every variant; a variant may bring its own id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(id = "{tenant}/{order_id}", key = tenant)]
enum TenantOrder {
    Opened {
        tenant: String,
        order_id: u64,
    },
    #[outbox(id = "{tenant}")]
    Closed {
        tenant: String,
        order_id: u64,
    },
    Moved {
        tenant: String,
        order_id: u64,
        #[outbox(id)]
        move_no: u32,
    },
}

#[test]
fn enum_template_and_key_are_inherited() {
    // No topic attribute: the enum's name, dotted.
    assert_eq!(<TenantOrder as OutboxEvent>::TOPICS, ["tenant.order"]);
    let opened = TenantOrder::Opened {
        tenant: "acme".into(),
        order_id: 7,
    };
    assert_eq!(opened.topic(), "tenant.order");
    assert_eq!(opened.msg_id().unwrap().as_str(), "acme/7:Opened");
    assert_eq!(opened.ordering_key(), "acme");

    let closed = TenantOrder::Closed {
        tenant: "acme".into(),
        order_id: 7,
    };
    assert_eq!(closed.msg_id().unwrap().as_str(), "acme:Closed");
    assert_eq!(closed.ordering_key(), "acme");

    let moved = TenantOrder::Moved {
        tenant: "acme".into(),
        order_id: 7,
        move_no: 4,
    };
    assert_eq!(moved.msg_id().unwrap().as_str(), "4:Moved");
    assert_eq!(moved.ordering_key(), "acme");
}

/// A variant's `key` overrides the enum's default, the business key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
enum AccountEvent {
    #[outbox(key = account)]
    Debited {
        #[outbox(id)]
        transfer_id: String,
        account: String,
    },
    Closed {
        #[outbox(id)]
        account: String,
    },
}

#[test]
fn variant_key_overrides_ordering_key() {
    let debited = AccountEvent::Debited {
        transfer_id: "t-1".into(),
        account: "alice".into(),
    };
    assert_eq!(debited.business_key(), "t-1");
    assert_eq!(debited.ordering_key(), "alice");
    let closed = AccountEvent::Closed {
        account: "bob".into(),
    };
    assert_eq!(closed.ordering_key(), "bob");
    assert_eq!(<AccountEvent as OutboxEvent>::TOPICS, ["account.event"]);
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Payload {
    sku: String,
    qty: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
struct Wrapped<T> {
    #[outbox(id)]
    id: String,
    inner: T,
}

/// A where clause with a trailing comma must survive the bounds the derive adds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(topic = "tagged")]
struct Tagged<T>
where
    T: Clone,
{
    #[outbox(id)]
    id: u64,
    tag: T,
}

#[test]
fn generic_events() {
    assert_eq!(Wrapped::<Payload>::TOPIC, "wrapped");
    assert_eq!(Wrapped::<Payload>::EVENT_TYPE, "Wrapped");
    assert_eq!(
        Wrapped::<Payload>::msg_id_for("w-1").unwrap().as_str(),
        "w-1:Wrapped"
    );
    let e = Wrapped {
        id: "w-1".into(),
        inner: Payload {
            sku: "SKU-1".into(),
            qty: 2,
        },
    };
    assert_eq!(e.msg_id().unwrap().as_str(), "w-1:Wrapped");
    let envelope = Envelope::from_event(&e, DEFAULT_MAX_PAYLOAD_BYTES).unwrap();
    assert_eq!(envelope.decode::<Wrapped<Payload>>().unwrap(), e);

    let t = Tagged {
        id: 9,
        tag: vec!["a".to_owned()],
    };
    assert_eq!(t.topic(), "tagged");
    assert_eq!(t.msg_id().unwrap().as_str(), "9:Tagged");
}

#[test]
fn invalid_msg_id_is_an_error_not_a_panic_or_truncation() {
    let spaced = paid("order 42");
    assert!(matches!(
        spaced.msg_id(),
        Err(InvalidMsgId::BadChar { at: 5, .. })
    ));
    assert!(matches!(
        OrderPaid::msg_id_for("order 42"),
        Err(InvalidMsgId::BadChar { at: 5, .. })
    ));

    // 60 bytes of id + ":OrderPaid" = 70 bytes, over the 64-byte limit.
    let long = "x".repeat(60);
    match paid(&long).msg_id() {
        Err(InvalidMsgId::TooLong { id, len }) => {
            assert_eq!(len, 70);
            assert_eq!(id, format!("{long}:OrderPaid"));
        }
        other => panic!("expected TooLong, got {other:?}"),
    }
    assert!(matches!(
        OrderPaid::msg_id_for(&long),
        Err(InvalidMsgId::TooLong { len: 70, .. })
    ));

    // The envelope refuses the event instead of storing a bad or cut id.
    assert!(matches!(
        Envelope::from_event(&paid(&long), DEFAULT_MAX_PAYLOAD_BYTES),
        Err(Error::InvalidMsgId(InvalidMsgId::TooLong { len: 70, .. }))
    ));
}

#[test]
fn envelope_round_trip() {
    let e = paid("order-42");
    let envelope = Envelope::from_event(&e, DEFAULT_MAX_PAYLOAD_BYTES).unwrap();
    assert_eq!(envelope.msg_id.as_str(), "order-42:OrderPaid");
    assert_eq!(envelope.topic, "order.paid");
    assert_eq!(envelope.event_type, "OrderPaid");
    assert_eq!(envelope.key, "order-42");
    assert_eq!(envelope.schema_version, 1);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&envelope.payload).unwrap(),
        serde_json::json!({ "order_id": "order-42", "amount_cents": 1999 })
    );
    assert_eq!(envelope.decode::<OrderPaid>().unwrap(), e);

    let invoice = Invoice {
        invoice_no: 17,
        customer: "cust-1".into(),
    };
    let envelope = Envelope::from_event(&invoice, DEFAULT_MAX_PAYLOAD_BYTES).unwrap();
    assert_eq!(envelope.key, "cust-1");
    assert_eq!(envelope.schema_version, 3);
    assert_eq!(envelope.decode::<Invoice>().unwrap(), invoice);

    let refunded = OrderEvent::Refunded {
        order_id: "o-1".into(),
        refund_no: 2,
    };
    let envelope = Envelope::from_event(&refunded, DEFAULT_MAX_PAYLOAD_BYTES).unwrap();
    assert_eq!(envelope.topic, "refunds");
    assert_eq!(envelope.event_type, "Refunded");
    assert_eq!(envelope.schema_version, 2);
    assert_eq!(envelope.decode::<OrderEvent>().unwrap(), refunded);
}

/// The consts are usable in const contexts and through a generic bound.
#[test]
fn consts_through_the_trait() {
    const TOPIC: &str = OrderPaid::TOPIC;
    fn topics<E: OutboxEvent>() -> &'static [&'static str] {
        E::TOPICS
    }
    fn event_types<E: OutboxEvent>() -> &'static [&'static str] {
        E::EVENT_TYPES
    }
    assert_eq!(TOPIC, "order.paid");
    assert_eq!(topics::<OrderEvent>(), ["orders", "refunds"]);
    assert_eq!(
        event_types::<OrderEvent>(),
        ["Placed", "Refunded", "OrderCancelledV2"]
    );
    assert_eq!(topics::<Wrapped<u8>>(), ["wrapped"]);
}

/// A value whose `Display` writes nothing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Blank;

impl std::fmt::Display for Blank {
    fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
struct Keyword {
    #[outbox(id)]
    r#type: String,
    #[outbox(id)]
    code: Blank,
}

/// An event whose business key is written by hand: the trait's default `msg_id`.
#[derive(Debug, Serialize, Deserialize)]
struct HandMade {
    key: String,
}

impl OutboxEvent for HandMade {
    const EVENT_TYPES: &'static [&'static str] = &["HandMade"];
    const TOPICS: &'static [&'static str] = &["hand.made"];
    const SCHEMA_VERSION: u32 = 1;
    fn topic(&self) -> &'static str {
        "hand.made"
    }
    fn event_type(&self) -> &'static str {
        "HandMade"
    }
    fn business_key(&self) -> String {
        self.key.clone()
    }
}

/// An empty id part used to give `:OrderPaid`, which every later event with an empty
/// `order_id` then "duplicated". Now each part is checked and named, at emit (`msg_id`,
/// which the envelope calls) and in `msg_id_for`.
#[test]
fn an_empty_id_part_is_a_typed_error_naming_the_field() {
    let empty = |part| Err(InvalidMsgId::EmptyPart { part });
    assert_eq!(paid("").msg_id(), empty("order_id"));
    assert_eq!(OrderPaid::msg_id_for(""), empty("order_id"));
    assert!(matches!(
        Envelope::from_event(&paid(""), DEFAULT_MAX_PAYLOAD_BYTES),
        Err(Error::InvalidMsgId(InvalidMsgId::EmptyPart {
            part: "order_id"
        }))
    ));

    // Several id fields: each is checked, even when the others would keep the key
    // non-empty (`acme::3` would still be one key for every empty order number).
    let line = |tenant: &str, order_no: &str| LineShipped {
        tenant: tenant.into(),
        sku: String::new(), // not an id field: may be empty
        order_no: order_no.parse().unwrap_or(0),
        line: 3,
    };
    assert_eq!(line("", "1").msg_id(), empty("tenant"));
    assert_eq!(LineShipped::msg_id_for("acme", "", 3), empty("order_no"));
    assert_eq!(LineShipped::msg_id_for("", "", 3), empty("tenant"));
    assert!(line("acme", "1").msg_id().is_ok());

    // Template parts: a literal around the field does not make an empty field valid.
    let templated = Templated {
        tenant: String::new(),
        order_id: 7,
        note: String::new(),
    };
    assert_eq!(templated.msg_id(), empty("tenant"));
    assert_eq!(Templated::msg_id_for("", 7), empty("tenant"));
    assert_eq!(Templated::msg_id_for("acme", ""), empty("order_id"));

    // Enums: the variant's own id fields and the enum's template.
    let placed = OrderEvent::Placed {
        order_id: String::new(),
        total_cents: 1,
    };
    assert_eq!(placed.msg_id(), empty("order_id"));
    let opened = TenantOrder::Opened {
        tenant: String::new(),
        order_id: 7,
    };
    assert_eq!(opened.msg_id(), empty("tenant"));
    let moved = TenantOrder::Moved {
        tenant: String::new(), // not part of this variant's id
        order_id: 7,
        move_no: 4,
    };
    assert_eq!(moved.msg_id().unwrap().as_str(), "4:Moved");

    // Any `Display` that writes nothing; raw identifiers are named without `r#`.
    let keyword = |t: &str| Keyword {
        r#type: t.into(),
        code: Blank,
    };
    assert_eq!(keyword("").msg_id(), empty("type"));
    assert_eq!(keyword("x").msg_id(), empty("code"));
    assert_eq!(Keyword::msg_id_for("x", Blank), empty("code"));

    // A hand-written business key goes through `MsgId::from_parts`, which refuses it too.
    let hand = HandMade { key: String::new() };
    assert_eq!(hand.msg_id(), empty("business key"));
    let hand = HandMade { key: "k".into() };
    assert_eq!(hand.msg_id().unwrap().as_str(), "k:HandMade");

    let e = paid("").msg_id().unwrap_err().to_string();
    assert!(e.contains("`order_id` is empty"), "{e}");
}

// `outbox-core` under another name, as in a crate that renames the dependency.
extern crate outbox_core as renamed;

/// `#[outbox(crate = "...")]`: the generated code reaches `outbox-core` by that path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(crate = "renamed", key = account)]
struct Transferred {
    #[outbox(id)]
    transfer_id: String,
    account: String,
}

/// A crate that wraps `outbox-core` and re-exports it, derive included.
mod facade {
    pub(crate) use outbox_core as outbox;
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, facade::outbox::OutboxEvent)]
#[outbox(crate = "crate::facade::outbox", id = "{tenant}/{n}", topic = "ledger")]
enum Ledger<T> {
    Booked {
        tenant: String,
        n: u64,
        entry: T,
    },
    #[outbox(key = tenant)]
    Reversed {
        tenant: String,
        n: u64,
    },
}

#[test]
fn crate_attribute_names_outbox_core_by_another_path() {
    let e = Transferred {
        transfer_id: "t-1".into(),
        account: "a-9".into(),
    };
    assert_eq!(Transferred::TOPIC, "transferred");
    assert_eq!(e.msg_id().unwrap().as_str(), "t-1:Transferred");
    assert_eq!(e.ordering_key(), "a-9");
    assert_eq!(
        Transferred::msg_id_for("").unwrap_err(),
        InvalidMsgId::EmptyPart {
            part: "transfer_id"
        }
    );

    let booked = Ledger::Booked {
        tenant: "acme".into(),
        n: 7,
        entry: 1999_i64,
    };
    assert_eq!(<Ledger<i64> as OutboxEvent>::TOPICS, ["ledger"]);
    assert_eq!(booked.msg_id().unwrap().as_str(), "acme/7:Booked");
    assert_eq!(booked.ordering_key(), "acme/7");
    let reversed = Ledger::<i64>::Reversed {
        tenant: "acme".into(),
        n: 7,
    };
    assert_eq!(reversed.ordering_key(), "acme");
}
