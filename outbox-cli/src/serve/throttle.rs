//! Wrong tokens, slowed down: a guesser gets a burst of tries, then one a second for the
//! whole server, whatever addresses it comes from. The right token is never slowed, so an
//! attack cannot lock the operator out.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Wrong tokens allowed at once before the pace applies.
const BURST: u32 = 10;
/// The pace after the burst: one wrong token per this long.
const PACE: Duration = Duration::from_secs(1);
/// A wrong token that would wait longer than this is refused at once (429) instead:
/// waiting guesses must not pile up without end.
const MAX_WAIT: Duration = Duration::from_secs(30);

/// The generic cell rate algorithm: one instant says when the bucket is empty again.
pub(super) struct Throttle {
    /// When every wrong token seen so far will have been paid for (`PACE` each).
    empty_at: Mutex<Instant>,
}

impl Throttle {
    pub(super) fn new() -> Self {
        Self {
            empty_at: Mutex::new(Instant::now()),
        }
    }

    /// Waits as long as this wrong token must: nothing within the burst, then its turn
    /// at the pace. `false`: the queue is too long; refuse without waiting.
    pub(super) async fn wrong_token(&self) -> bool {
        let Some(wait) = self.reserve(Instant::now()) else {
            return false;
        };
        tokio::time::sleep(wait).await;
        true
    }

    /// Books a wrong token seen at `now`: how long it waits, `None` past [`MAX_WAIT`].
    fn reserve(&self, now: Instant) -> Option<Duration> {
        let mut empty_at = self.empty_at.lock().unwrap_or_else(|e| e.into_inner());
        let after = (*empty_at).max(now) + PACE;
        let wait = after.saturating_duration_since(now + PACE * BURST);
        if wait > MAX_WAIT {
            return None;
        }
        *empty_at = after;
        Some(wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_passes_then_the_pace_applies_and_a_long_queue_is_refused() {
        let throttle = Throttle::new();
        let now = Instant::now();
        for _ in 0..BURST {
            assert_eq!(throttle.reserve(now), Some(Duration::ZERO));
        }
        assert_eq!(throttle.reserve(now), Some(PACE));
        assert_eq!(throttle.reserve(now), Some(PACE * 2));
        // Paid off with time: after the queue drained, a burst again.
        let later = now + PACE * (BURST + 2) * 2;
        assert_eq!(throttle.reserve(later), Some(Duration::ZERO));
        let mut waits = 0;
        while throttle.reserve(later).is_some() {
            waits += 1;
        }
        assert_eq!(waits, BURST - 1 + 30, "the burst, then 30 s of queue");
        assert_eq!(throttle.reserve(later), None, "still refused");
        assert_eq!(
            throttle.reserve(later + PACE),
            Some(MAX_WAIT),
            "one more place a second later"
        );
    }
}
