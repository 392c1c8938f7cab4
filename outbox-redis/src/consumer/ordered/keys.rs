//! Ordered mode's queues: the entries read, one queue per key of each stream, of which
//! only the head runs, and only one at a time.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::super::Job;
use super::super::lanes::entry_key;
use crate::entry::redriven_for_another;

/// A key of a stream: a key's order holds within its stream (its partition).
pub(super) type KeyId = (Arc<str>, Vec<u8>);

/// Where a key's head stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing running: its head (if any) is ready, in `Keys::ready`.
    Idle,
    /// Its head is being handled.
    Busy,
    /// Its head failed and runs again at this time.
    Waiting(Instant),
    /// Dead-lettered with `AfterDeadLetter::Block`: waits for an operator.
    Blocked,
}

struct Queue {
    jobs: VecDeque<Job>,
    state: State,
}

/// Every key's queue of the streams held. Entries of one key leave their queue in the
/// order they came (stream order), each only after the one before it settled
/// (acknowledged or dead-lettered).
#[derive(Default)]
pub(super) struct Keys {
    queues: HashMap<KeyId, Queue>,
    /// Idle keys with a head, in the order they became ready.
    ready: VecDeque<KeyId>,
    /// The entries queued (running included), by stream and id: an entry is queued once.
    entries: HashSet<EntryId>,
    /// The consumer's group: another group's redrive queues under a key of its own.
    group: Arc<str>,
}

/// An entry of a stream.
pub(super) type EntryId = (Arc<str>, String);

impl Keys {
    /// The queues of `group`'s consumer.
    pub(super) fn new(group: &str) -> Self {
        Self {
            group: group.into(),
            ..Self::default()
        }
    }

    /// The queue `job` goes to: its key's, but for another group's redrive, which this
    /// group only acknowledges. It gets a queue of its own (`0xFF` and its entry id: no
    /// UTF-8 key starts so), not to wait behind its key's earlier entries, or forever
    /// behind a key this group blocked.
    fn key_id(&self, job: &Job) -> KeyId {
        let key = if redriven_for_another(&job.entry.map, &self.group).is_some() {
            [&[0xFF][..], job.entry.id.as_bytes()].concat()
        } else {
            entry_key(&job.entry)
        };
        (Arc::clone(&job.stream), key)
    }

    /// Queues `job` behind the earlier entries of its key, unless it is queued already.
    pub(super) fn push(&mut self, job: Job) {
        if !self
            .entries
            .insert((Arc::clone(&job.stream), job.entry.id.clone()))
        {
            return;
        }
        let id = self.key_id(&job);
        let queue = self.queues.entry(id.clone()).or_insert_with(|| Queue {
            jobs: VecDeque::new(),
            state: State::Idle,
        });
        queue.jobs.push_back(job);
        if queue.state == State::Idle && queue.jobs.len() == 1 {
            self.ready.push_back(id);
        }
    }

    /// Blocks `key` of `stream` (found blocked when the stream was taken over).
    pub(super) fn block(&mut self, stream: &Arc<str>, key: Vec<u8>) {
        let id = (Arc::clone(stream), key);
        self.ready.retain(|k| *k != id);
        self.queues
            .entry(id)
            .or_insert_with(|| Queue {
                jobs: VecDeque::new(),
                state: State::Idle,
            })
            .state = State::Blocked;
    }

    /// Up to `n` heads of ready keys, now busy; keys of streams for which `runnable` is
    /// false are skipped (and stay ready). Sorted by key, so that batches of
    /// consumers sharing keys lock their rows in one order.
    pub(super) fn take(&mut self, n: usize, runnable: impl Fn(&str) -> bool) -> Vec<Job> {
        let mut jobs = Vec::new();
        let mut skipped = Vec::new();
        while jobs.len() < n {
            let Some(id) = self.ready.pop_front() else {
                break;
            };
            if !runnable(&id.0) {
                skipped.push(id);
                continue;
            }
            if let Some(queue) = self.queues.get_mut(&id)
                && let Some(job) = queue.jobs.pop_front()
            {
                queue.state = State::Busy;
                jobs.push(job);
            }
        }
        // Back in front, in their order: they were ready first.
        for id in skipped.into_iter().rev() {
            self.ready.push_front(id);
        }
        jobs.sort_by_cached_key(|job| entry_key(&job.entry));
        jobs
    }

    /// A head taken by [`take`](Self::take) ended. `settled`: its key goes on with its
    /// next entry; otherwise the job goes back to the head of its key, which waits until
    /// `retry_at` (or, `blocked`, for an operator). A key of a stream dropped meanwhile
    /// is ignored.
    pub(super) fn done(&mut self, job: Job, settled: bool, retry_at: Instant, blocked: bool) {
        let id = self.key_id(&job);
        let Some(queue) = self.queues.get_mut(&id) else {
            return;
        };
        if queue.state != State::Busy {
            return;
        }
        if settled {
            self.entries
                .remove(&(Arc::clone(&job.stream), job.entry.id.clone()));
            queue.state = if blocked { State::Blocked } else { State::Idle };
        } else {
            queue.jobs.push_front(job);
            queue.state = State::Waiting(retry_at);
        }
        self.settle(id);
    }

    /// Makes a key ready again, or forgets it once it has nothing queued.
    fn settle(&mut self, id: KeyId) {
        let Some(queue) = self.queues.get(&id) else {
            return;
        };
        if queue.state == State::Idle {
            if queue.jobs.is_empty() {
                self.queues.remove(&id);
            } else {
                self.ready.push_back(id);
            }
        }
    }

    /// Makes the keys whose wait is over ready; returns when the next wait ends.
    pub(super) fn wake(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut woken = Vec::new();
        for (id, queue) in &mut self.queues {
            if let State::Waiting(at) = queue.state {
                if at <= now {
                    queue.state = State::Idle;
                    woken.push(id.clone());
                } else {
                    next = Some(next.map_or(at, |n| n.min(at)));
                }
            }
        }
        for id in woken {
            self.settle(id);
        }
        next
    }

    /// Unblocks the blocked keys of `stream` that are not in `still_blocked`.
    pub(super) fn unblock(&mut self, stream: &str, still_blocked: &[Vec<u8>]) {
        let freed: Vec<KeyId> = self
            .queues
            .iter_mut()
            .filter(|(id, q)| {
                &*id.0 == stream && q.state == State::Blocked && !still_blocked.contains(&id.1)
            })
            .map(|(id, q)| {
                q.state = State::Idle;
                id.clone()
            })
            .collect();
        for id in freed {
            tracing::info!(stream, key = %String::from_utf8_lossy(&id.1), "key unblocked");
            self.settle(id);
        }
    }

    /// Whether `stream` has blocked keys.
    pub(super) fn has_blocked(&self, stream: &str) -> bool {
        self.queues
            .iter()
            .any(|(id, q)| &*id.0 == stream && q.state == State::Blocked)
    }

    /// Forgets every queue of `stream` (its lease was lost): its entries stay pending for
    /// the next holder. Heads running end into [`done`](Self::done), which ignores them.
    pub(super) fn drop_stream(&mut self, stream: &str) {
        self.queues.retain(|id, _| &*id.0 != stream);
        self.ready.retain(|id| &*id.0 != stream);
        self.entries.retain(|(s, _)| &**s != stream);
    }

    /// Entries queued for `stream`, running included.
    pub(super) fn queued_in(&self, stream: &str) -> usize {
        self.queues
            .iter()
            .filter(|(id, _)| &*id.0 == stream)
            .map(|(_, q)| q.jobs.len() + usize::from(q.state == State::Busy))
            .sum()
    }

    /// Entries queued for `stream` that will run without an operator: those of keys
    /// not blocked, running included.
    pub(super) fn runnable_in(&self, stream: &str) -> usize {
        self.queues
            .iter()
            .filter(|(id, q)| &*id.0 == stream && q.state != State::Blocked)
            .map(|(_, q)| q.jobs.len() + usize::from(q.state == State::Busy))
            .sum()
    }

    /// Entries queued that will run without an operator (those of keys not blocked),
    /// running included.
    pub(super) fn runnable(&self) -> usize {
        self.queues
            .values()
            .filter(|q| q.state != State::Blocked)
            .map(|q| q.jobs.len() + usize::from(q.state == State::Busy))
            .sum()
    }

    /// Entries queued, running included.
    #[cfg(test)]
    fn queued(&self) -> usize {
        self.entries.len()
    }

    /// The entries queued (running included).
    pub(super) fn entries(&self) -> &HashSet<EntryId> {
        &self.entries
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use redis::streams::StreamId;

    use super::*;

    fn job(stream: &str, id: u64, key: &str) -> Job {
        let mut map = HashMap::new();
        map.insert(
            "key".to_owned(),
            redis::Value::BulkString(key.as_bytes().to_vec()),
        );
        Job {
            stream: Arc::from(stream),
            entry: StreamId {
                id: format!("{id}-0"),
                map,
                ..StreamId::default()
            },
            delivery_count: 1,
        }
    }

    fn ids(jobs: &[Job]) -> Vec<&str> {
        jobs.iter().map(|j| j.entry.id.as_str()).collect()
    }

    #[test]
    fn one_head_per_key_runs_and_the_next_follows_only_once_it_settled() {
        let mut keys = Keys::default();
        for (i, k) in ["a", "b", "a", "a", "b"].iter().enumerate() {
            keys.push(job("s", i as u64, k));
        }
        let first = keys.take(10, |_| true);
        assert_eq!(ids(&first), ["0-0", "1-0"], "one head per key");
        assert!(keys.take(10, |_| true).is_empty(), "busy keys give nothing");
        let now = Instant::now();
        let mut first = first.into_iter();
        let a = first.next().unwrap();
        let b = first.next().unwrap();
        // `a` fails: its head waits, and nothing of `a` runs meanwhile.
        keys.done(a, false, now + Duration::from_secs(60), false);
        keys.done(b, true, now, false);
        assert_eq!(ids(&keys.take(10, |_| true)), ["4-0"]);
        assert_eq!(keys.wake(now), Some(now + Duration::from_secs(60)));
        keys.wake(now + Duration::from_secs(60));
        let again = keys.take(10, |_| true);
        assert_eq!(ids(&again), ["0-0"], "the failed head runs again, first");
        keys.done(again.into_iter().next().unwrap(), true, now, false);
        assert_eq!(ids(&keys.take(10, |_| true)), ["2-0"]);
        assert_eq!(keys.queued(), 3);
        keys.push(job("s", 3, "a"));
        assert_eq!(
            keys.queued(),
            3,
            "an entry queued already is not queued twice"
        );
    }

    #[test]
    fn a_blocked_key_waits_until_unblocked_and_dropped_streams_are_forgotten() {
        let mut keys = Keys::default();
        keys.push(job("s", 1, "a"));
        keys.push(job("s", 2, "a"));
        keys.push(job("t", 3, "a"));
        let heads = keys.take(10, |s| s == "s");
        assert_eq!(ids(&heads), ["1-0"], "streams not runnable are skipped");
        let now = Instant::now();
        keys.done(heads.into_iter().next().unwrap(), true, now, true);
        assert!(keys.has_blocked("s"));
        assert_eq!(
            ids(&keys.take(10, |_| true)),
            ["3-0"],
            "only the other stream's key"
        );
        keys.unblock("s", &[b"a".to_vec()]);
        assert!(keys.take(10, |_| true).is_empty(), "still blocked");
        keys.unblock("s", &[]);
        assert_eq!(ids(&keys.take(10, |_| true)), ["2-0"]);
        assert_eq!(keys.queued_in("s"), 1);
        keys.block(&Arc::from("s"), b"b".to_vec());
        keys.push(job("s", 5, "b"));
        assert_eq!(keys.queued_in("s"), 2);
        assert_eq!(
            keys.runnable_in("s"),
            1,
            "a blocked key's entries wait for an operator"
        );
        keys.drop_stream("s");
        assert_eq!(keys.queued_in("s"), 0);
        assert_eq!(keys.queued(), 1, "t's head, still running");
    }
}
