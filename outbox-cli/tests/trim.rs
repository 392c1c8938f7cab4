//! `outbox trim` against the real Redis, on streams under a prefix of its own.

mod fixtures;

use fixtures::{outbox, redis_url, unique};
use predicates::str::contains;
use redis::Commands as _;
use serde_json::json;

/// Keys under a random prefix, deleted on drop.
struct Streams {
    prefix: String,
    con: redis::Connection,
}

impl Streams {
    fn new() -> Self {
        let client = redis::Client::open(redis_url()).expect("a Redis URL");
        let con = client
            .get_connection()
            .expect("Redis must be running at REDIS_URL for these tests");
        Self {
            prefix: format!("{}:", unique("trim")),
            con,
        }
    }

    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Adds `n` entries to `stream`; returns their ids.
    fn add(&mut self, stream: &str, n: usize) -> Vec<String> {
        let key = self.key(stream);
        (0..n)
            .map(|i| {
                redis::cmd("XADD")
                    .arg(&key)
                    .arg("*")
                    .arg("n")
                    .arg(i)
                    .query(&mut self.con)
                    .unwrap()
            })
            .collect()
    }

    fn create_group(&mut self, stream: &str, group: &str) {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(self.key(stream))
            .arg(group)
            .arg("0")
            .query(&mut self.con)
            .unwrap();
    }

    /// Delivers the next `count` entries of `stream` to `group`; returns their ids.
    fn read(&mut self, stream: &str, group: &str, count: usize) -> Vec<String> {
        let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(group)
            .arg("c1")
            .arg("COUNT")
            .arg(count)
            .arg("STREAMS")
            .arg(self.key(stream))
            .arg(">")
            .query(&mut self.con)
            .unwrap();
        reply.keys[0].ids.iter().map(|e| e.id.clone()).collect()
    }

    fn ack(&mut self, stream: &str, group: &str, ids: &[String]) {
        let _: usize = redis::cmd("XACK")
            .arg(self.key(stream))
            .arg(group)
            .arg(ids)
            .query(&mut self.con)
            .unwrap();
    }

    /// The ids left in `stream`.
    fn ids(&mut self, stream: &str) -> Vec<String> {
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(self.key(stream))
            .arg("-")
            .arg("+")
            .query(&mut self.con)
            .unwrap();
        reply.ids.into_iter().map(|e| e.id).collect()
    }

    fn trim(&self, extra: &[&str]) -> assert_cmd::assert::Assert {
        outbox()
            .args([
                "trim",
                "--redis-url",
                &redis_url(),
                "--stream-prefix",
                &self.prefix,
            ])
            .args(extra)
            .assert()
    }
}

impl Drop for Streams {
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

#[test]
fn trim_removes_only_what_every_group_acknowledged() {
    let mut s = Streams::new();
    // Six entries read by two groups: `a` acked the first four, the last two are still
    // pending; `b` read and acked only the first three, the rest it has not read.
    let ids = s.add("order.paid", 6);
    s.create_group("order.paid", "a");
    s.create_group("order.paid", "b");
    let read_a = s.read("order.paid", "a", 6);
    s.ack("order.paid", "a", &read_a[..4]);
    let read_b = s.read("order.paid", "b", 3);
    s.ack("order.paid", "b", &read_b);
    // No group: nobody says what may go.
    s.add("no.groups", 3);
    // A dead-letter stream, everything acked by its one group: still skipped.
    s.add("order.paid:dead", 4);
    s.create_group("order.paid:dead", "d");
    let read_d = s.read("order.paid:dead", "d", 4);
    s.ack("order.paid:dead", "d", &read_d);
    // Another type under the prefix is not a stream: ignored.
    let string = s.key("a.string");
    let _: () = s.con.set(string, "x").unwrap();

    let out = s.trim(&["--json"]).success().get_output().stdout.clone();
    let mut reports: serde_json::Value = serde_json::from_slice(&out).unwrap();
    // The bound is the id after `b`'s last delivered one: above ids[2], at most ids[3].
    let min_id = reports[1]["min_id"].take();
    assert!(min_id.is_string(), "{reports}");
    assert_eq!(
        reports,
        json!([
            {"stream": s.key("no.groups"), "removed": 0, "min_id": null},
            {"stream": s.key("order.paid"), "removed": 3, "min_id": null},
        ])
    );
    assert_eq!(s.ids("order.paid"), ids[3..]);
    assert_eq!(s.ids("no.groups").len(), 3);
    assert_eq!(s.ids("order.paid:dead").len(), 4);

    // Once `b` acks the rest, only `a`'s pending entries stay.
    let rest_b = s.read("order.paid", "b", 10);
    s.ack("order.paid", "b", &rest_b);
    let stream = s.key("order.paid");
    s.trim(&[])
        .success()
        .stdout(contains(format!(
            "{stream}  removed 1 (acknowledged below {})",
            ids[4]
        )))
        .stdout(contains(format!(
            "{}no.groups   left alone: no consumer group",
            s.prefix
        )))
        .stdout(contains("removed 1 entries from 2 stream(s)"));
    assert_eq!(s.ids("order.paid"), ids[4..]);
}

#[test]
fn trim_without_matching_streams_says_so() {
    let s = Streams::new();
    s.trim(&[])
        .success()
        .stdout(format!("no streams named {}*\n", s.prefix));
    s.trim(&["--json"]).success().stdout("[]\n");
}

#[test]
fn trim_reports_an_unreachable_redis() {
    outbox()
        .args(["trim", "--redis-url", "redis://127.0.0.1:1"])
        .assert()
        .code(1)
        .stderr(contains(
            "error: Redis is not reachable at redis://127.0.0.1:1 (",
        ));
    outbox()
        .args(["trim", "--redis-url", "not a url"])
        .assert()
        .code(2)
        .stderr(contains("error: invalid broker URL `not a url`"));
}
