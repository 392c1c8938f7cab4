//! The relay's position in the binlog: a MariaDB GTID position, one `domain-server-seq`
//! per replication domain, as `@@gtid_binlog_pos` prints it and `@slave_connect_state`
//! takes it.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use crate::CdcError;

/// A MariaDB GTID position: for each replication domain, the last transaction
/// (`domain-server-seq`) read. Empty on a server that has logged no transaction yet.
/// Parsed from and printed as `0-1-42,1-2-7`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GtidPosition {
    /// Domain id → (server id, sequence number).
    domains: BTreeMap<u32, (u32, u64)>,
}

impl GtidPosition {
    /// The position after transaction `domain-server-seq`.
    pub(crate) fn advance(&mut self, domain: u32, server: u32, seq: u64) {
        self.domains.insert(domain, (server, seq));
    }

    /// Whether every domain of `other` is at or before this position: every transaction
    /// up to `other` was read up to here.
    pub fn covers(&self, other: &Self) -> bool {
        other.domains.iter().all(|(domain, &(_, seq))| {
            self.domains
                .get(domain)
                .is_some_and(|&(_, ours)| ours >= seq)
        })
    }

    /// How many transactions `other` is ahead of this position, summed over domains
    /// (sequence numbers count the transactions of a domain).
    pub fn behind(&self, other: &Self) -> u64 {
        other
            .domains
            .iter()
            .map(|(domain, &(_, seq))| {
                let ours = self.domains.get(domain).map_or(0, |&(_, s)| s);
                seq.saturating_sub(ours)
            })
            .sum()
    }
}

impl fmt::Display for GtidPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (domain, (server, seq))) in self.domains.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{domain}-{server}-{seq}")?;
        }
        Ok(())
    }
}

impl FromStr for GtidPosition {
    type Err = CdcError;

    fn from_str(s: &str) -> Result<Self, CdcError> {
        let bad = || CdcError::Decode(format!("`{s}` is not a MariaDB GTID position"));
        let mut position = Self::default();
        for gtid in s.split(',').map(str::trim).filter(|g| !g.is_empty()) {
            let mut parts = gtid.split('-');
            let (Some(d), Some(srv), Some(n), None) =
                (parts.next(), parts.next(), parts.next(), parts.next())
            else {
                return Err(bad());
            };
            let domain = d.parse().map_err(|_| bad())?;
            let server = srv.parse().map_err(|_| bad())?;
            let seq = n.parse().map_err(|_| bad())?;
            position.advance(domain, server, seq);
        }
        Ok(position)
    }
}

/// MariaDB's `GTID_EVENT` (type 162), which mysql_common does not parse: the GTID of the
/// transaction that follows and whether it is a standalone statement (DDL, no COMMIT).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MariadbGtid {
    pub(crate) domain: u32,
    pub(crate) seq: u64,
    /// `FL_STANDALONE`: the group is one statement, ended by no XID or COMMIT event.
    pub(crate) standalone: bool,
}

/// The event type of MariaDB's GTID event.
pub(crate) const MARIADB_GTID_EVENT: u8 = 162;

impl MariadbGtid {
    /// Reads the event's body (after the common header): sequence number (u64), domain
    /// id (u32), flags (u8), little-endian. The server id is the event header's.
    pub(crate) fn read(data: &[u8]) -> Result<Self, CdcError> {
        let bad = || CdcError::Decode("a MariaDB GTID event shorter than 13 bytes".into());
        let seq = data.get(0..8).ok_or_else(bad)?;
        let domain = data.get(8..12).ok_or_else(bad)?;
        let flags = *data.get(12).ok_or_else(bad)?;
        Ok(Self {
            seq: u64::from_le_bytes(seq.try_into().map_err(|_| bad())?),
            domain: u32::from_le_bytes(domain.try_into().map_err(|_| bad())?),
            standalone: flags & 0x01 != 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_reads_and_prints_as_mariadb_does() {
        let p: GtidPosition = "0-7-4,1-2-10".parse().unwrap();
        assert_eq!(p.to_string(), "0-7-4,1-2-10");
        assert_eq!("".parse::<GtidPosition>().unwrap(), GtidPosition::default());
        assert!("0-7".parse::<GtidPosition>().is_err());
        assert!("0-7-x".parse::<GtidPosition>().is_err());
        assert!("0-7-4-1".parse::<GtidPosition>().is_err());
    }

    #[test]
    fn covers_and_behind_compare_each_domain() {
        let at: GtidPosition = "0-7-4,1-2-10".parse().unwrap();
        let later: GtidPosition = "0-7-6".parse().unwrap();
        assert!(!at.covers(&later));
        assert!(at.covers(&"0-7-4".parse().unwrap()));
        assert!(!at.covers(&"2-1-1".parse().unwrap()));
        assert_eq!(at.behind(&later), 2);
        assert_eq!(later.behind(&at), 10);
        let mut moved = at.clone();
        moved.advance(0, 7, 6);
        assert!(moved.covers(&later));
    }

    #[test]
    fn the_gtid_event_body_is_read_and_a_short_one_refused() {
        let mut body = 5u64.to_le_bytes().to_vec();
        body.extend(3u32.to_le_bytes());
        body.push(0x01);
        let g = MariadbGtid::read(&body).unwrap();
        assert_eq!((g.domain, g.seq, g.standalone), (3, 5, true));
        assert!(MariadbGtid::read(&body[..12]).is_err());
    }
}
