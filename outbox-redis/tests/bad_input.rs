//! Wrong Redis passwords, unreachable servers and malformed URLs, through the library:
//! each is a typed error with the client's words, an outage where waiting can fix it,
//! and the password appears in no error's `Display` or `Debug` and in no `Debug` of the
//! publisher or consumer. Nothing is written: the server's streams stay as they were.

mod fixtures;

use fixtures::*;
use outbox_core::{MemoryDb, Publisher as _};
use outbox_redis::{Consumer, PublisherConfig, RedisPublisher};
use outbox_tests::{PasswordRedis, assert_hidden};

fn publisher_for(url: &str) -> RedisPublisher {
    RedisPublisher::new(url)
        .and_then(|p| {
            p.with_config(PublisherConfig::default().with_stream_prefix(unique_prefix("test")))
        })
        .expect("a well-formed URL")
}

fn consumer_for(url: &str) -> Consumer<MemoryDb<Applied>> {
    Consumer::builder(url, "bad-input")
        .handle::<OrderPaid, _>(Recorder::ok())
        .idempotency(MemoryDb::new(Applied::new()))
        .with_config(fast_config(&unique_prefix("test")))
        .build()
        .expect("a well-formed URL")
}

async fn keys(url: &str) -> usize {
    let client = outbox_redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    outbox_redis::redis::cmd("DBSIZE")
        .query_async(&mut conn)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_an_outage_without_the_password() {
    let server = PasswordRedis::start();
    let secret = "Wr0ng-Redis-Secret";
    let url = server.url_with_password(secret);
    let right = server.url_with_password(PasswordRedis::PASSWORD);

    let publisher = publisher_for(&url);
    assert!(!format!("{publisher:?}").contains(secret), "{publisher:?}");
    let e = publisher.check().await.unwrap_err();
    assert!(e.is_outage(), "{e:?}");
    assert!(
        outbox_core::error_chain(&e)
            .to_string()
            .contains("authentication failed"),
        "{e}"
    );
    assert_hidden(&e, secret);
    // A publish fails as a whole (the relay backs off; no message spends a retry).
    let e = publisher
        .publish(&stored([paid(1)]))
        .await
        .expect_err("published with a wrong password");
    assert!(e.is_outage(), "{e:?}");
    assert_hidden(&e, secret);

    let consumer = consumer_for(&url);
    assert!(!format!("{consumer:?}").contains(secret), "{consumer:?}");
    let e = consumer
        .ensure_groups()
        .await
        .expect_err("ran with a wrong password");
    assert!(e.is_outage(), "{e:?}");
    assert!(
        outbox_core::error_chain(&e)
            .to_string()
            .contains("authentication failed"),
        "{e}"
    );
    assert_hidden(&e, secret);

    // Nothing reached the server, and the right password works.
    assert_eq!(keys(&right).await, 0);
    publisher_for(&right)
        .check()
        .await
        .expect("the right password");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_on_a_server_that_needs_one_is_an_outage() {
    let server = PasswordRedis::start();
    let url = server
        .url_with_password("")
        .replace("redis://:@", "redis://");
    // `check` sends nothing without a durability probe; the first write is refused.
    let e = publisher_for(&url)
        .publish(&stored([paid(1)]))
        .await
        .expect_err("published without the password");
    assert!(e.is_outage(), "{e:?}");
    // Redis answers a long command of an unauthenticated client with a protocol error
    // (and closes the connection) rather than NOAUTH.
    assert!(
        outbox_core::error_chain(&e)
            .to_string()
            .contains("unauthenticated"),
        "{e}"
    );
    let e = consumer_for(&url)
        .ensure_groups()
        .await
        .expect_err("ran without the password");
    assert!(e.is_outage(), "{e:?}");
    assert!(
        outbox_core::error_chain(&e).to_string().contains("NOAUTH"),
        "{e}"
    );
    assert_eq!(
        keys(&server.url_with_password(PasswordRedis::PASSWORD)).await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_redis_is_an_outage_without_the_password() {
    // Nothing listens on port 1 of the loopback: refused at once.
    let secret = "Unreach4ble-Secret";
    let url = format!("redis://user:{secret}@127.0.0.1:1/0");
    let e = publisher_for(&url).check().await.unwrap_err();
    assert!(e.is_outage(), "{e:?}");
    assert_hidden(&e, secret);
    let e = publisher_for(&url)
        .publish(&stored([paid(1)]))
        .await
        .unwrap_err();
    assert!(e.is_outage(), "{e:?}");
    assert_hidden(&e, secret);
    let e = consumer_for(&url).ensure_groups().await.unwrap_err();
    assert!(e.is_outage(), "{e:?}");
    assert_hidden(&e, secret);
}

#[test]
fn a_malformed_url_is_a_config_error_without_the_password() {
    let secret = "Malf0rmed-Secret";
    for url in [
        format!("redis://:{secret}@127.0.0.1:notaport"),
        format!("rediss:/:{secret}@host"),
        format!("http://:{secret}@127.0.0.1:6379"),
        format!("redis://:{secret}@127.0.0.1:6379/notadb"),
    ] {
        let e = RedisPublisher::new(url.as_str()).expect_err(&url);
        assert!(!e.is_outage(), "{e:?}");
        assert_hidden(&e, secret);
        let e = Consumer::builder(url.as_str(), "g")
            .handle::<OrderPaid, _>(Recorder::ok())
            .idempotency(MemoryDb::new(Applied::new()))
            .build()
            .expect_err(&url);
        assert_hidden(&e, secret);
    }
}

/// `max_len` past what Redis accepts for `MAXLEN` (a signed 64-bit number) is refused
/// when the publisher is built: before, every XADD failed and each message spent its
/// retries on it until it was dead-lettered.
#[test]
fn a_max_len_redis_cannot_take_is_a_config_error() {
    let config = |max_len| PublisherConfig::default().with_max_len(Some(max_len));
    for n in [0, usize::MAX, i64::MAX as usize + 1] {
        let e = RedisPublisher::new(redis_url())
            .and_then(|p| p.with_config(config(n)))
            .expect_err("accepted");
        assert!(e.is_config(), "{e:?}");
        assert!(e.to_string().contains("max_len must be"), "{e}");
    }
    RedisPublisher::new(redis_url())
        .and_then(|p| p.with_config(config(i64::MAX as usize)))
        .expect("the largest MAXLEN");
}
