//! Partitioned topics as operators meet them: `outbox relay --partitions` publishing to
//! partition streams, `outbox streams` showing partitions, groups and lease holders, and
//! `outbox trim` on partition streams, against the real PostgreSQL and Redis; and bad
//! `--partitions` values.

mod fixtures;

use std::time::{Duration, Instant};

use fixtures::relay::start_relay;
use fixtures::{TestDb, outbox, redis_url, unique};
use outbox_core::{Partitions, partition_of};
use predicates::str::contains;
use redis::Commands as _;
use serde_json::json;

/// Fail-safe for waits on the relay; no test relies on it for timing.
const PATIENCE: Duration = Duration::from_secs(60);

/// Keys under a prefix of their own, deleted on drop.
struct Keys {
    prefix: String,
    con: redis::Connection,
}

impl Keys {
    fn new() -> Self {
        let con = redis::Client::open(redis_url())
            .expect("a Redis URL")
            .get_connection()
            .expect("Redis must be running at REDIS_URL for these tests");
        Self {
            prefix: format!("{}:", unique("parts")),
            con,
        }
    }

    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// `(id, msg_id, key)` of each entry of `stream`, in stream order.
    fn entries(&mut self, stream: &str) -> Vec<(String, String, String)> {
        let reply: redis::streams::StreamRangeReply =
            self.con.xrange_all(self.key(stream)).unwrap();
        let field = |e: &redis::streams::StreamId, name| e.get::<String>(name).unwrap_or_default();
        reply
            .ids
            .iter()
            .map(|e| (e.id.clone(), field(e, "msg_id"), field(e, "key")))
            .collect()
    }

    fn len(&mut self, stream: &str) -> usize {
        self.con.xlen(self.key(stream)).unwrap()
    }

    fn add(&mut self, stream: &str, n: usize) -> Vec<String> {
        let key = self.key(stream);
        (0..n)
            .map(|i| self.con.xadd(&key, "*", &[("n", i)]).unwrap())
            .collect()
    }

    fn create_group(&mut self, stream: &str, group: &str) {
        let _: () = self
            .con
            .xgroup_create(self.key(stream), group, "0")
            .unwrap();
    }

    /// Delivers the next `count` entries to `group` and acknowledges them.
    fn read_and_ack(&mut self, stream: &str, group: &str, count: usize) {
        let opts = redis::streams::StreamReadOptions::default()
            .group(group, "c1")
            .count(count);
        let reply: redis::streams::StreamReadReply = self
            .con
            .xread_options(&[self.key(stream)], &[">"], &opts)
            .unwrap();
        let ids: Vec<String> = reply.keys[0].ids.iter().map(|e| e.id.clone()).collect();
        let _: usize = self.con.xack(self.key(stream), group, &ids).unwrap();
    }

    fn key_type(&mut self, key: &str) -> String {
        redis::cmd("TYPE").arg(key).query(&mut self.con).unwrap()
    }

    fn run(&self, command: &str, extra: &[&str]) -> assert_cmd::assert::Assert {
        outbox()
            .args([
                command,
                "--redis-url",
                &redis_url(),
                "--stream-prefix",
                &self.prefix,
            ])
            .args(extra)
            .assert()
    }
}

impl Drop for Keys {
    fn drop(&mut self) {
        let keys: Vec<String> = self
            .con
            .keys(format!("{}*", self.prefix))
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: redis::RedisResult<usize> = self.con.del(keys);
        }
    }
}

/// `--partitions cli.ping=4`: every message lands on the partition stream of its key
/// (`partition_of`, the documented hash), each partition in commit order, no message on
/// the unpartitioned stream, and the count recorded for consumers and `outbox streams`.
#[test]
fn relay_with_partitions_publishes_each_key_to_its_partition_stream() {
    let db = TestDb::postgres();
    db.migrate();
    db.emit(1..=40);
    let mut keys = Keys::new();
    let mut relay = start_relay(&db, &keys.prefix, &["--partitions", "cli.ping=4"]);
    let deadline = Instant::now() + PATIENCE;
    while (0..4)
        .map(|p| keys.len(&format!("cli.ping:{p}")))
        .sum::<usize>()
        < 40
    {
        if let Some(status) = relay.child.try_wait().unwrap() {
            panic!("the relay exited ({status}); log:\n{}", relay.log());
        }
        assert!(Instant::now() < deadline, "log:\n{}", relay.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    relay.signal("TERM");
    assert!(relay.wait().success(), "log:\n{}", relay.log());
    assert!(
        relay.log().contains("partitions=cli.ping=4"),
        "{}",
        relay.log()
    );

    let four = Partitions::new(4).unwrap();
    let mut seen = Vec::new();
    for p in 0..4 {
        let ns: Vec<u32> = keys
            .entries(&format!("cli.ping:{p}"))
            .into_iter()
            .map(|(_, msg_id, key)| {
                assert_eq!(partition_of(&key, four), p, "{msg_id} on partition {p}");
                assert_eq!(msg_id, format!("{key}:Ping"));
                key.parse().unwrap()
            })
            .collect();
        assert!(!ns.is_empty(), "partition {p} got nothing of 40 keys");
        assert!(ns.is_sorted(), "partition {p} out of commit order: {ns:?}");
        seen.extend(ns);
    }
    seen.sort_unstable();
    assert_eq!(seen, (1..=40).collect::<Vec<u32>>(), "every message once");
    assert_eq!(keys.key_type(&keys.key("cli.ping")), "none");
    let recorded: Option<u32> = keys.con.hget(keys.key("partitions"), "cli.ping").unwrap();
    assert_eq!(recorded, Some(4));
}

/// `outbox streams` groups the streams by topic, partitions in number order, with the
/// recorded count, lengths, dead letters, groups and the lease holder read from
/// `<stream>:lease:<group>`; the keys that are not streams are not listed.
#[test]
fn streams_show_partitions_groups_and_lease_holders() {
    let mut k = Keys::new();
    for p in [0, 1, 10] {
        k.add(&format!("order.paid:{p}"), 3);
        k.create_group(&format!("order.paid:{p}"), "billing");
    }
    k.read_and_ack("order.paid:1", "billing", 2);
    k.add("order.paid:1:dead", 2);
    k.add("order.shipped", 5);
    k.create_group("order.shipped", "billing");
    let _: () = k.con.hset(k.key("partitions"), "order.paid", 11).unwrap();
    let _: () = k.con.hset(k.key("partitions"), "order.packed", 2).unwrap();
    // The lease an ordered consumer would hold, set by hand.
    let lease = k.key("order.paid:0:lease:billing");
    let _: () = k.con.pset_ex(&lease, "3:consumer-a", 60_000).unwrap();
    let _: () = k.con.set(format!("{lease}:epoch"), 3).unwrap();
    // An ordered consumer holds the one stream of an unpartitioned topic too.
    let _: () = k
        .con
        .pset_ex(k.key("order.shipped:lease:billing"), "1:consumer-b", 60_000)
        .unwrap();

    let out = k
        .run("streams", &["--json"])
        .success()
        .get_output()
        .stdout
        .clone();
    let mut topics: serde_json::Value = serde_json::from_slice(&out).unwrap();
    for (topic, stream) in [(1, 0), (2, 0)] {
        let ttl = topics[topic]["streams"][stream]["groups"][0]["lease"]["ttl_ms"].take();
        assert!(
            ttl.as_u64().is_some_and(|ms| ms > 0 && ms <= 60_000),
            "{ttl}"
        );
    }
    // Only `order.paid:1` was read from, by its one consumer, which acked everything.
    let group = |lag: u64, consumers: u64, lease: serde_json::Value| json!([{"group": "billing", "pending": 0, "lag": lag, "consumers": consumers, "lease": lease}]);
    let stream = |name: &str, partition: Option<u32>, length, dead_letters, groups| {
        json!({"stream": k.key(name), "partition": partition, "length": length,
               "dead_letters": dead_letters, "groups": groups})
    };
    assert_eq!(
        topics,
        json!([
            {"topic": "order.packed", "recorded_partitions": 2, "streams": []},
            {"topic": "order.paid", "recorded_partitions": 11, "streams": [
                stream("order.paid:0", Some(0), 3, 0,
                    group(3, 0, json!({"holder": "consumer-a", "epoch": 3, "ttl_ms": null}))),
                stream("order.paid:1", Some(1), 3, 2, group(1, 1, json!(null))),
                stream("order.paid:10", Some(10), 3, 0, group(3, 0, json!(null))),
            ]},
            {"topic": "order.shipped", "recorded_partitions": null, "streams": [
                stream("order.shipped", None, 5, 0,
                    group(5, 0, json!({"holder": "consumer-b", "epoch": 1, "ttl_ms": null}))),
            ]},
        ])
    );

    k.run("streams", &[])
        .success()
        .stdout(contains("order.paid: 11 partition(s) recorded\n"))
        .stdout(contains(format!(
            "  {}order.paid:1  length 3, 2 dead letter(s)\n",
            k.prefix
        )))
        .stdout(contains(
            "    group billing: pending 0, lag 3, 0 consumer(s), held by consumer-a (epoch 3, ",
        ))
        .stdout(contains(
            "    group billing: pending 0, lag 1, 1 consumer(s), no lease holder\n",
        ))
        .stdout(contains(
            "    group billing: pending 0, lag 5, 0 consumer(s), held by consumer-b (epoch 1, ",
        ))
        .stdout(contains(
            "order.packed: 2 partition(s) recorded\n  no stream yet\n",
        ));
}

/// `outbox trim` trims partition streams like any other, skips their dead-letter
/// streams, and leaves the keys that are not streams (leases, epochs, the hash of
/// partition counts) alone.
#[test]
fn trim_trims_partition_streams_and_leaves_other_keys_alone() {
    let mut k = Keys::new();
    for p in 0..2 {
        let stream = format!("order.paid:{p}");
        k.add(&stream, 4);
        k.create_group(&stream, "billing");
        k.read_and_ack(&stream, "billing", 3);
    }
    k.add("order.paid:0:dead", 1);
    let lease = k.key("order.paid:0:lease:billing");
    let _: () = k.con.pset_ex(&lease, "1:consumer-a", 60_000).unwrap();
    let _: () = k.con.set(format!("{lease}:epoch"), 1).unwrap();
    let _: () = k.con.hset(k.key("partitions"), "order.paid", 2).unwrap();

    let out = k
        .run("trim", &["--json"])
        .success()
        .get_output()
        .stdout
        .clone();
    let mut reports: serde_json::Value = serde_json::from_slice(&out).unwrap();
    for r in reports.as_array_mut().unwrap() {
        assert!(r["min_id"].take().is_string(), "{r}");
    }
    assert_eq!(
        reports,
        json!([
            {"stream": k.key("order.paid:0"), "removed": 3, "min_id": null},
            {"stream": k.key("order.paid:1"), "removed": 3, "min_id": null},
        ])
    );
    assert_eq!(k.len("order.paid:0"), 1);
    assert_eq!(k.len("order.paid:0:dead"), 1);
    assert_eq!(k.key_type(&lease), "string");
    assert_eq!(k.key_type(&format!("{lease}:epoch")), "string");
    assert_eq!(k.key_type(&k.key("partitions")), "hash");
}

/// Bad `--partitions` values are usage errors (exit 2) that say what is wrong, before
/// anything connects.
#[test]
fn bad_partitions_values_are_usage_errors() {
    let relay = |values: &[&str]| {
        let mut cmd = outbox();
        cmd.args(["--database-url", "postgres://127.0.0.1:1/none", "relay"])
            .args(["--redis-url", "redis://127.0.0.1:1"]);
        for v in values {
            cmd.args(["--partitions", v]);
        }
        cmd.assert().code(2)
    };
    let invalid = |v: &str| format!("invalid value '{v}' for '--partitions <TOPIC=N>': ");
    relay(&["order.paid=0"])
        .stderr(contains(invalid("order.paid=0")))
        .stderr(contains("partitions must be between 1 and 1024; got 0"));
    relay(&["order.paid=2000"]).stderr(contains("got 2000"));
    relay(&["order.paid=abc"]).stderr(contains(format!(
        "{}`abc` is not a partition count",
        invalid("order.paid=abc")
    )));
    relay(&["order.paid"]).stderr(contains(format!(
        "{}expected TOPIC=N, e.g. order.paid=8",
        invalid("order.paid")
    )));
    relay(&["order:paid=2"]).stderr(contains("topic \"order:paid\" must contain only"));
    relay(&["order.paid=2", "order.paid=4"]).stderr(contains(
        "error: --partitions gives topic `order.paid` twice",
    ));
}
