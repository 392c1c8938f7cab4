use std::sync::Arc;

use serde_json::Value;

use super::Dispatcher;
use super::prepared::panic_message;
#[cfg(doc)]
use crate::Delivery;
use crate::{BoxError, Envelope, Error, InvalidConfig, OutboxEvent};

pub(super) type Step = Arc<dyn Fn(Value) -> Result<Value, BoxError> + Send + Sync>;

/// A payload ready to decode: the text as it arrived (no step applied: decoded straight
/// from the text, as if there were no upgrades), or the JSON its upgrade steps made.
pub(super) enum Payload {
    Text,
    Upgraded(Value),
}

impl<C: 'static> Dispatcher<C> {
    /// Registers the step that turns a payload of `E`'s schema version `from` into
    /// version `from + 1`, so that a handler of `E` (at
    /// [`E::SCHEMA_VERSION`](OutboxEvent::SCHEMA_VERSION), `#[outbox(version = N)]`)
    /// receives the messages of producers still at an older version.
    ///
    /// A payload of version `v` below `E`'s goes through the steps from `v`, `v + 1`, ..
    /// in turn, each on the JSON the one before made, and is then decoded; a version
    /// without a step is taken as compatible and passed on unchanged (a field added with
    /// `#[serde(default)]` needs none). The handler's [`Delivery::envelope`] stays the
    /// message as it arrived. A payload newer than `E`
    /// ([`Error::UnsupportedSchemaVersion`]) and one a step fails or panics on
    /// ([`Error::Upgrade`]) are refused before decoding and are poison
    /// ([`Error::is_poison`]): a consumer dead-letters them at once.
    ///
    /// Steps belong to the consuming service, not to the event type (they may need its
    /// settings), and may be registered before or after the handler. Fails if `from` is
    /// 0 or not below `E`'s version, or if a step from `from` is already registered for
    /// one of `E`'s event types.
    ///
    /// ```
    /// use outbox_core::{Delivery, Dispatcher, Envelope, Handler, HandlerError, MemoryDb,
    ///                   MemoryTx, OutboxEvent, Processed};
    /// use serde_json::{Value, json};
    ///
    /// // Version 1: `{order_id, cents}`; version 2: `cents` renamed to `amount_cents`;
    /// // version 3: `currency` added.
    /// #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
    /// #[outbox(version = 3)]
    /// struct OrderPaid { #[outbox(id)] order_id: String, amount_cents: i64, currency: String }
    ///
    /// struct Revenue;
    /// impl Handler<OrderPaid> for Revenue {
    ///     type Conn = MemoryTx<Vec<String>>;
    ///     fn handle(&self, e: OrderPaid, tx: &mut Self::Conn, _: &Delivery) -> Result<(), HandlerError> {
    ///         tx.data().push(format!("{} {} {}", e.order_id, e.amount_cents, e.currency));
    ///         Ok(())
    ///     }
    /// }
    ///
    /// let mut dispatcher = Dispatcher::new();
    /// dispatcher.register::<OrderPaid, _>(Revenue)?;
    /// dispatcher
    ///     .upgrade::<OrderPaid>(1, |mut v: Value| {
    ///         let cents = v["cents"].take();
    ///         v["amount_cents"] = cents;
    ///         Ok(v)
    ///     })?
    ///     .upgrade::<OrderPaid>(2, |mut v: Value| {
    ///         v["currency"] = json!("EUR"); // orders before v3 are in euros
    ///         Ok(v)
    ///     })?;
    ///
    /// // A message from a producer still at version 1.
    /// let mut envelope = Envelope::from_event(
    ///     &OrderPaid { order_id: "o-1".into(), amount_cents: 0, currency: String::new() }, 1024)?;
    /// envelope.schema_version = 1;
    /// envelope.payload = r#"{"order_id":"o-1","cents":1999}"#.into();
    /// let db = MemoryDb::new(Vec::new());
    /// let v1 = Delivery { envelope, delivery_count: 1, entry_id: None };
    /// assert_eq!(dispatcher.consume(&db, "revenue", &v1)?, Processed::Applied);
    /// assert_eq!(db.read(|rows| rows.clone()), ["o-1 1999 EUR"]);
    ///
    /// // One from a newer producer is refused, not decoded.
    /// let mut v4 = v1.clone();
    /// v4.envelope.schema_version = 4;
    /// let refused = dispatcher.consume(&db, "revenue", &v4).unwrap_err();
    /// assert!(refused.is_poison());
    /// assert!(refused.to_string().ends_with("produced by a newer service (v4 > v3)"));
    /// # Ok::<_, outbox_core::Error>(())
    /// ```
    pub fn upgrade<E: OutboxEvent>(
        &mut self,
        from: u32,
        step: impl Fn(Value) -> Result<Value, BoxError> + Send + Sync + 'static,
    ) -> Result<&mut Self, Error> {
        let field = format!("upgrade step of `{}`", E::EVENT_TYPES.join("`, `"));
        if from == 0 || from >= E::SCHEMA_VERSION {
            let rule = format!(
                "must start from a version 1 to {} (below its version {}); got {from}",
                E::SCHEMA_VERSION.saturating_sub(1),
                E::SCHEMA_VERSION
            );
            return Err(InvalidConfig::new(field, rule).into());
        }
        if E::EVENT_TYPES
            .iter()
            .any(|t| self.upgrades.get(t).is_some_and(|s| s.contains_key(&from)))
        {
            let rule = format!("from version {from} is already registered");
            return Err(InvalidConfig::new(field, rule).into());
        }
        let step: Step = Arc::new(step);
        for t in E::EVENT_TYPES {
            self.upgrades
                .entry(t)
                .or_default()
                .insert(from, Arc::clone(&step));
        }
        Ok(self)
    }

    /// The payload of `envelope` at schema version `target`: refused if newer, upgraded
    /// through the registered steps if older.
    pub(super) fn upgraded(&self, envelope: &Envelope, target: u32) -> Result<Payload, Error> {
        let version = envelope.schema_version;
        // A payload of a newer schema may carry fields the handler's type does not know,
        // which serde would drop without a word: refuse it before decoding.
        if version > target {
            return Err(Error::UnsupportedSchemaVersion {
                event_type: envelope.event_type.clone(),
                version,
                supported: target,
            });
        }
        let mut steps = match self.upgrades.get(envelope.event_type.as_str()) {
            Some(steps) => steps.range(version..target).peekable(),
            None => return Ok(Payload::Text),
        };
        if steps.peek().is_none() {
            return Ok(Payload::Text);
        }
        let mut value: Value =
            serde_json::from_str(&envelope.payload).map_err(|source| Error::Decode {
                event_type: envelope.event_type.clone(),
                source,
            })?;
        for (&from, step) in steps {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(value)))
                .unwrap_or_else(|panic| {
                    Err(format!("upgrade step panicked: {}", panic_message(&*panic)).into())
                });
            value = result.map_err(|source| Error::Upgrade {
                event_type: envelope.event_type.clone(),
                from,
                source,
            })?;
        }
        Ok(Payload::Upgraded(value))
    }
}

/// Decodes a payload as `E`: from the text, or from the JSON the upgrade steps made.
pub(super) fn decode<E: OutboxEvent>(envelope: &Envelope, payload: Payload) -> Result<E, Error> {
    match payload {
        Payload::Text => envelope.decode(),
        Payload::Upgraded(value) => serde_json::from_value(value).map_err(|source| Error::Decode {
            event_type: envelope.event_type.clone(),
            source,
        }),
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use serde_json::json;

    use super::*;
    use crate::{Delivery, Handler, HandlerError, MemoryDb, MemoryTx, Processed};

    /// v1 `{order_id, cents}`; v2 renamed `cents` to `amount_cents`; v3 added `currency`.
    #[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
    #[outbox(version = 3)]
    struct OrderPaid {
        #[outbox(id)]
        order_id: String,
        amount_cents: i64,
        currency: String,
    }

    struct Record;
    impl Handler<OrderPaid> for Record {
        type Conn = MemoryTx<Vec<String>>;
        fn handle(
            &self,
            e: OrderPaid,
            tx: &mut Self::Conn,
            _: &Delivery,
        ) -> Result<(), HandlerError> {
            tx.data()
                .push(format!("{} {} {}", e.order_id, e.amount_cents, e.currency));
            Ok(())
        }
    }

    fn delivery(version: u32, payload: serde_json::Value) -> Delivery {
        let e = OrderPaid {
            order_id: payload["order_id"].as_str().unwrap().into(),
            amount_cents: 0,
            currency: String::new(),
        };
        let mut envelope = Envelope::from_event(&e, 1024).unwrap();
        envelope.schema_version = version;
        envelope.payload = payload.to_string();
        super::super::first_delivery(envelope)
    }

    /// A dispatcher at v3 with both steps; counts the steps' calls.
    fn dispatcher() -> (Dispatcher<MemoryTx<Vec<String>>>, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let mut d = Dispatcher::new();
        let (c1, c2) = (Arc::clone(&calls), Arc::clone(&calls));
        // Steps before the handler: the order does not matter.
        d.upgrade::<OrderPaid>(2, move |mut v| {
            c2.fetch_add(1, Ordering::SeqCst);
            v["currency"] = json!("EUR");
            Ok(v)
        })
        .unwrap()
        .upgrade::<OrderPaid>(1, move |mut v| {
            c1.fetch_add(1, Ordering::SeqCst);
            let cents = v
                .get_mut("cents")
                .map(serde_json::Value::take)
                .ok_or("a v1 payload without `cents`")?;
            v["amount_cents"] = cents;
            Ok(v)
        })
        .unwrap();
        d.register::<OrderPaid, _>(Record).unwrap();
        (d, calls)
    }

    fn consume(d: &Dispatcher<MemoryTx<Vec<String>>>, delivery: &Delivery) -> Vec<String> {
        let db = MemoryDb::new(Vec::new());
        assert_eq!(d.consume(&db, "g", delivery).unwrap(), Processed::Applied);
        db.read(Clone::clone)
    }

    #[test]
    fn older_payloads_go_through_every_step_up_to_the_handlers_version() {
        let (d, calls) = dispatcher();
        let v1 = delivery(1, json!({"order_id": "o-1", "cents": 100}));
        assert_eq!(consume(&d, &v1), ["o-1 100 EUR"]);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        let v2 = delivery(2, json!({"order_id": "o-2", "amount_cents": 200}));
        assert_eq!(consume(&d, &v2), ["o-2 200 EUR"]);
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        // The handler's own version runs no step.
        let v3 = delivery(
            3,
            json!({"order_id": "o-3", "amount_cents": 300, "currency": "USD"}),
        );
        assert_eq!(consume(&d, &v3), ["o-3 300 USD"]);
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_newer_payload_is_poison_naming_both_versions() {
        let (d, calls) = dispatcher();
        let v4 = delivery(
            4,
            json!({"order_id": "o-4", "amount_cents": 400, "currency": "USD", "vat": 1}),
        );
        let err = d.prepare(&v4.envelope).err().unwrap();
        assert!(err.is_poison(), "{err}");
        assert!(
            matches!(
                err,
                Error::UnsupportedSchemaVersion {
                    version: 4,
                    supported: 3,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "`OrderPaid` payload has schema version 4; this consumer handles versions up to \
             3: produced by a newer service (v4 > v3)"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_failing_or_panicking_step_is_poison_naming_the_step() {
        let (d, _) = dispatcher();
        let bad = delivery(1, json!({"order_id": "o-1", "amount": 100}));
        let err = d.prepare(&bad.envelope).err().unwrap();
        assert!(err.is_poison(), "{err}");
        assert_eq!(
            crate::error_chain(&err).to_string(),
            "cannot upgrade a `OrderPaid` payload from schema version 1 to 2: a v1 payload \
             without `cents`"
        );

        let mut d = Dispatcher::<MemoryTx<Vec<String>>>::new();
        d.register::<OrderPaid, _>(Record).unwrap();
        d.upgrade::<OrderPaid>(2, |v| {
            assert!(v.get("amount_cents").is_some(), "no amount");
            Ok(v)
        })
        .unwrap();
        let err = d.prepare(&bad.envelope).err().unwrap();
        assert!(matches!(err, Error::Upgrade { from: 2, .. }), "{err}");
        assert!(
            crate::error_chain(&err)
                .to_string()
                .ends_with("upgrade step panicked: no amount")
        );
        // A payload that is not JSON cannot reach a step.
        let mut garbled = bad;
        garbled.envelope.payload = "{not json".into();
        let err = d.prepare(&garbled.envelope).err().unwrap();
        assert!(matches!(err, Error::Decode { .. }), "{err}");
    }

    #[test]
    fn a_version_without_a_step_is_passed_on_as_compatible() {
        // No steps at all: an older payload is decoded as it is (and fails if it lacks
        // what the newer type requires).
        let mut d = Dispatcher::<MemoryTx<Vec<String>>>::new();
        d.register::<OrderPaid, _>(Record).unwrap();
        let v2 = delivery(2, json!({"order_id": "o-2", "amount_cents": 2}));
        let err = d.prepare(&v2.envelope).err().unwrap();
        assert!(matches!(err, Error::Decode { .. }), "{err}");
        // Only 2 → 3: a v1 payload skips to it unchanged.
        d.upgrade::<OrderPaid>(2, |mut v| {
            v["currency"] = json!("EUR");
            Ok(v)
        })
        .unwrap();
        assert_eq!(consume(&d, &v2), ["o-2 2 EUR"]);
        let v1 = delivery(1, json!({"order_id": "o-1", "amount_cents": 1}));
        assert_eq!(consume(&d, &v1), ["o-1 1 EUR"]);
    }

    #[test]
    fn steps_outside_the_types_versions_or_twice_are_refused() {
        let (mut d, _) = dispatcher();
        for from in [0, 3, 4] {
            let err = d.upgrade::<OrderPaid>(from, Ok).err().unwrap();
            assert!(matches!(err, Error::Config(_)), "{err}");
            assert!(err.to_string().contains("from a version 1 to 2"), "{err}");
        }
        let err = d.upgrade::<OrderPaid>(1, Ok).err().unwrap();
        assert!(err.to_string().contains("already registered"), "{err}");
        assert!(format!("{d:?}").contains(r#"upgrades_from: [("OrderPaid", [1, 2])]"#));
    }
}
