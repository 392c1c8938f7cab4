//! Which writes must wait until the replicas show they have caught up
//! ([`RedisPublisher::replicas_behind`](super::RedisPublisher)).
//!
//! Kept per stream, not as one flag: on a cluster a call may touch only healthy shards,
//! and its passing check must not clear the debt of a shard whose wait went unmet, or
//! that shard would get its batch again at the next call that reaches it.

use std::collections::HashSet;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The streams whose next write waits for the durability check.
#[derive(Debug)]
pub(super) struct CatchUp(Mutex<Owed>);

#[derive(Debug)]
struct Owed {
    /// Every stream: at the start and after an outage (the server may be back without
    /// its replicas).
    everywhere: bool,
    /// The streams of writes whose durability wait went unmet.
    streams: HashSet<String>,
}

impl Default for CatchUp {
    fn default() -> Self {
        Self(Mutex::new(Owed {
            everywhere: true,
            streams: HashSet::new(),
        }))
    }
}

impl CatchUp {
    fn lock(&self) -> MutexGuard<'_, Owed> {
        // Two plain fields: no invariant a panic could break halfway.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// After an outage: every stream waits for the check.
    pub(super) fn everywhere(&self) {
        self.lock().everywhere = true;
    }

    /// The durability wait after writes to `streams` went unmet.
    pub(super) fn owe<'a>(&self, streams: impl IntoIterator<Item = &'a str>) {
        let mut owed = self.lock();
        owed.streams.extend(streams.into_iter().map(str::to_owned));
    }

    /// Whether a write to any of `streams` must wait for the check.
    pub(super) fn owed<'a>(&self, mut streams: impl Iterator<Item = &'a str>) -> bool {
        let owed = self.lock();
        owed.everywhere || streams.any(|s| owed.streams.contains(s))
    }

    /// The check passed for `streams`; with `all`, for every stream it was made for.
    pub(super) fn caught_up<'a>(&self, streams: impl IntoIterator<Item = &'a str>, all: bool) {
        let mut owed = self.lock();
        for s in streams {
            owed.streams.remove(s);
        }
        if all {
            owed.everywhere = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::CatchUp;

    #[test]
    fn a_check_that_passes_elsewhere_keeps_an_unmet_stream_owed() {
        let catch_up = CatchUp::default();
        assert!(
            catch_up.owed(["a"].into_iter()),
            "the start checks everything"
        );
        catch_up.caught_up(["a"], true);
        assert!(!catch_up.owed(["a", "b"].into_iter()));
        // Shard of `b` left without replicas; the next call reaches only `a`'s.
        catch_up.owe(["b"]);
        assert!(!catch_up.owed(["a"].into_iter()));
        catch_up.caught_up(["a"], true);
        assert!(
            catch_up.owed(["b"].into_iter()),
            "b's debt outlives a's check"
        );
        catch_up.caught_up(["b"], true);
        assert!(!catch_up.owed(["b"].into_iter()));
        catch_up.everywhere();
        assert!(
            catch_up.owed(["c"].into_iter()),
            "an outage checks everything"
        );
    }
}
