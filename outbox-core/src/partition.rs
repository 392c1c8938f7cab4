//! Partitions: a topic spread over several streams by ordering key, so that each stream can
//! be read by one consumer at a time and a key's messages reach its handler in order.
//!
//! The hash is part of the wire contract: a producer in another language that writes to a
//! partitioned topic must place a key exactly as [`partition_of`] does (FNV-1a, 64 bits,
//! over the key's UTF-8 bytes, modulo the partition count).

use std::num::NonZeroU32;

use crate::{InvalidConfig, OutboxEvent};

/// The most partitions a topic may have. Each partition is a stream with its own consumer
/// lease; more than this costs Redis round trips without adding parallelism a consumer
/// group can use.
pub const MAX_PARTITIONS: u32 = 1024;

/// A validated partition count: `1..=`[`MAX_PARTITIONS`]. One partition is an
/// unpartitioned topic: one stream, named `<prefix><topic>` with no partition suffix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Partitions(NonZeroU32);

impl Partitions {
    /// An unpartitioned topic.
    pub const ONE: Partitions = Partitions(NonZeroU32::MIN);

    /// `count` partitions, or an [`InvalidConfig`] for the field `partitions` when it is 0
    /// or above [`MAX_PARTITIONS`].
    pub fn new(count: u32) -> Result<Self, InvalidConfig> {
        match NonZeroU32::new(count) {
            Some(n) if count <= MAX_PARTITIONS => Ok(Self(n)),
            _ => Err(InvalidConfig::new(
                "partitions",
                format!("must be between 1 and {MAX_PARTITIONS}; got {count}"),
            )),
        }
    }

    /// The partition count of event type `E`: its
    /// [`OutboxEvent::PARTITIONS`]. A hand-written count out of `1..=`[`MAX_PARTITIONS`]
    /// fails the build where this is called (the derive already refuses one), so the
    /// value needs no check at run time.
    ///
    /// ```
    /// use outbox_core::{OutboxEvent, Partitions};
    ///
    /// #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
    /// #[outbox(partitions = 8)]
    /// struct OrderPaid { #[outbox(id)] order_id: String }
    ///
    /// assert_eq!(Partitions::of_event::<OrderPaid>().get(), 8);
    /// ```
    ///
    /// A hand-written impl with a count of 0 does not build:
    ///
    /// ```compile_fail,E0080
    /// use outbox_core::{OutboxEvent, Partitions};
    ///
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct HandMade { key: String }
    ///
    /// impl OutboxEvent for HandMade {
    ///     const EVENT_TYPES: &'static [&'static str] = &["HandMade"];
    ///     const TOPICS: &'static [&'static str] = &["hand.made"];
    ///     const SCHEMA_VERSION: u32 = 1;
    ///     const PARTITIONS: u32 = 0;
    ///     fn topic(&self) -> &'static str { "hand.made" }
    ///     fn event_type(&self) -> &'static str { "HandMade" }
    ///     fn business_key(&self) -> String { self.key.clone() }
    /// }
    ///
    /// let _ = Partitions::of_event::<HandMade>();
    /// ```
    pub const fn of_event<E: OutboxEvent>() -> Self {
        const {
            match NonZeroU32::new(E::PARTITIONS) {
                Some(n) if n.get() <= MAX_PARTITIONS => Self(n),
                _ => panic!("OutboxEvent::PARTITIONS must be from 1 to MAX_PARTITIONS (1024)"),
            }
        }
    }

    /// The count.
    pub const fn get(self) -> u32 {
        self.0.get()
    }

    /// Whether the topic is spread over more than one stream.
    pub const fn is_partitioned(self) -> bool {
        self.0.get() > 1
    }

    /// The partition of `key`: see [`partition_of`].
    pub fn of(self, key: &str) -> u32 {
        partition_of(key, self)
    }
}

impl Default for Partitions {
    fn default() -> Self {
        Self::ONE
    }
}

impl std::fmt::Display for Partitions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// The partition, in `0..partitions`, that carries the messages of ordering key `key`:
/// FNV-1a (64 bits) of the key's UTF-8 bytes, modulo the count.
///
/// Stable across versions, platforms and languages: it is how every producer and the
/// relay agree on where a key lives. FNV-1a because it is a dozen lines anywhere, needs no
/// seed, and spreads short keys such as `order-42` evenly enough for a modulo.
///
/// ```
/// use outbox_core::{Partitions, partition_of};
///
/// let eight = Partitions::new(8)?;
/// assert_eq!(partition_of("order-42", eight), partition_of("order-42", eight));
/// assert!(partition_of("order-42", eight) < 8);
/// assert_eq!(partition_of("anything", Partitions::ONE), 0);
/// # Ok::<(), outbox_core::InvalidConfig>(())
/// ```
pub fn partition_of(key: &str, partitions: Partitions) -> u32 {
    let p = u64::from(partitions.get());
    // Below p, so it fits the u32 that p came from.
    (fnv1a64(key.as_bytes()) % p) as u32
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes.iter().fold(OFFSET_BASIS, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(PRIME)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_fnv1a_64() {
        // Published test vectors of FNV-1a 64: a producer in another language checks its
        // own implementation against these.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    /// The table of `docs/partitions.md`, which producers in other languages check
    /// their implementation against.
    #[test]
    fn the_documented_partitions_hold() {
        let table: [(&str, u64, [u32; 3]); 6] = [
            ("", 0xcbf2_9ce4_8422_2325, [5, 5, 805]),
            ("a", 0xaf63_dc4c_8601_ec8c, [4, 12, 140]),
            ("foobar", 0x8594_4171_f739_67e8, [0, 8, 1000]),
            ("order-42", 0x7d1d_eb86_a056_62d4, [4, 4, 724]),
            ("tenant/7:order-9", 0xd7f0_d423_4b10_5bf3, [3, 3, 1011]),
            ("ключ", 0x2961_30de_6f5b_7a81, [1, 1, 641]),
        ];
        for (key, hash, partitions) in table {
            assert_eq!(fnv1a64(key.as_bytes()), hash, "{key}");
            for (p, expected) in [8, 16, 1024].into_iter().zip(partitions) {
                let p = Partitions::new(p).unwrap();
                assert_eq!(partition_of(key, p), expected, "{key} over {p}");
            }
        }
    }

    #[test]
    fn keys_land_where_the_contract_says() {
        let eight = Partitions::new(8).unwrap();
        for key in ["", "a", "foobar", "order-42", "tenant/7:order-9", "ключ"] {
            let expected = (fnv1a64(key.as_bytes()) % 8) as u32;
            assert_eq!(partition_of(key, eight), expected, "{key}");
        }
    }

    #[test]
    fn keys_spread_over_every_partition() {
        let p = Partitions::new(8).unwrap();
        let mut counts = [0_u32; 8];
        for i in 0..8_000 {
            counts[p.of(&format!("order-{i}")) as usize] += 1;
        }
        // Even spread is 1,000 each; FNV-1a on such keys stays well inside ±20 %.
        assert!(
            counts.iter().all(|&c| (800..=1_200).contains(&c)),
            "{counts:?}"
        );
    }

    #[test]
    fn counts_out_of_range_are_refused_with_the_field() {
        for bad in [0, MAX_PARTITIONS + 1, u32::MAX] {
            let err = Partitions::new(bad).unwrap_err();
            assert_eq!(err.field(), "partitions");
            assert!(err.rule().contains(&bad.to_string()), "{err}");
        }
        assert_eq!(Partitions::new(1).unwrap(), Partitions::ONE);
        assert!(!Partitions::ONE.is_partitioned());
        assert_eq!(
            Partitions::new(MAX_PARTITIONS).unwrap().get(),
            MAX_PARTITIONS
        );
    }
}
