//! `outbox relay --admin-addr`: /healthz and /readyz as a Kubernetes probe reads them
//! (the status code; the JSON body for the operator), from a real relay process whose
//! private Redis or PostgreSQL is stopped under it.

mod fixtures;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

use fixtures::process::Background;
use fixtures::{Backend, Mariadb, Postgres, Sqlite, TestDb, unique};
use outbox_tests::{ScratchPostgres, ScratchRedis};

/// Longest wait for a relay to start or an endpoint to change its answer.
const PATIENCE: Duration = Duration::from_secs(30);

/// A relay with its admin endpoint on a free port; killed on drop.
struct Relay {
    process: Background,
    admin: SocketAddr,
}

impl Relay {
    fn start(database_url: &str, redis_url: &str, extra: &[&str]) -> Self {
        let admin = SocketAddr::from(([127, 0, 0, 1], outbox_tests::ports::free_port()));
        let prefix = format!("{}:", unique("admin"));
        let admin_addr = admin.to_string();
        let mut args = vec![
            "--database-url",
            database_url,
            "relay",
            "--redis-url",
            redis_url,
        ];
        args.extend(["--stream-prefix", &prefix, "--poll-interval", "100ms"]);
        args.extend(["--admin-addr", &admin_addr]);
        args.extend_from_slice(extra);
        let relay = Self {
            process: Background::spawn(&args, "info"),
            admin,
        };
        relay.eventually("the admin endpoint accepts", || {
            TcpStream::connect(relay.admin).is_ok()
        });
        relay
    }

    /// `GET path`: the status code and the body.
    fn get(&self, path: &str) -> (u16, serde_json::Value) {
        let response = outbox_tests::http_get(self.admin, path, PATIENCE);
        let json = serde_json::from_str(response.body())
            .unwrap_or_else(|e| panic!("{path}: body is not JSON ({e}): {}", response.text));
        (response.status, json)
    }

    /// Polls `path` until it answers `code`; returns the body.
    fn wait_for(&self, path: &str, code: u16) -> serde_json::Value {
        let mut last = None;
        self.eventually(&format!("{path} answers {code}"), || {
            let (got, body) = self.get(path);
            last = Some(body);
            got == code
        });
        last.expect("one answer at least")
    }

    fn eventually(&self, what: &str, cond: impl FnMut() -> bool) {
        outbox_tests::wait_until_explained(PATIENCE, cond, || {
            format!("{what}; relay log:\n{}", self.log())
        });
    }

    fn log(&self) -> String {
        self.process.log()
    }

    /// SIGTERM; the relay must exit with 0.
    fn stop(mut self) {
        self.process.stop();
    }
}

/// /healthz is 200 with both services up, 503 naming Redis while the relay's Redis is
/// stopped, and 200 again once it is back.
fn healthz_names_redis_when_it_is_down<B: Backend>() {
    let db = &TestDb::new(B::ENGINE);
    db.migrate();
    let mut redis = ScratchRedis::start();
    let relay = Relay::start(&db.url, &redis.url(), &[]);
    let (code, body) = relay.get("/healthz");
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["status"], "ok", "{body}");
    assert_eq!(body["database"], "up", "{body}");
    assert_eq!(body["redis"], "up", "{body}");

    redis.stop();
    let (code, body) = relay.get("/healthz");
    assert_eq!(code, 503, "{body}");
    assert_eq!(body["status"], "unavailable", "{body}");
    assert_eq!(body["database"], "up", "{body}");
    let down = body["redis"].as_str().unwrap_or_default();
    assert!(down.starts_with("down: "), "{body}");

    redis.restart();
    relay.wait_for("/healthz", 200);
    relay.stop();
}

/// /readyz is 200 with nothing due, 503 while a message older than --ready-max-age is
/// stuck (its Redis is down), and 200 once the relay has published it.
fn readyz_fails_while_an_old_message_is_stuck<B: Backend>() {
    let db = &TestDb::new(B::ENGINE);
    db.migrate();
    let mut redis = ScratchRedis::start();
    redis.stop();
    let relay = Relay::start(&db.url, &redis.url(), &["--ready-max-age", "1m"]);
    let (code, body) = relay.get("/readyz");
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["status"], "ready", "{body}");

    db.emit([1]);
    db.exec(&format!("UPDATE outbox SET created_at = {}", db.ago(600)));
    let (code, body) = relay.get("/readyz");
    assert_eq!(code, 503, "{body}");
    assert_eq!(body["status"], "lagging", "{body}");
    assert_eq!(body["due"], 1, "{body}");
    assert_eq!(body["max_age_seconds"], 60.0, "{body}");
    let age = body["oldest_due_age_seconds"].as_f64().unwrap_or_default();
    assert!(age >= 600.0, "{body}");

    redis.restart();
    let body = relay.wait_for("/readyz", 200);
    assert_eq!(body["due"], 0, "published: {body}");
    relay.stop();
}

outbox_tests::on_every_backend! {
    postgres => Postgres, mariadb => Mariadb, sqlite => Sqlite;
    healthz_names_redis_when_it_is_down,
    readyz_fails_while_an_old_message_is_stuck,
}

/// /healthz and /readyz are 503 naming the database while the relay's PostgreSQL is down.
#[test]
fn healthz_names_the_database_when_it_is_down() {
    let pg = ScratchPostgres::start();
    let url = pg.url_with_password(ScratchPostgres::PASSWORD);
    let migrate = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(["--database-url", &url, "migrate"])
        .output()
        .expect("outbox migrate runs");
    assert!(migrate.status.success(), "{migrate:?}");
    let redis = ScratchRedis::start();
    let relay = Relay::start(&url, &redis.url(), &[]);
    relay.wait_for("/healthz", 200);

    drop(pg);
    let (code, body) = relay.get("/healthz");
    assert_eq!(code, 503, "{body}");
    assert_eq!(body["redis"], "up", "{body}");
    let down = body["database"].as_str().unwrap_or_default();
    assert!(down.starts_with("down: "), "{body}");
    assert!(
        !down.contains(ScratchPostgres::PASSWORD),
        "the password stays hidden: {body}"
    );
    let (code, body) = relay.get("/readyz");
    assert_eq!(code, 503, "{body}");
    assert_eq!(body["status"], "unavailable", "{body}");
}

/// An admin address that is taken stops the relay at start with the address named.
#[test]
fn an_admin_address_in_use_is_reported() {
    let db = TestDb::sqlite();
    db.migrate();
    let taken = TcpListener::bind("127.0.0.1:0").expect("a port");
    let addr = taken.local_addr().expect("its address").to_string();
    fixtures::outbox()
        .args(["--database-url", &db.url, "relay", "--redis-url"])
        .arg(fixtures::redis_url())
        .args(["--admin-addr", &addr])
        .timeout(PATIENCE)
        .assert()
        .code(1)
        .stderr(predicates::str::contains(format!(
            "error: cannot serve the admin endpoint on {addr}"
        )))
        .stderr(predicates::str::contains("in use"));
}
