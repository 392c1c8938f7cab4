//! Keys are compared exactly by the per-key claim: `k` and `k ` (a trailing space) are
//! two keys, each kept in its own order, although MariaDB's `utf8mb4_bin` (a PAD SPACE
//! collation) finds them equal. PostgreSQL is checked with the same scenarios.

mod fixtures;

use fixtures::{Backend, My, Pg, exec, runtime};
use outbox_core::{ClaimedBatch, OutboxEvent, RelayBatchOutcome, RelayStore};
use outbox_diesel::{Emit as _, OutboxConnection};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(key = account)]
struct Moved {
    #[outbox(id)]
    n: u32,
    account: String,
}

fn emit<C: OutboxConnection>(c: &mut C, rows: &[(u32, &str)]) {
    c.emit_all(rows.iter().map(|&(n, account)| Moved {
        n,
        account: account.into(),
    }))
    .unwrap();
}

/// `(n, key)` of a batch, in order.
fn rows(batch: &impl ClaimedBatch) -> Vec<(String, String)> {
    batch
        .messages()
        .iter()
        .map(|m| {
            (
                m.envelope
                    .msg_id
                    .as_str()
                    .trim_end_matches(":Moved")
                    .to_owned(),
                m.envelope.key.clone(),
            )
        })
        .collect()
}

fn pairs(want: &[(u32, &str)]) -> Vec<(String, String)> {
    want.iter()
        .map(|&(n, k)| (n.to_string(), k.to_owned()))
        .collect()
}

/// Another relay holds the first row of `k ` and of `k`: the later rows of both keys wait
/// for it, and go out in order once it has published.
async fn held_rows_hold_back_their_exact_key<B: Backend>() {
    let db = B::create();
    let mut c = B::connect(&db);
    emit(
        &mut c,
        &[
            (1, "k "),
            (2, "k"),
            (3, "k"),
            (4, "k "),
            (5, "k"),
            (6, "k "),
        ],
    );
    let store = B::store(&db);
    let other = store.claim(2).await.unwrap();
    assert_eq!(rows(&other), pairs(&[(1, "k "), (2, "k")]));
    let mine = store.claim(100).await.unwrap();
    assert_eq!(
        rows(&mine),
        [],
        "each key's later rows wait for its first row, held by the other relay"
    );
    drop(mine); // empty: it holds no connection or lock
    let ids = other.messages().iter().map(|m| m.id).collect();
    other
        .complete(RelayBatchOutcome {
            sent: ids,
            ..RelayBatchOutcome::default()
        })
        .await
        .unwrap();
    assert_eq!(
        rows(&store.claim(100).await.unwrap()),
        pairs(&[(3, "k"), (4, "k "), (5, "k"), (6, "k ")])
    );
}

#[test]
fn mysql_keys_that_differ_by_trailing_spaces_keep_their_own_order() {
    runtime().block_on(held_rows_hold_back_their_exact_key::<My>());
}

#[test]
fn pg_keys_that_differ_by_trailing_spaces_keep_their_own_order() {
    runtime().block_on(held_rows_hold_back_their_exact_key::<Pg>());
}

/// A row of `k ` waiting for its retry holds back `k `, not `k`.
async fn retry_holds_back_only_its_exact_key<B: Backend>(later: &str) {
    let db = B::create();
    let mut c = B::connect(&db);
    emit(&mut c, &[(1, "k "), (2, "k"), (3, "k "), (4, "k")]);
    exec(
        &mut c,
        &format!("UPDATE outbox SET next_retry_at = {later} WHERE msg_id = '1:Moved'"),
    );
    let store = B::store(&db);
    assert_eq!(
        rows(&store.claim(100).await.unwrap()),
        pairs(&[(2, "k"), (4, "k")])
    );
}

#[test]
fn mysql_a_retry_holds_back_only_its_exact_key() {
    runtime().block_on(retry_holds_back_only_its_exact_key::<My>(
        "UTC_TIMESTAMP(6) + INTERVAL 1 HOUR",
    ));
}

#[test]
fn pg_a_retry_holds_back_only_its_exact_key() {
    runtime().block_on(retry_holds_back_only_its_exact_key::<Pg>(
        "now() + interval '1 hour'",
    ));
}
