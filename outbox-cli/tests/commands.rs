//! `outbox migrate`, `status`, `dead …` and `purge …` against the real databases, and
//! how bad input fails.

mod fixtures;

use fixtures::{Backend, Mariadb, Postgres, Sqlite, TestDb, outbox};
use predicates::prelude::*;
use predicates::str::contains;
use serde_json::json;

outbox_tests::on_every_backend! {
    postgres => Postgres, mariadb => Mariadb, sqlite => Sqlite;
    migrate_is_idempotent,
    status_counts_due_new_the_oldest_age_and_dead,
    dead_letters_list_show_redrive_and_purge,
    unreadable_dead_letters_are_shown_refused_for_redrive_and_purged,
    purge_deletes_only_old_sent_messages_and_dedup_records,
}

fn migrate_is_idempotent<B: Backend>() {
    let db = &TestDb::new(B::ENGINE);
    for _ in 0..2 {
        db.outbox()
            .arg("migrate")
            .assert()
            .success()
            .stdout(contains("outbox tables are up to date"));
    }
    assert_eq!(
        db.status(),
        json!({"due": 0, "oldest_due_age_seconds": null, "dead": 0})
    );
    // The printed SQL is the backend's own migration.
    db.outbox()
        .args(["migrate", "--print"])
        .assert()
        .success()
        .stdout(contains("CREATE TABLE IF NOT EXISTS outbox"));
}

fn status_counts_due_new_the_oldest_age_and_dead<B: Backend>() {
    let db = &TestDb::new(B::ENGINE);
    db.migrate();
    db.outbox()
        .arg("status")
        .assert()
        .success()
        .stdout("due NEW messages:  0\noldest due age:    -\nDEAD messages:     0\n");

    db.emit(1..=3);
    db.exec(&format!(
        "UPDATE outbox SET created_at = {} WHERE msg_id = '1:Ping'",
        db.ago(7200)
    ));
    db.kill(&[3]);

    let status = db.status();
    assert_eq!(
        (status["due"].clone(), status["dead"].clone()),
        (json!(2), json!(1)),
        "{status}"
    );
    let age = status["oldest_due_age_seconds"].as_f64().expect("an age");
    assert!(
        (7200.0..86_400.0).contains(&age),
        "the aged row is the oldest: {status}"
    );
    db.outbox()
        .arg("status")
        .assert()
        .success()
        .stdout(contains("due NEW messages:  2\noldest due age:    2h"))
        .stdout(contains("DEAD messages:     1"));
}

fn dead_letters_list_show_redrive_and_purge<B: Backend>() {
    let db = &TestDb::new(B::ENGINE);
    db.migrate();
    db.emit(1..=4);
    db.kill(&[1, 2, 3]);

    let list = db.json(&["dead", "list", "--json"]);
    let msg_ids: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["msg_id"].as_str().unwrap())
        .collect();
    assert_eq!(msg_ids, ["1:Ping", "2:Ping", "3:Ping"]);
    assert_eq!(list[0]["status"], "DEAD");
    assert_eq!(list[0]["retries"], 10);
    assert_eq!(list[0]["last_error"], "WRONGTYPE 1");
    assert_eq!(list[0]["payload"], json!({"n": 1}));
    let (id1, id2) = (db.id_of(1), db.id_of(2));

    // Pages: a full page says how to get the next one.
    let page = db.stdout(&["dead", "list", "--limit", "2"]);
    assert!(
        page.contains("1:Ping") && page.contains("2:Ping") && !page.contains("3:Ping"),
        "{page}"
    );
    assert!(page.contains("WRONGTYPE 2"), "{page}");
    assert!(
        page.contains(&format!("outbox dead list --after {id2}")),
        "{page}"
    );
    let rest = db.json(&["dead", "list", "--after", &id2.to_string(), "--json"]);
    assert_eq!(rest.as_array().unwrap().len(), 1);
    assert_eq!(rest[0]["msg_id"], "3:Ping");

    // Show by row id and by msg_id.
    let shown = db.stdout(&["dead", "show", &id1.to_string()]);
    for expected in [
        "msg_id:         1:Ping",
        "status:         DEAD",
        "last error:     WRONGTYPE 1",
        "\"n\": 1",
    ] {
        assert!(shown.contains(expected), "missing {expected:?} in\n{shown}");
    }
    assert_eq!(db.json(&["dead", "show", "2:Ping", "--json"])["id"], id2);
    db.outbox()
        .args(["dead", "show", "999999999"])
        .assert()
        .code(1)
        .stderr(contains(
            "error: no outbox message with id or msg_id `999999999`",
        ))
        .stderr(contains("panicked").not());

    // Re-drive one; a NEW message in the list is left alone with a warning.
    db.outbox()
        .args(["dead", "redrive", &id1.to_string(), "4:Ping"])
        .assert()
        .success()
        .stdout(contains("re-drove 1 DEAD message(s)"))
        .stderr(contains("4:Ping) is NEW, not DEAD: left alone"));
    let redriven = db.json(&["dead", "show", "1:Ping", "--json"]);
    assert_eq!(
        (redriven["status"].as_str(), redriven["retries"].as_u64()),
        (Some("NEW"), Some(0))
    );
    assert_eq!(redriven["last_error"], json!(null));
    assert_eq!(
        (db.status()["due"].clone(), db.status()["dead"].clone()),
        (json!(2), json!(2))
    );

    // An unknown id fails before anything changes.
    db.outbox()
        .args(["dead", "redrive", "3:Ping", "nope:Ping"])
        .assert()
        .code(1)
        .stderr(contains("no outbox message with id or msg_id `nope:Ping`"));
    assert_eq!(db.status()["dead"], 2);

    // Purge one by msg_id: it is gone.
    db.outbox()
        .args(["dead", "purge", "2:Ping"])
        .assert()
        .success()
        .stdout(contains("deleted 1 DEAD message(s)"));
    db.outbox()
        .args(["dead", "show", "2:Ping"])
        .assert()
        .code(1);

    db.outbox()
        .args(["dead", "redrive", "--all"])
        .assert()
        .success()
        .stdout(contains("re-drove 1 DEAD message(s)"));
    assert_eq!(db.status()["dead"], 0);
    assert_eq!(db.status()["due"], 3);

    // Purge all: every DEAD row goes, nothing else is touched.
    db.kill(&[1, 3]);
    db.outbox()
        .args(["dead", "purge", "--all"])
        .assert()
        .success()
        .stdout(contains("deleted 2 DEAD message(s)"));
    assert_eq!(db.json(&["dead", "list", "--json"]), json!([]));
    assert_eq!(db.status()["due"], 1, "4:Ping is still NEW");
    db.stdout(&["dead", "show", "4:Ping"]);
}

/// DEAD rows whose fields do not decode (written around the library, dead-lettered by
/// the relay) are listed and shown as stored, escaped, with the reason; a redrive that
/// selects one is refused and changes nothing, `redrive --all` leaves them DEAD and says
/// so, purge deletes them.
fn unreadable_dead_letters_are_shown_refused_for_redrive_and_purged<B: Backend>() {
    let db = &TestDb::new(B::ENGINE);
    db.migrate();
    db.emit(1..=2);
    db.kill(&[1]);
    let bad_id = db.forge_dead("acc bad id", "cli.ping", "{}");
    let bad_headers = db.forge_dead("h:Ping", "red\u{1b}[31mtopic", r#"{"retries": 3}"#);

    let list = db.stdout(&["dead", "list"]);
    for needle in [
        "\"acc bad id\"",
        "UNREADABLE: msg_id \"acc bad id\" contains whitespace",
        "UNREADABLE: headers are not a JSON object of strings",
        "red\\u{1b}[31mtopic",
        "1:Ping",
        "(2 UNREADABLE:",
    ] {
        assert!(list.contains(needle), "{needle:?} not in:\n{list}");
    }
    assert!(
        !list.contains('\u{1b}'),
        "a control character reached the terminal:\n{list}"
    );
    let json = db.json(&["dead", "list", "--json"]);
    assert_eq!(json.as_array().map(Vec::len), Some(3), "{json}");
    assert_eq!(json[0]["msg_id"], "1:Ping");
    assert!(json[0].get("unreadable").is_none(), "{json}");
    assert_eq!(json[1]["msg_id"], "acc bad id");
    assert_eq!(json[1]["id"], bad_id);
    assert_eq!(json[1]["status"], "DEAD");
    assert_eq!(json[1]["payload"], json!({"n": 1}));
    assert!(
        json[1]["unreadable"]
            .as_str()
            .is_some_and(|r| r.contains("contains whitespace")),
        "{json}"
    );
    assert_eq!(json[2]["headers"], json!({"retries": 3}));

    let shown = db.stdout(&["dead", "show", "acc bad id"]);
    assert!(
        shown.contains(&format!("id:             {bad_id}"))
            && shown.contains("UNREADABLE:     msg_id \"acc bad id\"")
            && shown.contains("fix the row before a redrive"),
        "{shown}"
    );
    let shown = db.json(&["dead", "show", &bad_headers.to_string(), "--json"]);
    assert!(
        shown["unreadable"]
            .as_str()
            .is_some_and(|r| r.contains("headers")),
        "{shown}"
    );

    // A redrive that selects an unreadable row is refused as a whole.
    db.outbox()
        .args(["dead", "redrive", "1:Ping", &bad_id.to_string()])
        .assert()
        .code(1)
        .stderr(contains("error: refused to redrive"))
        .stderr(contains(format!("outbox row {bad_id} cannot be re-driven")))
        .stderr(contains("fix the row or purge it"));
    assert_eq!(db.status()["dead"], 3, "nothing was re-driven");
    // --all re-drives the others and says which stay DEAD.
    db.outbox()
        .args(["dead", "redrive", "--all"])
        .assert()
        .success()
        .stdout(contains("re-drove 1 DEAD message(s)"))
        .stderr(contains(format!(
            "warning: message {bad_id} (\"acc bad id\") is unreadable"
        )))
        .stderr(contains(format!(
            "warning: message {bad_headers} (\"h:Ping\") is unreadable"
        )));
    assert_eq!(db.status()["dead"], 2);
    assert_eq!(
        db.json(&["dead", "show", "1:Ping", "--json"])["status"],
        "NEW"
    );

    db.outbox()
        .args(["dead", "purge", "acc bad id"])
        .assert()
        .success()
        .stdout(contains("deleted 1 DEAD message(s)"));
    db.outbox()
        .args(["dead", "purge", "--all"])
        .assert()
        .success()
        .stdout(contains("deleted 1 DEAD message(s)"));
    assert_eq!(db.status()["dead"], 0);
    assert_eq!(db.stdout(&["dead", "list"]), "no dead letters\n");
}

fn purge_deletes_only_old_sent_messages_and_dedup_records<B: Backend>() {
    let db = &TestDb::new(B::ENGINE);
    db.migrate();
    db.emit(1..=5);
    let day = 86_400;
    for (n, days) in [(1, 10), (2, 8), (3, 1)] {
        db.exec(&format!(
            "UPDATE outbox SET status = 1, sent_at = {} WHERE msg_id = '{n}:Ping'",
            db.ago(days * day)
        ));
    }
    // Old NEW and DEAD messages are never purged as SENT.
    db.exec(&format!(
        "UPDATE outbox SET created_at = {} WHERE msg_id IN ('4:Ping', '5:Ping')",
        db.ago(30 * day)
    ));
    db.kill(&[5]);

    db.outbox()
        .args(["purge", "sent", "--older-than", "7d", "--batch-size", "1"])
        .assert()
        .success()
        .stdout(contains(
            "deleted 2 SENT message(s) published more than 7days ago",
        ));
    db.outbox()
        .args(["dead", "show", "1:Ping"])
        .assert()
        .code(1);
    db.outbox()
        .args(["dead", "show", "2:Ping"])
        .assert()
        .code(1);
    assert_eq!(
        db.json(&["dead", "show", "3:Ping", "--json"])["status"],
        "SENT"
    );
    assert_eq!(
        db.json(&["dead", "show", "4:Ping", "--json"])["status"],
        "NEW"
    );
    assert_eq!(
        db.json(&["dead", "show", "5:Ping", "--json"])["status"],
        "DEAD"
    );

    for (msg_id, days) in [("old:Ping", 40), ("new:Ping", 1)] {
        db.exec(&format!(
            "INSERT INTO consumed_msg (consumer_group, msg_id, consumed_at) VALUES ('points', '{msg_id}', {})",
            db.ago(days * day)
        ));
    }
    db.outbox()
        .args(["purge", "consumed", "--older-than", "30d"])
        .assert()
        .success()
        .stdout(contains(
            "deleted 1 consumed_msg record(s) older than 30days",
        ));
    // The recent record was kept: a zero retention deletes it now.
    db.outbox()
        .args(["purge", "consumed", "--older-than", "0s"])
        .assert()
        .success()
        .stdout(contains("deleted 1 consumed_msg record(s)"));
}

#[test]
fn migrate_print_needs_no_database() {
    outbox()
        .args(["migrate", "--print", "--backend", "mysql"])
        .assert()
        .success()
        .stdout(contains("ENGINE = InnoDB"));
    outbox()
        .args(["migrate", "--print", "--backend", "postgres", "--down"])
        .assert()
        .success()
        .stdout(contains("DROP TABLE"));
    let db = TestDb::sqlite();
    db.outbox()
        .args(["migrate", "--print"])
        .assert()
        .success()
        .stdout(contains("outbox_relay_lease"));
    assert!(!db.sqlite_path().exists(), "printing creates no database");
}

/// Failures a user can cause: a readable `error:` line, a non-zero exit, never a panic.
fn fails(cmd: &mut assert_cmd::Command, code: i32, message: &str) {
    cmd.assert()
        .code(code)
        .stderr(contains(message))
        .stderr(contains("panicked").not());
}

#[test]
fn an_unknown_url_scheme_is_a_usage_error() {
    for url in ["redis://127.0.0.1/0", "mongodb://h/db", "orders.txt"] {
        fails(
            outbox().args(["--database-url", url, "status"]),
            2,
            "error: unsupported database URL",
        );
    }
}

#[test]
fn a_missing_database_url_is_a_usage_error() {
    fails(
        outbox().arg("status"),
        2,
        "error: no database URL: pass --database-url or set DATABASE_URL",
    );
}

#[test]
fn an_unreachable_database_is_reported() {
    fails(
        outbox().args([
            "--database-url",
            "postgres://postgres@127.0.0.1:1/test",
            "status",
        ]),
        1,
        "error: PostgreSQL is not reachable at postgres://postgres@127.0.0.1:1/test (",
    );
    fails(
        outbox().args([
            "--database-url",
            "mysql://root:secret@127.0.0.1:1/test",
            "dead",
            "list",
        ]),
        1,
        "error: MySQL is not reachable at mysql://root:***@127.0.0.1:1/test (",
    );
    let db = TestDb::sqlite();
    fails(
        db.outbox().arg("status"),
        1,
        "does not exist (`outbox migrate` creates it)",
    );
    assert!(
        !db.sqlite_path().exists(),
        "a read command creates no database"
    );
}

#[test]
fn a_database_without_the_tables_suggests_migrate() {
    let db = TestDb::postgres();
    fails(
        db.outbox().arg("status"),
        1,
        "hint: the outbox tables are missing: run `outbox migrate` first",
    );
}

#[test]
fn bad_durations_and_numbers_are_usage_errors() {
    let db = TestDb::sqlite();
    fails(
        db.outbox().args(["purge", "sent", "--older-than", "7x"]),
        2,
        "invalid value '7x' for '--older-than",
    );
    fails(
        db.outbox().args(["purge", "sent"]),
        2,
        "--older-than <DURATION>",
    );
    fails(
        db.outbox().args(["dead", "list", "--limit", "0"]),
        2,
        "invalid value '0' for '--limit",
    );
    fails(db.outbox().args(["dead", "redrive"]), 2, "error:");
    fails(
        db.outbox().args(["dead", "purge", "1", "--all"]),
        2,
        "cannot be used with",
    );
}
