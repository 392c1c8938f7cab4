//! The publisher against the shared nats-server (127.0.0.1:4222, JetStream) and private
//! ones: subjects, headers, the dedup window, refusals that hold their key, stream
//! settings checked, outages told apart from refusals.

use std::time::Duration;

use async_nats::jetstream;
use chrono::Utc;
use outbox_core::{Envelope, Headers, MsgId, Partitions, Publisher, RejectKind, StoredMessage};
use outbox_nats::{Naming, NatsPublisher, PublisherConfig, StreamSettings};
use outbox_tests::{DropStreams, ScratchNats, nats_url, unique};

/// Names of this test alone (subjects `t_<pid>_<hex>.<topic>`, streams
/// `St_<pid>_<hex>_..`), and their streams' removal when the test ends.
fn naming() -> (Naming, DropStreams) {
    let id = unique("t");
    let streams = format!("S{id}_");
    (
        Naming::new(id, streams.clone()).unwrap(),
        DropStreams::new(nats_url(), streams),
    )
}

fn message(id: i64, topic: &str, key: &str, payload: &str) -> StoredMessage {
    StoredMessage {
        id,
        retries: 0,
        envelope: Envelope {
            msg_id: MsgId::new(format!("{key}-{id}:Moved")).unwrap(),
            topic: topic.into(),
            event_type: "Moved".into(),
            key: key.into(),
            schema_version: 1,
            payload: payload.into(),
            headers: Headers::from([("traceparent".to_owned(), "00-abc-def-01".to_owned())]),
            created_at: Utc::now(),
        },
    }
}

async fn client(url: &str) -> async_nats::Client {
    async_nats::connect(url)
        .await
        .expect("nats-server on 127.0.0.1:4222 (scripts/services.sh)")
}

async fn publisher(config: PublisherConfig) -> (NatsPublisher, jetstream::Context) {
    let client = client(&nats_url()).await;
    let js = jetstream::new(client.clone());
    (NatsPublisher::new(client, config).unwrap(), js)
}

/// The stored messages of `stream`: (subject, msg_id header, payload).
async fn stored(js: &jetstream::Context, stream: &str) -> Vec<(String, String, String)> {
    let mut stream = js.get_stream(stream).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut out = Vec::new();
    for seq in 1..=last {
        let m = stream.get_raw_message(seq).await.unwrap();
        let id = m.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned());
        out.push((
            m.subject.to_string(),
            id.unwrap_or_default(),
            String::from_utf8(m.payload.to_vec()).unwrap(),
        ));
    }
    out
}

#[tokio::test]
async fn a_batch_lands_in_order_on_its_topics_subjects_with_the_msg_id() {
    let (naming, _streams) = naming();
    let config = PublisherConfig::default().with_naming(naming.clone());
    let (publisher, js) = publisher(config).await;
    let batch = [
        message(1, "order.paid", "a", r#"{"n":1}"#),
        message(2, "order.shipped", "a", r#"{"n":2}"#),
        message(3, "order.paid", "b", r#"{"n":3}"#),
    ];
    let outcomes = publisher.publish(&batch).await.unwrap();
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");

    let paid = stored(&js, &naming.stream("order.paid")).await;
    let subject = naming.subject("order.paid");
    assert_eq!(
        paid,
        [
            (
                subject.clone(),
                "a-1:Moved".to_owned(),
                r#"{"n":1}"#.to_owned()
            ),
            (subject, "b-3:Moved".to_owned(), r#"{"n":3}"#.to_owned()),
        ]
    );
    let shipped = stored(&js, &naming.stream("order.shipped")).await;
    assert_eq!(shipped.len(), 1);

    // The consumer's view: every envelope field comes back.
    let stream = js.get_stream(naming.stream("order.paid")).await.unwrap();
    let raw = stream.get_raw_message(1).await.unwrap();
    let back = outbox_nats::envelope_from_message(Some(&raw.headers), &raw.payload, "x").unwrap();
    let mut sent = batch[0].envelope.clone();
    sent.created_at = back.created_at; // RFC 3339 keeps nanoseconds; compare the rest
    assert_eq!(back, sent);

    // Settings of a new stream: the defaults.
    let info = js.get_stream(naming.stream("order.paid")).await.unwrap();
    let c = &info.cached_info().config;
    assert_eq!(c.duplicate_window, Duration::from_secs(120));
    assert_eq!(c.num_replicas, 1);
}

#[tokio::test]
async fn a_republish_inside_the_duplicate_window_is_dropped_by_the_server() {
    let (naming, _streams) = naming();
    let (publisher, js) = publisher(PublisherConfig::default().with_naming(naming.clone())).await;
    let batch: Vec<StoredMessage> = (1..=20)
        .map(|i| message(i, "order.paid", "k", "{}"))
        .collect();
    assert!(
        publisher
            .publish(&batch)
            .await
            .unwrap()
            .iter()
            .all(Result::is_ok)
    );
    // The relay publishes the same rows again (a crash before the SENT mark): taken.
    let again = publisher.publish(&batch).await.unwrap();
    assert!(again.iter().all(Result::is_ok), "{again:?}");
    let mut stream = js.get_stream(naming.stream("order.paid")).await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        20,
        "no copy stored"
    );
}

#[tokio::test]
async fn a_partitioned_topic_has_a_subject_per_partition() {
    let (naming, _streams) = naming();
    let eight = Partitions::new(8).unwrap();
    let config = PublisherConfig::default()
        .with_naming(naming.clone())
        .with_partitions("order.paid", eight);
    let (publisher, js) = publisher(config).await;
    let batch: Vec<StoredMessage> = (1..=6)
        .map(|i| message(i, "order.paid", &format!("order-{}", i % 3), "{}"))
        .collect();
    assert!(
        publisher
            .publish(&batch)
            .await
            .unwrap()
            .iter()
            .all(Result::is_ok)
    );
    let stored = stored(&js, &naming.stream("order.paid")).await;
    for (m, (subject, id, _)) in batch.iter().zip(&stored) {
        let p = eight.of(&m.envelope.key);
        assert_eq!(subject, &naming.partition_subject("order.paid", p));
        assert_eq!(id, m.envelope.msg_id.as_str());
    }
}

#[tokio::test]
async fn a_refused_message_holds_the_rest_of_its_key_and_spends_a_retry() {
    let (naming, _streams) = naming();
    let streams = StreamSettings::default().with_max_message_size(2048);
    let config = PublisherConfig::default()
        .with_naming(naming.clone())
        .with_streams(streams);
    let (publisher, js) = publisher(config).await;
    let big = format!(r#"{{"pad":"{}"}}"#, "x".repeat(4096));
    let batch = [
        message(1, "order.paid", "a", &big),
        message(2, "order.paid", "a", "{}"),
        message(3, "order.paid", "b", "{}"),
    ];
    let outcomes = publisher.publish(&batch).await.unwrap();
    let kinds: Vec<Option<RejectKind>> = outcomes
        .iter()
        .map(|o| o.as_ref().err().map(|r| r.kind))
        .collect();
    assert_eq!(
        kinds,
        [Some(RejectKind::Message), Some(RejectKind::Held), None],
        "{outcomes:?}"
    );
    let reason = &outcomes[0].as_ref().unwrap_err().reason;
    assert!(reason.contains("max_message_size"), "{reason}");
    let stored = stored(&js, &naming.stream("order.paid")).await;
    assert_eq!(stored.len(), 1, "only b was sent: {stored:?}");
}

#[tokio::test]
async fn a_stream_with_other_settings_is_refused_with_a_typed_error() {
    let (naming, _streams) = naming();
    let client = client(&nats_url()).await;
    let js = jetstream::new(client.clone());
    let stream = naming.stream("order.paid");
    let theirs = StreamSettings::default().with_duplicate_window(Duration::from_secs(5));
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![naming.subject("order.paid")],
        duplicate_window: theirs.duplicate_window,
        ..Default::default()
    })
    .await
    .unwrap();
    let publisher = NatsPublisher::new(
        client,
        PublisherConfig::default().with_naming(naming.clone()),
    )
    .unwrap();
    let err = publisher.ensure_streams(["order.paid"]).await.unwrap_err();
    assert!(err.is_stream_mismatch(), "{err}");
    assert!(err.to_string().contains("duplicate_window"), "{err}");

    // At publish: the topic's fault, no retry spent; other topics go.
    let batch = [
        message(1, "order.paid", "a", "{}"),
        message(2, "order.other", "b", "{}"),
    ];
    let outcomes = publisher.publish(&batch).await.unwrap();
    let first = outcomes[0].as_ref().unwrap_err();
    assert_eq!(first.kind, RejectKind::Topic, "{first:?}");
    assert!(outcomes[1].is_ok(), "{outcomes:?}");
}

/// A stream whose messages leave at another age than configured (sooner: lost to a
/// consumer that is behind) is refused, naming `max_age`.
#[tokio::test]
async fn a_stream_with_another_max_age_is_refused() {
    let (naming, _streams) = naming();
    let client = client(&nats_url()).await;
    let js = jetstream::new(client.clone());
    let ours = StreamSettings::default();
    js.create_stream(async_nats::jetstream::stream::Config {
        name: naming.stream("order.paid"),
        subjects: vec![naming.subject("order.paid")],
        duplicate_window: ours.duplicate_window,
        max_age: Duration::from_secs(3600),
        ..Default::default()
    })
    .await
    .unwrap();
    let publisher = NatsPublisher::new(
        client,
        PublisherConfig::default().with_naming(naming.clone()),
    )
    .unwrap();
    let err = publisher.ensure_streams(["order.paid"]).await.unwrap_err();
    assert!(err.is_stream_mismatch(), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("max_age") && text.contains("3600s") && text.contains("604800s"),
        "{text}"
    );
    // The same age is accepted.
    let same = NatsPublisher::new(
        js.client(),
        PublisherConfig::default()
            .with_naming(naming)
            .with_streams(ours.with_max_age(Duration::from_secs(3600))),
    )
    .unwrap();
    same.ensure_streams(["order.paid"]).await.unwrap();
}

#[tokio::test]
async fn a_missing_stream_is_refused_when_creation_is_off() {
    let (naming, _streams) = naming();
    let streams = StreamSettings::default().with_create(false);
    let config = PublisherConfig::default()
        .with_naming(naming)
        .with_streams(streams);
    let (publisher, _) = publisher(config).await;
    let err = publisher.ensure_streams(["order.paid"]).await.unwrap_err();
    assert!(matches!(err, outbox_nats::Error::StreamMissing(_)), "{err}");
}

#[tokio::test]
async fn a_server_down_is_an_outage_of_the_whole_call_and_back_it_takes_the_batch() {
    let mut server = ScratchNats::start();
    let (naming, _streams) = naming();
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(server.url())
        .await
        .unwrap();
    let config = PublisherConfig::default()
        .with_naming(naming.clone())
        .with_ack_timeout(Duration::from_secs(2));
    let publisher = NatsPublisher::new(client.clone(), config).unwrap();
    outbox_tests::eventually("the client to connect", || {
        client.connection_state() == async_nats::connection::State::Connected
    })
    .await;
    let batch = [message(1, "order.paid", "a", "{}")];
    assert!(publisher.publish(&batch).await.unwrap()[0].is_ok());

    server.stop();
    let err = publisher.publish(&batch).await.unwrap_err();
    assert!(err.is_outage(), "{err}");

    server.restart();
    outbox_tests::eventually("the client to reconnect", || {
        client.connection_state() == async_nats::connection::State::Connected
    })
    .await;
    let batch2 = [message(2, "order.paid", "a", "{}")];
    assert!(publisher.publish(&batch2).await.unwrap()[0].is_ok());
    let js = jetstream::new(client);
    let stored = stored(&js, &naming.stream("order.paid")).await;
    assert_eq!(
        stored.len(),
        2,
        "the store survived the restart: {stored:?}"
    );
}
