//! `outbox migrate --cdc`, `outbox relay --cdc`, `outbox status` and `/readyz` in CDC
//! mode, against a private PostgreSQL cluster with `wal_level = logical` (the shared
//! server runs `replica`).

mod fixtures;

use diesel::{Connection as _, PgConnection};
use fixtures::cdc::{
    BULK_ROWS, cdc_relay, emit, free_addr, get, migrate_cdc, relayed_within_memory, status,
};
use fixtures::process::Background;
use fixtures::relay::Streams;
use fixtures::{outbox, redis_url};
use outbox_tests::ScratchPostgres;
use predicates::str::contains;

#[test]
fn cdc_relay_publishes_in_commit_order_and_status_reports_the_slot() {
    let pg = ScratchPostgres::start_logical();
    let url = pg.url();
    // Committed before the slot exists: published by the backfill.
    outbox()
        .args(["--database-url", &url, "migrate"])
        .assert()
        .success();
    emit::<PgConnection>(&url, 1..=3);
    outbox()
        .args(["--database-url", &url, "migrate", "--cdc"])
        .assert()
        .success()
        .stdout(contains("CDC relay set up"));
    let s = status(&url);
    assert_eq!(s["cdc"]["slot"], "outbox_cdc", "{s}");
    // A polling relay started by mistake must not publish the table again.
    let streams = Streams::new();
    let mut polling = Background::spawn(
        &[
            "--database-url",
            &url,
            "relay",
            "--broker",
            &redis_url(),
            "--stream-prefix",
            &streams.prefix,
        ],
        "info",
    );
    let exit = polling.wait();
    assert!(!exit.success(), "a polling relay in CDC mode must stop");
    assert!(polling.log().contains("--to-polling"), "{}", polling.log());
    assert!(streams.msg_ids().is_empty(), "it published nothing");
    assert_eq!(s["cdc"]["lost"], false, "{s}");
    assert!(s["due"].is_null(), "no NEW-row backlog in CDC mode: {s}");

    let admin = free_addr();
    let mut relay = cdc_relay(&url, &streams, admin, &[]);
    streams.wait_for(3, &mut relay);
    emit::<PgConnection>(&url, 4..=6);
    emit::<PgConnection>(&url, [7]);
    let published = streams.wait_for(7, &mut relay);
    let expected: Vec<String> = (1..=7).map(|n| format!("{n}:Ping")).collect();
    assert_eq!(published, expected, "every message once, in commit order");
    let ready = get(admin, "/readyz");
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    assert!(ready.contains("\"cdc\""), "{ready}");
    assert!(get(admin, "/metrics").contains("outbox_relay_published_total"));

    relay.signal("TERM");
    let exit = relay.wait();
    assert!(
        exit.success(),
        "exit {exit} after SIGTERM; log:\n{}",
        relay.log()
    );

    // Retention: the rows stay NEW under CDC, so `purge sent` asks the CDC library which
    // were published; with --older-than 0s every one of them that the relay reported.
    let out = outbox()
        .args([
            "--database-url",
            &url,
            "purge",
            "sent",
            "--older-than",
            "0s",
        ])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let out = String::from_utf8(out).expect("utf-8");
    assert!(out.contains("the CDC relay published"), "{out}");
}

#[test]
fn a_lost_slot_is_reported_with_its_recovery_and_recovered() {
    let pg = ScratchPostgres::start_logical();
    let url = pg.url();
    migrate_cdc(&url);
    // What max_slot_wal_keep_size does, as far as the relay can tell: the slot is gone.
    let mut c = PgConnection::establish(&url).expect("connect");
    diesel::RunQueryDsl::execute(
        diesel::sql_query("SELECT pg_drop_replication_slot('outbox_cdc')"),
        &mut c,
    )
    .expect("drop the slot");
    emit::<PgConnection>(&url, 1..=2);

    let s = status(&url);
    assert_eq!(s["cdc"]["lost"], true, "{s}");
    let text = outbox()
        .args(["--database-url", &url, "status"])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8(text).expect("utf-8");
    assert!(text.contains("--recover-slot"), "{text}");

    let streams = Streams::new();
    let mut refused = cdc_relay(&url, &streams, free_addr(), &[]);
    let exit = refused.wait();
    assert!(!exit.success(), "a relay on a lost slot must stop");
    assert!(
        refused.log().contains("--recover-slot"),
        "{}",
        refused.log()
    );

    outbox()
        .args(["--database-url", &url, "migrate", "--cdc", "--recover-slot"])
        .assert()
        .success();
    let mut relay = cdc_relay(&url, &streams, free_addr(), &[]);
    let published = streams.wait_for(2, &mut relay);
    assert_eq!(published, ["1:Ping", "2:Ping"]);
    assert_eq!(status(&url)["cdc"]["lost"], false);
    relay.signal("TERM");
    assert!(relay.wait().success(), "log:\n{}", relay.log());
}

#[test]
fn switching_to_cdc_and_back_loses_nothing() {
    let pg = ScratchPostgres::start_logical();
    let url = pg.url();
    let streams = Streams::new();
    let polling = |streams: &Streams| {
        Background::spawn(
            &[
                "--database-url",
                &url,
                "relay",
                "--broker",
                &redis_url(),
                "--stream-prefix",
                &streams.prefix,
                "--poll-interval",
                "100ms",
            ],
            "info",
        )
    };
    outbox()
        .args(["--database-url", &url, "migrate"])
        .assert()
        .success();
    emit::<PgConnection>(&url, 1..=2);
    let mut relay = polling(&streams);
    streams.wait_for(2, &mut relay);
    relay.signal("TERM");
    assert!(relay.wait().success(), "log:\n{}", relay.log());

    // Polling -> CDC: 3 committed while no relay runs, before the slot (backfill), 4 after.
    emit::<PgConnection>(&url, [3]);
    migrate_cdc(&url);
    emit::<PgConnection>(&url, [4]);
    let mut relay = cdc_relay(&url, &streams, free_addr(), &[]);
    streams.wait_for(4, &mut relay);
    relay.signal("TERM");
    assert!(relay.wait().success(), "log:\n{}", relay.log());

    // CDC -> polling: 5 committed after the CDC relay stopped.
    emit::<PgConnection>(&url, [5]);
    outbox()
        .args(["--database-url", &url, "migrate", "--to-polling"])
        .assert()
        .success()
        .stdout(contains("CDC mode off"));
    assert!(status(&url).get("cdc").is_none(), "CDC mode is off");
    let mut relay = polling(&streams);
    let published = streams.wait_for(5, &mut relay);
    relay.signal("TERM");
    assert!(relay.wait().success(), "log:\n{}", relay.log());

    // Every message, each first appearance in commit order; the switch back may publish
    // the last few CDC messages again (the consumers' inbox absorbs them).
    let mut first: Vec<&str> = Vec::new();
    for id in &published {
        if !first.contains(&id.as_str()) {
            first.push(id);
        }
    }
    assert_eq!(first, ["1:Ping", "2:Ping", "3:Ping", "4:Ping", "5:Ping"]);
    assert_eq!(
        status(&url)["due"],
        0,
        "the polling relay took over every NEW row"
    );
}

/// One transaction of 48,000 messages of 3 KB (some 144 MB of payload, a bulk import)
/// is relayed whole, each message once, by `outbox relay --cdc` with its defaults, whose
/// memory stays far below the transaction's size: past `transaction_memory` (32 MiB)
/// the relay holds the rows' ids only and reads them back from the table. (Held whole,
/// it peaked at 213 MiB.)
#[test]
fn a_transaction_larger_than_memory_is_relayed_within_bounded_memory() {
    let pg = ScratchPostgres::start_logical();
    let url = pg.url();
    migrate_cdc(&url);
    relayed_within_memory::<PgConnection>(
        &url,
        &format!(
            "INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) \
             SELECT 'bulk-' || i || ':Ping', 'cli.ping', 'Ping', 'bulk-' || (i % 16), \
                    json_build_object('n', i, 'pad', repeat(md5(i::text), 94))::jsonb \
             FROM generate_series(1, {BULK_ROWS}) i"
        ),
    );
}
