//! The run's own database: created, handed out to each process under a name the fault
//! injector can find its sessions by, queried for the checks, dropped.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant, SystemTime};

use diesel::connection::SimpleConnection as _;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, SmallInt, Text};
use diesel::{MysqlConnection, PgConnection};
use outbox_harness::chaos::{self, ChaosDb as _, chaos_keys, chaos_log, chaos_sums};

use crate::BoxError;
use crate::config::Backend;

/// An open connection to the run's database.
pub(crate) enum Conn {
    Pg(PgConnection),
    My(MysqlConnection),
}

/// Evaluates `$body` with `$c` bound to the connection, whatever its backend.
macro_rules! with_conn {
    ($conn:expr, $c:ident => $body:expr) => {
        match $conn {
            Conn::Pg($c) => $body,
            Conn::My($c) => $body,
        }
    };
}

#[derive(QueryableByName)]
struct OutboxRow {
    #[diesel(sql_type = Text)]
    msg_id: String,
    #[diesel(sql_type = SmallInt)]
    status: i16,
}

#[derive(QueryableByName)]
struct MsgIdRow {
    #[diesel(sql_type = Text)]
    msg_id: String,
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// `--partitioned`: partitions of 5 s, so that the relays make new ones all through the
/// run.
pub(crate) const PARTITION_INTERVAL: Duration = Duration::from_secs(5);
/// `--partitioned`: partitions made ahead (100 s). A maintenance run holds the maintenance
/// lock while its `DETACH .. CONCURRENTLY` waits for the transactions on the table (up to
/// 30 s a step), and a SIGSTOPped relay or consumer keeps its transaction open for up to
/// 40 s, two of them overlapping longer; meanwhile no other relay makes partitions. The
/// margin covers that: an emit whose time had no partition would fail its transaction.
pub(crate) const PARTITION_PREMAKE: u32 = 20;
/// `--partitioned`: partitions dropped 90 s after their range ends, so that the relays
/// detach and drop them under the faults. It is the dedup window of both tables: the
/// producers never emit a msg_id twice (each names its transaction), but a consumer sees a
/// message again long after applying it, and `consumed_msg` must still refuse it then: an
/// entry whose `XACK` failed (Redis down, connections killed, the consumer killed or
/// stopped) is claimed by another consumer once idle 30 s (`min_idle`, claims every 5 s),
/// and a relay stopped (up to 40 s) between its `XADD` and its commit, its session then
/// killed, has the other relay publish the message again. The longest is a message
/// applied whose `XACK` fails, claimed by another consumer some 35 s later, which is then
/// SIGSTOPped for up to 40 s before its dedup insert: 75 s. 90 s is past it.
pub(crate) const PARTITION_RETENTION: Duration = Duration::from_secs(90);

/// What the database holds at the end of a run.
pub(crate) struct Contents {
    /// Committed messages per key (the key's last sequence number).
    pub(crate) committed: Vec<(String, i64)>,
    /// `(key, sum of seq, applications)` per key.
    pub(crate) sums: Vec<(String, i64, i64)>,
    /// Applications that did not follow their key's last one (summed over keys).
    pub(crate) handler_order_breaks: i64,
    /// The msg_id of every application, in order.
    pub(crate) log: Vec<String>,
    /// `(msg_id, status)` of every outbox row.
    pub(crate) outbox: Vec<(String, i16)>,
    /// The consumer group's dedup records.
    pub(crate) consumed: Vec<String>,
}

/// The run's database on its server.
pub(crate) struct Database {
    backend: Backend,
    admin_url: String,
    /// The database's name.
    pub(crate) name: String,
    /// MariaDB users created for the processes (dropped with the database).
    users: Vec<String>,
    created: bool,
    /// `--partitioned`: every partition seen attached, by table.
    seen: BTreeSet<(&'static str, String)>,
    last_sample: Option<Instant>,
    /// `--partitioned`: the least time, in seconds, the newest partition of a table was
    /// seen to end ahead of the clock.
    pub(crate) min_margin: Option<f64>,
    /// The harness's session for the samples and the maintenance lock's holder.
    probe: Option<PgConnection>,
}

/// `--partitioned`: what became of the partitions at the end of a run.
#[derive(Debug, Default)]
pub(crate) struct PartitionsEnd {
    /// Partitions seen attached during the run and gone at its end (detached and
    /// dropped), by table.
    pub(crate) dropped: BTreeMap<&'static str, usize>,
    /// Partitions detached but still there (a maintenance run killed between its
    /// `DETACH` and its `DROP`, not yet cleaned up by the next one).
    pub(crate) detached_left: Vec<String>,
}

impl Database {
    /// Creates database `name` on the server of `admin_url`, with the outbox tables (on
    /// PostgreSQL `partitioned` by time if asked) and the chaos tables for `keys` keys.
    pub(crate) fn create(
        backend: Backend,
        admin_url: &str,
        name: &str,
        keys: usize,
        partitioned: bool,
    ) -> Result<Self, BoxError> {
        let mut db = Self {
            backend,
            admin_url: admin_url.to_owned(),
            name: name.to_owned(),
            users: Vec::new(),
            created: false,
            seen: BTreeSet::new(),
            last_sample: None,
            min_margin: None,
            probe: None,
        };
        db.admin(&format!("CREATE DATABASE {name}"))?;
        db.created = true;
        let mut conn = db.connect("chaos-setup")?;
        match &mut conn {
            // Partitions of 5 s, made and dropped by the relays all through the run (see
            // `PARTITION_*`): the checks rely on the producers' log and the consumers'
            // applications, not on the rows, which retention takes.
            Conn::Pg(c) if partitioned => {
                let policy = outbox_diesel::PartitionPolicy::default()
                    .with_interval(PARTITION_INTERVAL)
                    .with_premake(PARTITION_PREMAKE)
                    .with_retention(PARTITION_RETENTION);
                outbox_diesel::migrate_partitioned(c, &policy)?;
            }
            _ => with_conn!(&mut conn, c => outbox_diesel::migrate(c))?,
        }
        match &mut conn {
            Conn::Pg(c) => c.batch_execute(chaos::POSTGRES_SETUP)?,
            Conn::My(c) => c.batch_execute(chaos::MYSQL_SETUP)?,
        }
        with_conn!(&mut conn, c => c.seed_keys(keys))?;
        Ok(db)
    }

    fn admin(&self, sql: &str) -> Result<(), BoxError> {
        match self.backend {
            Backend::Postgres => PgConnection::establish(&self.admin_url)?.batch_execute(sql)?,
            Backend::Mysql => MysqlConnection::establish(&self.admin_url)?.batch_execute(sql)?,
        }
        Ok(())
    }

    /// The URL a process called `who` connects with. On PostgreSQL `who` is the session's
    /// `application_name`; MariaDB has no such thing, so each process gets a user of its
    /// own, named after it.
    pub(crate) fn url_for(&mut self, who: &str) -> Result<String, BoxError> {
        match self.backend {
            Backend::Postgres => Ok(self.harness_url(who)),
            Backend::Mysql => {
                let url = with_database(&self.admin_url, &self.name);
                let user = self.mysql_user(who);
                if !self.users.contains(&user) {
                    self.admin(&format!(
                        "CREATE USER IF NOT EXISTS '{user}'@'%';
                         GRANT ALL ON {}.* TO '{user}'@'%';",
                        self.name
                    ))?;
                    self.users.push(user.clone());
                }
                Ok(with_user(&url, &user))
            }
        }
    }

    /// `--cdc` on MariaDB: the global privileges the binlog CDC relay needs for user
    /// `who` (see [`url_for`](Self::url_for)): `REPLICATION SLAVE` (the binlog dump),
    /// `BINLOG MONITOR` (the binlog's position), `PROCESS` (the open transactions behind
    /// its watermark, and the lock holder's session), as `outbox_cdc::mysql::check_server`
    /// asks; and `CONNECTION ADMIN`: each relay has a user of its own here, and a waiting
    /// relay ends the session of a silent (SIGSTOPped) holder with `KILL CONNECTION`.
    pub(crate) fn grant_binlog_reader(&mut self, who: &str) -> Result<(), BoxError> {
        let user = self.mysql_user(who);
        self.admin(&format!(
            "GRANT REPLICATION SLAVE, BINLOG MONITOR, PROCESS, CONNECTION ADMIN \
             ON *.* TO '{user}'@'%'"
        ))
    }

    fn mysql_user(&self, who: &str) -> String {
        // The database name is unique to the run; users are global to the server.
        format!("{}_{who}", self.name).replace('-', "_")
    }

    /// The URL of the harness's own sessions (the producer's, the checks'), which are
    /// never killed: on PostgreSQL named `who`, on MariaDB the admin user.
    pub(crate) fn harness_url(&self, who: &str) -> String {
        let url = with_database(&self.admin_url, &self.name);
        match self.backend {
            Backend::Postgres => {
                let sep = if url.contains('?') { '&' } else { '?' };
                format!("{url}{sep}application_name={who}")
            }
            Backend::Mysql => url,
        }
    }

    /// Opens a connection as `who` (see [`harness_url`](Self::harness_url)).
    pub(crate) fn connect(&self, who: &str) -> Result<Conn, BoxError> {
        let url = self.harness_url(who);
        Ok(match self.backend {
            Backend::Postgres => Conn::Pg(PgConnection::establish(&url)?),
            Backend::Mysql => Conn::My(MysqlConnection::establish(&url)?),
        })
    }

    /// Ends every session of process `who` (`pg_terminate_backend`, MariaDB
    /// `KILL CONNECTION`); returns how many there were.
    pub(crate) fn kill_sessions(&self, who: &str) -> Result<usize, BoxError> {
        match self.backend {
            Backend::Postgres => {
                let mut c = PgConnection::establish(&self.admin_url)?;
                let killed: Vec<Count> = diesel::sql_query(
                    "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity \
                     WHERE datname = $1 AND application_name = $2",
                )
                .bind::<Text, _>(&self.name)
                .bind::<Text, _>(who)
                .load(&mut c)?;
                Ok(killed.first().map_or(0, |k| k.n as usize))
            }
            Backend::Mysql => self.kill_mysql_user(&self.mysql_user(who)),
        }
    }

    fn kill_mysql_user(&self, user: &str) -> Result<usize, BoxError> {
        #[derive(QueryableByName)]
        struct Id {
            #[diesel(sql_type = BigInt)]
            id: i64,
        }
        let mut c = MysqlConnection::establish(&self.admin_url)?;
        let ids: Vec<Id> = diesel::sql_query(
            "SELECT CAST(id AS SIGNED) AS id FROM information_schema.processlist WHERE user = ?",
        )
        .bind::<Text, _>(user)
        .load(&mut c)?;
        let mut killed = 0;
        for Id { id } in ids {
            // The session may have ended in between ("Unknown thread id").
            if c.batch_execute(&format!("KILL CONNECTION {id}")).is_ok() {
                killed += 1;
            }
        }
        Ok(killed)
    }

    /// The harness's probe session (opened again after an error).
    fn probe(&mut self) -> Result<&mut PgConnection, BoxError> {
        if self.probe.is_none() {
            self.probe = Some(PgConnection::establish(&self.harness_url("chaos-check"))?);
        }
        Ok(self.probe.as_mut().expect("just opened"))
    }

    /// `--partitioned`: notes the partitions attached now, and how far ahead of the clock
    /// each table's newest one ends; at most once a second unless `force`d. A failure
    /// (the database down) is only reported when `force`d.
    pub(crate) fn sample_partitions(&mut self, force: bool) -> Result<(), BoxError> {
        if self.backend != Backend::Postgres
            || (!force
                && self
                    .last_sample
                    .is_some_and(|t| t.elapsed() < Duration::from_secs(1)))
        {
            return Ok(());
        }
        self.last_sample = Some(Instant::now());
        match self.probe().and_then(|c| Ok(outbox_diesel::partitions(c)?)) {
            Ok(parts) => self.note(parts),
            Err(e) => {
                self.probe = None;
                if force { Err(e) } else { Ok(()) }
            }
        }
    }

    /// Notes `parts`, attached now: each one seen, and how far ahead each table's newest
    /// ends.
    fn note(&mut self, parts: Vec<outbox_diesel::Partition>) -> Result<(), BoxError> {
        let now_ms = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)?
            .as_millis() as i64;
        let mut newest: BTreeMap<&'static str, i64> = BTreeMap::new();
        for p in parts {
            if let Some(to) = p.to {
                let end = newest.entry(p.table).or_insert(i64::MIN);
                *end = (*end).max(to.timestamp_millis());
            }
            self.seen.insert((p.table, p.name));
        }
        for end in newest.into_values() {
            let margin = (end - now_ms) as f64 / 1000.0;
            self.min_margin = Some(self.min_margin.map_or(margin, |m| m.min(margin)));
        }
        Ok(())
    }

    /// `--partitioned`, at the end (no relay running): the partitions seen during the run
    /// that are gone, and those detached but left.
    pub(crate) fn partitions_end(&mut self) -> Result<PartitionsEnd, BoxError> {
        #[derive(QueryableByName)]
        struct Table {
            #[diesel(sql_type = Text)]
            name: String,
        }
        let parts = outbox_diesel::partitions(self.probe()?)?;
        let attached: BTreeSet<String> = parts.iter().map(|p| p.name.clone()).collect();
        self.note(parts)?;
        let existing: Vec<Table> = diesel::sql_query(
            "SELECT relname::text AS name FROM pg_class \
             WHERE relkind IN ('r', 'p') AND relname ~ '^(outbox|consumed_msg)_p[0-9]{8}t[0-9]{6}$'",
        )
        .load(self.probe()?)?;
        let existing: BTreeSet<String> = existing.into_iter().map(|r| r.name).collect();
        let mut end = PartitionsEnd::default();
        for (table, name) in &self.seen {
            let dropped = end.dropped.entry(table).or_default();
            if !existing.contains(name) {
                *dropped += 1;
            }
        }
        end.detached_left = existing.difference(&attached).cloned().collect();
        // Closed: its server process names the run's database, which the check for
        // leftovers looks for.
        self.probe = None;
        Ok(end)
    }

    /// The process holding the partition maintenance lock now (one relay's maintenance
    /// run, see `outbox_diesel::maintain_partitions`), and what its session runs.
    pub(crate) fn maintaining(&mut self) -> Result<Option<(String, String, f64)>, BoxError> {
        #[derive(QueryableByName)]
        struct Holder {
            #[diesel(sql_type = Text)]
            name: String,
            #[diesel(sql_type = Text)]
            query: String,
            #[diesel(sql_type = diesel::sql_types::Double)]
            age: f64,
        }
        let found: Result<Vec<Holder>, BoxError> = self.probe().and_then(|c| {
            Ok(diesel::sql_query(
                "SELECT a.application_name::text AS name, \
                 coalesce(a.state, '') || ': ' || left(coalesce(a.query, ''), 120) AS query, \
                 extract(epoch FROM clock_timestamp() - a.backend_start)::float8 AS age \
                 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                 WHERE l.locktype = 'advisory' AND l.granted AND l.classid = 1869968486::oid \
                 AND a.datname = current_database() AND a.pid <> pg_backend_pid()",
            )
            .load(c)?)
        });
        match found {
            Ok(rows) => Ok(rows.into_iter().next().map(|h| (h.name, h.query, h.age))),
            Err(e) => {
                self.probe = None;
                Err(e)
            }
        }
    }

    /// Committed messages, distinct messages applied, and NEW outbox rows, so far.
    pub(crate) fn progress(&self) -> Result<(i64, i64, i64), BoxError> {
        let mut conn = self.connect("chaos-check")?;
        with_conn!(&mut conn, c => {
            let committed: Vec<i64> = chaos_keys::table.select(chaos_keys::next_seq).load(c)?;
            let applied: Vec<Count> =
                diesel::sql_query("SELECT COUNT(DISTINCT msg_id) AS n FROM chaos_log").load(c)?;
            let new: Vec<Count> =
                diesel::sql_query("SELECT COUNT(*) AS n FROM outbox WHERE status = 0").load(c)?;
            Ok((
                committed.iter().sum(),
                applied.first().map_or(0, |n| n.n),
                new.first().map_or(0, |n| n.n),
            ))
        })
    }

    /// Everything the checks need.
    pub(crate) fn contents(&self, group: &str) -> Result<Contents, BoxError> {
        let mut conn = self.connect("chaos-check")?;
        with_conn!(&mut conn, c => {
            let committed = chaos_keys::table
                .select((chaos_keys::k, chaos_keys::next_seq))
                .order(chaos_keys::k)
                .load(c)?;
            let sums = chaos_sums::table
                .select((chaos_sums::k, chaos_sums::total, chaos_sums::applied))
                .order(chaos_sums::k)
                .load(c)?;
            let breaks: Vec<i64> = chaos_sums::table.select(chaos_sums::breaks).load(c)?;
            let log = chaos_log::table
                .select(chaos_log::msg_id)
                .order(chaos_log::id)
                .load(c)?;
            let outbox: Vec<OutboxRow> =
                diesel::sql_query("SELECT msg_id, status FROM outbox ORDER BY id").load(c)?;
            let consumed: Vec<MsgIdRow> = diesel::sql_query(format!(
                "SELECT msg_id FROM consumed_msg WHERE consumer_group = '{group}'"
            ))
            .load(c)?;
            Ok(Contents {
                committed,
                sums,
                handler_order_breaks: breaks.iter().sum(),
                log,
                outbox: outbox.into_iter().map(|r| (r.msg_id, r.status)).collect(),
                consumed: consumed.into_iter().map(|r| r.msg_id).collect(),
            })
        })
    }

    /// Drops the database (and the MariaDB users), ending its sessions first.
    pub(crate) fn drop_all(&mut self) -> Result<(), BoxError> {
        self.probe = None;
        if !std::mem::take(&mut self.created) {
            return Ok(());
        }
        match self.backend {
            Backend::Postgres => self.admin(&format!("DROP DATABASE {} WITH (FORCE)", self.name)),
            Backend::Mysql => {
                for user in std::mem::take(&mut self.users) {
                    let _ = self.kill_mysql_user(&user);
                    self.admin(&format!("DROP USER IF EXISTS '{user}'@'%'"))?;
                }
                self.admin(&format!("DROP DATABASE {}", self.name))
            }
        }
    }
}

/// `url` with its database (path) replaced by `db`; the query string is kept.
fn with_database(url: &str, db: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let host_start = base.find("://").map_or(0, |i| i + 3);
    let host_end = base[host_start..]
        .find('/')
        .map_or(base.len(), |i| host_start + i);
    let mut out = format!("{}/{db}", &base[..host_end]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// `url` with its user replaced by `user` (and no password).
fn with_user(url: &str, user: &str) -> String {
    let Some(start) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let host_end = url[start..].find('/').map_or(url.len(), |i| start + i);
    let host = match url[start..host_end].rfind('@') {
        Some(at) => &url[start + at + 1..host_end],
        None => &url[start..host_end],
    };
    format!("{}{user}@{host}{}", &url[..start], &url[host_end..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/test", "chaos_1"),
            "postgres://postgres@127.0.0.1:5432/chaos_1"
        );
        assert_eq!(
            with_database("postgres://h/test?sslmode=disable", "c"),
            "postgres://h/c?sslmode=disable"
        );
        assert_eq!(
            with_database("mysql://root@h:3306", "c"),
            "mysql://root@h:3306/c"
        );
        assert_eq!(
            with_user("mysql://root:pw@127.0.0.1:3306/c", "u1"),
            "mysql://u1@127.0.0.1:3306/c"
        );
        assert_eq!(with_user("mysql://h/c", "u1"), "mysql://u1@h/c");
    }
}
