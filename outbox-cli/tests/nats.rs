//! `--broker nats://`: the `outbox` binary against the shared NATS JetStream server
//! (127.0.0.1:4222, or `NATS_URL`), as an operator runs it. The relay publishes every
//! row once, in order per key, and a row published again (its SENT mark lost) is dropped
//! by the server's duplicate window; `outbox streams` reads the stream back; options and
//! URLs that do not fit the broker are usage errors. Each test has its own stream and
//! subject prefixes.

mod fixtures;
#[cfg(feature = "serve")]
mod serve_support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use fixtures::process::Background;
use fixtures::{AnyConn, TestDb, outbox, unique};
use outbox_core::OutboxEvent;
use outbox_diesel::Emit as _;
use outbox_nats::async_nats::{self, jetstream};
use outbox_tests::{ScratchNats, nats_url};
use predicates::prelude::PredicateBooleanExt as _;
use predicates::str::contains;

/// How long one step may take: generous, for a busy machine.
const PATIENCE: Duration = Duration::from_secs(60);

/// A step of one key's sequence: msg_id `<key>/<seq>:Step`, ordering key `<key>`.
#[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "cli.step", key = key, id = "{key}/{seq}")]
struct Step {
    key: String,
    seq: u32,
}

/// The prefixes of one test: a stream prefix and a subject prefix no other test uses.
struct Prefixes {
    stream: String,
    subject: String,
}

impl Prefixes {
    fn new() -> Self {
        let id = unique("clinats");
        Self {
            stream: format!("{}_", id.to_uppercase()),
            subject: id,
        }
    }

    /// The topic's stream.
    fn stream(&self) -> String {
        format!("{}cli_step", self.stream)
    }

    /// The library's names for these prefixes.
    fn naming(&self) -> outbox_nats::Naming {
        outbox_nats::Naming::new(self.subject.clone(), self.stream.clone()).unwrap()
    }
}

/// A current-thread runtime for the test's own NATS client.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

async fn jetstream() -> jetstream::Context {
    let client = async_nats::connect(nats_url())
        .await
        .unwrap_or_else(|e| panic!("NATS at {} must be up: {e}", nats_url()));
    jetstream::new(client)
}

/// Every message of `stream` in sequence order, as `(msg_id, key)` from its headers.
async fn messages(js: &jetstream::Context, stream: &str) -> Vec<(String, String)> {
    let mut stream = js
        .get_stream(stream)
        .await
        .expect("the relay created the stream");
    let last = stream
        .info()
        .await
        .expect("stream info")
        .state
        .last_sequence;
    let mut out = Vec::new();
    for seq in 1..=last {
        let m = stream.get_raw_message(seq).await.expect("message");
        let header = |name: &str| {
            m.headers
                .get(name)
                .map(|v| v.as_str().to_owned())
                .unwrap_or_else(|| panic!("message {seq} has no {name}"))
        };
        out.push((header("Nats-Msg-Id"), header("Outbox-Key")));
    }
    out
}

/// Emits `keys` × `seqs`, one transaction per seq round, so the ids of a key climb in
/// the order its steps were written.
fn emit_steps(db: &TestDb, keys: &[&str], seqs: std::ops::Range<u32>) {
    let AnyConn::Pg(mut conn) = db.conn() else {
        panic!("a PostgreSQL database");
    };
    for seq in seqs {
        let steps: Vec<Step> = keys
            .iter()
            .map(|k| Step {
                key: (*k).to_owned(),
                seq,
            })
            .collect();
        diesel::Connection::transaction(&mut conn, |c| {
            c.emit_all(steps)?;
            Ok::<_, diesel::result::Error>(())
        })
        .expect("emit");
    }
}

fn sent(db: &TestDb) -> i64 {
    db.scalar("SELECT count(*) AS n FROM outbox WHERE status = 1")
}

/// Waits until `n` rows are SENT, failing with the relay's log if it exits or stalls.
fn wait_sent(db: &TestDb, relay: &mut Background, n: i64) {
    let deadline = Instant::now() + PATIENCE;
    while sent(db) < n {
        if let Some(status) = relay.child.try_wait().expect("try_wait") {
            panic!("the relay exited ({status}); log:\n{}", relay.log());
        }
        assert!(
            Instant::now() < deadline,
            "{} of {n} rows SENT after {PATIENCE:?}; log:\n{}",
            sent(db),
            relay.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn relay(db: &TestDb, p: &Prefixes, extra: &[&str]) -> Background {
    let url = nats_url();
    let mut args = vec![
        "--database-url",
        &db.url,
        "relay",
        "--broker",
        &url,
        "--stream-prefix",
        &p.stream,
        "--subject-prefix",
        &p.subject,
        "--poll-interval",
        "100ms",
        "--batch-size",
        "40",
    ];
    args.extend_from_slice(extra);
    Background::spawn(&args, "info")
}

/// `outbox relay --broker nats://…` publishes every row once and in order per key; with
/// the SENT marks lost (as after a crash between the publish and the mark) a second relay
/// publishes them all again and the stream still holds each once (`Nats-Msg-Id` inside
/// the duplicate window). `outbox streams` reads the stream's length back.
#[test]
fn relay_to_nats_publishes_each_row_once_in_order_per_key() {
    let db = TestDb::postgres();
    db.migrate();
    let p = Prefixes::new();
    let keys = ["a", "b", "c", "d"];
    emit_steps(&db, &keys, 0..30);
    let total = 4 * 30;

    let admin = format!("127.0.0.1:{}", outbox_tests::ports::free_port());
    let mut first = relay(
        &db,
        &p,
        &[
            "--replicas",
            "1",
            "--duplicate-window",
            "2m",
            "--admin-addr",
            &admin,
        ],
    );
    wait_sent(&db, &mut first, total);
    // The probe reaches NATS, not Redis.
    let health = outbox_tests::http_get(
        admin.parse().expect("an address"),
        "/healthz",
        Duration::from_secs(5),
    );
    assert_eq!(health.status, 200, "{}", health.text);
    assert!(health.body().contains(r#""nats":"up""#), "{}", health.text);
    // Rows emitted while the relay runs (woken by NOTIFY or its poll).
    emit_steps(&db, &keys, 30..40);
    let total = 4 * 40;
    wait_sent(&db, &mut first, total);
    first.stop();

    let rt = runtime();
    let js = rt.block_on(jetstream());
    let stream = p.stream();
    let published = rt.block_on(messages(&js, &stream));
    assert_published_once_in_order(&published, &keys, 40);

    // The marks lost: everything NEW again, published again, dropped by the server.
    db.exec("UPDATE outbox SET status = 0, sent_at = NULL");
    let mut again = relay(&db, &p, &[]);
    wait_sent(&db, &mut again, total);
    again.stop();
    let republished = rt.block_on(messages(&js, &stream));
    assert_eq!(
        republished.len(),
        published.len(),
        "a row published again within the duplicate window was stored twice"
    );

    let listed = outbox()
        .args([
            "streams",
            "--broker",
            &nats_url(),
            "--stream-prefix",
            &p.stream,
        ])
        .arg("--json")
        .output()
        .expect("outbox streams runs");
    assert!(listed.status.success(), "{listed:?}");
    let topics: serde_json::Value = serde_json::from_slice(&listed.stdout).expect("JSON");
    assert_eq!(topics[0]["topic"], "cli_step", "{topics}");
    assert_eq!(
        topics[0]["streams"][0]["stream"],
        stream.as_str(),
        "{topics}"
    );
    assert_eq!(topics[0]["streams"][0]["length"], total, "{topics}");

    rt.block_on(js.delete_stream(&stream))
        .expect("delete the stream");
}

/// Each msg_id once, every step of every key there, and each key's steps in seq order.
fn assert_published_once_in_order(published: &[(String, String)], keys: &[&str], seqs: u32) {
    let ids: BTreeSet<&str> = published.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids.len(), published.len(), "a msg_id twice: {published:?}");
    let expected: BTreeSet<String> = keys
        .iter()
        .flat_map(|k| (0..seqs).map(move |s| format!("{k}/{s}:Step")))
        .collect();
    let got: BTreeSet<String> = ids.iter().map(|s| (*s).to_owned()).collect();
    assert_eq!(got, expected, "messages lost or unexpected");
    let mut per_key: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for (id, key) in published {
        let seq = id
            .strip_suffix(":Step")
            .and_then(|id| id.rsplit_once('/'))
            .and_then(|(_, s)| s.parse().ok());
        per_key
            .entry(key)
            .or_default()
            .push(seq.expect("<key>/<seq>:Step"));
    }
    for (key, seqs) in per_key {
        assert!(seqs.is_sorted(), "key {key} out of order: {seqs:?}");
    }
}

/// URLs and options that do not fit the broker are usage errors (exit 2), reported
/// before anything connects and without the password.
#[test]
fn nats_urls_and_options_that_do_not_fit_are_usage_errors() {
    let db = "postgres://127.0.0.1:1/nothing";
    let relay = |broker: &str, extra: &[&str]| {
        let mut cmd = outbox();
        cmd.args(["--database-url", db, "relay", "--broker", broker])
            .args(extra);
        cmd.assert()
    };
    for (url, says) in [
        ("nats://:s3cret@h:notaport", "`h:notaport`"),
        ("nats://:s3cret@h:4222/db", "drop the path"),
        ("nats://:s3cret@h1:4222,,h2:4222", "empty host"),
        ("nats://:s3cret@h:4222?x=1", "unknown parameter `x`"),
    ] {
        let out = relay(url, &[]).code(2).stderr(contains(says));
        let stderr = String::from_utf8_lossy(&out.get_output().stderr).into_owned();
        assert!(!stderr.contains("s3cret"), "{url}: {stderr}");
    }
    relay(
        "nats://:s3cret@127.0.0.1:4222",
        &["--durability", "replicas=1"],
    )
    .code(2)
    .stderr(contains("--durability"))
    .stderr(contains("Redis brokers only"));
    relay("nats://127.0.0.1:4222", &["--max-stream-len", "10"])
        .code(2)
        .stderr(contains("--max-stream-len"));
    relay("nats://127.0.0.1:4222", &["--stream-prefix", "a.b"])
        .code(2)
        .stderr(contains("stream_prefix"));
    relay("redis://127.0.0.1:6379", &["--replicas", "3"])
        .code(2)
        .stderr(contains("NATS brokers only"));
    relay("nats://127.0.0.1:4222", &["--replicas", "6"]).code(2);
    relay("redis://127.0.0.1:6379", &["--max-age", "1d"])
        .code(2)
        .stderr(contains("--max-age"))
        .stderr(contains("NATS brokers only"));
    // Trim: JetStream's retention removes messages; the refusal says where to look.
    outbox()
        .args(["trim", "--broker", "nats://:s3cret@127.0.0.1:4222"])
        .assert()
        .code(2)
        .stderr(contains("does not apply to NATS"))
        .stderr(contains("max_age"))
        .stderr(contains("outbox relay --max-age"))
        .stderr(contains("s3cret").not());
}

/// A message the stream holds is not removed by `outbox trim` on NATS, even one every
/// group acknowledged: the stream's own retention (`--max-age`) decides.
#[test]
fn trim_on_nats_removes_nothing() {
    let p = Prefixes::new();
    let rt = runtime();
    let js = rt.block_on(jetstream());
    rt.block_on(publish_steps(&p, &[("k", 1)]));
    outbox()
        .args([
            "trim",
            "--broker",
            &nats_url(),
            "--stream-prefix",
            &p.stream,
        ])
        .assert()
        .code(2);
    assert_eq!(rt.block_on(messages(&js, &p.stream())).len(), 1);
    rt.block_on(drop_streams(&js, &p));
}

/// Publishes `(key, seq)` steps through the library's publisher, on `p`'s names.
async fn publish_steps(p: &Prefixes, steps: &[(&str, u32)]) {
    let client = async_nats::connect(nats_url()).await.expect("NATS");
    let publisher = outbox_nats::NatsPublisher::new(
        client,
        outbox_nats::PublisherConfig::default().with_naming(p.naming()),
    )
    .unwrap();
    let batch: Vec<outbox_core::StoredMessage> = steps
        .iter()
        .enumerate()
        .map(|(i, (key, seq))| outbox_core::StoredMessage {
            id: i as i64 + 1,
            retries: 0,
            envelope: outbox_core::Envelope::from_event(
                &Step {
                    key: (*key).to_owned(),
                    seq: *seq,
                },
                1 << 20,
            )
            .unwrap(),
        })
        .collect();
    let outcomes = outbox_core::Publisher::publish(&publisher, &batch)
        .await
        .unwrap();
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
}

/// Removes the streams of `p` (the topic's and the dead-letter stream).
async fn drop_streams(js: &jetstream::Context, p: &Prefixes) {
    for stream in [p.stream(), format!("{}DEAD", p.stream)] {
        let _ = js.delete_stream(stream).await;
    }
}

/// A relay whose server is down (a private server, stopped) keeps running and spends no
/// retry (an outage), and publishes everything once the server is back on its port.
#[test]
fn relay_to_nats_waits_out_a_server_outage_without_spending_retries() {
    let db = TestDb::postgres();
    db.migrate();
    let p = Prefixes::new();
    emit_steps(&db, &["k"], 0..5);
    let mut server = ScratchNats::start();
    server.stop();
    let url = server.url();
    let mut r = Background::spawn(
        &[
            "--database-url",
            &db.url,
            "relay",
            "--broker",
            &url,
            "--stream-prefix",
            &p.stream,
            "--subject-prefix",
            &p.subject,
            "--poll-interval",
            "100ms",
        ],
        "info",
    );
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        r.child.try_wait().expect("try_wait").is_none(),
        "the relay gave up; log:\n{}",
        r.log()
    );
    assert_eq!(sent(&db), 0);
    let retried = "SELECT count(*) AS n FROM outbox WHERE retries > 0 OR status = 2";
    assert_eq!(
        db.scalar(retried),
        0,
        "an outage spent retries; log:\n{}",
        r.log()
    );
    server.restart();
    wait_sent(&db, &mut r, 5);
    assert_eq!(
        db.scalar(retried),
        0,
        "an outage spent retries; log:\n{}",
        r.log()
    );
    r.stop();
}

/// Fails every step of key `poison`; counts the others.
#[cfg(feature = "serve")]
struct FailPoison;

#[cfg(feature = "serve")]
impl outbox_core::Handler<Step> for FailPoison {
    type Conn = outbox_core::MemoryTx<u32>;
    fn handle(
        &self,
        step: Step,
        tx: &mut Self::Conn,
        _: &outbox_core::Delivery,
    ) -> Result<(), outbox_core::HandlerError> {
        if step.key == "poison" {
            return Err(outbox_core::HandlerError::msg("poisoned step"));
        }
        *tx.data() += 1;
        Ok(())
    }
}

/// Runs a consumer of `group` (the library's, as a service runs it) until it has
/// dead-lettered `poison/1` and applied the rest, then stops it.
#[cfg(feature = "serve")]
async fn consume_until_dead_lettered(p: &Prefixes, group: &str) {
    let client = async_nats::connect(nats_url()).await.expect("NATS");
    let config = outbox_nats::ConsumerConfig::default()
        .with_naming(p.naming())
        .with_fetch_wait(Duration::from_millis(200))
        .with_max_deliveries(1);
    let consumer = outbox_nats::Consumer::builder(client, group)
        .handle::<Step, _>(FailPoison)
        .idempotency(outbox_core::MemoryDb::new(0u32))
        .with_config(config)
        .build()
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = consumer.clone();
    let run = tokio::spawn(async move {
        running
            .run_until(async {
                let _ = stopped.await;
            })
            .await
    });
    let deadline = Instant::now() + PATIENCE;
    while !(consumer.stats().dead_lettered == 1 && consumer.stats().consumed == 1) {
        assert!(Instant::now() < deadline, "{:?}", consumer.stats());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
}

/// `outbox serve --broker nats://…`: the dead letter a consumer wrote is listed with its
/// group and reason, shown with its payload, and redriven through the API back onto its
/// stream for its group alone; the groups page shows each durable consumer's lag (the
/// messages published after it stopped) and pending count.
#[cfg(feature = "serve")]
#[test]
fn serve_lists_shows_and_redrives_nats_dead_letters_and_shows_the_lag() {
    use serve_support::{Server, TOKEN};
    let db = TestDb::postgres();
    db.migrate();
    let p = Prefixes::new();
    let group = unique("billing");
    let rt = runtime();
    let js = rt.block_on(jetstream());
    rt.block_on(async {
        publish_steps(&p, &[("poison", 1), ("ok", 1)]).await;
        consume_until_dead_lettered(&p, &group).await;
        publish_steps(&p, &[("late", 1), ("late", 2)]).await;
    });
    let url = nats_url();
    let server = Server::start(
        &db.url,
        &[
            "--broker",
            &url,
            "--stream-prefix",
            &p.stream,
            "--token",
            TOKEN,
        ],
    );

    let dead = server.json("/api/dead");
    assert_eq!(dead["redis"], true, "{dead}");
    assert_eq!(dead["redis_error"], serde_json::Value::Null, "{dead}");
    assert_eq!(dead["consumers_total"], 1, "{dead}");
    let letter = &dead["consumers"][0];
    assert_eq!(letter["group"], group.as_str(), "{dead}");
    assert_eq!(letter["msg_id"], "poison/1:Step", "{dead}");
    assert_eq!(letter["stream"], p.stream().as_str(), "{dead}");
    assert_eq!(letter["dead_stream"], format!("{}DEAD", p.stream), "{dead}");
    assert_eq!(letter["delivery_count"], 1, "{dead}");
    assert!(
        letter["reason"].as_str().unwrap().contains("poisoned step"),
        "{dead}"
    );
    let item = letter["item"].as_str().unwrap().to_owned();
    let encoded: String = form_urlencoded::byte_serialize(item.as_bytes()).collect();
    let shown = server.json(&format!("/api/dead/show?item={encoded}"));
    assert!(
        shown["fields"]["payload"]
            .as_str()
            .is_some_and(|p| p.contains("\"poison\"")),
        "{shown}"
    );
    let (status, page) = server.get("/dead");
    assert_eq!(status, 200);
    assert!(
        page.contains("poisoned step") && page.contains(&group),
        "{page}"
    );
    // A dead letter of another server's prefix is not this page's to touch.
    let (status, _) = server.get("/api/dead/show?item=consumer:1:OTHER_DEAD");
    assert_eq!(status, 400);

    let groups = server.json("/api/groups");
    let ours = groups
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["group"] == group.as_str())
        .unwrap_or_else(|| panic!("{groups}"));
    assert_eq!(ours["stream"], p.stream().as_str(), "{groups}");
    assert_eq!(ours["lag"], 2, "published after it stopped: {groups}");
    assert_eq!(ours["pending"], 0, "{groups}");
    let (status, page) = server.get("/groups");
    assert_eq!(status, 200);
    assert!(page.contains(&group), "{page}");

    let (status, done) = server.post_json(
        "/api/dead/redrive",
        &serde_json::json!({"items": [item]}),
        Some(TOKEN),
    );
    assert_eq!(status, 200, "{done}");
    let done: serde_json::Value = serde_json::from_str(&done).unwrap();
    assert_eq!(done["consumers"], 1, "{done}");
    assert_eq!(server.json("/api/dead")["consumers_total"], 0);
    let stored = rt.block_on(messages(&js, &p.stream()));
    assert_eq!(
        stored.len(),
        5,
        "two, two more, and the redriven one: {stored:?}"
    );
    assert!(
        stored[4].0.starts_with("poison/1:Step:redrive:"),
        "{stored:?}"
    );
    let redriven_for = rt.block_on(async {
        let stream = js.get_stream(p.stream()).await.unwrap();
        let m = stream.get_raw_message(5).await.unwrap();
        m.headers
            .get(outbox_nats::REDRIVE_GROUP_HEADER)
            .map(|v| v.as_str().to_owned())
    });
    assert_eq!(redriven_for.as_deref(), Some(group.as_str()));
    rt.block_on(drop_streams(&js, &p));
}
