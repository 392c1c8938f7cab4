//! Connection URLs for messages and logs, without their passwords.

/// `url` with its password hidden (`user:***@host`, `password=***`), for messages and
/// logs. A path such as `/tmp/a:b@c.db` (no `scheme://`) is left as it is.
///
/// ```
/// use outbox_core::redact_url;
///
/// assert_eq!(redact_url("redis://:pw@h:1/0"), "redis://:***@h:1/0");
/// assert_eq!(redact_url("postgres://h/db?password=x&a=b"), "postgres://h/db?password=***&a=b");
/// ```
pub fn redact_url(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some(start) = out.find("://").map(|i| i + 3) {
        let end = out[start..]
            .find(['/', '?'])
            .map_or(out.len(), |i| start + i);
        if let Some(at) = out[start..end].rfind('@').map(|i| start + i)
            && let Some(colon) = out[start..at].find(':').map(|i| start + i)
        {
            out.replace_range(colon + 1..at, "***");
        }
    }
    if let Some(p) = out.find("password=").map(|i| i + "password=".len()) {
        let end = out[p..].find('&').map_or(out.len(), |i| p + i);
        out.replace_range(p..end, "***");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn passwords_are_hidden() {
        for (url, shown) in [
            ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
            (
                "postgres://u:secret@h:5432/db",
                "postgres://u:***@h:5432/db",
            ),
            ("mysql://u@h/db", "mysql://u@h/db"),
            (
                "postgres://h/db?user=u&password=secret&x=1",
                "postgres://h/db?user=u&password=***&x=1",
            ),
            ("/tmp/a:b@c.db", "/tmp/a:b@c.db"),
        ] {
            assert_eq!(redact_url(url), shown);
        }
    }
}
