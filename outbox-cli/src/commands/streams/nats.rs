//! `outbox streams --broker nats://…`: the JetStream streams under the prefix, each with
//! its messages and its durable consumers (one per group).

use futures_util::TryStreamExt as _;
use outbox_nats::async_nats::jetstream;

use crate::broker::{Broker, NatsServers};
use crate::error::CliError;
use crate::output::{GroupReport, StreamReport, TopicStreams};

use super::TIMEOUT;

/// Every stream whose name starts with `prefix`, sorted by name: its topic is the name
/// after the prefix (`OUTBOX_order_paid` → `order_paid`; the dead-letter stream is
/// `DEAD`). A stream holds every partition of its topic, so `partition` is always
/// `None`; per group, `pending` is the messages delivered and not acknowledged,
/// `lag` those not delivered yet.
pub(super) async fn read(
    servers: &NatsServers,
    broker: &Broker,
    prefix: &str,
) -> Result<Vec<TopicStreams>, CliError> {
    let client = servers
        .connect(TIMEOUT)
        .await
        .map_err(|reason| CliError::NatsConnect {
            url: broker.display().to_owned(),
            reason,
        })?;
    let js = jetstream::ContextBuilder::new()
        .timeout(TIMEOUT)
        .build(client);
    let failed = |e: &dyn std::fmt::Display| CliError::Nats(e.to_string());
    let mut infos: Vec<jetstream::stream::Info> = js
        .streams()
        .try_filter(|info| std::future::ready(info.config.name.starts_with(prefix)))
        .try_collect()
        .await
        .map_err(|e| failed(&e))?;
    infos.sort_by(|a, b| a.config.name.cmp(&b.config.name));
    let mut topics = Vec::with_capacity(infos.len());
    for info in infos {
        let name = info.config.name;
        let stream = js.get_stream(&name).await.map_err(|e| failed(&e))?;
        let mut groups: Vec<GroupReport> = stream
            .consumers()
            .map_ok(|c| GroupReport {
                group: c.name,
                pending: c.num_ack_pending,
                lag: usize::try_from(c.num_pending).ok(),
                consumers: 1,
                lease: None,
            })
            .try_collect()
            .await
            .map_err(|e| failed(&e))?;
        groups.sort_by(|a, b| a.group.cmp(&b.group));
        topics.push(TopicStreams {
            topic: name[prefix.len()..].to_owned(),
            recorded_partitions: None,
            streams: vec![StreamReport {
                stream: name,
                partition: None,
                length: info.state.messages,
                dead_letters: 0,
                groups,
            }],
        });
    }
    Ok(topics)
}
