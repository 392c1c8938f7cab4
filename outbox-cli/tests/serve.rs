//! `outbox serve` as a process: its pages and JSON API against an isolated database and
//! streams under a unique prefix, redrive and purge with and without the token and the
//! CSRF token, dead letters that do not decode, 4xx answers to bad input, the refusal
//! to serve other addresses without a token and requests naming other hosts, reads that
//! need the token (bearer or the session of a login) unless `--public-reads`, and no
//! password on any page.
#![cfg(feature = "serve")]

mod fixtures;
mod serve_support;

use fixtures::TestDb;
use outbox_tests::{Engine, PasswordRedis, redis_url};
use serde_json::json;
use serve_support::{Server, Streams, TOKEN};

/// An outbox with `1:Ping`..`3:Ping`, the first two DEAD, and streams with a group and
/// two consumer dead letters.
fn scenario() -> (TestDb, Streams) {
    let db = TestDb::postgres();
    db.migrate();
    db.emit(1..=3);
    db.kill(&[1, 2]);
    (db, Streams::new(&redis_url()))
}

fn serve(db: &TestDb, streams: &Streams, extra: &[&str]) -> Server {
    let mut args = vec![
        "--redis-url",
        outbox_tests_redis(),
        "--stream-prefix",
        streams.prefix.as_str(),
    ];
    args.extend_from_slice(extra);
    Server::start(&db.url, &args)
}

fn outbox_tests_redis() -> &'static str {
    static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    URL.get_or_init(redis_url)
}

#[test]
fn the_pages_and_the_api_show_backlog_dead_letters_and_groups() {
    let (db, streams) = scenario();
    let server = serve(&db, &streams, &["--token", TOKEN]);
    // A relay parked on the default channel: its session holds the wake-up lock.
    let fixtures::AnyConn::Pg(mut relay) = db.conn() else {
        unreachable!("a PostgreSQL scenario")
    };
    let (class, key) = outbox_diesel::wake_lock_key("outbox");
    diesel::connection::SimpleConnection::batch_execute(
        &mut relay,
        &format!("SET application_name = 'relay-1'; SELECT pg_advisory_lock({class}, {key})"),
    )
    .unwrap();

    let overview = server.json("/api/overview");
    assert_eq!(overview["due"], 1, "{overview}");
    assert_eq!(overview["dead"], 2, "{overview}");
    assert_eq!(
        overview["topics"],
        json!([{"topic": "cli.ping", "new": 1, "dead": 2}])
    );
    assert_eq!(overview["published"].as_array().map(Vec::len), Some(15));
    assert_eq!(overview["relays"]["tracked"], true);
    let seen = overview["relays"]["seen"].as_array().expect("relays seen");
    // Every relay parked on this database is listed: the other tests' relays too, which
    // share the database (each in a schema of its own).
    assert!(
        seen.iter().any(|r| r
            .as_str()
            .is_some_and(|r| r.contains("relay-1 (parked, last statement at"))),
        "{overview}"
    );
    let (status, page) = server.get("/");
    assert_eq!(status, 200);
    for text in ["cli.ping", "<svg", "due messages", "Relays"] {
        assert!(page.contains(text), "the overview lacks {text}: {page}");
    }

    let dead = server.json("/api/dead");
    assert_eq!(dead["outbox_total"], 2, "{dead}");
    assert_eq!(dead["consumers_total"], 2, "{dead}");
    assert_eq!(
        dead["outbox"][0]["msg_id"], "2:Ping",
        "newest first: {dead}"
    );
    assert_eq!(
        dead["consumers"][0]["msg_id"], "9:Ping",
        "newest first: {dead}"
    );
    assert_eq!(dead["consumers"][0]["group"], "billing");
    // Filters: error text (case-insensitive), topic, type, age; pages.
    let one = server.json("/api/dead?error=wrongtype%201");
    assert_eq!(one["outbox_total"], 1, "{one}");
    assert_eq!(one["outbox"][0]["msg_id"], "1:Ping");
    assert_eq!(one["consumers_total"], 0);
    assert_eq!(server.json("/api/dead?topic=other")["outbox_total"], 0);
    assert_eq!(server.json("/api/dead?type=Ping")["consumers_total"], 2);
    assert_eq!(server.json("/api/dead?older_than=1h")["outbox_total"], 0);
    let paged = server.json("/api/dead?per_page=1&page=1");
    assert_eq!(paged["outbox"][0]["msg_id"], "1:Ping", "{paged}");
    assert_eq!(paged["consumers"][0]["msg_id"], "8:Ping", "{paged}");
    let (status, _) = server.get("/api/dead?older_than=soon");
    assert_eq!(status, 400);

    let (status, page) = server.get("/dead?error=WRONGTYPE");
    assert_eq!(status, 200);
    assert!(page.contains("1:Ping") && page.contains("2:Ping"), "{page}");
    assert!(
        !page.contains("9:Ping"),
        "the consumer's reason does not match: {page}"
    );

    // Details: the outbox row and the consumer dead letter, payload pretty-printed (and
    // escaped, as all text is).
    let id = db.id_of(1);
    let (status, page) = server.get(&format!("/dead/show?item=outbox:{id}"));
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("&quot;n&quot;: 1") && page.contains("WRONGTYPE 1"),
        "{page}"
    );
    let item = dead["consumers"][0]["item"].as_str().unwrap();
    let shown = server.json(&format!("/api/dead/show?item={}", urlencode(item)));
    assert_eq!(shown["fields"]["payload"], "{\"n\":9}", "{shown}");
    let (status, page) = server.get(&format!("/dead/show?item={}", urlencode(item)));
    assert_eq!(status, 200);
    assert!(
        page.contains("&quot;trace&quot;: &quot;t-1&quot;") && page.contains("no such account"),
        "{page}"
    );
    let (status, _) = server.get("/api/dead/show?item=outbox:999999");
    assert_eq!(status, 404);

    // Consumer groups: lag, pending, consumers, oldest pending.
    let groups = server.json("/api/groups");
    let group = &groups[0];
    assert_eq!(group["stream"], streams.stream.as_str(), "{groups}");
    assert_eq!(group["group"], "billing");
    assert_eq!(group["pending"], 1);
    assert_eq!(group["consumers"][0]["name"], "c1");
    assert!(group["oldest_pending_id"].is_string(), "{groups}");
    assert_eq!(
        groups.as_array().map(Vec::len),
        Some(1),
        "dead-letter streams have no group"
    );
    let (status, page) = server.get("/groups");
    assert_eq!(status, 200);
    assert!(page.contains("billing") && page.contains("c1"), "{page}");
}

fn urlencode(text: &str) -> String {
    form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

#[test]
fn redrive_and_purge_need_the_token_and_the_forms_their_csrf_token() {
    let (db, streams) = scenario();
    let server = serve(&db, &streams, &["--token", TOKEN]);
    let (one, two) = (db.id_of(1), db.id_of(2));
    let item1 = format!("outbox:{one}");
    let csrf = server.csrf();

    // Refused: no token, a wrong one, no CSRF token; the API without its bearer token.
    for pairs in [
        vec![("item", item1.as_str()), ("csrf", csrf.as_str())],
        vec![
            ("item", item1.as_str()),
            ("csrf", csrf.as_str()),
            ("token", "wrong"),
        ],
        vec![("item", item1.as_str()), ("token", TOKEN)],
        vec![
            ("item", item1.as_str()),
            ("csrf", "0".repeat(64).as_str()),
            ("token", TOKEN),
        ],
    ] {
        for path in ["/dead/redrive", "/dead/purge"] {
            let (status, page) = server.post_form(path, &pairs);
            assert_eq!(status, 403, "{path} {pairs:?}: {page}");
        }
    }
    let body = json!({"items": [item1]});
    for token in [None, Some("wrong")] {
        for path in ["/api/dead/redrive", "/api/dead/purge"] {
            assert_eq!(
                server.post_json(path, &body, token).0,
                403,
                "{path} {token:?}"
            );
        }
    }
    assert_eq!(db.status()["dead"], 2, "nothing changed");
    assert_eq!(streams.msg_ids(&streams.dead).len(), 2, "nothing changed");

    // The form with both: `1:Ping` back to NEW; through the API: `2:Ping` deleted.
    let (status, page) = server.post_form(
        "/dead/redrive",
        &[("item", &item1), ("csrf", &csrf), ("token", TOKEN)],
    );
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("Re-drove 1 outbox message(s)"), "{page}");
    let (status, done) = server.post_json(
        "/api/dead/purge",
        &json!({"items": [format!("outbox:{two}")]}),
        Some(TOKEN),
    );
    assert_eq!(status, 200, "{done}");
    assert_eq!(db.status()["dead"], 0);
    assert_eq!(db.status()["due"], 2, "3:Ping and the re-driven 1:Ping");
    assert_eq!(
        db.json(&["dead", "show", "1:Ping", "--json"])["status"],
        "NEW"
    );
    db.outbox()
        .args(["dead", "show", "2:Ping"])
        .assert()
        .failure();

    // Consumer dead letters: 9:Ping back on its stream, 8:Ping purged.
    let dead = server.json("/api/dead");
    let (nine, eight) = (
        dead["consumers"][0]["item"].as_str().unwrap().to_owned(),
        dead["consumers"][1]["item"].as_str().unwrap().to_owned(),
    );
    let (status, page) = server.post_form(
        "/dead/redrive",
        &[("item", &nine), ("csrf", &csrf), ("token", TOKEN)],
    );
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("and 1 consumer dead letter(s)"), "{page}");
    let (status, done) =
        server.post_json("/api/dead/purge", &json!({"items": [eight]}), Some(TOKEN));
    assert_eq!(status, 200, "{done}");
    assert_eq!(streams.msg_ids(&streams.stream), ["7:Ping", "9:Ping"]);
    assert!(streams.msg_ids(&streams.dead).is_empty());

    assert!(
        !server.log().contains(TOKEN),
        "the token was logged: {}",
        server.log()
    );
}

#[test]
fn without_a_token_the_page_is_read_only() {
    let (db, streams) = scenario();
    let server = serve(&db, &streams, &[]);
    let item = format!("outbox:{}", db.id_of(1));
    let (status, page) = server.get(&format!("/dead/confirm?action=redrive&item={item}"));
    assert_eq!(status, 200);
    assert!(page.contains("read-only"), "{page}");
    let csrf = server.csrf();
    let (status, _) = server.post_form(
        "/dead/redrive",
        &[("item", &item), ("csrf", &csrf), ("token", "")],
    );
    assert_eq!(status, 403);
    assert_eq!(db.status()["dead"], 2);
}

/// Every read of the pages and the API, for the dead letter `item`.
fn reads(item: &str) -> Vec<String> {
    let item = urlencode(item);
    [
        "/",
        "/dead",
        "/groups",
        "/api/overview",
        "/api/dead",
        "/api/groups",
    ]
    .map(str::to_owned)
    .into_iter()
    .chain([
        format!("/dead/show?item={item}"),
        format!("/api/dead/show?item={item}"),
        format!("/dead/confirm?action=purge&item={item}"),
    ])
    .collect()
}

/// A server with a token, on every address (and on loopback: a token guards reads
/// wherever it listens), answers every read 401 without it, showing no dead letter, and
/// serves it with the bearer token or with the session cookie a login gave.
#[test]
fn with_a_token_reads_need_it_or_the_session_of_a_login() {
    let (db, streams) = scenario();
    let item = format!("outbox:{}", db.id_of(1));
    for ip in ["0.0.0.0", "127.0.0.1"] {
        let server = Server::start_on(
            ip,
            &db.url,
            &[
                "--redis-url",
                outbox_tests_redis(),
                "--stream-prefix",
                &streams.prefix,
                "--token",
                TOKEN,
            ],
        );
        for path in reads(&item) {
            for headers in [
                vec![],
                vec![("Authorization", "Bearer wrong")],
                vec![("Cookie", "outbox_session=forged")],
            ] {
                let (status, body) = server.get_with(&path, &headers);
                assert_eq!(status, 401, "{ip} {path} {headers:?}: {body}");
                for shown in ["1:Ping", "9:Ping", "cli.ping", "billing", "WRONGTYPE"] {
                    assert!(!body.contains(shown), "{ip} {path} shows {shown}: {body}");
                }
                let says = if path.starts_with("/api/") {
                    "Authorization: Bearer"
                } else {
                    "id=\"login\""
                };
                assert!(body.contains(says), "{ip} {path}: {body}");
            }
            let bearer = format!("Bearer {TOKEN}");
            let (status, body) = server.get_with(&path, &[("Authorization", &bearer)]);
            assert_eq!(status, 200, "{ip} {path}: {body}");
        }

        let (status, cookie, _, page) = server.login("wrong", "/dead");
        assert_eq!(status, 401, "{page}");
        assert!(cookie.is_empty() && page.contains("wrong token"), "{page}");
        let (status, cookie, location, _) = server.login(TOKEN, "/dead?topic=cli.ping");
        assert_eq!((status, location.as_str()), (303, "/dead?topic=cli.ping"));
        for attribute in ["HttpOnly", "SameSite=Strict", "Path=/"] {
            assert!(cookie.contains(attribute), "{cookie}");
        }
        assert!(
            !cookie.contains(TOKEN),
            "the cookie holds the token: {cookie}"
        );
        let session = cookie.split(';').next().unwrap();
        for path in reads(&item) {
            let (status, body) = server.get_with(&path, &[("Cookie", session)]);
            assert_eq!(status, 200, "{ip} {path}: {body}");
        }
        let (_, page) = server.get_with("/dead", &[("Cookie", session)]);
        assert!(page.contains("1:Ping") && page.contains("9:Ping"), "{page}");
        let (_, _, location, _) = server.login(TOKEN, "//evil.example/");
        assert_eq!(location, "/", "a login redirects within the server only");
        assert_eq!(server.get_with("/healthz", &[]), (200, "ok\n".to_owned()));
        assert!(!server.log().contains(TOKEN), "{}", server.log());
    }
}

/// `--public-reads`: every read is served without the token, off loopback too; redrive
/// and purge still need it.
#[test]
fn public_reads_serve_reads_without_the_token() {
    let (db, streams) = scenario();
    let item = format!("outbox:{}", db.id_of(1));
    let server = Server::start_on(
        "0.0.0.0",
        &db.url,
        &[
            "--redis-url",
            outbox_tests_redis(),
            "--stream-prefix",
            &streams.prefix,
            "--token",
            TOKEN,
            "--public-reads",
        ],
    );
    for path in reads(&item) {
        let (status, body) = server.get_with(&path, &[]);
        assert_eq!(status, 200, "{path}: {body}");
    }
    let (_, page) = server.get_with("/dead", &[]);
    assert!(page.contains("1:Ping") && page.contains("9:Ping"), "{page}");
    let body = json!({"items": [item]});
    assert_eq!(server.post_json("/api/dead/purge", &body, None).0, 403);
    assert_eq!(db.status()["dead"], 2, "nothing changed");
}

#[test]
fn a_non_loopback_address_without_a_token_is_refused() {
    let db = TestDb::postgres();
    db.migrate();
    let port = outbox_tests::ports::free_port();
    let out = db
        .outbox()
        .env_remove("OUTBOX_SERVE_TOKEN")
        .args(["serve", "--addr", &format!("0.0.0.0:{port}")])
        .timeout(std::time::Duration::from_secs(30))
        .assert()
        .code(2)
        .get_output()
        .stderr
        .clone();
    let stderr = String::from_utf8_lossy(&out);
    assert!(
        stderr.contains("refusing to serve on 0.0.0.0") && stderr.contains("--token"),
        "{stderr}"
    );
}

#[test]
fn no_password_appears_on_any_page() {
    let db = TestDb::postgres();
    db.migrate();
    db.emit(1..=2);
    db.kill(&[1]);
    // The server trusts local connections, so the password is only carried along.
    let db_password = "pg-secret-4f2a";
    let url = db.url.replacen(
        "postgres://postgres@",
        &format!("postgres://postgres:{db_password}@"),
        1,
    );
    assert!(url.contains(db_password), "{url}");
    let redis = PasswordRedis::start();
    let redis_url = redis.url_with_password(PasswordRedis::PASSWORD);
    let streams = Streams::new(&redis_url);
    let server = Server::start(
        &url,
        &[
            "--redis-url",
            &redis_url,
            "--stream-prefix",
            &streams.prefix,
            "--token",
            TOKEN,
        ],
    );
    let item = format!("outbox:{}", db.id_of(1));
    for path in [
        "/",
        "/dead",
        &format!("/dead/show?item={item}"),
        &format!("/dead/confirm?action=purge&item={item}"),
        "/groups",
        "/api/overview",
        "/api/dead",
        "/api/groups",
    ] {
        let (status, body) = server.get(path);
        assert_eq!(status, 200, "{path}: {body}");
        for secret in [db_password, PasswordRedis::PASSWORD, TOKEN] {
            assert!(!body.contains(secret), "{path} shows a secret: {body}");
        }
    }
    let overview = server.json("/api/overview");
    assert!(
        overview["redis"].as_str().unwrap().contains(":***@"),
        "{overview}"
    );
    assert!(
        overview["database"].as_str().unwrap().contains(":***@"),
        "{overview}"
    );
    let log = server.log();
    for secret in [db_password, PasswordRedis::PASSWORD, TOKEN] {
        assert!(!log.contains(secret), "the log shows a secret: {log}");
    }
}

#[test]
fn the_overview_reads_every_backend() {
    for engine in [Engine::Postgres, Engine::Mariadb, Engine::Sqlite] {
        let db = TestDb::new(engine);
        db.migrate();
        db.emit(1..=3);
        db.kill(&[1]);
        db.exec(&format!(
            "UPDATE outbox SET status = 1, sent_at = {} WHERE msg_id = '2:Ping'",
            db.ago(90)
        ));
        let server = Server::start(&db.url, &[]);
        let o = server.json("/api/overview");
        assert_eq!(
            o["topics"],
            json!([{"topic": "cli.ping", "new": 1, "dead": 1}]),
            "{engine:?}: {o}"
        );
        let published: u64 = o["published"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["published"].as_u64().unwrap())
            .sum();
        assert_eq!(published, 1, "{engine:?}: {o}");
        assert_eq!(
            o["relays"]["tracked"],
            engine != Engine::Mariadb,
            "{engine:?}: {o}"
        );
        let (status, page) = server.get("/");
        assert_eq!(status, 200, "{engine:?}");
        assert!(page.contains("<svg"), "{engine:?}");
    }
}

#[test]
fn every_value_is_escaped() {
    let db = TestDb::postgres();
    db.migrate();
    db.emit([1]);
    db.kill(&[1]);
    db.exec(
        "UPDATE outbox SET last_error = '<script>alert(1)</script>', \
         headers = '{\"x\": \"<img src=x onerror=alert(2)>\"}' WHERE msg_id = '1:Ping'",
    );
    let server = Server::start(&db.url, &[]);
    let item = format!("outbox:{}", db.id_of(1));
    for path in ["/dead".to_owned(), format!("/dead/show?item={item}")] {
        let (status, page) = server.get(&path);
        assert_eq!(status, 200, "{path}: {page}");
        assert!(
            !page.contains("<script>alert") && !page.contains("<img src=x"),
            "{path}: {page}"
        );
        assert!(
            page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{path}: {page}"
        );
    }
}

#[test]
fn the_outbox_dead_letters_show_while_redis_is_down() {
    let db = TestDb::postgres();
    db.migrate();
    db.emit([1]);
    db.kill(&[1]);
    // Nothing listens there.
    let redis = format!("redis://127.0.0.1:{}", outbox_tests::ports::free_port());
    let server = Server::start(&db.url, &["--redis-url", &redis]);
    let dead = server.json("/api/dead");
    assert_eq!(dead["outbox_total"], 1, "{dead}");
    assert!(dead["redis_error"].is_string(), "{dead}");
    let (status, page) = server.get("/dead");
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("1:Ping") && page.contains("Cannot read them from Redis"),
        "{page}"
    );
    let (status, _) = server.get("/api/groups");
    assert_eq!(status, 500, "the groups need Redis");
}

/// The row id of the outbox row with this msg_id (compared as stored).
fn id_of_raw(db: &TestDb, msg_id: &str) -> i64 {
    db.scalar(&format!(
        "SELECT id AS n FROM outbox WHERE msg_id = '{msg_id}'"
    ))
}

/// A NEW row with `msg_id = 'acc bad id'` (written around the library) is dead-lettered
/// by a real relay; the list, the detail and the API show it as stored with the reason, a
/// redrive of it is refused (409) and changes nothing, a purge deletes it.
#[test]
fn a_dead_letter_the_relay_made_of_an_unreadable_row_is_shown_and_purged() {
    let (db, streams) = scenario();
    db.exec(
        "INSERT INTO outbox (msg_id, topic, event_type, msg_key, schema_version, payload) \
         VALUES ('acc bad id', 'cli.ping', 'Ping', 'acc', 1, '{\"n\": 0}')",
    );
    let bad = id_of_raw(&db, "acc bad id");
    let mut relay = fixtures::relay::start_relay(&db, &streams.prefix, &[]);
    outbox_tests::wait_until_within(
        "the relay dead-letters the unreadable row",
        std::time::Duration::from_secs(60),
        || {
            db.scalar(&format!(
                "SELECT COUNT(*) AS n FROM outbox WHERE id = {bad} AND status = 2 \
                 AND last_error LIKE 'unreadable row: msg_id%whitespace%'"
            )) == 1
        },
    );
    relay.stop();
    let server = serve(&db, &streams, &["--token", TOKEN]);
    let item = format!("outbox:{bad}");

    let dead = server.json("/api/dead");
    assert_eq!(dead["outbox_total"], 3, "{dead}");
    let shown = &dead["outbox"][0];
    assert_eq!(shown["item"], item.as_str(), "newest first: {dead}");
    assert_eq!(shown["msg_id"], "acc bad id");
    assert_eq!(shown["payload"], json!({"n": 0}));
    assert!(
        shown["unreadable"]
            .as_str()
            .is_some_and(|r| r.contains("\"acc bad id\" contains whitespace")),
        "{dead}"
    );
    assert_eq!(dead["outbox"][1]["msg_id"], "2:Ping");
    assert!(dead["outbox"][1].get("unreadable").is_none(), "{dead}");
    let one = server.json(&format!("/api/dead/show?item={item}"));
    assert_eq!(
        (&one["id"], &one["msg_id"]),
        (&json!(bad), &json!("acc bad id"))
    );
    assert!(one["unreadable"].is_string(), "{one}");
    let (status, page) = server.get("/dead");
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("acc bad id")
            && page
                .contains("<b>unreadable: </b>msg_id &quot;acc bad id&quot; contains whitespace")
            && page.contains("2:Ping"),
        "{page}"
    );
    let (status, page) = server.get(&format!("/dead/show?item={item}"));
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("id=\"unreadable\"") && page.contains("Fix the row before a redrive"),
        "{page}"
    );

    // A redrive is refused, through the API and the form, and changes nothing.
    let (status, body) = server.post_json(
        "/api/dead/redrive",
        &json!({"items": [item, format!("outbox:{}", db.id_of(1))]}),
        Some(TOKEN),
    );
    assert_eq!(status, 409, "{body}");
    assert!(
        body.contains(&format!("outbox row {bad} cannot be re-driven"))
            && body.contains("purge it"),
        "{body}"
    );
    let csrf = server.csrf();
    let (status, page) = server.post_form(
        "/dead/redrive",
        &[("item", &item), ("csrf", &csrf), ("token", TOKEN)],
    );
    assert_eq!(status, 409, "{page}");
    assert!(page.contains("cannot be re-driven"), "{page}");
    assert_eq!(db.status()["dead"], 3, "nothing was re-driven");

    let (status, body) =
        server.post_json("/api/dead/purge", &json!({"items": [item]}), Some(TOKEN));
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["outbox"],
        1
    );
    assert_eq!(db.status()["dead"], 2);
    let (status, _) = server.get(&format!("/api/dead/show?item={item}"));
    assert_eq!(status, 404);
}

/// On MariaDB and SQLite too, the list and the detail read an unreadable DEAD row.
#[test]
fn unreadable_dead_letters_are_listed_on_every_backend() {
    for engine in [Engine::Postgres, Engine::Mariadb, Engine::Sqlite] {
        let db = TestDb::new(engine);
        db.migrate();
        db.emit([1]);
        let bad = db.forge_dead("h:Ping", "cli.ping", r#"{"retries": 3}"#);
        let server = Server::start(&db.url, &[]);
        let dead = server.json("/api/dead");
        assert_eq!(dead["outbox_total"], 1, "{engine:?}: {dead}");
        assert!(
            dead["outbox"][0]["unreadable"]
                .as_str()
                .is_some_and(|r| r.contains("headers are not a JSON object of strings")),
            "{engine:?}: {dead}"
        );
        let (status, page) = server.get(&format!("/dead/show?item=outbox:{bad}"));
        assert_eq!(status, 200, "{engine:?}: {page}");
        assert!(
            page.contains("h:Ping") && page.contains("Unreadable: "),
            "{engine:?}: {page}"
        );
    }
}

/// Every malformed or unknown selection and filter answers 4xx with a clear message, on
/// the API (as JSON) and on the pages; consumer items are kept to the dead-letter
/// streams of the configured prefix.
#[test]
fn bad_input_answers_4xx_with_a_clear_message() {
    let (db, streams) = scenario();
    let server = serve(&db, &streams, &["--token", TOKEN]);
    let other = streams.add_dead_letter(5);
    let foreign = format!("consumer:{other}:elsewhere:cli.ping:dead");
    for (item, says) in [
        ("outbox:abc", "not a dead letter: `outbox:abc`"),
        ("outbox:99999999999999999999", "not a dead letter"),
        ("1:Ping", "not a dead letter: `1:Ping`"),
        ("nope:Ping", "not a dead letter"),
        ("outbox:nope:Ping", "not a dead letter"),
        ("consumer:xyz:outbox:cli.ping:dead", "not a dead letter"),
        ("consumer:1-0:", "not a dead letter"),
        ("", "not a dead letter"),
        (
            foreign.as_str(),
            "is not a dead-letter stream of this server",
        ),
        (
            &format!("consumer:{other}:{}", streams.stream),
            "is not a dead-letter stream of this server",
        ),
    ] {
        let path = format!("/api/dead/show?item={}", urlencode(item));
        let (status, body) = server.get(&path);
        assert_eq!(status, 400, "{path}: {body}");
        let error: serde_json::Value = serde_json::from_str(&body).expect("a JSON error");
        assert!(
            error["error"].as_str().is_some_and(|e| e.contains(says)),
            "{path}: {body}"
        );
        let (status, page) = server.get(&format!("/dead/show?item={}", urlencode(item)));
        assert_eq!(status, 400, "{item}: {page}");
    }
    // A dead letter of the prefix that is not there (any more) is a 404.
    let (status, _) = server.get(&format!(
        "/api/dead/show?item={}",
        urlencode(&format!("consumer:1-0:{}", streams.dead))
    ));
    assert_eq!(status, 404);
    for path in ["/api/dead?older_than=banana", "/dead?older_than=banana"] {
        let (status, body) = server.get(path);
        assert_eq!(status, 400, "{path}: {body}");
        assert!(body.contains("older_than `banana`"), "{path}: {body}");
    }
    let (status, body) = server.post_json(
        "/api/dead/purge",
        &json!({"items": ["outbox:x"]}),
        Some(TOKEN),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(db.status()["dead"], 2, "nothing changed");
}

/// `GET path` with `Host: host` over plain HTTP/1.1: the status code and the body.
fn get_with_host(base: &str, path: &str, host: &str) -> (u16, String) {
    use std::io::{Read as _, Write as _};
    let addr = base.trim_start_matches("http://");
    let mut tcp = std::net::TcpStream::connect(addr).expect("connect");
    tcp.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    write!(
        tcp,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    tcp.read_to_string(&mut response).expect("a response");
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {response}"));
    (status, response)
}

/// A page on another site that rebinds its name to 127.0.0.1 reaches the server with its
/// own name in `Host`: such requests are refused (421); the bound address, `localhost`
/// and `--allowed-host` names are served.
#[test]
fn requests_naming_other_hosts_are_refused() {
    let (db, streams) = scenario();
    let server = serve(&db, &streams, &["--allowed-host", "ops.example"]);
    let port = server.base.rsplit(':').next().unwrap().to_owned();
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("ops.example:{port}"),
        "OPS.example".to_owned(),
    ] {
        let (status, body) = get_with_host(&server.base, "/api/dead", &host);
        assert_eq!(status, 200, "{host}: {body}");
    }
    for host in [
        format!("rebind.example:{port}"),
        "rebind.example".to_owned(),
        format!("localhost.rebind.example:{port}"),
        format!("10.1.2.3:{port}"),
    ] {
        for path in [
            "/",
            "/dead",
            "/api/dead",
            "/api/overview",
            "/dead/confirm?action=purge&item=outbox:1",
        ] {
            let (status, body) = get_with_host(&server.base, path, &host);
            assert_eq!(status, 421, "{host} {path}: {body}");
            assert!(
                body.contains(&format!("does not serve host `{host}`")) && !body.contains("1:Ping"),
                "{host} {path}: {body}"
            );
        }
    }
}

/// The `name=value` of a `Set-Cookie`.
fn cookie_pair(set_cookie: &str) -> String {
    set_cookie.split(';').next().unwrap_or_default().to_owned()
}

/// Each login is a session of its own, its cookie named by the server's port: a browser
/// sends every cookie of a host to every port, and two servers on one host must not log
/// each other out. A logout ends the session it comes with, not the others.
#[test]
fn sessions_are_per_server_and_per_login_and_a_logout_ends_one() {
    let (db, streams) = scenario();
    let args = [
        "--redis-url",
        outbox_tests_redis(),
        "--stream-prefix",
        &streams.prefix,
        "--token",
        TOKEN,
    ];
    let (a, b) = (Server::start(&db.url, &args), Server::start(&db.url, &args));
    let login = |server: &Server| {
        let (status, set_cookie, _, page) = server.login(TOKEN, "/");
        assert_eq!(status, 303, "{page}");
        cookie_pair(&set_cookie)
    };
    let (first, other, at_b) = (login(&a), login(&a), login(&b));
    assert_ne!(first, other, "each login has a session of its own");
    let port_of = |server: &Server| server.base.rsplit(':').next().unwrap().to_owned();
    assert!(
        first.starts_with(&format!("outbox_session_{}=", port_of(&a))),
        "{first}"
    );
    assert!(
        at_b.starts_with(&format!("outbox_session_{}=", port_of(&b))),
        "{at_b}"
    );

    let (_, overview) = a.get_with("/", &[("Cookie", &first)]);
    assert!(
        overview.contains("action=\"/logout\""),
        "a logout button: {overview}"
    );

    // The browser's jar holds both servers' cookies and sends them to both.
    let jar = format!("{first}; {at_b}");
    assert_eq!(a.get_with("/api/overview", &[("Cookie", &jar)]).0, 200);
    assert_eq!(b.get_with("/api/overview", &[("Cookie", &jar)]).0, 200);
    // B's session does not open A, nor A's B.
    assert_eq!(a.get_with("/api/overview", &[("Cookie", &at_b)]).0, 401);
    assert_eq!(b.get_with("/api/overview", &[("Cookie", &first)]).0, 401);

    let (status, cleared, location) = a.post_with("/logout", &[("Cookie", &jar)]);
    assert_eq!((status, location.as_str()), (303, "/login"));
    assert!(cleared.contains("Max-Age=0"), "{cleared}");
    assert!(
        cleared.starts_with(&format!("outbox_session_{}=;", port_of(&a))),
        "{cleared}"
    );
    let (status, _) = a.get_with("/api/overview", &[("Cookie", &first)]);
    assert_eq!(
        status, 401,
        "the cookie of a session logged out opens nothing"
    );
    assert_eq!(a.get_with("/api/overview", &[("Cookie", &other)]).0, 200);
    assert_eq!(b.get_with("/api/overview", &[("Cookie", &at_b)]).0, 200);
}

/// Past a burst, wrong tokens wait their turn, one a second for the whole server, so a
/// guesser gets nowhere fast; the right token meanwhile is answered at once.
#[test]
fn wrong_tokens_are_slowed_down_and_the_right_one_is_not() {
    let (db, streams) = scenario();
    let server = Server::start(
        &db.url,
        &[
            "--redis-url",
            outbox_tests_redis(),
            "--stream-prefix",
            &streams.prefix,
            "--token",
            TOKEN,
        ],
    );
    // The burst: answered as they come.
    for guess in 0..10 {
        let (status, _, _, _) = server.login(&format!("guess-{guess}"), "/");
        assert_eq!(status, 401);
    }
    // Five more at once: they queue, a second apart.
    let started = std::time::Instant::now();
    let finished = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for guess in 0..5 {
            let (server, finished) = (&server, &finished);
            s.spawn(move || {
                let (status, _, _, _) = server.login(&format!("more-{guess}"), "/");
                assert_eq!(status, 401);
                finished.lock().unwrap().push(("wrong", started.elapsed()));
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
        let (status, _, _, _) = server.login(TOKEN, "/");
        assert_eq!(status, 303);
        finished.lock().unwrap().push(("right", started.elapsed()));
    });
    let finished = finished.into_inner().unwrap();
    assert_eq!(
        finished[0].0, "right",
        "the right token waited for the guesses: {finished:?}"
    );
    let (_, last) = finished.last().unwrap();
    assert!(
        *last >= std::time::Duration::from_secs(4),
        "five guesses past the burst took {last:?}"
    );
    // A wrong bearer token is a guess too.
    let (status, _) = server.get_with("/api/overview", &[("Authorization", "Bearer nope")]);
    assert_eq!(status, 401);
}
