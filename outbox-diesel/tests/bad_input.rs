//! Bad input at the database side, on each backend (PostgreSQL and MariaDB on this
//! machine, SQLite in a temp file): events that make no valid message, rows written
//! around the library that do not decode, missing tables, tables a newer release
//! migrated, wrong passwords and unreachable servers. Each is a
//! typed error with a clear message, and nothing committed changes: the tests compare
//! the outbox rows and the business rows before and after.

mod fixtures;

use std::time::Duration;

use diesel::connection::SimpleConnection as _;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::{Connection, MysqlConnection, PgConnection};
use fixtures::{Backend, Lite, My, Pg, PgParted, TestDb, exec, runtime};
use outbox_core::Status;
use outbox_core::{Inbox as _, InvalidMsgId, MsgId, OutboxEvent, RelayStore as _};
use outbox_diesel::{
    DieselInbox, Emit, Error, MIGRATION_VERSION, MysqlRelayStore, OutboxRecord, OutboxRow,
    PgRelayStore, UnreadableRecord,
};
use outbox_tests::{MariadbUser, assert_hidden};
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

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
struct Attachment {
    #[outbox(id)]
    name: String,
    body: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(key = region)]
struct Routed {
    #[outbox(id)]
    order_id: String,
    region: String,
}

fn paid(order_id: &str) -> OrderPaid {
    OrderPaid {
        order_id: order_id.into(),
        amount_cents: 1999,
    }
}

/// Everything committed that a bad input could touch: the outbox rows (every column
/// the operations queries read) and the two accounts.
#[derive(Debug, PartialEq, Eq, Clone)]
struct Snapshot {
    outbox: Vec<OutboxRecord>,
    balances: (i64, i64),
}

fn snapshot<B: Backend>(c: &mut B::Conn) -> Snapshot {
    Snapshot {
        outbox: outbox_diesel::list_messages(c, None, 0, 10_000).expect("outbox rows"),
        balances: balances::<B>(c),
    }
}

fn balances<B: Backend>(c: &mut B::Conn) -> (i64, i64) {
    let balance = |c: &mut B::Conn, id: &str| {
        B::scalar(
            c,
            &format!("SELECT balance AS n FROM accounts WHERE id = '{id}'"),
        )
    };
    (balance(c, "alice"), balance(c, "bob"))
}

/// In one transaction: a transfer and a good event, then `bad` (which must fail as
/// `expected` says), then another good event, and commit. The bad event's error leaves
/// the transaction usable; afterwards the outbox holds exactly the two good events more
/// and the transfer, and nothing of the bad one.
fn refused_and_the_transaction_goes_on<B: Backend>(
    db: &TestDb,
    bad: impl FnOnce(&mut B::Conn) -> Result<(), Error>,
    expected: impl FnOnce(&Error) -> bool,
) -> Error {
    let mut conn = B::connect(db);
    let before = snapshot::<B>(&mut conn);
    let mut refused = None;
    conn.transaction(|c| {
        exec(
            c,
            "UPDATE accounts SET balance = balance - 100 WHERE id = 'alice'",
        );
        c.emit(paid("good-1"))?;
        let e = bad(c).expect_err("the bad input was accepted");
        assert!(expected(&e), "unexpected error: {e:?}");
        refused = Some(e);
        c.emit(paid("good-2"))?;
        exec(
            c,
            "UPDATE accounts SET balance = balance + 100 WHERE id = 'bob'",
        );
        Ok::<_, Error>(())
    })
    .expect("the transaction commits after the refused event");
    let after = snapshot::<B>(&mut conn);
    let mut expected_outbox = before.outbox.clone();
    for id in ["good-1", "good-2"] {
        let row = after
            .outbox
            .iter()
            .find(|r| r.envelope.msg_id.as_str() == format!("{id}:OrderPaid"))
            .expect("the good events are in the outbox");
        expected_outbox.push(row.clone());
    }
    assert_eq!(
        after.outbox, expected_outbox,
        "the outbox changed beyond the good events"
    );
    assert_eq!(after.balances, (900, 100));
    refused.unwrap()
}

fn an_empty_id_field_is_refused<B: Backend>() {
    let db = B::create();
    let e = refused_and_the_transaction_goes_on::<B>(
        &db,
        |c| c.emit(paid("")).map(drop),
        |e| {
            matches!(
                e,
                Error::Core(outbox_core::Error::InvalidMsgId(InvalidMsgId::EmptyPart {
                    part: "order_id"
                }))
            )
        },
    );
    assert!(e.is_invalid_event());
    assert!(
        e.to_string().contains("msg_id part `order_id` is empty"),
        "{e}"
    );
}

fn an_empty_template_part_is_refused<B: Backend>() {
    let db = B::create();
    let e = refused_and_the_transaction_goes_on::<B>(
        &db,
        |c| {
            c.emit(TenantOrderPaid {
                tenant: String::new(),
                order_id: "o-1".into(),
            })
            .map(drop)
        },
        |e| {
            matches!(
                e,
                Error::Core(outbox_core::Error::InvalidMsgId(InvalidMsgId::EmptyPart {
                    part: "tenant"
                }))
            )
        },
    );
    assert!(e.to_string().contains("`tenant` is empty"), "{e}");
}

fn an_overlong_id_is_refused<B: Backend>() {
    let db = B::create();
    // 56 + ":OrderPaid" = 66 bytes, over the VARCHAR(64) of msg_id: never truncated.
    let e = refused_and_the_transaction_goes_on::<B>(
        &db,
        |c| c.emit(paid(&"9".repeat(56))).map(drop),
        |e| {
            matches!(
                e,
                Error::Core(outbox_core::Error::InvalidMsgId(InvalidMsgId::TooLong {
                    len: 66,
                    ..
                }))
            )
        },
    );
    assert!(
        e.to_string().contains("is 66 bytes long; the limit is 64"),
        "{e}"
    );
}

fn whitespace_or_control_characters_in_an_id_are_refused<B: Backend>() {
    let db = B::create();
    for (id, at) in [
        ("order 7", 5),
        ("order-7\t", 7),
        ("order\u{0}7", 5),
        ("\u{1b}[31m", 0),
    ] {
        let e = refused_and_the_transaction_goes_on::<B>(
            &db,
            |c| c.emit(paid(id)).map(drop),
            |e| matches!(e, Error::Core(outbox_core::Error::InvalidMsgId(InvalidMsgId::BadChar { at: a, .. })) if *a == at),
        );
        assert!(
            e.to_string().contains("whitespace or a control character"),
            "{e}"
        );
        // Each round commits its two good events; clear them for the next round.
        exec(&mut B::connect(&db), "DELETE FROM outbox");
        exec(
            &mut B::connect(&db),
            "UPDATE accounts SET balance = CASE WHEN id = 'alice' THEN 1000 ELSE 0 END",
        );
    }
}

fn a_2_mib_payload_is_refused<B: Backend>() {
    let db = B::create();
    let e = refused_and_the_transaction_goes_on::<B>(
        &db,
        |c| {
            c.emit(Attachment {
                name: "scan-1".into(),
                body: "x".repeat(2 << 20),
            })
            .map(drop)
        },
        |e| matches!(e, Error::Core(outbox_core::Error::PayloadTooLarge { limit, size, .. }) if *limit == 1 << 20 && *size > 2 << 20),
    );
    assert!(e.is_invalid_event());
    assert!(e.to_string().contains("the limit is 1048576"), "{e}");
}

fn an_overlong_ordering_key_is_refused<B: Backend>() {
    let db = B::create();
    let e = refused_and_the_transaction_goes_on::<B>(
        &db,
        |c| {
            c.emit(Routed {
                order_id: "o-1".into(),
                region: "r".repeat(256),
            })
            .map(drop)
        },
        |e| {
            matches!(
                e,
                Error::FieldTooLong {
                    field: "key",
                    len: 256,
                    limit: 255,
                    ..
                }
            )
        },
    );
    assert!(e.is_invalid_event());
}

fn a_duplicate_is_refused_and_the_first_stays<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    conn.transaction(|c| c.emit(paid("dup")).map(drop)).unwrap();
    let e = refused_and_the_transaction_goes_on::<B>(
        &db,
        |c| {
            c.emit(OrderPaid {
                order_id: "dup".into(),
                amount_cents: 1,
            })
            .map(drop)
        },
        |e| matches!(e, Error::Core(outbox_core::Error::Duplicate(id)) if id.as_str() == "dup:OrderPaid"),
    );
    assert!(e.is_duplicate());
}

fn one_bad_event_in_emit_all_writes_none_of_them<B: Backend>() {
    let db = B::create();
    refused_and_the_transaction_goes_on::<B>(
        &db,
        |c| {
            c.emit_all([paid("batch-1"), paid(""), paid("batch-3")])
                .map(drop)
        },
        |e| {
            matches!(
                e,
                Error::Core(outbox_core::Error::InvalidMsgId(
                    InvalidMsgId::EmptyPart { .. }
                ))
            )
        },
    );
    let mut conn = B::connect(&db);
    assert_eq!(
        B::scalar(
            &mut conn,
            "SELECT COUNT(*) AS n FROM outbox WHERE msg_id LIKE 'batch-%'"
        ),
        0
    );
}

/// A database nobody migrated: emit fails with the database's own words naming the
/// table, the caller's transaction (which propagates it) rolls back, and the consumer's
/// inbox reports a store failure without applying anything.
fn missing_tables_are_a_clear_error_and_nothing_commits<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    exec(&mut conn, "DROP TABLE consumed_msg; DROP TABLE outbox;");
    let before = balances::<B>(&mut conn);
    let result = conn.transaction(|c| {
        exec(c, "UPDATE accounts SET balance = 0 WHERE id = 'alice'");
        c.emit(paid("o-1"))?;
        Ok::<_, Error>(())
    });
    let e = result.unwrap_err();
    assert!(matches!(e, Error::Database(_)), "{e:?}");
    let text = outbox_core::error_chain(&e).to_string();
    assert!(
        text.contains("outbox") && (text.contains("exist") || text.contains("no such table")),
        "{text}"
    );
    assert!(!e.is_invalid_event() && !e.is_duplicate());
    let after = balances::<B>(&mut conn);
    assert_eq!(
        after, before,
        "the business write committed without its event"
    );

    let inbox = DieselInbox::new(B::pool(&db, 1));
    let id = MsgId::new("o-1:OrderPaid").unwrap();
    let mut ran = false;
    let e = inbox
        .process("g", &id, |c: &mut B::Conn| {
            ran = true;
            c.batch_execute("UPDATE accounts SET balance = 0 WHERE id = 'bob'")?;
            Ok(())
        })
        .unwrap_err();
    assert!(!ran, "the handler ran without a dedup table");
    assert!(e.is_outage(), "{e:?}");
    assert!(
        outbox_core::error_chain(&e)
            .to_string()
            .contains("consumed_msg"),
        "{e}"
    );
}

/// Each backend's SQL for recording a migration version and checking an index.
fn newer_release_sql<B: Backend>() -> (&'static str, &'static str, &'static str) {
    match B::NAME {
        "PostgreSQL" => (
            "INSERT INTO outbox_migrations (version) VALUES (2)",
            "DROP INDEX outbox_sent",
            "SELECT COUNT(*) AS n FROM pg_indexes WHERE indexname = 'outbox_sent' \
             AND schemaname = current_schema()",
        ),
        // The partitioned layout has no `outbox_sent` (retention drops partitions).
        "PostgreSQL (partitioned)" => (
            "INSERT INTO outbox_migrations (version) VALUES (2)",
            "DROP INDEX outbox_dead",
            "SELECT COUNT(*) AS n FROM pg_indexes WHERE indexname = 'outbox_dead' \
             AND schemaname = current_schema()",
        ),
        "MariaDB" => (
            "INSERT INTO outbox_migrations (version, applied_at) VALUES (2, UTC_TIMESTAMP(6))",
            "DROP INDEX outbox_sent ON outbox",
            "SELECT COUNT(*) AS n FROM information_schema.statistics \
             WHERE table_schema = DATABASE() AND index_name = 'outbox_sent'",
        ),
        _ => (
            "INSERT INTO outbox_migrations (version) VALUES (2)",
            "DROP INDEX outbox_sent",
            "SELECT COUNT(*) AS n FROM sqlite_master WHERE name = 'outbox_sent'",
        ),
    }
}

/// Tables a newer release migrated (it recorded version 2 and, say, replaced an index):
/// this release's migrate refuses with `SchemaTooNew` and changes nothing, instead of
/// re-creating what the newer one removed.
fn tables_of_a_newer_release_are_left_alone<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    conn.transaction(|c| c.emit(paid("kept")).map(drop))
        .unwrap();
    let (record, drop_index, count_index) = newer_release_sql::<B>();
    exec(&mut conn, record);
    exec(&mut conn, drop_index);
    let before = snapshot::<B>(&mut conn);

    let e = outbox_diesel::migrate(&mut conn).unwrap_err();
    assert!(
        matches!(
            e,
            Error::SchemaTooNew {
                found: 2,
                supported: MIGRATION_VERSION
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "the outbox tables are at migration version 2, newer than this release knows (1): \
         nothing was changed; use the release that migrated them"
    );
    assert_eq!(
        B::scalar(&mut conn, count_index),
        0,
        "migrate re-created the index"
    );
    assert_eq!(snapshot::<B>(&mut conn), before);
    assert_eq!(
        B::scalar(&mut conn, "SELECT COUNT(*) AS n FROM outbox_migrations"),
        2
    );
}

/// Tables migrated before `outbox_migrations` existed are brought up to date; running
/// migrate again records nothing twice.
fn tables_without_a_recorded_version_are_migrated<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    exec(&mut conn, "DROP TABLE outbox_migrations");
    outbox_diesel::migrate(&mut conn).unwrap();
    outbox_diesel::migrate(&mut conn).unwrap();
    assert_eq!(
        B::scalar(
            &mut conn,
            "SELECT COUNT(*) AS n FROM outbox_migrations WHERE version = 1"
        ),
        1
    );
    assert_eq!(
        B::scalar(
            &mut conn,
            "SELECT COUNT(*) AS n FROM outbox_migrations WHERE version <> 1"
        ),
        0
    );
}

/// Inserts a NEW row by SQL, as a foreign producer might: a copy of the row of
/// `good:OrderPaid` with `msg_id` and `headers` as given.
fn insert_raw<B: Backend>(c: &mut B::Conn, msg_id: &str, headers: &str) -> i64 {
    exec(
        c,
        &format!(
            "INSERT INTO outbox (msg_id, topic, event_type, msg_key, schema_version, payload, \
             headers, next_retry_at, created_at) \
             SELECT '{msg_id}', topic, event_type, msg_key, schema_version, payload, \
             '{headers}', next_retry_at, created_at FROM outbox WHERE msg_id = 'good:OrderPaid'"
        ),
    );
    B::scalar(
        c,
        &format!("SELECT id AS n FROM outbox WHERE msg_id = '{msg_id}'"),
    )
}

fn unreadable(row: &OutboxRow) -> &UnreadableRecord {
    match row {
        OutboxRow::Unreadable(u) => u,
        OutboxRow::Readable(r) => panic!("row {} decodes: {r:?}", r.id),
    }
}

/// Rows the relay dead-letters because they do not decode (a msg_id with whitespace,
/// headers that are not strings) are listed, found, refused for a redrive and purged,
/// next to a DEAD row that decodes.
fn unreadable_dead_letters_are_listed_refused_for_redrive_and_purged<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    conn.emit(paid("good")).unwrap();
    let good = B::scalar(
        &mut conn,
        "SELECT id AS n FROM outbox WHERE msg_id = 'good:OrderPaid'",
    );
    let bad_id = insert_raw::<B>(&mut conn, "acc bad id", "{}");
    let bad_headers = insert_raw::<B>(&mut conn, "h:OrderPaid", r#"{"retries": 3}"#);
    // The relay dead-letters the two unreadable rows and publishes the good one; then the
    // good one is made DEAD too, as a rejected message would be.
    let relay = outbox_core::Relay::new(B::store(&db), outbox_core::MemoryBroker::new());
    let report = runtime().block_on(relay.run_once()).unwrap();
    assert_eq!((report.claimed, report.sent), (1, 1), "{report:?}");
    exec(
        &mut conn,
        &format!("UPDATE outbox SET status = 2, last_error = 'rejected' WHERE id = {good}"),
    );

    let dead = outbox_diesel::dead_letters(&mut conn, 0, 10).unwrap();
    assert_eq!(
        dead.iter().map(OutboxRow::id).collect::<Vec<_>>(),
        [good, bad_id, bad_headers]
    );
    assert!(
        matches!(&dead[0], OutboxRow::Readable(r) if r.envelope.msg_id.as_str() == "good:OrderPaid")
    );
    let u = unreadable(&dead[1]);
    assert_eq!(
        (
            u.msg_id.as_str(),
            u.topic.as_str(),
            u.status(),
            u.payload.contains("1999")
        ),
        ("acc bad id", "order.paid", Some(Status::Dead), true)
    );
    assert!(
        u.reason.contains("\"acc bad id\" contains whitespace"),
        "{u:?}"
    );
    assert!(
        u.last_error
            .as_deref()
            .is_some_and(|e| e.starts_with("unreadable row: msg_id")),
        "the relay's reason: {u:?}"
    );
    assert!(u.created_at.is_some() && u.next_retry_at.is_some(), "{u:?}");
    let u = unreadable(&dead[2]);
    assert!(
        u.reason
            .contains("headers are not a JSON object of strings"),
        "{u:?}"
    );
    assert_eq!(u.headers.replace(' ', ""), r#"{"retries":3}"#);

    // Found by its stored msg_id and by id; the decoding calls say which row and why.
    let found = outbox_diesel::find_row(&mut conn, "acc bad id")
        .unwrap()
        .unwrap();
    assert_eq!(unreadable(&found).id, bad_id);
    let by_id = outbox_diesel::list_rows(&mut conn, None, bad_id - 1, 1).unwrap();
    assert_eq!(unreadable(&by_id[0]).id, bad_id);
    let e = outbox_diesel::find_message(&mut conn, "acc bad id").unwrap_err();
    assert!(
        matches!(e, Error::CorruptRow { id, .. } if id == bad_id),
        "{e:?}"
    );

    // A redrive that selects one is refused as a whole; redrive_all leaves them DEAD.
    let before = outbox_diesel::dead_letters(&mut conn, 0, 10).unwrap();
    let e = outbox_diesel::redrive(&mut conn, &[good, bad_id]).unwrap_err();
    assert!(
        matches!(&e, Error::UnreadableRow { id, reason } if *id == bad_id && reason.contains("whitespace")),
        "{e:?}"
    );
    assert!(e.to_string().contains("fix the row or purge it"), "{e}");
    assert_eq!(
        outbox_diesel::dead_letters(&mut conn, 0, 10).unwrap(),
        before,
        "nothing changed"
    );
    assert_eq!(outbox_diesel::redrive_all(&mut conn).unwrap(), 1);
    let left: Vec<i64> = outbox_diesel::dead_letters(&mut conn, 0, 10)
        .unwrap()
        .iter()
        .map(OutboxRow::id)
        .collect();
    assert_eq!(left, [bad_id, bad_headers]);
    assert_eq!(
        outbox_diesel::find_message(&mut conn, "good:OrderPaid")
            .unwrap()
            .unwrap()
            .status,
        Status::New
    );

    // Fixed, it is a message again and can be re-driven.
    exec(
        &mut conn,
        &format!("UPDATE outbox SET headers = '{{}}' WHERE id = {bad_headers}"),
    );
    assert_eq!(
        outbox_diesel::redrive(&mut conn, &[bad_headers]).unwrap(),
        1
    );
    assert_eq!(outbox_diesel::purge_dead(&mut conn, &[bad_id]).unwrap(), 1);
    assert!(
        outbox_diesel::dead_letters(&mut conn, 0, 10)
            .unwrap()
            .is_empty()
    );
    assert_eq!(outbox_diesel::backlog(&mut conn).unwrap().dead, 0);
}

/// A row with a status no release writes is listed as unreadable, not a failed listing.
fn an_unknown_status_is_listed_as_unreadable<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    conn.emit(paid("a")).unwrap();
    exec(&mut conn, "UPDATE outbox SET status = 7");
    let rows = outbox_diesel::list_rows(&mut conn, None, 0, 10).unwrap();
    let u = unreadable(&rows[0]);
    assert_eq!(
        (u.status, u.status(), u.msg_id.as_str()),
        (7, None, "a:OrderPaid")
    );
    assert!(u.reason.contains('7'), "{u:?}");
    let e = outbox_diesel::list_messages(&mut conn, None, 0, 10).unwrap_err();
    assert!(matches!(e, Error::CorruptRow { .. }), "{e:?}");
}

outbox_tests::on_every_backend! {
    postgres => Pg, postgres_partitioned => PgParted, mariadb => My, sqlite => Lite;
    unreadable_dead_letters_are_listed_refused_for_redrive_and_purged,
    an_unknown_status_is_listed_as_unreadable,
    an_empty_id_field_is_refused,
    an_empty_template_part_is_refused,
    an_overlong_id_is_refused,
    whitespace_or_control_characters_in_an_id_are_refused,
    a_2_mib_payload_is_refused,
    an_overlong_ordering_key_is_refused,
    a_duplicate_is_refused_and_the_first_stays,
    one_bad_event_in_emit_all_writes_none_of_them,
    missing_tables_are_a_clear_error_and_nothing_commits,
    tables_of_a_newer_release_are_left_alone,
    tables_without_a_recorded_version_are_migrated,
}

/// PostgreSQL takes timestamps chrono cannot hold (`infinity`): the relay dead-letters
/// such a row, and the listings show it as unreadable instead of failing on the cast.
#[test]
fn postgres_an_infinite_created_at_is_listed_as_unreadable() {
    let db = Pg::create();
    let mut conn = Pg::connect(&db);
    conn.emit(paid("forever")).unwrap();
    exec(&mut conn, "UPDATE outbox SET created_at = 'infinity'");
    let relay = outbox_core::Relay::new(Pg::store(&db), outbox_core::MemoryBroker::new());
    let report = runtime().block_on(relay.run_once()).unwrap();
    assert_eq!((report.claimed, report.sent), (0, 0), "{report:?}");
    let dead = outbox_diesel::dead_letters(&mut conn, 0, 10).unwrap();
    let u = unreadable(&dead[0]);
    assert_eq!(
        (u.msg_id.as_str(), u.created_at),
        ("forever:OrderPaid", None)
    );
    assert_eq!(u.reason, "created_at is out of range");
    assert_eq!(outbox_diesel::purge_dead(&mut conn, &[u.id]).unwrap(), 1);
}

/// On PostgreSQL migrate may run inside the caller's transaction: the version probe on
/// a database without `outbox_migrations` does not abort it.
#[test]
fn postgres_migrate_inside_a_transaction_leaves_it_usable() {
    let db = Pg::create();
    let mut conn = Pg::connect(&db);
    exec(&mut conn, "DROP TABLE outbox_migrations");
    conn.transaction(|c| {
        outbox_diesel::migrate(c)?;
        c.emit(paid("after-migrate"))?;
        Ok::<_, Error>(())
    })
    .unwrap();
    assert_eq!(
        Pg::scalar(
            &mut conn,
            "SELECT COUNT(*) AS n FROM outbox WHERE msg_id = 'after-migrate:OrderPaid'"
        ),
        1
    );
}

// ---- wrong passwords and unreachable servers, through the library ----

/// Neither the error's `Display` (with its sources) nor its `Debug` holds `secret`.
/// A pool that does not connect until asked, so that each use meets the server.
fn lazy_pool<C: diesel::r2d2::R2D2Connection + 'static>(url: &str) -> Pool<ConnectionManager<C>> {
    Pool::builder()
        .max_size(1)
        .connection_timeout(Duration::from_secs(3))
        .build_unchecked(ConnectionManager::new(url))
}

#[test]
fn postgres_wrong_password_is_a_clear_error_without_the_password() {
    let server = outbox_tests::ScratchPostgres::start();
    let secret = "Wr0ng-PG-Secret";
    let url = server.url_with_password(secret);

    // The one-call constructor: its pool cannot open a connection.
    let e = PgRelayStore::connect(&url, 1).unwrap_err();
    assert!(matches!(e, Error::Pool(_)), "{e:?}");
    assert!(
        outbox_core::error_chain(&e)
            .to_string()
            .contains("password authentication failed"),
        "{e}"
    );
    assert_hidden(&e, secret);

    // A store over a pool that connects lazily: every claim is an outage (the relay
    // backs off as a whole, spending no message's retries), with the server's words.
    let store = PgRelayStore::new(lazy_pool(&url)).with_listener(url.clone());
    let rt = runtime();
    let e = rt.block_on(store.claim(10)).unwrap_err();
    assert!(e.is_outage(), "{e:?}");
    assert!(
        outbox_core::error_chain(&e)
            .to_string()
            .contains("password authentication failed"),
        "{e}"
    );
    assert_hidden(&e, secret);
    // Waiting with the listener fails quietly (it logs and polls); nothing to leak there.
    rt.block_on(outbox_core::RelayStore::wait_for_work(
        &store,
        Duration::from_millis(100),
    ));
    assert!(!format!("{store:?}").contains(secret), "{store:?}");

    let inbox = DieselInbox::<PgConnection>::new(lazy_pool(&url));
    let e = inbox
        .process("g", &MsgId::new("a:B").unwrap(), |_| Ok(()))
        .unwrap_err();
    assert!(e.is_outage(), "{e:?}");
    assert_hidden(&e, secret);
    assert!(!format!("{inbox:?}").contains(secret));

    // The right password works: the refusal was the password's.
    let mut ok =
        PgConnection::establish(&server.url_with_password(outbox_tests::ScratchPostgres::PASSWORD))
            .expect("the right password connects");
    exec(&mut ok, "SELECT 1");
}

#[test]
fn mariadb_wrong_password_is_a_clear_error_without_the_password() {
    let user = MariadbUser::new("bad_input");
    let secret = "Wr0ng-Maria-Secret";
    let url = user.url_with_password(secret);

    let Err(e) = MysqlConnection::establish(&url) else {
        panic!("a wrong password connected");
    };
    let e = Error::from(e);
    assert!(
        outbox_core::error_chain(&e)
            .to_string()
            .contains("Access denied"),
        "{e}"
    );
    assert_hidden(&e, secret);

    let store = MysqlRelayStore::new(lazy_pool(&url));
    let e = runtime().block_on(store.claim(10)).unwrap_err();
    assert!(e.is_outage(), "{e:?}");
    assert!(
        outbox_core::error_chain(&e)
            .to_string()
            .contains("Access denied"),
        "{e}"
    );
    assert_hidden(&e, secret);

    let inbox = DieselInbox::<MysqlConnection>::new(lazy_pool(&url));
    let e = inbox
        .process("g", &MsgId::new("a:B").unwrap(), |_| Ok(()))
        .unwrap_err();
    assert!(e.is_outage(), "{e:?}");
    assert_hidden(&e, secret);

    // The right password works: the refusal was the password's.
    let mut ok = MysqlConnection::establish(&user.url_with_password(MariadbUser::PASSWORD))
        .expect("connects");
    exec(&mut ok, "SELECT 1");
}

#[test]
fn unreachable_servers_are_outages_with_the_drivers_words() {
    // Port 1 on the loopback: nothing listens, the connection is refused at once.
    let rt = runtime();
    let pg = PgRelayStore::new(lazy_pool("postgres://u:Pg-Secret-1@127.0.0.1:1/db"));
    let e = rt.block_on(pg.claim(1)).unwrap_err();
    assert!(e.is_outage(), "{e:?}");
    assert!(
        outbox_core::error_chain(&e)
            .to_string()
            .contains("Connection refused"),
        "{e}"
    );
    assert_hidden(&e, "Pg-Secret-1");

    let my = MysqlRelayStore::new(lazy_pool("mysql://u:My-Secret-1@127.0.0.1:1/db"));
    let e = rt.block_on(my.claim(1)).unwrap_err();
    assert!(e.is_outage(), "{e:?}");
    assert!(
        outbox_core::error_chain(&e)
            .to_string()
            .contains("Can't connect"),
        "{e}"
    );
    assert_hidden(&e, "My-Secret-1");
}
