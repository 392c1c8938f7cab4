//! `outbox relay --durability`: what the relay waits for before it marks a row SENT
//! ([`outbox_redis::Durability`]).

use std::time::Duration;

use outbox_redis::{Durability, PublisherConfig};

/// How long the wait may take when `timeout=` is not given.
pub(crate) const DEFAULT_WAIT: Duration = Duration::from_secs(1);

/// The forms, for messages.
const FORMS: &str = "reply, replicas=N[,timeout=T] or aof=local|N|local+N[,timeout=T]";

/// Parses `reply`, `replicas=N[,timeout=T]` (`WAIT N`) or `aof=local|N|local+N[,timeout=T]`
/// (`WAITAOF`: the primary's own AOF, N replicas' AOF, or both). T is a duration (`500ms`,
/// `2s`) or a number of milliseconds, more than zero and less than the publisher's
/// response timeout (5 s); [`DEFAULT_WAIT`] without it.
pub(crate) fn parse_durability(text: &str) -> Result<Durability, String> {
    let mut parts = text.split(',');
    let head = parts.next().unwrap_or_default();
    let timeout = match parts.next() {
        None => DEFAULT_WAIT,
        Some(part) => {
            let value = part.strip_prefix("timeout=").ok_or_else(|| {
                format!("expected `timeout=T` after the first comma, got `{part}` ({FORMS})")
            })?;
            wait_timeout(value)?
        }
    };
    if let Some(extra) = parts.next() {
        return Err(format!("unexpected `{extra}` ({FORMS})"));
    }
    let durability = match head.split_once('=') {
        None if head == "reply" && text == "reply" => Durability::Reply,
        None if head == "reply" => return Err("`reply` takes no timeout".to_owned()),
        Some(("replicas", n)) => Durability::Replicas {
            replicas: count(n, "replicas")?,
            timeout,
        },
        Some(("aof", what)) => aof(what, timeout)?,
        _ => return Err(format!("expected {FORMS}, got `{text}`")),
    };
    Ok(durability)
}

/// `local`, `N` or `local+N`.
fn aof(what: &str, timeout: Duration) -> Result<Durability, String> {
    let (local, replicas) = match what.split_once('+') {
        Some(("local", n)) => (true, count(n, "aof=local+")?),
        None if what == "local" => (true, 0),
        None => (false, count(what, "aof=")?),
        Some(_) => {
            return Err(format!(
                "expected aof=local, aof=N or aof=local+N, got `aof={what}`"
            ));
        }
    };
    Ok(Durability::Aof {
        local,
        replicas,
        timeout,
    })
}

/// A replica count, at least 1 (a wait for none would wait for nothing: that is `reply`).
fn count(n: &str, what: &str) -> Result<u32, String> {
    match n.parse::<u32>() {
        Ok(0) => Err(format!(
            "{what}0 waits for nothing: use `reply`, or at least 1 replica"
        )),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{n}` is not a replica count ({what}N, N from 1)")),
    }
}

/// A duration (`500ms`, `2s`) or bare milliseconds, within what the publisher allows.
fn wait_timeout(value: &str) -> Result<Duration, String> {
    let timeout = match value.parse::<u64>() {
        Ok(ms) => Duration::from_millis(ms),
        Err(_) => humantime::parse_duration(value)
            .map_err(|e| format!("`{value}` is not a duration ({e}); e.g. timeout=500ms"))?,
    };
    let limit = PublisherConfig::default().response_timeout;
    if timeout.is_zero() || timeout >= limit {
        return Err(format!(
            "timeout={value} must be more than zero and less than the publisher's response \
             timeout ({limit:?})"
        ));
    }
    Ok(timeout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_durability_has_its_form() {
        let ms = Duration::from_millis;
        assert_eq!(parse_durability("reply"), Ok(Durability::Reply));
        assert_eq!(
            parse_durability("replicas=1"),
            Ok(Durability::Replicas {
                replicas: 1,
                timeout: DEFAULT_WAIT
            })
        );
        assert_eq!(
            parse_durability("replicas=2,timeout=250"),
            Ok(Durability::Replicas {
                replicas: 2,
                timeout: ms(250)
            })
        );
        assert_eq!(
            parse_durability("aof=local,timeout=2s"),
            Ok(Durability::Aof {
                local: true,
                replicas: 0,
                timeout: ms(2000)
            })
        );
        assert_eq!(
            parse_durability("aof=1"),
            Ok(Durability::Aof {
                local: false,
                replicas: 1,
                timeout: DEFAULT_WAIT
            })
        );
        assert_eq!(
            parse_durability("aof=local+2,timeout=300ms"),
            Ok(Durability::Aof {
                local: true,
                replicas: 2,
                timeout: ms(300)
            })
        );
    }

    #[test]
    fn mistakes_say_what_is_wrong() {
        for (text, says) in [
            ("", "expected reply"),
            ("always", "expected reply"),
            ("reply,timeout=1s", "takes no timeout"),
            ("replicas", "expected reply"),
            ("replicas=", "is not a replica count"),
            ("replicas=0", "waits for nothing"),
            ("replicas=-1", "`-1` is not a replica count"),
            ("replicas=1,timeout=0", "more than zero"),
            ("replicas=1,timeout=5s", "less than"),
            ("replicas=1,timeout=soon", "`soon` is not a duration"),
            ("replicas=1,wait=1s", "expected `timeout=T`"),
            ("replicas=1,timeout=1s,x", "unexpected `x`"),
            ("aof=0", "waits for nothing"),
            ("aof=remote", "`remote` is not a replica count"),
            ("aof=local+0", "waits for nothing"),
            ("aof=1+local", "expected aof=local"),
        ] {
            let err = parse_durability(text).unwrap_err();
            assert!(err.contains(says), "{text}: {err}");
        }
    }
}
