//! An empty business key at emit: a typed error naming the field, and nothing written,
//! against each backend (PostgreSQL and MariaDB on this machine, SQLite in a temp file).
//! Before, `OrderPaid { order_id: "" }` was stored as `:OrderPaid`, and every later
//! event with an empty key was rejected as its duplicate.

mod fixtures;

use diesel::Connection;
use fixtures::{Backend, Lite, My, Pg, PgParted};
use outbox_core::{InvalidMsgId, OutboxEvent};
use outbox_diesel::{Emit, Error};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
struct OrderPaid {
    #[outbox(id)]
    order_id: String,
    amount_cents: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(id = "{tenant}/{order_id}")]
struct TenantOrderPaid {
    tenant: String,
    order_id: String,
}

fn paid(order_id: &str) -> OrderPaid {
    OrderPaid {
        order_id: order_id.into(),
        amount_cents: 1999,
    }
}

fn empty(part: &'static str) -> impl Fn(&Error) -> bool {
    move |e| matches!(e, Error::Core(outbox_core::Error::InvalidMsgId(InvalidMsgId::EmptyPart { part: p })) if *p == part)
}

fn outbox_rows<B: Backend>(c: &mut B::Conn) -> i64 {
    B::scalar(c, "SELECT COUNT(*) AS n FROM outbox")
}

fn an_empty_business_key_is_refused_and_nothing_is_written<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    conn.transaction(|c| {
        let e = c.emit(paid("")).unwrap_err();
        assert!(empty("order_id")(&e), "{e:?}");
        assert!(e.is_invalid_event(), "{e}");
        assert!(e.to_string().contains("`order_id` is empty"), "{e}");
        // A second one is the same error, not a "duplicate" of the first.
        let e = c.emit(paid("")).unwrap_err();
        assert!(empty("order_id")(&e), "{e:?}");
        let e = c
            .emit(TenantOrderPaid {
                tenant: "acme".into(),
                order_id: String::new(),
            })
            .unwrap_err();
        assert!(empty("order_id")(&e), "{e:?}");
        // emit_all is all or nothing: the valid event before the empty one is not written.
        let e = c.emit_all([paid("order-1"), paid("")]).unwrap_err();
        assert!(empty("order_id")(&e), "{e:?}");
        assert_eq!(outbox_rows::<B>(c), 0, "nothing inserted");
        // The transaction is still usable.
        c.emit(paid("order-2"))?;
        Ok::<_, diesel::result::Error>(())
    })
    .unwrap();
    assert_eq!(outbox_rows::<B>(&mut conn), 1);
    assert!(
        outbox_diesel::find_message(&mut conn, ":OrderPaid")
            .unwrap()
            .is_none()
    );
    // Through `?` into diesel's error, the typed error can be recovered.
    let e = conn
        .transaction(|c| {
            c.emit(paid(""))?;
            Ok::<_, diesel::result::Error>(())
        })
        .unwrap_err();
    assert!(
        Error::from_diesel_ref(&e).is_some_and(empty("order_id")),
        "{e}"
    );
    assert_eq!(outbox_rows::<B>(&mut conn), 1);
}

outbox_tests::on_every_backend! {
    postgres => Pg, postgres_partitioned => PgParted, mariadb => My, sqlite => Lite;
    an_empty_business_key_is_refused_and_nothing_is_written,
}
