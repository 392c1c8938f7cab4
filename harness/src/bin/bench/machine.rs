//! Facts about the machine and the services, printed with the table.

use diesel::{Connection as _, PgConnection, QueryableByName, RunQueryDsl as _};

use crate::BoxError;

#[derive(QueryableByName)]
struct Setting {
    #[diesel(sql_type = diesel::sql_types::Text)]
    v: String,
}

fn pg_setting(conn: &mut PgConnection, name: &str) -> String {
    diesel::sql_query(format!("SELECT current_setting('{name}') AS v"))
        .get_result::<Setting>(conn)
        .map_or_else(|e| format!("? ({e})"), |s| s.v)
}

/// The load average of the last minute, from `/proc/loadavg`.
pub(crate) fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// Processes of other work that share the machine (the chaos runs of this workspace).
pub(crate) fn neighbours() -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
        .filter(|comm| {
            let comm = comm.trim();
            comm.starts_with("chaos") || comm == "outbox"
        })
        .count()
}

/// Markdown lines: cores, CPU, PostgreSQL and Redis versions and the settings that
/// matter for these figures.
pub(crate) async fn facts(pg_url: &str, redis_url: &str) -> Result<Vec<String>, BoxError> {
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "?".into());
    let mut pg = PgConnection::establish(pg_url)?;
    let pg_version = pg_setting(&mut pg, "server_version");
    let pg_settings = [
        "shared_buffers",
        "synchronous_commit",
        "fsync",
        "wal_level",
        "max_connections",
        "deadlock_timeout",
    ]
    .map(|s| format!("{s}={}", pg_setting(&mut pg, s)))
    .join(", ");
    let mut redis = redis::Client::open(redis_url)?
        .get_multiplexed_async_connection()
        .await?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut redis)
        .await?;
    let redis_version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .trim()
        .to_owned();
    let mut redis_settings = Vec::new();
    for name in ["appendonly", "appendfsync", "save", "maxmemory"] {
        let v: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg(name)
            .query_async(&mut redis)
            .await
            .unwrap_or_default();
        redis_settings.push(format!("{name}={}", v.get(1).map_or("?", String::as_str)));
    }
    Ok(vec![
        format!("- machine: {cores} cores ({cpu})"),
        format!("- PostgreSQL {pg_version}: {pg_settings}"),
        format!("- Redis {redis_version}: {}", redis_settings.join(", ")),
    ])
}
