//! Batch mode's lanes: entries split by key so that side-by-side batches share none.

use std::collections::HashMap;

use redis::streams::StreamId;

use super::Job;
use crate::entry::value_bytes;

/// The ordering key of an entry, as the relay wrote it (the `key` field; an entry of
/// another producer without one falls back to its `msg_id`).
pub(super) fn entry_key(entry: &StreamId) -> Vec<u8> {
    entry
        .map
        .get("key")
        .or_else(|| entry.map.get("msg_id"))
        .map(value_bytes)
        .unwrap_or_default()
}

/// The lane of `key` among `lanes`: FNV-1a, so that every consumer process (whatever its
/// Rust version) puts a key in the same lane.
fn lane_of(key: &[u8], lanes: usize) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in key {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % lanes.max(1) as u64) as usize
}

/// Splits the entries of one read in batch mode into lanes: `(lane, batches)`, each a
/// list of batches of at most `size` entries that one task runs one after another.
///
/// - A key's lane is a hash of the key modulo `lanes` (the consumer's `max_in_flight`),
///   so all entries of a key go to one lane, and in every read and every consumer
///   process to the lane of the same number. The run loop runs one task per lane
///   number at a time: the transactions running side by side in this consumer never
///   write the rows of the same key (a handler that updates its key's row would
///   otherwise wait for, or deadlock with, a sibling batch), and a key's entries run in
///   stream order. Two consumer processes collide only lane against lane of the same
///   number, never one lane against many.
/// - Within a lane, keys come in byte order, so that batches of different consumers lock
///   the rows of shared keys in the same order: they wait for each other, but do not
///   deadlock.
pub(super) fn lanes(jobs: Vec<Job>, size: usize, lanes: usize) -> Vec<(usize, Vec<Vec<Job>>)> {
    let size = size.max(1);
    let mut keys: Vec<(Vec<u8>, Vec<Job>)> = Vec::new();
    let mut index: HashMap<Vec<u8>, usize> = HashMap::new();
    for job in jobs {
        let key = entry_key(&job.entry);
        match index.get(&key) {
            Some(&i) => keys[i].1.push(job),
            None => {
                index.insert(key.clone(), keys.len());
                keys.push((key, vec![job]));
            }
        }
    }
    let count = lanes.max(1);
    let mut lanes: Vec<Vec<(Vec<u8>, Vec<Job>)>> = (0..count).map(|_| Vec::new()).collect();
    for key in keys {
        lanes[lane_of(&key.0, count)].push(key);
    }
    lanes
        .into_iter()
        .enumerate()
        .filter(|(_, lane)| !lane.is_empty())
        .map(|(n, mut lane)| {
            lane.sort_by(|a, b| a.0.cmp(&b.0));
            let jobs: Vec<Job> = lane.into_iter().flat_map(|(_, jobs)| jobs).collect();
            let mut batches = Vec::with_capacity(jobs.len().div_ceil(size));
            let mut jobs = jobs.into_iter().peekable();
            while jobs.peek().is_some() {
                batches.push(jobs.by_ref().take(size).collect());
            }
            (n, batches)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn job(id: usize, key: &str) -> Job {
        let mut map = HashMap::new();
        map.insert(
            "key".to_owned(),
            redis::Value::BulkString(key.as_bytes().to_vec()),
        );
        Job {
            stream: Arc::from("s"),
            entry: StreamId {
                id: format!("{id}-0"),
                map,
                ..StreamId::default()
            },
            delivery_count: 1,
        }
    }

    fn ids(batch: &[Job]) -> Vec<&str> {
        batch.iter().map(|j| j.entry.id.as_str()).collect()
    }

    #[test]
    fn lanes_keep_each_key_in_one_lane_in_stream_order_with_keys_sorted() {
        // 24 entries over 6 keys; batches of 2, 3 lanes.
        let keys = ["c", "a", "b", "d", "f", "e"];
        let jobs = (0..24).map(|i| job(i, keys[i % keys.len()])).collect();
        let lanes = lanes(jobs, 2, 3);
        assert!(lanes.len() <= 3);
        let mut seen = Vec::new();
        for (n, lane) in &lanes {
            assert!(*n < 3);
            assert!(
                lane.iter()
                    .all(|batch| !batch.is_empty() && batch.len() <= 2)
            );
            let flat: Vec<&Job> = lane.iter().flatten().collect();
            let lane_keys: Vec<Vec<u8>> = flat.iter().map(|j| entry_key(&j.entry)).collect();
            let mut sorted = lane_keys.clone();
            sorted.sort();
            assert_eq!(lane_keys, sorted, "keys in byte order within a lane");
            for j in flat {
                assert_eq!(lane_of(&entry_key(&j.entry), 3), *n);
                seen.push((entry_key(&j.entry), j.entry.id.clone()));
            }
        }
        // Each key in exactly one lane, its entries in stream order.
        for key in keys {
            let holders = lanes
                .iter()
                .filter(|(_, lane)| {
                    lane.iter()
                        .flatten()
                        .any(|j| entry_key(&j.entry) == key.as_bytes())
                })
                .count();
            assert_eq!(holders, 1, "key {key} in one lane");
            let order: Vec<usize> = seen
                .iter()
                .filter(|(k, _)| k == key.as_bytes())
                .map(|(_, id)| id.trim_end_matches("-0").parse().unwrap())
                .collect();
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(order, sorted, "key {key} in stream order");
        }
        assert_eq!(seen.len(), 24);
    }

    #[test]
    fn a_key_has_the_same_lane_in_every_read() {
        let read = |keys: &[&str]| {
            let jobs = keys.iter().enumerate().map(|(i, k)| job(i, k)).collect();
            lanes(jobs, 10, 8)
                .into_iter()
                .flat_map(|(n, lane)| {
                    lane.into_iter()
                        .flatten()
                        .map(move |j| (String::from_utf8(entry_key(&j.entry)).unwrap(), n))
                })
                .collect::<HashMap<String, usize>>()
        };
        let first = read(&["acct-1", "acct-2", "acct-3", "acct-4"]);
        let second = read(&["acct-4", "acct-9", "acct-1"]);
        assert_eq!(first["acct-1"], second["acct-1"]);
        assert_eq!(first["acct-4"], second["acct-4"]);
        // The hash is fixed (FNV-1a): other consumer processes agree.
        assert_eq!(lane_of(b"", 8), (0xcbf2_9ce4_8422_2325u64 % 8) as usize);
    }

    #[test]
    fn a_hot_key_is_one_lane_of_batches() {
        let one_key = (0..7).map(|i| job(i, "hot")).collect();
        let hot = lanes(one_key, 3, 4);
        assert_eq!(hot.len(), 1, "a single key is one lane");
        let sizes: Vec<usize> = hot[0].1.iter().map(Vec::len).collect();
        assert_eq!(sizes, [3, 3, 1]);
        assert_eq!(ids(&hot[0].1[0]), ["0-0", "1-0", "2-0"]);
    }
}
