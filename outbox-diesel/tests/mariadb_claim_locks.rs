//! On MariaDB a per-key claim locks the rows it hands out, not every due row: a second
//! relay claims the rows of other keys meanwhile. (With the head check in its condition,
//! MariaDB planned the claim as a range scan and a filesort, which locked every due NEW
//! row of a small table before the LIMIT; the claim now scans `outbox_claim` in id order.)

mod fixtures;

use fixtures::{Backend, My, runtime};
use outbox_core::{ClaimedBatch, OutboxEvent, RelayStore};
use outbox_diesel::Emit;
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(key = account)]
struct Moved {
    #[outbox(id)]
    n: u32,
    account: String,
}

fn msg_ids(batch: &impl ClaimedBatch) -> Vec<String> {
    batch
        .messages()
        .iter()
        .map(|m| m.envelope.msg_id.to_string())
        .collect()
}

#[test]
fn mysql_a_second_relay_claims_other_keys_while_the_first_holds_its_batch() {
    let db = My::create();
    let mut c = My::connect(&db);
    // Six keys, one row each.
    c.emit_all((0..6).map(|n| Moved {
        n,
        account: format!("k{n}"),
    }))
    .unwrap();
    let (first, second) = (My::store(&db), My::store(&db));
    runtime().block_on(async {
        let held = first.claim(3).await.unwrap();
        assert_eq!(msg_ids(&held), ["0:Moved", "1:Moved", "2:Moved"]);
        let next = second.claim(3).await.unwrap();
        assert_eq!(
            msg_ids(&next),
            ["3:Moved", "4:Moved", "5:Moved"],
            "the first claim locked only its own rows"
        );
    });
}
