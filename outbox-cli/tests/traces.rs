//! `outbox relay` built with the `opentelemetry` feature and given an OTLP endpoint
//! exports its spans: a message that carries a `traceparent` gets an
//! `outbox.relay.publish` span in that trace, received by a collector over HTTP.
#![cfg(feature = "opentelemetry")]

mod fixtures;

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use fixtures::TestDb;
use fixtures::process::Background;
use fixtures::relay::Streams;

/// What the collector received: each request's path and body.
type Received = Mutex<Vec<(String, Vec<u8>)>>;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

/// A stand-in OTLP/HTTP collector: records each request's path and body, answers 200.
struct Collector {
    addr: std::net::SocketAddr,
    received: Arc<Received>,
}

impl Collector {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().unwrap();
        let received = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&received);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let sink = Arc::clone(&sink);
                std::thread::spawn(move || serve(stream, &sink));
            }
        });
        Self { addr, received }
    }

    fn requests(&self) -> Vec<(String, Vec<u8>)> {
        self.received.lock().unwrap().clone()
    }
}

/// Reads HTTP/1.1 requests off one connection (kept alive) until it closes.
fn serve(stream: TcpStream, sink: &Received) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut writer = stream;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
            return;
        }
        let mut length = 0;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            if line == "\r\n" {
                break;
            }
            if let Some((name, value)) = line.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().expect("a length");
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).expect("the body");
        let path = request_line
            .split(' ')
            .nth(1)
            .unwrap_or_default()
            .to_owned();
        sink.lock().unwrap().push((path, body));
        let reply =
            "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
        if writer.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn the_relay_exports_a_publish_span_in_the_messages_trace() {
    let db = TestDb::postgres();
    db.migrate();
    db.emit([1]);
    db.exec(&format!(
        r#"UPDATE outbox SET headers = '{{"traceparent": "00-{TRACE_ID}-00f067aa0ba902b7-01"}}'"#
    ));
    let collector = Collector::start();
    let endpoint = format!("http://{}", collector.addr);
    let streams = Streams::new();
    let args = [
        "--database-url",
        &db.url,
        "relay",
        "--redis-url",
        &fixtures::redis_url(),
        "--stream-prefix",
        &streams.prefix,
        "--poll-interval",
        "100ms",
    ];
    let mut relay = Background::spawn_with_env(
        &args,
        "info",
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str())],
    );
    streams.wait_for(1, &mut relay);
    // SIGTERM: the relay stops and exports what it has before it exits.
    relay.stop();

    let trace_id: Vec<u8> = (0..16)
        .map(|i| u8::from_str_radix(&TRACE_ID[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let requests = collector.requests();
    let found = requests.iter().any(|(path, body)| {
        path == "/v1/traces" && contains(body, &trace_id) && contains(body, b"outbox.relay.publish")
    });
    assert!(
        found,
        "no outbox.relay.publish span of trace {TRACE_ID} among {} export(s) to {:?}; log:\n{}",
        requests.len(),
        requests.iter().map(|(p, _)| p).collect::<Vec<_>>(),
        relay.log()
    );
}
