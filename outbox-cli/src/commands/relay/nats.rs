//! `outbox relay --broker nats://…`: the NATS JetStream publisher's configuration from
//! the relay's options, and its client.

use outbox_nats::{Naming, NatsPublisher, PublisherConfig, StreamSettings};

use crate::args::RelayArgs;
use crate::broker::{Broker, NatsServers};
use crate::error::CliError;

/// The publisher's configuration: the prefixes, the partitions, the stream settings
/// (the crate's recommended defaults unless `--replicas` / `--duplicate-window` /
/// `--max-age` say otherwise). The Redis-only options are refused, as is a value the
/// publisher would refuse: all usage errors, found before anything connects.
pub(super) fn publisher_config(
    broker: &Broker,
    args: &RelayArgs,
) -> Result<PublisherConfig, CliError> {
    let redis_only = |option: &'static str| CliError::BrokerOption {
        option,
        url: broker.display().to_owned(),
        applies_to: "Redis",
    };
    if args.durability != outbox_redis::Durability::default() {
        return Err(redis_only("--durability (NATS: --replicas)"));
    }
    if args.max_stream_len.is_some() {
        return Err(redis_only("--max-stream-len"));
    }
    let invalid = |source: outbox_core::InvalidConfig| CliError::NatsConfig {
        url: broker.display().to_owned(),
        source: source.into(),
    };
    let naming = Naming::new(
        args.subject_prefix
            .as_deref()
            .unwrap_or(outbox_nats::DEFAULT_SUBJECT_PREFIX),
        args.stream_prefix
            .as_deref()
            .unwrap_or(outbox_nats::DEFAULT_STREAM_PREFIX),
    )
    .map_err(invalid)?;
    let defaults = StreamSettings::default();
    let streams = defaults
        .clone()
        .with_replicas(args.replicas.map_or(defaults.replicas, usize::from))
        .with_duplicate_window(args.duplicate_window.unwrap_or(defaults.duplicate_window))
        .with_max_age(args.max_age.unwrap_or(defaults.max_age));
    let mut config = PublisherConfig::default()
        .with_naming(naming)
        .with_streams(streams);
    for p in &args.partitions {
        if config.partitions.contains_key(&p.topic) {
            return Err(CliError::PartitionsTwice(p.topic.clone()));
        }
        config = config.with_partitions(p.topic.clone(), p.partitions);
    }
    config.validate().map_err(invalid)?;
    Ok(config)
}

/// The publisher on a client that keeps (re)connecting: a server down at start is an
/// outage the relay backs off from.
pub(super) async fn publisher(
    servers: &NatsServers,
    config: PublisherConfig,
    broker: &Broker,
) -> Result<NatsPublisher, CliError> {
    let client = servers.client().await.map_err(|e| CliError::NatsConfig {
        url: broker.display().to_owned(),
        source: outbox_nats::Error::Unavailable(e.to_string()),
    })?;
    NatsPublisher::new(client, config).map_err(|source| CliError::NatsConfig {
        url: broker.display().to_owned(),
        source,
    })
}
