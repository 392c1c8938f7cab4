//! Property tests of msg_id construction: `MsgId::new`, `MsgId::from_parts` and the ids
//! `#[derive(OutboxEvent)]` builds from fields and templates. Arbitrary input never
//! panics, what is accepted round-trips, and what is refused is refused with the
//! variant that names the first rule it breaks.

use outbox_core::{Envelope, InvalidMsgId, MAX_MSG_ID_LEN, MsgId, OutboxEvent};
use proptest::prelude::*;

/// The rule `MsgId::new` enforces, written independently of it.
fn expected(id: &str) -> Result<(), InvalidMsgId> {
    if id.is_empty() {
        return Err(InvalidMsgId::Empty);
    }
    if id.len() > MAX_MSG_ID_LEN {
        return Err(InvalidMsgId::TooLong {
            id: id.to_owned(),
            len: id.len(),
        });
    }
    match id
        .char_indices()
        .find(|(_, c)| c.is_whitespace() || c.is_control())
    {
        Some((at, _)) => Err(InvalidMsgId::BadChar {
            id: id.to_owned(),
            at,
        }),
        None => Ok(()),
    }
}

/// Strings that hit the interesting cases often: ids near the length limit, with
/// whitespace, control characters and multi-byte characters, next to any string at all.
fn id_like() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[a-z0-9:/_-]{0,70}",
        "[a-z \t\n\u{0}\u{7}\u{85}\u{a0}\u{2028}\u{3000}订:-]{0,40}",
        "[订😀a]{20,24}",
        Just(String::new()),
    ]
}

/// Whatever the id, an error message stays short enough for one log line (it used to
/// repeat the whole id, 100 MB from a foreign producer included).
const MAX_MESSAGE_LEN: usize = 400;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn msg_id_new_accepts_exactly_the_valid_ids(id in id_like()) {
        let got = MsgId::new(id.clone());
        prop_assert_eq!(got.as_ref().map(|_| ()).map_err(Clone::clone), expected(&id));
        match got {
            Ok(m) => {
                prop_assert_eq!(m.as_str(), id.as_str());
                prop_assert_eq!(m.to_string(), id.clone());
                prop_assert_eq!(MsgId::try_from(m.as_str()), Ok(m.clone()));
                let json = serde_json::to_string(&m).unwrap();
                prop_assert_eq!(serde_json::from_str::<MsgId>(&json).unwrap(), m);
            }
            Err(e) => {
                prop_assert!(e.to_string().len() <= MAX_MESSAGE_LEN, "{}", e);
                // What `new` refuses, deserialization refuses too.
                let json = serde_json::to_string(&id).unwrap();
                prop_assert!(serde_json::from_str::<MsgId>(&json).is_err());
            }
        }
    }

    #[test]
    fn from_parts_joins_with_a_colon_or_names_the_empty_part(
        key in id_like(),
        event_type in id_like(),
    ) {
        match MsgId::from_parts(&key, &event_type) {
            Ok(id) => {
                prop_assert!(!key.is_empty() && !event_type.is_empty());
                prop_assert_eq!(id.as_str(), format!("{key}:{event_type}"));
            }
            Err(InvalidMsgId::EmptyPart { part }) => {
                let first_empty = if key.is_empty() { "business key" } else { "event type" };
                prop_assert_eq!(part, first_empty);
                prop_assert!(key.is_empty() || event_type.is_empty());
            }
            Err(e) => {
                prop_assert!(!key.is_empty() && !event_type.is_empty());
                prop_assert_eq!(Err(e), expected(&format!("{key}:{event_type}")));
            }
        }
    }

    #[test]
    fn template_ids_round_trip_or_name_the_failing_part(
        tenant in id_like(),
        order_id in id_like(),
        amount in any::<i64>(),
    ) {
        let e = Refunded { tenant: tenant.clone(), order_id: order_id.clone(), amount };
        let got = e.msg_id();
        // The builder without an instance agrees with the instance.
        prop_assert_eq!(&Refunded::msg_id_for(&tenant, &order_id), &got);
        if tenant.is_empty() {
            prop_assert_eq!(got, Err(InvalidMsgId::EmptyPart { part: "tenant" }));
        } else if order_id.is_empty() {
            prop_assert_eq!(got, Err(InvalidMsgId::EmptyPart { part: "order_id" }));
        } else {
            let full = format!("{tenant}/{order_id}:Refunded");
            prop_assert_eq!(got.as_ref().map(MsgId::as_str).map_err(Clone::clone), expected(&full).map(|()| full.as_str()));
            prop_assert_eq!(e.business_key(), format!("{tenant}/{order_id}"));
            if let Ok(id) = got {
                // Accepted: the envelope carries it, and the payload decodes back to
                // the same event.
                let envelope = Envelope::from_event(&e, 1 << 20).unwrap();
                prop_assert_eq!(&envelope.msg_id, &id);
                prop_assert_eq!(envelope.key.as_str(), e.business_key());
                prop_assert_eq!(envelope.decode::<Refunded>().unwrap(), e);
            } else {
                let err = Envelope::from_event(&e, 1 << 20).unwrap_err();
                prop_assert!(matches!(err, outbox_core::Error::InvalidMsgId(_)), "{}", err);
            }
        }
    }

    #[test]
    fn several_id_fields_join_with_colons(
        region in id_like(),
        seq in any::<u64>(),
    ) {
        let e = Shipped { region: region.clone(), seq };
        match e.msg_id() {
            Ok(id) => prop_assert_eq!(id.as_str(), format!("{region}:{seq}:Shipped")),
            Err(InvalidMsgId::EmptyPart { part }) => {
                prop_assert_eq!(part, "region");
                prop_assert!(region.is_empty());
            }
            Err(e) => prop_assert_eq!(Err(e), expected(&format!("{region}:{seq}:Shipped"))),
        }
        prop_assert_eq!(Shipped::msg_id_for(&region, seq), e.msg_id());
    }
}

#[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(id = "{tenant}/{order_id}")]
struct Refunded {
    tenant: String,
    order_id: String,
    amount: i64,
}

#[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize, OutboxEvent)]
struct Shipped {
    #[outbox(id)]
    region: String,
    #[outbox(id)]
    seq: u64,
}

/// A 100 MB id (a foreign producer's, or a bug's) is refused with a message that does
/// not repeat it: the message goes into logs and dead-letter reasons.
#[test]
fn a_huge_id_is_refused_with_a_short_message() {
    for id in [
        "x".repeat(100 << 20),
        format!("{} tail", "y".repeat(100 << 20)),
        "订".repeat(1 << 20),
    ] {
        let err = MsgId::new(id.clone()).unwrap_err();
        assert!(matches!(err, InvalidMsgId::TooLong { len, .. } if len == id.len()));
        let text = err.to_string();
        assert!(text.len() <= MAX_MESSAGE_LEN, "{} bytes", text.len());
        assert!(text.contains(&format!("{} bytes long", id.len())), "{text}");
    }
    let mut bad = "z".repeat(60);
    bad.push('\n');
    bad.push_str(&"z".repeat(10_000));
    let err = InvalidMsgId::BadChar { id: bad, at: 60 };
    assert!(err.to_string().len() <= MAX_MESSAGE_LEN, "{err}");
}
