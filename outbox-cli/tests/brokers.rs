//! `--broker`: the `outbox` binary against each Redis topology the library reaches, as
//! an operator runs it. A relay through Sentinel across a SIGKILLed primary, with
//! `--durability replicas=1` (nothing lost, and a missing replica an outage); a relay,
//! `streams` and `trim` on a three-node cluster; URLs and durabilities that do not parse.
//! Private `redis-server`s on free loopback ports (`redis-server` and `redis-cli` must be
//! on the `PATH`).

mod fixtures;
mod serve_support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use fixtures::process::Background;
use fixtures::{TestDb, outbox, redis_url, unique};
use outbox_tests::scratch_sentinel::sync_query;
use outbox_tests::{ScratchCluster, ScratchSentinel};
use predicates::str::contains;
use serve_support::Server;

/// How long one step may take: generous, for a busy machine.
const PATIENCE: Duration = Duration::from_secs(60);

/// Polls `cond` until it holds; fails after [`PATIENCE`] with the relay's log, or at
/// once if the relay exits.
fn wait(what: &str, relay: &mut Background, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        if let Some(status) = relay.child.try_wait().expect("try_wait") {
            panic!(
                "the relay exited ({status}) waiting for {what}; log:\n{}",
                relay.log()
            );
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; log:\n{}",
            relay.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The msg_ids of `stream` on the server at `port` (empty if it does not answer).
fn msg_ids_at(port: u16, stream: &str) -> BTreeSet<String> {
    let entries: Vec<(String, Vec<String>)> =
        sync_query(port, redis::cmd("XRANGE").arg(stream).arg("-").arg("+")).unwrap_or_default();
    entries
        .into_iter()
        .filter_map(|(_, fields)| {
            let at = fields.chunks(2).position(|kv| kv[0] == "msg_id")?;
            Some(fields[at * 2 + 1].clone())
        })
        .collect()
}

fn pings(ns: std::ops::RangeInclusive<u32>) -> BTreeSet<String> {
    ns.map(|n| format!("{n}:Ping")).collect()
}

fn status_of(db: &TestDb, msg_id: &str) -> String {
    db.json(&["dead", "show", msg_id, "--json"])["status"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// `outbox relay --broker redis+sentinel://… --durability replicas=1` while the primary
/// is SIGKILLed: Sentinel promotes the replica, the relay follows it, and once the old
/// primary is back as a replica of the new one every message emitted before, during and
/// after is on the new primary's stream, no retry spent. Then the replica is killed: the
/// relay reports the unmet WAIT as an outage and keeps the new rows NEW, and publishes
/// them once the replica is back.
#[test]
fn relay_through_sentinel_follows_a_failover_and_waits_for_a_replica() {
    let mut d = ScratchSentinel::start();
    let [first, second] = d.data_ports();
    let db = TestDb::postgres();
    db.migrate();
    let prefix = format!("{}:", unique("cli"));
    let stream = format!("{prefix}cli.ping");
    let sentinels: Vec<String> = (0..3)
        .map(|i| format!("127.0.0.1:{}", d.sentinel_port(i)))
        .collect();
    let broker = format!(
        "redis+sentinel://{}/{}",
        sentinels.join(","),
        ScratchSentinel::MASTER
    );
    let admin = std::net::SocketAddr::from(([127, 0, 0, 1], outbox_tests::ports::free_port()));
    let mut relay = Background::spawn(
        &[
            "--database-url",
            &db.url,
            "relay",
            "--broker",
            &broker,
            "--stream-prefix",
            &prefix,
            "--poll-interval",
            "100ms",
            "--durability",
            "replicas=1,timeout=500ms",
            "--admin-addr",
            &admin.to_string(),
        ],
        "info",
    );
    db.emit(1..=50);
    wait("50 messages on the first primary", &mut relay, || {
        msg_ids_at(first, &stream) == pings(1..=50)
    });
    assert!(
        relay.log().contains("broker=redis+sentinel://127.0.0.1:"),
        "the broker is logged:\n{}",
        relay.log()
    );

    d.kill(0);
    db.emit(51..=100);
    d.wait("the replica's promotion", || {
        d.primary_port() == Some(second)
    });
    // Until a replica acknowledges, WAIT 1 is unmet: the rows stay NEW meanwhile.
    d.start_data(0, Some(second), "");
    d.wait_replica_synced(first, second);
    db.emit(101..=150);
    wait("every message on the new primary", &mut relay, || {
        db.status()["due"] == 0 && msg_ids_at(second, &stream).is_superset(&pings(1..=150))
    });
    let retries = db.scalar("SELECT COALESCE(MAX(retries), 0)::bigint AS n FROM outbox");
    assert_eq!(
        retries,
        0,
        "the failover spent retries; log:\n{}",
        relay.log()
    );

    // The replica (the old primary) gone: nothing can be acknowledged.
    d.kill(0);
    let outages = relay.log().matches("0 of 1 replicas acknowledged").count();
    db.emit(151..=160);
    relay.wait_for_log("0 of 1 replicas acknowledged", outages + 1);
    std::thread::sleep(Duration::from_secs(1));
    for n in [151, 160] {
        assert_eq!(
            status_of(&db, &format!("{n}:Ping")),
            "NEW",
            "log:\n{}",
            relay.log()
        );
    }
    assert!(relay.log().contains("relay paused after an outage"));
    d.start_data(0, Some(second), "");
    d.wait_replica_synced(first, second);
    wait("the rows held back to be published", &mut relay, || {
        db.status()["due"] == 0
    });
    assert!(msg_ids_at(second, &stream).is_superset(&pings(1..=160)));
    assert_eq!(db.status()["dead"], 0);
    relay.stop();

    // `streams` asks the sentinels for the primary too.
    let listed = outbox()
        .args([
            "streams",
            "--broker",
            &broker,
            "--stream-prefix",
            &prefix,
            "--json",
        ])
        .timeout(PATIENCE)
        .output()
        .unwrap();
    assert!(listed.status.success(), "{listed:?}");
    let topics: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    let shown = &topics[0]["streams"][0];
    assert_eq!(shown["stream"], stream.as_str(), "{topics}");
    assert!(shown["length"].as_u64() >= Some(160), "{topics}");
}

/// `outbox relay --broker redis+cluster://…` (two seeds of three nodes) publishes a
/// topic spread over partitions that land on several nodes; `outbox streams` lists them
/// all with their lengths, and `outbox trim` trims on every node what the group
/// acknowledged, leaving what it did not.
#[test]
fn relay_streams_and_trim_reach_every_node_of_a_cluster() {
    let cluster = ScratchCluster::start();
    let db = TestDb::postgres();
    db.migrate();
    let prefix = format!("{}:", unique("cli"));
    let broker = format!(
        "redis+cluster://127.0.0.1:{},127.0.0.1:{}",
        cluster.ports[0], cluster.ports[1]
    );
    let mut relay = Background::spawn(
        &[
            "--database-url",
            &db.url,
            "relay",
            "--broker",
            &broker,
            "--stream-prefix",
            &prefix,
            "--poll-interval",
            "100ms",
            "--partitions",
            "cli.ping=4",
        ],
        "info",
    );
    db.emit(1..=40);
    let mut conn = redis::cluster::ClusterClient::new(cluster.urls())
        .and_then(|c| c.get_connection())
        .expect("a cluster connection");
    let streams: Vec<String> = (0..4)
        .map(|p| format!("{prefix}{{cli.ping:{p}}}"))
        .collect();
    let length = |conn: &mut redis::cluster::ClusterConnection, s: &str| -> u64 {
        redis::cmd("XLEN").arg(s).query(conn).unwrap()
    };
    wait("40 messages over the partitions", &mut relay, || {
        streams.iter().map(|s| length(&mut conn, s)).sum::<u64>() == 40
    });
    relay.stop();
    let nodes_with_streams = (cluster.ports.iter())
        .filter(|&&p| !cluster.streams_on(p, &prefix).is_empty())
        .count();
    assert!(
        nodes_with_streams >= 2,
        "the partitions sit on one node only"
    );

    let listed = outbox()
        .args([
            "streams",
            "--broker",
            &broker,
            "--stream-prefix",
            &prefix,
            "--json",
        ])
        .timeout(PATIENCE)
        .output()
        .unwrap();
    assert!(listed.status.success(), "{listed:?}");
    let topics: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(topics[0]["topic"], "cli.ping", "{topics}");
    assert_eq!(topics[0]["recorded_partitions"], 4, "{topics}");
    let shown: Vec<(String, u64)> = (topics[0]["streams"].as_array().unwrap().iter())
        .map(|s| {
            (
                s["stream"].as_str().unwrap().to_owned(),
                s["length"].as_u64().unwrap(),
            )
        })
        .collect();
    let expected: Vec<(String, u64)> = streams
        .iter()
        .map(|s| (s.clone(), length(&mut conn, s)))
        .collect();
    assert_eq!(
        shown, expected,
        "every partition, on whichever node it lives"
    );

    // A group reads and acknowledges everything but partition 0's entries.
    for (p, stream) in streams.iter().enumerate() {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(stream)
            .arg("g")
            .arg("0")
            .query(&mut conn)
            .unwrap();
        if p == 0 {
            continue;
        }
        let read: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("g")
            .arg("c")
            .arg("STREAMS")
            .arg(stream)
            .arg(">")
            .query(&mut conn)
            .unwrap();
        let ids: Vec<String> = read.keys[0].ids.iter().map(|e| e.id.clone()).collect();
        let _: u64 = redis::cmd("XACK")
            .arg(stream)
            .arg("g")
            .arg(&ids)
            .query(&mut conn)
            .unwrap();
    }
    let before: Vec<u64> = streams.iter().map(|s| length(&mut conn, s)).collect();
    let trimmed = outbox()
        .args([
            "trim",
            "--broker",
            &broker,
            "--stream-prefix",
            &prefix,
            "--json",
        ])
        .timeout(PATIENCE)
        .output()
        .unwrap();
    assert!(trimmed.status.success(), "{trimmed:?}");
    let reports: serde_json::Value = serde_json::from_slice(&trimmed.stdout).unwrap();
    for (p, stream) in streams.iter().enumerate() {
        let report = (reports.as_array().unwrap().iter())
            .find(|r| r["stream"] == stream.as_str())
            .unwrap_or_else(|| panic!("{stream} not trimmed: {reports}"));
        let removed = if p == 0 { 0 } else { before[p] };
        assert_eq!(report["removed"], removed, "{stream}: {reports}");
        assert_eq!(length(&mut conn, stream), before[p] - removed, "{stream}");
    }

    // The operator's page lists the group of every partition, whichever node holds it.
    let server = Server::start(&db.url, &["--broker", &broker, "--stream-prefix", &prefix]);
    let groups = server.json("/api/groups");
    let mut listed: Vec<(String, String)> = (groups.as_array().expect("groups").iter())
        .map(|g| {
            (
                g["stream"].as_str().unwrap().to_owned(),
                g["group"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    listed.sort();
    let expected: Vec<(String, String)> = streams
        .iter()
        .map(|s| (s.clone(), "g".to_owned()))
        .collect();
    assert_eq!(listed, expected, "{groups}");
}

/// Broker URLs and durabilities that do not parse: usage errors (exit 2) that say what
/// is wrong, before anything connects, and never show a password.
#[test]
fn bad_broker_urls_and_durabilities_are_usage_errors_without_passwords() {
    let secret = "s3cret-Broker";
    let db = TestDb::sqlite();
    for (url, says) in [
        (
            format!("redis+sentinel://:{secret}@127.0.0.1:26379"),
            "names no master",
        ),
        (
            format!("redis+cluster://:{secret}@127.0.0.1:x"),
            "refused the node `127.0.0.1:x`",
        ),
        (
            format!("redis+cluster://:{secret}@h1:1/3"),
            "database 0 only",
        ),
        (
            format!("rediss+clustre://:{secret}@h1:1"),
            "unknown scheme `rediss+clustre`",
        ),
        (format!("u:{secret}@127.0.0.1:6379"), "not a URL"),
        (
            format!("redis://:{secret}@127.0.0.1:port"),
            "refused the URL",
        ),
    ] {
        for command in [
            vec!["--database-url", &db.url, "relay", "--broker", &url],
            vec!["trim", "--broker", &url],
            vec!["streams", "--redis-url", &url],
        ] {
            let out = outbox().args(&command).timeout(PATIENCE).output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{command:?}: {stderr}");
            assert!(
                stderr.starts_with("error: invalid broker URL `"),
                "{command:?}: {stderr}"
            );
            assert!(stderr.contains(says), "{command:?}: {stderr}");
            assert!(
                !stderr.contains(secret),
                "{command:?} shows the password: {stderr}"
            );
        }
    }
    // The same URL from the environment.
    let url = format!("redis+sentinel://:{secret}@h:1");
    for var in ["OUTBOX_BROKER", "REDIS_URL"] {
        let out = outbox()
            .env(var, &url)
            .arg("trim")
            .timeout(PATIENCE)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}: {stderr}");
        assert!(
            stderr.contains("names no master") && !stderr.contains(secret),
            "{stderr}"
        );
    }
    // --broker wins over a REDIS_URL left in the environment; nothing at all is a
    // usage error.
    outbox()
        .env("REDIS_URL", &url)
        .args([
            "trim",
            "--broker",
            &redis_url(),
            "--stream-prefix",
            &unique("none"),
        ])
        .timeout(PATIENCE)
        .assert()
        .success();
    outbox()
        .arg("streams")
        .timeout(PATIENCE)
        .assert()
        .code(2)
        .stderr(contains("error: no broker URL: pass --broker"));
    // An option the deployment cannot take: a cluster's stream prefix holds no brace.
    db.outbox()
        .args([
            "relay",
            "--broker",
            "redis+cluster://127.0.0.1:1",
            "--stream-prefix",
            "a{b}:",
        ])
        .timeout(PATIENCE)
        .assert()
        .code(2)
        .stderr(contains(
            "error: cannot publish to `redis+cluster://127.0.0.1:1` with these options",
        ))
        .stderr(contains("must not contain `{` or `}` on a Redis Cluster"));
    for (durability, says) in [
        ("replicas=0", "waits for nothing"),
        (
            "replicas=1,timeout=9s",
            "less than the publisher's response timeout",
        ),
        ("aof=remote", "`remote` is not a replica count"),
        ("always", "expected reply, replicas=N"),
    ] {
        db.outbox()
            .args([
                "relay",
                "--broker",
                &redis_url(),
                "--durability",
                durability,
            ])
            .timeout(PATIENCE)
            .assert()
            .code(2)
            .stderr(contains(says));
    }
}
