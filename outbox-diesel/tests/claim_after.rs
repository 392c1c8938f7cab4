//! A claim ahead (`RelayStore::claim_after`) on PostgreSQL: the batch in hand holds back
//! none of the later rows of its keys (the relay publishes it first), while a batch held
//! by another relay still does. (MariaDB keeps the default claim ahead: see
//! `MysqlRelayStore::claims_ahead`.)

mod fixtures;

use fixtures::{Backend, Pg, runtime};
use outbox_core::{ClaimedBatch, OutboxEvent, RelayStore};
use outbox_diesel::{ClaimOrder, Emit};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(key = account)]
struct Moved {
    #[outbox(id)]
    n: u32,
    account: String,
}

/// Rows 0..6 over the keys a, b, c, a, b, c.
fn emit_two_rounds<B: Backend>(db: &fixtures::TestDb) {
    let mut c = B::connect(db);
    c.emit_all((0..6).map(|n| Moved {
        n,
        account: ["a", "b", "c"][n as usize % 3].into(),
    }))
    .unwrap();
}

fn msg_ids(batch: &impl ClaimedBatch) -> Vec<String> {
    batch
        .messages()
        .iter()
        .map(|m| m.envelope.msg_id.to_string())
        .collect()
}

fn ids(batch: &impl ClaimedBatch) -> Vec<i64> {
    batch.messages().iter().map(|m| m.id).collect()
}

fn the_batch_in_hand_holds_back_nothing<B: Backend>() {
    let db = B::create();
    emit_two_rounds::<B>(&db);
    let store = B::store(&db);
    runtime().block_on(async {
        let in_hand = store.claim(3).await.unwrap();
        assert_eq!(msg_ids(&in_hand), ["0:Moved", "1:Moved", "2:Moved"]);
        // A plain claim beside it finds every later row behind it ...
        let plain = store.claim(3).await.unwrap();
        assert!(
            plain.messages().is_empty(),
            "{}: {:?}",
            B::NAME,
            msg_ids(&plain)
        );
        // (It held nothing: its transaction has ended, no lock is left to release.)
        drop(plain);
        // ... a claim ahead of it takes them.
        let ahead = store.claim_after(3, &ids(&in_hand)).await.unwrap();
        assert_eq!(
            msg_ids(&ahead),
            ["3:Moved", "4:Moved", "5:Moved"],
            "{}: the claim ahead of the batch in hand",
            B::NAME
        );
    });
}

fn another_relays_batch_still_holds_back_its_keys<B: Backend>() {
    let db = B::create();
    emit_two_rounds::<B>(&db);
    let other_relay = B::store(&db);
    let store = B::store(&db);
    runtime().block_on(async {
        let others = other_relay.claim(1).await.unwrap();
        assert_eq!(msg_ids(&others), ["0:Moved"]);
        let in_hand = store.claim(2).await.unwrap();
        assert_eq!(msg_ids(&in_hand), ["1:Moved", "2:Moved"]);
        let ahead = store.claim_after(3, &ids(&in_hand)).await.unwrap();
        assert_eq!(
            msg_ids(&ahead),
            ["4:Moved", "5:Moved"],
            "{}: key a waits behind the other relay's batch",
            B::NAME
        );
    });
}

#[test]
fn pg_the_batch_in_hand_holds_back_nothing() {
    the_batch_in_hand_holds_back_nothing::<Pg>();
}

#[test]
fn pg_another_relays_batch_still_holds_back_its_keys() {
    another_relays_batch_still_holds_back_its_keys::<Pg>();
}

#[test]
fn pg_unordered_claims_ignore_the_batch_in_hand() {
    let db = Pg::create();
    emit_two_rounds::<Pg>(&db);
    let store = Pg::store(&db).with_order(ClaimOrder::Unordered);
    runtime().block_on(async {
        let in_hand = store.claim(3).await.unwrap();
        let ahead = store.claim_after(3, &ids(&in_hand)).await.unwrap();
        assert_eq!(msg_ids(&ahead), ["3:Moved", "4:Moved", "5:Moved"]);
    });
}

/// The ids in hand are left out by id, not only because their rows are locked: a batch
/// in hand that was released early (rolled back in an outage) must not be claimed a
/// second time ahead of its own completion, and a due row between its ids still is.
#[test]
fn pg_unordered_claims_ahead_leave_out_the_ids_in_hand_even_unlocked() {
    let db = Pg::create();
    emit_two_rounds::<Pg>(&db);
    let store = Pg::store(&db).with_order(ClaimOrder::Unordered);
    runtime().block_on(async {
        let all = store.claim(6).await.unwrap();
        let (first, third) = (all.messages()[0].id, all.messages()[2].id);
        drop(all);
        fixtures::released::<Pg>(&store, 0).await; // nothing is locked
        let ahead = store.claim_after(3, &[first, third]).await.unwrap();
        assert_eq!(msg_ids(&ahead), ["1:Moved", "3:Moved", "4:Moved"]);
    });
}
