//! The contract of `outbox-diesel`, run against each backend: PostgreSQL and MariaDB on
//! this machine, SQLite in a temp file.

mod fixtures;

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use chrono::Utc;
use diesel::Connection;
use diesel::connection::SimpleConnection as _;
use fixtures::{Backend, Lite, My, Pg, PgParted, exec, runtime};
use outbox_core::{
    ClaimedBatch, DeadRow, HandlerError, Inbox, MemoryBroker, MsgId, OutboxEvent, Processed, Relay,
    RelayBatchOutcome, RelayConfig, RelayStore, RetryPolicy, Status,
};
use outbox_diesel::{DieselInbox, Emit, EmitOptions, Error, OutboxConnection};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
struct AccountTransferred {
    #[outbox(id)]
    transfer_id: String,
    from: String,
    to: String,
    amount: i64,
}

fn transfer(id: &str, amount: i64) -> AccountTransferred {
    AccountTransferred {
        transfer_id: id.into(),
        from: "alice".into(),
        to: "bob".into(),
        amount,
    }
}

fn move_money<C: OutboxConnection>(c: &mut C, amount: i64) {
    exec(
        c,
        &format!(
            "UPDATE accounts SET balance = balance - {amount} WHERE id = 'alice';
             UPDATE accounts SET balance = balance + {amount} WHERE id = 'bob';"
        ),
    );
}

fn balance<B: Backend>(c: &mut B::Conn, who: &str) -> i64 {
    B::scalar(
        c,
        &format!("SELECT balance AS n FROM accounts WHERE id = '{who}'"),
    )
}

fn outbox_rows<B: Backend>(c: &mut B::Conn) -> i64 {
    B::scalar(c, "SELECT COUNT(*) AS n FROM outbox")
}

fn msg(id: &str) -> String {
    MsgId::from_parts(id, "AccountTransferred")
        .unwrap()
        .into_string()
}

fn record<B: Backend>(c: &mut B::Conn, transfer_id: &str) -> outbox_diesel::OutboxRecord {
    outbox_diesel::find_message(c, &msg(transfer_id))
        .unwrap()
        .unwrap_or_else(|| panic!("no outbox row for {transfer_id}"))
}

fn commit_writes_business_row_and_message<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    let id = conn
        .transaction(|c| {
            move_money(c, 100);
            let id = c.emit(transfer("t-1", 100))?;
            Ok::<_, diesel::result::Error>(id)
        })
        .unwrap();
    assert_eq!(id.as_str(), "t-1:AccountTransferred");
    assert_eq!(balance::<B>(&mut conn, "alice"), 900);
    assert_eq!(balance::<B>(&mut conn, "bob"), 100);
    let r = record::<B>(&mut conn, "t-1");
    assert_eq!(r.status, Status::New);
    assert_eq!(r.retries, 0);
    assert_eq!(r.envelope.topic, "account.transferred");
    assert_eq!(r.envelope.event_type, "AccountTransferred");
    assert_eq!(r.envelope.key, "t-1");
    assert_eq!(r.envelope.schema_version, 1);
    let decoded: AccountTransferred = r.envelope.decode().unwrap();
    assert_eq!(decoded.amount, 100);
    assert!((Utc::now() - r.envelope.created_at).num_seconds().abs() < 60);
    // Visible to another connection: it committed.
    let mut other = B::connect(&db);
    assert_eq!(outbox_rows::<B>(&mut other), 1);

    // A pooled connection works the same way (it derefs to the backend connection).
    let pool = B::pool(&db, 1);
    let mut pooled = pool.get().unwrap();
    pooled
        .transaction(|c| c.emit(transfer("t-2", 1)).map(drop))
        .unwrap();
    assert_eq!(outbox_rows::<B>(&mut other), 2);
}

fn rollback_after_emit_writes_neither<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    let failed = conn.transaction(|c| {
        move_money(c, 100);
        c.emit(transfer("t-1", 100))?;
        Err::<(), _>(diesel::result::Error::RollbackTransaction)
    });
    assert!(failed.is_err());
    assert_eq!(balance::<B>(&mut conn, "alice"), 1000);
    assert_eq!(outbox_rows::<B>(&mut conn), 0);
}

fn panic_inside_transaction_writes_neither<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
        conn.transaction(|c| {
            move_money(c, 100);
            c.emit(transfer("t-1", 100))?;
            panic!("business code panicked after emit");
            #[allow(unreachable_code)]
            Ok::<_, diesel::result::Error>(())
        })
    }));
    assert!(outcome.is_err());
    drop(conn);
    let mut check = B::connect(&db);
    assert_eq!(balance::<B>(&mut check, "alice"), 1000);
    assert_eq!(outbox_rows::<B>(&mut check), 0);
}

fn duplicate_is_reported_and_transaction_stays_usable<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    conn.transaction(|c| c.emit(transfer("t-1", 100)).map(drop))
        .unwrap();

    // Caught inside the closure: the transaction goes on and commits its other writes.
    conn.transaction(|c| {
        move_money(c, 7);
        let e = c.emit(transfer("t-1", 999)).unwrap_err();
        assert!(e.is_duplicate(), "{e}");
        assert!(matches!(&e, Error::Core(outbox_core::Error::Duplicate(id)) if id.as_str() == "t-1:AccountTransferred"));
        c.emit(transfer("t-2", 7))?;
        Ok::<_, diesel::result::Error>(())
    })
    .unwrap();
    assert_eq!(balance::<B>(&mut conn, "bob"), 7);
    assert_eq!(outbox_rows::<B>(&mut conn), 2);
    let first: AccountTransferred = record::<B>(&mut conn, "t-1").envelope.decode().unwrap();
    assert_eq!(first.amount, 100, "the first message is untouched");

    // Propagated with `?`: a diesel error that callers can recognise; all rolled back.
    let e = conn
        .transaction(|c| {
            move_money(c, 1);
            c.emit(transfer("t-1", 1))?;
            Ok::<_, diesel::result::Error>(())
        })
        .unwrap_err();
    assert!(outbox_diesel::is_duplicate(&e), "{e}");
    assert_eq!(balance::<B>(&mut conn, "bob"), 7);

    // emit_all is all or nothing, and leaves the transaction usable too.
    conn.transaction(|c| {
        let e = c
            .emit_all([transfer("t-3", 1), transfer("t-1", 1), transfer("t-4", 1)])
            .unwrap_err();
        assert!(
            matches!(&e, Error::Core(outbox_core::Error::Duplicate(id)) if id.as_str() == "t-1:AccountTransferred"),
            "{e}"
        );
        let e = c
            .emit_all([transfer("t-5", 1), transfer("t-5", 2)])
            .unwrap_err();
        assert!(e.is_duplicate());
        c.emit(transfer("t-6", 1))?;
        Ok::<_, diesel::result::Error>(())
    })
    .unwrap();
    let ids: Vec<String> = outbox_diesel::list_messages(&mut conn, None, 0, 100)
        .unwrap()
        .into_iter()
        .map(|r| r.envelope.msg_id.into_string())
        .collect();
    assert_eq!(ids, [msg("t-1"), msg("t-2"), msg("t-6")]);
}

fn emit_all_writes_every_event_in_order<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    let events: Vec<_> = (0..1500)
        .map(|i| transfer(&format!("b-{i:04}"), i))
        .collect();
    let ids = conn.transaction(|c| c.emit_all::<_, _>(events)).unwrap();
    assert_eq!(ids.len(), 1500);
    let rows = outbox_diesel::list_messages(&mut conn, Some(Status::New), 0, 2000).unwrap();
    let got: Vec<&str> = rows.iter().map(|r| r.envelope.msg_id.as_str()).collect();
    let want: Vec<&str> = ids.iter().map(MsgId::as_str).collect();
    assert_eq!(got, want, "id order is emit order");
    // A duplicate in the second statement (past 1000 rows) takes back the first too.
    let events: Vec<_> = (0..1200)
        .map(|i| transfer(&format!("c-{i:04}"), i))
        .chain([transfer("b-0000", 0)])
        .collect();
    let e = conn
        .transaction(|c| c.emit_all::<_, _>(events))
        .unwrap_err();
    assert!(e.is_duplicate());
    assert_eq!(outbox_rows::<B>(&mut conn), 1500);
    // Headers travel with envelopes.
    let env = outbox_core::Envelope::from_event(&transfer("h-1", 1), 1024)
        .unwrap()
        .with_header("traceparent", "00-abc-def-01");
    conn.emit_envelopes(&EmitOptions::new(), std::slice::from_ref(&env))
        .unwrap();
    let r = record::<B>(&mut conn, "h-1");
    assert_eq!(r.envelope.headers["traceparent"], "00-abc-def-01");
}

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
struct Note {
    #[outbox(id)]
    id: String,
    text: String,
}

fn invalid_events_are_typed_errors<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    conn.transaction(|c| {
        move_money(c, 5);
        let e = c
            .emit(Note {
                id: "has space".into(),
                text: String::new(),
            })
            .unwrap_err();
        assert!(matches!(e, Error::Core(outbox_core::Error::InvalidMsgId(_))), "{e}");
        let e = c
            .emit(Note {
                id: "x".repeat(80),
                text: String::new(),
            })
            .unwrap_err();
        assert!(matches!(e, Error::Core(outbox_core::Error::InvalidMsgId(_))), "{e}");
        let small = EmitOptions::new().with_max_payload_bytes(64);
        let e = c
            .emit_with(
                &small,
                Note {
                    id: "n-1".into(),
                    text: "y".repeat(100),
                },
            )
            .unwrap_err();
        assert!(matches!(e, Error::Core(outbox_core::Error::PayloadTooLarge { limit: 64, .. })), "{e}");
        assert!(e.is_invalid_event());
        // The default limit is 1 MiB.
        let e = c
            .emit(Note {
                id: "n-2".into(),
                text: "z".repeat(1 << 20),
            })
            .unwrap_err();
        assert!(
            matches!(e, Error::Core(outbox_core::Error::PayloadTooLarge { limit, .. }) if limit == 1 << 20),
            "{e}"
        );
        // Options that break their rules are refused before anything is written.
        let unnamed = EmitOptions::new().with_channel("");
        let note = Note {
            id: "n-4".into(),
            text: String::new(),
        };
        let e = c.emit_with(&unnamed, note).unwrap_err();
        assert!(
            matches!(e, Error::Core(outbox_core::Error::Config(_))),
            "{e}"
        );
        // The transaction is still usable.
        c.emit(Note {
            id: "n-3".into(),
            text: "ok".into(),
        })?;
        Ok::<_, diesel::result::Error>(())
    })
    .unwrap();
    assert_eq!(balance::<B>(&mut conn, "bob"), 5);
    assert_eq!(outbox_rows::<B>(&mut conn), 1);
    // Through `?` into diesel's error, the typed error can be recovered.
    let e = conn
        .transaction(|c| {
            c.emit(Note {
                id: "bad id".into(),
                text: String::new(),
            })?;
            Ok::<_, diesel::result::Error>(())
        })
        .unwrap_err();
    assert!(
        matches!(
            Error::from_diesel_ref(&e),
            Some(Error::Core(outbox_core::Error::InvalidMsgId(_)))
        ),
        "{e}"
    );
}

fn migrate_is_idempotent<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    conn.emit(transfer("t-1", 1)).unwrap();
    outbox_diesel::migrate(&mut conn).unwrap();
    outbox_diesel::migrate(&mut conn).unwrap();
    assert_eq!(outbox_rows::<B>(&mut conn), 1);
}

fn emit_statement_is_prepared_once<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    let cached = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let log = cached.clone();
    conn.set_instrumentation(move |event: diesel::connection::InstrumentationEvent<'_>| {
        if let diesel::connection::InstrumentationEvent::CacheQuery { sql, .. } = event {
            log.lock().unwrap().push(sql.to_owned());
        }
    });
    for i in 0..5 {
        conn.transaction(|c| c.emit(transfer(&format!("p-{i}"), i)).map(drop))
            .unwrap();
    }
    let cached = cached.lock().unwrap();
    let inserts: Vec<_> = cached
        .iter()
        .filter(|s| s.contains("INSERT INTO outbox"))
        .collect();
    assert_eq!(
        inserts.len(),
        1,
        "emit's INSERT is prepared once and reused: {cached:?}"
    );
}

async fn relay_transitions<B: Backend>(db: &fixtures::TestDb) {
    let mut conn = B::connect(db);
    for id in ["t-1", "t-2", "t-3"] {
        conn.transaction(|c| c.emit(transfer(id, 1)).map(drop))
            .unwrap();
    }
    let broker = MemoryBroker::new();
    let config = RelayConfig::default().with_batch_size(10).with_retry(
        RetryPolicy::default()
            .with_max_attempts(2)
            .with_base_delay(Duration::from_millis(700))
            .with_max_delay(Duration::from_secs(5))
            .with_jitter(0.0),
    );
    let relay = Relay::new(B::store(db), broker.clone())
        .with_config(config)
        .unwrap();
    broker.reject_next(1);
    let before = Utc::now();
    let report = relay.run_once().await.unwrap();
    assert_eq!(
        (report.claimed, report.sent, report.retried, report.dead),
        (3, 2, 1, 0)
    );
    let r1 = record::<B>(&mut conn, "t-1");
    assert_eq!(r1.status, Status::New);
    assert_eq!(r1.retries, 1);
    assert_eq!(r1.last_error.as_deref(), Some("injected failure"));
    let delay = (r1.next_retry_at - before).num_milliseconds();
    assert!(
        (500..2000).contains(&delay),
        "retry scheduled {delay} ms later"
    );
    for id in ["t-2", "t-3"] {
        let r = record::<B>(&mut conn, id);
        assert_eq!(r.status, Status::Sent);
        assert!(r.sent_at.is_some());
    }
    assert_eq!(broker.published("account.transferred").len(), 2);

    // Not due yet: nothing to claim, and not in the backlog.
    assert_eq!(relay.run_once().await.unwrap().claimed, 0);
    assert_eq!(relay.store().backlog().await.unwrap().due, 0);
    tokio::time::sleep(Duration::from_millis(900)).await;
    let backlog = relay.store().backlog().await.unwrap();
    assert_eq!(backlog.due, 1);
    assert!(backlog.oldest_due_age.unwrap() >= Duration::from_millis(500));

    broker.reject_next(1);
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.claimed, report.dead), (1, 1));
    let r1 = record::<B>(&mut conn, "t-1");
    assert_eq!(r1.status, Status::Dead);
    assert_eq!(r1.retries, 2);
    let backlog = relay.store().backlog().await.unwrap();
    assert_eq!(
        (backlog.due, backlog.dead, backlog.oldest_due_age),
        (0, 1, None)
    );
    assert_eq!(relay.run_once().await.unwrap().claimed, 0);
}

fn relay_marks_sent_and_schedules_retries_then_dead<B: Backend>() {
    let db = B::create();
    runtime().block_on(relay_transitions::<B>(&db));
}

/// A row written around the library (here: headers that are not all strings) is
/// dead-lettered with the reason; the rows around it are published and the relay goes on.
fn an_unreadable_row_is_dead_lettered_not_a_stuck_relay<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    conn.transaction(|c| c.emit(transfer("t-1", 1)).map(drop))
        .unwrap();
    exec(
        &mut conn,
        "INSERT INTO outbox (msg_id, topic, event_type, msg_key, schema_version, payload, headers, \
         next_retry_at, created_at) \
         SELECT 't-2:AccountTransferred', topic, event_type, 't-2', schema_version, payload, \
                '{\"retries\": 3}', next_retry_at, created_at \
         FROM outbox WHERE msg_id = 't-1:AccountTransferred'",
    );
    conn.transaction(|c| c.emit(transfer("t-3", 1)).map(drop))
        .unwrap();
    let broker = MemoryBroker::new();
    let relay = Relay::new(B::store(&db), broker.clone());
    let report = runtime().block_on(relay.run_once()).unwrap();
    assert_eq!((report.claimed, report.sent), (2, 2), "{report:?}");
    let published: Vec<String> = broker
        .published("account.transferred")
        .iter()
        .map(|e| e.msg_id.to_string())
        .collect();
    assert_eq!(published, [msg("t-1"), msg("t-3")]);
    // The unreadable row cannot be read as a record either: count it in SQL.
    assert_eq!(
        B::scalar(
            &mut conn,
            "SELECT COUNT(*) AS n FROM outbox WHERE status = 2 AND last_error LIKE 'unreadable row:%'"
        ),
        1
    );
    assert_eq!(runtime().block_on(relay.run_once()).unwrap().claimed, 0);
}

fn idempotency_applies_the_handler_once<B: Backend>() {
    let db = B::create();
    let inbox = DieselInbox::<B::Conn>::new(B::pool(&db, 2));
    let id = MsgId::new("t-1:AccountTransferred").unwrap();
    let credit = |c: &mut B::Conn| -> Result<(), HandlerError> {
        c.batch_execute("UPDATE accounts SET balance = balance + 10 WHERE id = 'bob'")?;
        Ok(())
    };
    // A failing handler leaves neither its writes nor the dedup row.
    let e = inbox
        .process("points", &id, |c| {
            credit(c)?;
            Err(HandlerError::msg("downstream said no"))
        })
        .unwrap_err();
    assert!(matches!(e, outbox_core::Error::Handler(_)), "{e}");
    assert_eq!(
        inbox.process("points", &id, credit).unwrap(),
        Processed::Applied
    );
    let mut ran = false;
    let second = inbox
        .process("points", &id, |c| {
            ran = true;
            credit(c)
        })
        .unwrap();
    assert_eq!(second, Processed::Duplicate);
    assert!(!ran, "a duplicate does not run the handler");
    // Another group applies it on its own.
    assert_eq!(
        inbox.process("audit", &id, |_| Ok(())).unwrap(),
        Processed::Applied
    );
    let mut conn = B::connect(&db);
    assert_eq!(balance::<B>(&mut conn, "bob"), 10);
    assert_eq!(
        B::scalar(&mut conn, "SELECT COUNT(*) AS n FROM consumed_msg"),
        2
    );
}

fn operations_queries<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    for id in ["t-1", "t-2", "t-3", "t-4"] {
        conn.emit(transfer(id, 1)).unwrap();
    }
    let ids: Vec<i64> = outbox_diesel::list_messages(&mut conn, None, 0, 10)
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    let store = B::store(&db);
    let rt = runtime();
    let claim_complete = |outcome: RelayBatchOutcome| {
        rt.block_on(async {
            let batch = store.claim(3).await.unwrap();
            batch.complete(outcome).await.unwrap();
        })
    };
    claim_complete(RelayBatchOutcome {
        sent: vec![ids[0], ids[1]],
        retry: vec![],
        dead: vec![DeadRow {
            id: ids[2],
            error: "poison".into(),
        }],
    });

    // The two rows just sent, in the last minute (or the one before, across a minute).
    let minutes = outbox_diesel::published_per_minute(&mut conn, 15).unwrap();
    let ago: Vec<u32> = minutes.iter().map(|m| m.minutes_ago).collect();
    assert_eq!(
        ago,
        (0..15).rev().collect::<Vec<_>>(),
        "oldest first, every minute"
    );
    assert_eq!(minutes.iter().map(|m| m.published).sum::<u64>(), 2);
    assert!(
        minutes[13..]
            .iter()
            .any(|m| m.published > 0 && m.avg_latency_seconds.is_some()),
        "{minutes:?}"
    );
    assert!(
        minutes[..13]
            .iter()
            .all(|m| m.published == 0 && m.avg_latency_seconds.is_none())
    );
    let parked = outbox_diesel::parked_relays(&mut conn).unwrap();
    assert_eq!(
        parked.is_some(),
        B::NAME.starts_with("PostgreSQL"),
        "{parked:?}"
    );

    let dead: Vec<_> = outbox_diesel::dead_letters(&mut conn, 0, 10)
        .unwrap()
        .into_iter()
        .map(|r| r.into_record().unwrap())
        .collect();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].id, dead[0].retries), (ids[2], 1));
    assert_eq!(dead[0].last_error.as_deref(), Some("poison"));
    assert!(
        outbox_diesel::dead_letters(&mut conn, ids[2], 10)
            .unwrap()
            .is_empty()
    );
    let b = outbox_diesel::backlog(&mut conn).unwrap();
    assert_eq!((b.due, b.dead), (1, 1));

    assert_eq!(
        outbox_diesel::redrive(&mut conn, &[ids[2], ids[0]]).unwrap(),
        1
    );
    let r = record::<B>(&mut conn, "t-3");
    assert_eq!((r.status, r.retries, r.last_error), (Status::New, 0, None));
    // PostgreSQL gives a redriven row a new id, after every row emitted before (above
    // the relay's claim floor); the others keep it.
    let redriven = r.id;
    if B::NAME.starts_with("PostgreSQL") {
        assert!(redriven > ids[3], "{redriven} after {ids:?}");
    } else {
        assert_eq!(redriven, ids[2]);
    }
    assert_eq!(outbox_diesel::redrive_all(&mut conn).unwrap(), 0);
    assert_eq!(
        outbox_diesel::purge_dead(&mut conn, &[ids[0]]).unwrap(),
        0,
        "SENT rows are not dead"
    );

    // t-3 and t-4 are due again; kill t-3 once more, then purge it.
    claim_complete(RelayBatchOutcome {
        sent: vec![],
        retry: vec![],
        dead: vec![DeadRow {
            id: redriven,
            error: "poison".into(),
        }],
    });
    assert_eq!(
        outbox_diesel::purge_dead(&mut conn, &[redriven]).unwrap(),
        1
    );

    // SENT retention: nothing is old enough; then everything is, in batches of one.
    assert_eq!(
        outbox_diesel::purge_sent(&mut conn, Duration::from_secs(3600), 100).unwrap(),
        0
    );
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        outbox_diesel::purge_sent(&mut conn, Duration::ZERO, 1).unwrap(),
        2
    );
    let left: Vec<String> = outbox_diesel::list_messages(&mut conn, None, 0, 10)
        .unwrap()
        .into_iter()
        .map(|r| r.envelope.msg_id.into_string())
        .collect();
    assert_eq!(left, [msg("t-4")], "NEW rows are never purged");

    let inbox = DieselInbox::<B::Conn>::new(B::pool(&db, 1));
    for id in ["a:E", "b:E", "c:E"] {
        inbox
            .process("g", &MsgId::new(id).unwrap(), |_| Ok(()))
            .unwrap();
    }
    assert_eq!(
        outbox_diesel::purge_consumed(&mut conn, Duration::from_secs(3600), 10).unwrap(),
        0
    );
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        outbox_diesel::purge_consumed(&mut conn, Duration::ZERO, 2).unwrap(),
        3
    );
    drop(store);
}

fn retrying_counts_the_new_rows_that_failed<B: Backend>() {
    let db = B::create();
    let mut conn = B::connect(&db);
    assert_eq!(
        outbox_diesel::retrying(&mut conn).unwrap(),
        outbox_diesel::Retrying::default()
    );
    for id in ["r-1", "r-2", "r-3", "r-4"] {
        conn.emit(transfer(id, 1)).unwrap();
    }
    let rows = outbox_diesel::list_messages(&mut conn, None, 0, 10).unwrap();
    let store = B::store(&db);
    let retry = |id: i64| outbox_core::RetryRow {
        id,
        next_retry_at: Utc::now(),
        error: "refused".into(),
    };
    let rt = runtime();
    // r-1 fails twice, r-2 once, r-4 goes DEAD (not counted), r-3 is sent.
    for retry in [
        vec![retry(rows[0].id), retry(rows[1].id)],
        vec![retry(rows[0].id)],
    ] {
        rt.block_on(async {
            let batch = store.claim(4).await.unwrap();
            let dead = (batch.messages().len() == 4).then_some(DeadRow {
                id: rows[3].id,
                error: "poison".into(),
            });
            let sent = batch.messages().iter().map(|m| m.id);
            let sent = sent.filter(|id| *id == rows[2].id).collect();
            let outcome = RelayBatchOutcome {
                sent,
                retry,
                dead: dead.into_iter().collect(),
            };
            batch.complete(outcome).await.unwrap();
        });
    }
    let keys: std::collections::HashSet<_> = rows[..2].iter().map(|r| &r.envelope.key).collect();
    let r = outbox_diesel::retrying(&mut conn).unwrap();
    assert_eq!(
        (r.messages, r.keys, r.most_retries),
        (2, keys.len() as u64, 2),
        "{r:?}"
    );
    drop(store);
}

outbox_tests::on_every_backend! {
    postgres => Pg, postgres_partitioned => PgParted, mariadb => My, sqlite => Lite;
    commit_writes_business_row_and_message,
    rollback_after_emit_writes_neither,
    panic_inside_transaction_writes_neither,
    duplicate_is_reported_and_transaction_stays_usable,
    emit_all_writes_every_event_in_order,
    invalid_events_are_typed_errors,
    migrate_is_idempotent,
    emit_statement_is_prepared_once,
    relay_marks_sent_and_schedules_retries_then_dead,
    an_unreadable_row_is_dead_lettered_not_a_stuck_relay,
    idempotency_applies_the_handler_once,
    operations_queries,
    retrying_counts_the_new_rows_that_failed,
}
