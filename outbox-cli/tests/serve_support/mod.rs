//! `outbox serve` as a separate process on a free port, an HTTP client for it, and the
//! Redis side of the scenarios: a stream with a consumer group and a consumer's dead
//! letters, under a unique prefix.

// Each test binary uses a part of this module.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use redis::Commands as _;

/// The token the tests start the server with.
pub(crate) const TOKEN: &str = "serve-test-token-5f1c";

/// A running `outbox serve`; killed on drop.
pub(crate) struct Server {
    child: Child,
    /// Its stderr.
    pub(crate) log: PathBuf,
    /// `http://127.0.0.1:<port>`.
    pub(crate) base: String,
    agent: ureq::Agent,
    /// The `--token` it was started with, which [`Server::get`] sends as an operator's
    /// script would.
    token: Option<String>,
}

impl Server {
    /// Starts `outbox serve` on 127.0.0.1 and a free port with these arguments and waits
    /// until it listens.
    pub(crate) fn start(database_url: &str, extra: &[&str]) -> Self {
        Self::start_on("127.0.0.1", database_url, extra)
    }

    /// Starts `outbox serve` on `ip` (`0.0.0.0`: every address, off loopback) and a free
    /// port; requests go to 127.0.0.1.
    pub(crate) fn start_on(ip: &str, database_url: &str, extra: &[&str]) -> Self {
        let port = outbox_tests::ports::free_port();
        let log =
            std::env::temp_dir().join(format!("{}.log", outbox_tests::unique("outbox_serve")));
        let child = Command::new(env!("CARGO_BIN_EXE_outbox"))
            .env_remove("DATABASE_URL")
            .env_remove("OUTBOX_BROKER")
            .env_remove("REDIS_URL")
            .env_remove("OUTBOX_SERVE_TOKEN")
            .env("RUST_LOG", "info")
            .args(["--database-url", database_url, "serve", "--addr"])
            .arg(format!("{ip}:{port}"))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("start outbox serve");
        outbox_tests::ports::wait_for_port(port, "outbox serve", Duration::from_secs(30));
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        Self {
            child,
            log,
            base: format!("http://127.0.0.1:{port}"),
            agent,
            token: extra
                .windows(2)
                .find(|w| w[0] == "--token")
                .map(|w| w[1].to_owned()),
        }
    }

    /// `GET path`, with the bearer token if the server has one: the status and the body.
    pub(crate) fn get(&self, path: &str) -> (u16, String) {
        let bearer = self.token.as_ref().map(|t| format!("Bearer {t}"));
        match &bearer {
            Some(bearer) => self.get_with(path, &[("Authorization", bearer)]),
            None => self.get_with(path, &[]),
        }
    }

    /// `GET path` with these headers and no others: the status and the body.
    pub(crate) fn get_with(&self, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
        let mut req = self.agent.get(format!("{}{path}", self.base));
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let mut resp = req.call().unwrap_or_else(|e| panic!("GET {path}: {e}"));
        let body = resp.body_mut().read_to_string().expect("body");
        (resp.status().as_u16(), body)
    }

    /// `POST /login` with `token` and `next`: the status, the `Set-Cookie` and
    /// `Location` headers (empty when absent) and the body.
    pub(crate) fn login(&self, token: &str, next: &str) -> (u16, String, String, String) {
        let form = format!(
            "token={}&next={}",
            form_urlencoded::byte_serialize(token.as_bytes()).collect::<String>(),
            form_urlencoded::byte_serialize(next.as_bytes()).collect::<String>()
        );
        let mut resp = self
            .agent
            .post(format!("{}/login", self.base))
            .content_type("application/x-www-form-urlencoded")
            .send(form)
            .unwrap_or_else(|e| panic!("POST /login: {e}"));
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        let (cookie, location) = (header("set-cookie"), header("location"));
        let body = resp.body_mut().read_to_string().expect("body");
        (resp.status().as_u16(), cookie, location, body)
    }

    /// `POST path` with these headers and an empty body: the status, the `Set-Cookie`
    /// and `Location` headers (empty when absent).
    pub(crate) fn post_with(&self, path: &str, headers: &[(&str, &str)]) -> (u16, String, String) {
        let mut req = self.agent.post(format!("{}{path}", self.base));
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let resp = req
            .send_empty()
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        (
            resp.status().as_u16(),
            header("set-cookie"),
            header("location"),
        )
    }

    /// `GET path` that must answer 200 with JSON.
    pub(crate) fn json(&self, path: &str) -> serde_json::Value {
        let (status, body) = self.get(path);
        assert_eq!(status, 200, "GET {path}: {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: no JSON ({e}): {body}"))
    }

    /// `POST path` with a form body.
    pub(crate) fn post_form(&self, path: &str, pairs: &[(&str, &str)]) -> (u16, String) {
        let mut form = form_urlencoded::Serializer::new(String::new());
        for (k, v) in pairs {
            form.append_pair(k, v);
        }
        let mut resp = self
            .agent
            .post(format!("{}{path}", self.base))
            .content_type("application/x-www-form-urlencoded")
            .send(form.finish())
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        let body = resp.body_mut().read_to_string().expect("body");
        (resp.status().as_u16(), body)
    }

    /// `POST path` with a JSON body and, if given, a bearer token.
    pub(crate) fn post_json(
        &self,
        path: &str,
        body: &serde_json::Value,
        token: Option<&str>,
    ) -> (u16, String) {
        let mut req = self
            .agent
            .post(format!("{}{path}", self.base))
            .content_type("application/json");
        if let Some(token) = token {
            req = req.header("Authorization", format!("Bearer {token}"));
        }
        let mut resp = req
            .send(body.to_string())
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        let text = resp.body_mut().read_to_string().expect("body");
        (resp.status().as_u16(), text)
    }

    /// The CSRF token the confirmation page's form carries.
    pub(crate) fn csrf(&self) -> String {
        let (status, page) = self.get("/dead/confirm?action=purge&item=outbox:1");
        assert_eq!(status, 200, "{page}");
        let start = page.find("name=\"csrf\" value=\"").expect("a CSRF field") + 19;
        page[start..start + 64].to_owned()
    }

    /// What the server wrote to stderr.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Streams under a unique prefix on a Redis server; deleted on drop.
pub(crate) struct Streams {
    /// The prefix (`serve_<unique>:`).
    pub(crate) prefix: String,
    /// The stream of topic `cli.ping`.
    pub(crate) stream: String,
    /// Its dead-letter stream.
    pub(crate) dead: String,
    client: redis::Client,
}

impl Streams {
    /// A stream with group `billing` (one consumer `c1`, one pending entry) and two dead
    /// letters of that group, msg_ids `8:Ping` and `9:Ping`.
    pub(crate) fn new(redis_url: &str) -> Self {
        let prefix = format!("{}:", outbox_tests::unique("serve"));
        let stream = format!("{prefix}cli.ping");
        let dead = format!("{stream}:dead");
        let client = redis::Client::open(redis_url).expect("redis url");
        let streams = Self {
            prefix,
            stream,
            dead,
            client,
        };
        let mut c = streams.conn();
        let _: String = c
            .xadd(
                &streams.stream,
                "*",
                &[
                    ("msg_id", "7:Ping"),
                    ("topic", "cli.ping"),
                    ("type", "Ping"),
                    ("payload", "{\"n\":7}"),
                ],
            )
            .expect("XADD");
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&streams.stream)
            .arg("billing")
            .arg("0")
            .query(&mut c)
            .expect("XGROUP CREATE");
        let _: redis::Value = redis::cmd("XREADGROUP")
            .arg(&["GROUP", "billing", "c1", "COUNT", "1", "STREAMS"])
            .arg(&streams.stream)
            .arg(">")
            .query(&mut c)
            .expect("XREADGROUP");
        for n in [8, 9] {
            streams.add_dead_letter(n);
        }
        streams
    }

    /// A dead letter as the consumer writes it, for `<n>:Ping`.
    pub(crate) fn add_dead_letter(&self, n: u32) -> String {
        let msg_id = format!("{n}:Ping");
        let payload = format!("{{\"n\":{n}}}");
        let fields = [
            ("reason", "handler failed: no such account"),
            ("delivery_count", "5"),
            ("group", "billing"),
            ("stream", self.stream.as_str()),
            ("entry_id", "1-0"),
            ("msg_id", msg_id.as_str()),
            ("topic", "cli.ping"),
            ("type", "Ping"),
            ("version", "1"),
            ("key", "k"),
            ("payload", payload.as_str()),
            ("headers", "{\"trace\":\"t-1\"}"),
        ];
        self.conn()
            .xadd(&self.dead, "*", &fields)
            .expect("XADD dead letter")
    }

    /// A connection.
    pub(crate) fn conn(&self) -> redis::Connection {
        self.client.get_connection().expect("connect to Redis")
    }

    /// The msg_ids of a stream's entries, in order.
    pub(crate) fn msg_ids(&self, stream: &str) -> Vec<String> {
        let reply: redis::streams::StreamRangeReply =
            self.conn().xrange_all(stream).expect("XRANGE");
        reply
            .ids
            .iter()
            .map(|e| e.get::<String>("msg_id").unwrap_or_default())
            .collect()
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        if let Ok(mut c) = self.client.get_connection() {
            let _: redis::RedisResult<()> = c.del(&[&self.stream, &self.dead]);
        }
    }
}
