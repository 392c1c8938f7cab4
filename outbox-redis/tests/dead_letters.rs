//! The operators' dead-letter functions against the real Redis: a redrive appends the
//! message once, however many operators (or page tabs) redrive it at the same moment.

mod fixtures;

use fixtures::*;
use outbox_redis::redis::{self, AsyncCommands as _};

/// Writes a dead letter of `entry` as the consumer does: the original fields plus why.
async fn dead_letter_of(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    entry: &redis::streams::StreamId,
) -> String {
    let mut fields: Vec<(String, String)> = vec![
        ("stream".into(), stream.into()),
        ("group".into(), "billing".into()),
        ("entry_id".into(), entry.id.clone()),
        ("reason".into(), "handler failed".into()),
        ("delivery_count".into(), "5".into()),
    ];
    for name in ["msg_id", "type", "payload"] {
        fields.push((name.into(), field(entry, name)));
    }
    conn.xadd(format!("{stream}:dead"), "*", &fields)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_redriven_by_several_operators_at_once_is_appended_once() {
    let prefix = unique_prefix("redrive-race");
    let stream = format!("{prefix}order.paid");
    let dead_stream = format!("{stream}:dead");
    publish(&prefix, (1..=20).map(paid)).await;
    let mut conn = conn().await;
    let originals = xrange(&mut conn, &stream).await.ids;
    for entry in &originals {
        let id = dead_letter_of(&mut conn, &stream, entry).await;
        // Eight operators, each on a connection of its own, redrive it at once.
        let redrives = (0..8).map(|_| {
            let (dead_stream, id) = (dead_stream.clone(), id.clone());
            tokio::spawn(async move {
                let mut own = fixtures::conn().await;
                outbox_redis::redrive_dead_letter(&mut own, &dead_stream, &id).await
            })
        });
        let mut appended = 0;
        for redrive in futures_util::future::join_all(redrives).await {
            appended += usize::from(redrive.unwrap().expect("redrive"));
        }
        assert_eq!(appended, 1, "redrives of {id} that said they appended");
    }
    let entries = xrange(&mut conn, &stream).await.ids;
    assert_eq!(
        entries.len(),
        2 * originals.len(),
        "one copy per dead letter"
    );
    let dead: usize = conn.xlen(&dead_stream).await.unwrap();
    assert_eq!(dead, 0, "every dead letter redriven and deleted");
    cleanup(&prefix).await;
}
