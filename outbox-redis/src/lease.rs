//! Leases in Redis: one holder of a named thing at a time, lost when the holder stops
//! renewing it.
//!
//! A lease is a key (see [`lease_key`](crate::conn::lease_key)) whose value is
//! `<epoch>:<holder>`, set with a TTL. Acquiring it sets it only if it is free, counting
//! one more epoch at `<key>:epoch`; renewing and releasing compare the value first (a
//! script each), so a holder never extends or deletes a lease that expired and went to
//! someone else.
//!
//! The holder's side of the bargain is its local deadline: the lease counts as held only
//! until the moment the last successful renewal was *sent*, plus the TTL, minus a margin
//! (monotonic clock). Redis starts the TTL when it runs the command, later than that, so
//! the holder always gives up first; a process that was stopped (`SIGSTOP`, a long GC
//! pause of its host) finds its deadline passed when it resumes and stops at once,
//! whatever Redis says.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use redis::RedisResult;

use crate::conn::Conn;

/// Sets the lease if free: `KEYS[1]` the lease, `KEYS[2]` its epoch counter; `ARGV[1]`
/// the holder, `ARGV[2]` the TTL in ms. Returns the new epoch, or nil if held.
const ACQUIRE: &str = r"
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], epoch .. ':' .. ARGV[1], 'PX', ARGV[2])
return epoch
";

/// Extends the lease if it still has the value `ARGV[1]`, to `ARGV[2]` ms. Returns 1 if
/// extended.
const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// Deletes the lease if it still has the value `ARGV[1]`. Returns 1 if deleted.
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// A lease this process acquired. Shared by the task that renews it and the work that
/// must stop once it is lost ([`is_held`](Self::is_held)).
#[derive(Debug)]
pub(crate) struct Lease {
    key: String,
    /// `<epoch>:<holder>`, as stored.
    value: String,
    epoch: u64,
    ttl: Duration,
    /// Until when this process may act as the holder.
    valid_until: Mutex<Instant>,
    /// Given up ([`give_up`](Lease::give_up)): no renewal counts any more, not even
    /// one whose reply comes later. Written and read under `valid_until`'s lock.
    given_up: AtomicBool,
}

impl Lease {
    /// Acquires the lease at `key` for `holder` for `ttl`, if nobody holds it. `None`:
    /// held by someone (possibly `holder` itself, under an earlier epoch).
    pub(crate) async fn acquire(
        conn: &mut Conn,
        key: &str,
        holder: &str,
        ttl: Duration,
    ) -> RedisResult<Option<Lease>> {
        let sent = Instant::now();
        let epoch: Option<u64> = eval(ACQUIRE, 2)
            .arg(key)
            .arg(format!("{key}:epoch"))
            .arg(holder)
            .arg(millis(ttl))
            .query_async(conn)
            .await?;
        Ok(epoch.map(|epoch| Lease {
            key: key.to_owned(),
            value: format!("{epoch}:{holder}"),
            epoch,
            ttl,
            valid_until: Mutex::new(sent + valid_for(ttl)),
            given_up: AtomicBool::new(false),
        }))
    }

    /// Renews the lease for another TTL. `Ok(false)`: it was lost (expired, and perhaps
    /// taken by another holder), or given up meanwhile: [`is_held`](Self::is_held) is
    /// false from now on. An error leaves the local deadline as it was: the lease is
    /// lost when it passes, unless a later renewal succeeds first.
    pub(crate) async fn renew(&self, conn: &mut Conn) -> RedisResult<bool> {
        let sent = Instant::now();
        let renewed: i64 = eval(RENEW, 1)
            .arg(&self.key)
            .arg(&self.value)
            .arg(millis(self.ttl))
            .query_async(conn)
            .await?;
        if renewed != 1 {
            self.give_up();
            return Ok(false);
        }
        let mut until = self.until();
        // Given up meanwhile (its stream dropped): it stays lost, whatever Redis did (the
        // key expires there by itself). The flag changes under the same lock.
        if self.given_up.load(Ordering::Relaxed) {
            return Ok(false);
        }
        // A slow reply must not move the deadline back past a later renewal's.
        *until = (*until).max(sent + valid_for(self.ttl));
        Ok(true)
    }

    /// Gives the lease back, if still ours; from now on it is not held. Returns whether
    /// Redis still had it as ours.
    pub(crate) async fn release(&self, conn: &mut Conn) -> RedisResult<bool> {
        self.give_up();
        let released: i64 = eval(RELEASE, 1)
            .arg(&self.key)
            .arg(&self.value)
            .query_async(conn)
            .await?;
        Ok(released == 1)
    }

    /// Whether this process may still act as the holder: its local deadline (the last
    /// successful renewal's sending time plus the TTL minus a margin) has not passed.
    pub(crate) fn is_held(&self) -> bool {
        Instant::now() < *self.until()
    }

    /// Stops counting the lease as held, at once.
    pub(crate) fn give_up(&self) {
        let mut until = self.until();
        self.given_up.store(true, Ordering::Relaxed);
        *until = Instant::now();
    }

    /// The epoch under which it was acquired: one more at each acquisition of the key.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The lease's key.
    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    /// Its value while ours: `<epoch>:<holder>`.
    pub(crate) fn value(&self) -> &str {
        &self.value
    }

    /// Until when it counts as held, unless renewed.
    pub(crate) fn valid_until(&self) -> Instant {
        *self.until()
    }

    fn until(&self) -> std::sync::MutexGuard<'_, Instant> {
        // An `Instant` holds no invariant a panic could break.
        self.valid_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// How long after sending a successful renewal the lease counts as held: the TTL minus
/// a fifth of it, the margin for the two clocks' drift and for the work that checked
/// the lease just before its deadline to start.
fn valid_for(ttl: Duration) -> Duration {
    ttl - ttl / 5
}

/// `EVAL <script> <keys>`, to which the keys and then the arguments are added. (Redis
/// caches a script's compilation by its text; the crate's `script` feature, for
/// `EVALSHA`, would add a dependency for a few hundred bytes per call.)
pub(crate) fn eval(script: &str, keys: usize) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(script).arg(keys);
    cmd
}

/// Whole milliseconds, at least 1.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::Target;

    async fn conn() -> Conn {
        Target::single(outbox_tests::redis_url())
            .unwrap()
            .connector(Duration::from_secs(2), Duration::from_secs(5))
            .unwrap()
            .get()
            .await
            .expect("Redis must be running at REDIS_URL")
    }

    async fn value(conn: &mut Conn, key: &str) -> Option<String> {
        redis::cmd("GET").arg(key).query_async(conn).await.unwrap()
    }

    #[tokio::test]
    async fn one_holder_at_a_time_and_each_acquisition_is_a_new_epoch() {
        let mut c = conn().await;
        let key = outbox_tests::unique("lease");
        let ttl = Duration::from_secs(10);
        let a = Lease::acquire(&mut c, &key, "a", ttl)
            .await
            .unwrap()
            .unwrap();
        assert!(a.is_held());
        assert_eq!(
            value(&mut c, &key).await.as_deref(),
            Some(&*format!("{}:a", a.epoch()))
        );
        assert!(
            Lease::acquire(&mut c, &key, "b", ttl)
                .await
                .unwrap()
                .is_none()
        );
        assert!(
            Lease::acquire(&mut c, &key, "a", ttl)
                .await
                .unwrap()
                .is_none()
        );
        assert!(a.renew(&mut c).await.unwrap());
        assert!(a.release(&mut c).await.unwrap());
        assert!(!a.is_held());
        assert_eq!(value(&mut c, &key).await, None);
        let b = Lease::acquire(&mut c, &key, "b", ttl)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(b.epoch(), a.epoch() + 1);
        // The old holder can neither extend nor delete the new holder's lease.
        assert!(!a.renew(&mut c).await.unwrap());
        assert!(!a.release(&mut c).await.unwrap());
        assert_eq!(
            value(&mut c, &key).await.as_deref(),
            Some(&*format!("{}:b", b.epoch()))
        );
        assert!(b.release(&mut c).await.unwrap());
        let _: () = redis::cmd("DEL")
            .arg(format!("{key}:epoch"))
            .query_async(&mut c)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn an_unrenewed_lease_is_lost_locally_before_redis_lets_another_holder_take_it() {
        let mut c = conn().await;
        let key = outbox_tests::unique("lease");
        let ttl = Duration::from_millis(500);
        let a = Lease::acquire(&mut c, &key, "a", ttl)
            .await
            .unwrap()
            .unwrap();
        // Not renewed: the local deadline (before the TTL) passes first...
        outbox_tests::eventually("the local deadline", || !a.is_held()).await;
        let mut ttl_left: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut c)
            .await
            .unwrap();
        // ...while Redis may still hold it a moment; then it expires (-2: no such key)
        // and is free.
        while ttl_left != -2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
            ttl_left = redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut c)
                .await
                .unwrap();
        }
        let b = Lease::acquire(&mut c, &key, "b", ttl).await.unwrap();
        assert!(b.is_some(), "an expired lease is free");
        assert!(
            !a.renew(&mut c).await.unwrap(),
            "an expired lease cannot be renewed"
        );
        assert!(!a.is_held());
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .arg(format!("{key}:epoch"))
            .query_async(&mut c)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_lease_given_up_is_never_renewed_again() {
        let mut c = conn().await;
        let key = outbox_tests::unique("lease");
        let a = Lease::acquire(&mut c, &key, "a", Duration::from_secs(10))
            .await
            .unwrap()
            .unwrap();
        // Given up (its stream dropped) while a renewal is on its way, whose reply
        // comes after: Redis still had the lease as ours.
        a.give_up();
        assert!(!a.renew(&mut c).await.unwrap());
        assert!(!a.is_held(), "a late renewal brought back a lease given up");
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .arg(format!("{key}:epoch"))
            .query_async(&mut c)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn renewing_keeps_the_lease_past_its_ttl() {
        let mut c = conn().await;
        let key = outbox_tests::unique("lease");
        let ttl = Duration::from_secs(2);
        let a = Lease::acquire(&mut c, &key, "a", ttl)
            .await
            .unwrap()
            .unwrap();
        for _ in 0..5 {
            tokio::time::sleep(ttl / 3).await;
            assert!(a.renew(&mut c).await.unwrap());
            assert!(a.is_held());
        }
        assert!(
            Lease::acquire(&mut c, &key, "b", ttl)
                .await
                .unwrap()
                .is_none()
        );
        assert!(a.release(&mut c).await.unwrap());
        let _: () = redis::cmd("DEL")
            .arg(format!("{key}:epoch"))
            .query_async(&mut c)
            .await
            .unwrap();
    }
}
