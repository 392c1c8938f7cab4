//! Names no other test, test binary or run uses, so tests share the services without
//! seeing each other's data.

/// `<prefix>_<pid>_<16 hex digits>`: unique to this process and call, safe in SQL
/// identifiers (when `prefix` is), file names, Redis keys and consumer-group names.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}_{}_{:016x}", std::process::id(), fastrand::u64(..))
}

/// [`unique`] followed by `:`, a stream prefix that no other test's keys start with.
pub fn unique_prefix(prefix: &str) -> String {
    format!("{}:", unique(prefix))
}
