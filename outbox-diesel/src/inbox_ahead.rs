//! The blocking inbox's batch mode with the dedup rows inserted ahead (PostgreSQL): one
//! statement inserts the whole batch's rows and names the new messages, and one round
//! trip (`RELEASE SAVEPOINT ..; SAVEPOINT ..`) ends a message's savepoint and opens the
//! next one. A message then costs its handler's statements plus one round trip, where
//! the per-message path (`inbox::in_savepoint`) costs four with a one-statement handler:
//! savepoint, dedup insert, the handler's statement, release.
//!
//! The guarantees are the per-message path's:
//! - a duplicate (its row was there) runs nothing and is `Duplicate`;
//! - a failed message is rolled back to its savepoint, and its dedup row, inserted
//!   outside that savepoint, is deleted, so that nothing of it commits and it is
//!   redelivered;
//! - a handler that ignored a failed statement leaves the transaction aborted: the
//!   `RELEASE` fails, the message is rolled back alone (the `SAVEPOINT` or `COMMIT`
//!   after it in the same string does not run);
//! - one `COMMIT` ends the batch, sent with the last message's `RELEASE`.
//!
//! A msg_id that comes again in the same batch takes the per-message path, after the
//! open savepoint is released: its first occurrence may have failed and given its row
//! back.

use std::collections::HashSet;

use diesel::connection::TransactionManager as _;
use outbox_core::{HandlerError, InboxBatchOutcomes, MsgId, Processed};

use crate::OutboxConnection;
use crate::backend::Database as _;
use crate::inbox::{
    Failure, Tm, commit_error, depth, in_savepoint, roll_back_message, store_error,
};

/// Ends the savepoint of a message and opens the next one's, in one round trip. diesel
/// names a savepoint after the depth it is entered from: 1, in the batch's transaction.
const RELEASE_AND_SAVEPOINT: &str =
    "RELEASE SAVEPOINT diesel_savepoint_1; SAVEPOINT diesel_savepoint_1";

/// Ends the savepoint of the last message and commits the batch, in one round trip.
const RELEASE_AND_COMMIT: &str = "RELEASE SAVEPOINT diesel_savepoint_1; COMMIT";

/// Where the batch's transaction stands between two messages.
#[derive(Clone, Copy)]
enum Between {
    /// No savepoint open (depth 1).
    Idle,
    /// A savepoint open, nothing written in it yet (depth 2).
    Fresh,
    /// A savepoint open with this message's writes, to be released (depth 2).
    Written(usize),
}

/// The batch in the open transaction, whose dedup rows were inserted ahead: `new` holds
/// the msg_ids that were new. Commits; the error ends the batch with nothing committed
/// (the caller rolls back).
pub(crate) fn run<C: OutboxConnection>(
    c: &mut C,
    group: &str,
    msg_ids: &[MsgId],
    new: &HashSet<String>,
    handle: &mut impl FnMut(usize, &mut C) -> Result<(), HandlerError>,
) -> Result<InboxBatchOutcomes, outbox_core::Error> {
    let mut outcomes = Vec::with_capacity(msg_ids.len());
    let mut seen = HashSet::with_capacity(msg_ids.len());
    let mut at = Between::Idle;
    for (i, msg_id) in msg_ids.iter().enumerate() {
        let first = seen.insert(msg_id.as_str());
        if first && !new.contains(msg_id.as_str()) {
            outcomes.push(Ok(Processed::Duplicate));
            continue;
        }
        if !first {
            // Out of the open savepoint, so that no later failure rolls it back.
            leave(c, group, msg_ids, &mut at, &mut outcomes)?;
            outcomes.push(in_savepoint(c, group, msg_id, |c| handle(i, c))?);
            continue;
        }
        enter(c, group, msg_ids, &mut at, &mut outcomes)?;
        let handled = handle(i, c);
        let now = depth(c).map_err(store_error)?;
        if now < 2 {
            return Err(ended_by_handler(c, group, msg_ids, new, &seen, i, now));
        }
        let balanced = now == 2;
        let failure = match handled {
            Ok(()) if balanced => {
                // `Applied` once its savepoint is released (`enter` or `finish`).
                outcomes.push(Ok(Processed::Applied));
                at = Between::Written(i);
                continue;
            }
            Ok(()) => Failure::Handler(
                "the handler returned with a transaction of its own still open".into(),
            ),
            Err(e) => Failure::Handler(e.into_inner()),
        };
        outcomes.push(roll_back_message(c, 1, msg_id, failure, Some(group))?);
        at = Between::Idle;
    }
    finish(c, group, msg_ids, at, &mut outcomes)?;
    Ok(outcomes)
}

/// The handler of message `i` ended more than it began: it released its message's
/// savepoint (`depth` 1) or committed the batch's transaction (`depth` 0, a `COMMIT` of
/// its own). Its writes are then outside the savepoint, so rolling back to it and
/// giving its dedup row back would apply it twice. The batch fails as a whole instead
/// and the consumer runs its messages again one by one: at depth 1 the caller rolls it
/// all back; at depth 0 the messages up to `i` are committed with their dedup rows (they
/// come back as duplicates), and the dedup rows inserted ahead for the later new
/// messages, committed without their handlers having run, are given back here, or
/// those messages would come back as duplicates too and never be applied.
fn ended_by_handler<C: OutboxConnection>(
    c: &mut C,
    group: &str,
    msg_ids: &[MsgId],
    new: &HashSet<String>,
    seen: &HashSet<&str>,
    i: usize,
    depth: u32,
) -> outbox_core::Error {
    if depth == 0 {
        let mut later = HashSet::new();
        for msg_id in &msg_ids[i + 1..] {
            let id = msg_id.as_str();
            if new.contains(id)
                && !seen.contains(id)
                && later.insert(id)
                && let Err(e) = c.db().delete_consumed(group, id)
            {
                return store_error(e);
            }
        }
    }
    outbox_core::Error::TransientBatch {
        msg_id: Some(msg_ids[i].clone()),
        source: "the handler ended the batch's transaction (a COMMIT or a released savepoint \
                 of its own): the batch runs again one message at a time"
            .into(),
    }
}

/// Opens a fresh savepoint for the next message, releasing the previous message's.
fn enter<C: OutboxConnection>(
    c: &mut C,
    group: &str,
    msg_ids: &[MsgId],
    at: &mut Between,
    outcomes: &mut InboxBatchOutcomes,
) -> Result<(), outbox_core::Error> {
    match *at {
        Between::Fresh => {}
        Between::Idle => Tm::<C>::begin_transaction(c).map_err(|e| store_error(e.into()))?,
        Between::Written(i) => {
            if let Err(e) = c.batch_execute(RELEASE_AND_SAVEPOINT) {
                // The RELEASE failed (the SAVEPOINT after it did not run): message i's
                // handler left the transaction aborted.
                *at = Between::Idle;
                outcomes[i] =
                    roll_back_message(c, 1, &msg_ids[i], Failure::Release(e), Some(group))?;
                Tm::<C>::begin_transaction(c).map_err(|e| store_error(e.into()))?;
            }
        }
    }
    *at = Between::Fresh;
    Ok(())
}

/// Releases the open savepoint (depth 1 after it), for a message that runs on the
/// per-message path.
fn leave<C: OutboxConnection>(
    c: &mut C,
    group: &str,
    msg_ids: &[MsgId],
    at: &mut Between,
    outcomes: &mut InboxBatchOutcomes,
) -> Result<(), outbox_core::Error> {
    let was = std::mem::replace(at, Between::Idle);
    match was {
        Between::Idle => {}
        Between::Fresh => Tm::<C>::commit_transaction(c).map_err(|e| store_error(e.into()))?,
        Between::Written(i) => {
            // diesel rolls back to the savepoint when its RELEASE fails (`in_savepoint`
            // counts on it too); `roll_back_message` then finds depth 1.
            if let Err(e) = Tm::<C>::commit_transaction(c) {
                outcomes[i] =
                    roll_back_message(c, 1, &msg_ids[i], Failure::Release(e), Some(group))?;
            }
        }
    }
    Ok(())
}

/// Commits the batch, releasing the last message's savepoint in the same round trip.
fn finish<C: OutboxConnection>(
    c: &mut C,
    group: &str,
    msg_ids: &[MsgId],
    at: Between,
    outcomes: &mut InboxBatchOutcomes,
) -> Result<(), outbox_core::Error> {
    let ended = match at {
        Between::Idle => return Tm::<C>::commit_transaction(c).map_err(commit_error),
        Between::Fresh | Between::Written(_) => c.batch_execute(RELEASE_AND_COMMIT),
    };
    let Err(e) = ended else {
        // The connection saw the transaction end (libpq's status, which diesel follows).
        return Ok(());
    };
    match (depth(c).map_err(store_error)?, at) {
        // The COMMIT failed: the transaction is over, nothing of it committed.
        (0, _) => Err(commit_error(e)),
        // The RELEASE failed: the last message's handler left the transaction aborted.
        (2, Between::Written(i)) => {
            outcomes[i] = roll_back_message(c, 1, &msg_ids[i], Failure::Release(e), Some(group))?;
            Tm::<C>::commit_transaction(c).map_err(commit_error)
        }
        _ => Err(store_error(e.into())),
    }
}
