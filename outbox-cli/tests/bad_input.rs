//! Bad input to the `outbox` binary as operators meet it: wrong passwords and unreachable
//! hosts for each service, missing tables, tables a newer release migrated, a SIGTERM in
//! the middle of `outbox migrate`, and hostile argument values. Each gives a clear error
//! and the documented exit code, no password appears in any output (every run here logs
//! at `RUST_LOG=debug`) or metric, and the committed rows stay as they were.

mod fixtures;

use std::ffi::OsString;
use std::net::SocketAddr;
use std::os::unix::ffi::OsStringExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::process::Output;
use std::time::Duration;

use diesel::connection::SimpleConnection as _;
use diesel::sql_types::{BigInt, Integer};
use diesel::{Connection as _, MysqlConnection, PgConnection, QueryableByName, RunQueryDsl as _};
use fixtures::process::Background;
use fixtures::relay::scrape;
use fixtures::{AnyConn, Backend, Engine, Mariadb, Postgres, Sqlite, TestDb, redis_url, unique};
use outbox_diesel::OutboxRecord;
use outbox_tests::{
    MariadbUser, PasswordRedis, ScratchPostgres, database_url, mysql_url, wait_until_within,
};

/// Fail-safe for waits on subprocesses; no test relies on it for timing.
const PATIENCE: Duration = Duration::from_secs(60);

/// Runs the binary with `args` at `RUST_LOG=debug` and returns what it printed.
fn run(args: &[&str]) -> Output {
    run_os(args.iter().map(OsString::from).collect())
}

fn run_os(args: Vec<OsString>) -> Output {
    let mut cmd = fixtures::outbox();
    cmd.env("RUST_LOG", "debug")
        .args(args)
        .timeout(PATIENCE)
        .output()
        .expect("the binary runs")
}

/// stdout and stderr together, for leak checks.
fn printed(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The command failed with `code`, said `needles` on stderr, and printed no `secret`.
fn assert_fails(out: &Output, code: i32, needles: &[&str], secret: Option<&str>) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "stderr:\n{stderr}");
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "{needle:?} not in stderr:\n{stderr}"
        );
    }
    if let Some(secret) = secret {
        assert!(
            !printed(out).contains(secret),
            "the password was printed:\n{}",
            printed(out)
        );
    }
}

/// Every outbox row and the number of dedup records: what a bad input must not change.
fn snapshot(db: &TestDb) -> (Vec<OutboxRecord>, i64) {
    let rows = match db.conn() {
        AnyConn::Pg(mut c) => outbox_diesel::list_messages(&mut c, None, 0, 10_000),
        AnyConn::Mysql(mut c) => outbox_diesel::list_messages(&mut c, None, 0, 10_000),
        AnyConn::Sqlite(mut c) => outbox_diesel::list_messages(&mut c, None, 0, 10_000),
    };
    (
        rows.unwrap(),
        db.scalar("SELECT COUNT(*) AS n FROM consumed_msg"),
    )
}

/// The database commands, each of which connects first.
fn database_commands<'a>(url: &'a str, redis: &'a str) -> Vec<Vec<&'a str>> {
    let with = |args: &[&'a str]| {
        let mut v = vec!["--database-url", url];
        v.extend_from_slice(args);
        v
    };
    vec![
        with(&["migrate"]),
        with(&["status", "--json"]),
        with(&["dead", "list"]),
        with(&["dead", "redrive", "--all"]),
        with(&["purge", "sent", "--older-than", "7d"]),
        with(&["relay", "--redis-url", redis]),
        with(&["relay", "--migrate", "--redis-url", redis]),
    ]
}

// ---- wrong passwords ----

#[test]
fn postgres_wrong_password_is_reported_without_the_password() {
    let server = ScratchPostgres::start();
    let secret = "Wr0ng-PG-Secret";
    let url = server.url_with_password(secret);
    let shown = url.replace(secret, "***");
    for args in database_commands(&url, &redis_url()) {
        let out = run(&args);
        assert_fails(
            &out,
            1,
            &[
                &format!("error: cannot connect to the PostgreSQL database `{shown}`"),
                "password authentication failed for user \"postgres\"",
            ],
            Some(secret),
        );
    }
    // The password as a URL parameter, and from the environment.
    let param = format!(
        "{}?password={secret}",
        server.url_with_password("x").replace(":x@", "@")
    );
    let out = run(&["--database-url", &param, "status"]);
    assert_fails(
        &out,
        1,
        &["password=***", "password authentication failed"],
        Some(secret),
    );
    let out = fixtures::outbox()
        .env("DATABASE_URL", &url)
        .env("RUST_LOG", "debug")
        .arg("status")
        .timeout(PATIENCE)
        .output()
        .unwrap();
    assert_fails(&out, 1, &["password authentication failed"], Some(secret));
    // With the right password the same command works: the refusal was the password's.
    let out = run(&[
        "--database-url",
        &server.url_with_password(ScratchPostgres::PASSWORD),
        "migrate",
    ]);
    assert!(out.status.success(), "{}", printed(&out));
}

#[test]
fn mariadb_wrong_password_is_reported_without_the_password() {
    let user = MariadbUser::new("bad_input");
    let secret = "Wr0ng-Maria-Secret";
    let url = user.url_with_password(secret);
    let shown = url.replace(secret, "***");
    for args in database_commands(&url, &redis_url()) {
        let out = run(&args);
        assert_fails(
            &out,
            1,
            &[
                &format!("error: cannot connect to the MySQL database `{shown}`"),
                "Access denied for user",
            ],
            Some(secret),
        );
    }
    let out = run(&[
        "--database-url",
        &user.url_with_password(MariadbUser::PASSWORD),
        "migrate",
    ]);
    assert!(out.status.success(), "{}", printed(&out));
}

#[test]
fn redis_wrong_password_is_reported_without_the_password() {
    let server = PasswordRedis::start();
    let secret = "Wr0ng-Redis-Secret";
    let url = server.url_with_password(secret);
    let out = run(&["trim", "--redis-url", &url]);
    assert_fails(
        &out,
        1,
        &[
            &format!(
                "error: cannot connect to Redis `{}`",
                url.replace(secret, "***")
            ),
            "authentication failed",
        ],
        Some(secret),
    );
    let out = fixtures::outbox()
        .env("REDIS_URL", &url)
        .env("RUST_LOG", "debug")
        .arg("trim")
        .timeout(PATIENCE)
        .output()
        .unwrap();
    assert_fails(&out, 1, &["authentication failed"], Some(secret));
    let out = run(&[
        "trim",
        "--redis-url",
        &server.url_with_password(PasswordRedis::PASSWORD),
    ]);
    assert!(out.status.success(), "{}", printed(&out));
}

/// The relay with a wrong Redis password keeps running, reports the refusal in its log,
/// spends no message's retries (an outage, not the messages' fault), serves no password
/// in its metrics, and stops with 0 on SIGTERM. Run on PostgreSQL and MariaDB.
fn relay_with_a_wrong_redis_password(db: &TestDb) {
    db.migrate();
    db.emit(1..=3);
    let before = snapshot(db);
    let server = PasswordRedis::start();
    for (password, refusal) in [
        (Some("Wr0ng-Redis-Secret"), "authentication failed"),
        // No password at all: Redis refuses the pipelined XADD of an unauthenticated
        // client with a protocol error and closes the connection (the relay sees the
        // error or the broken pipe); the error used to count against each message.
        (None, "broker unavailable"),
    ] {
        let url = match password {
            Some(p) => server.url_with_password(p),
            None => server.url_with_password("").replace(":@", ""),
        };
        let metrics = free_addr();
        let mut relay = spawn_relay(
            db,
            &url,
            &[
                "--admin-addr",
                &metrics.to_string(),
                "--poll-interval",
                "100ms",
            ],
        );
        relay.wait_for_log(refusal, 3);
        let scraped = scrape(metrics);
        assert!(scraped.contains("outbox_relay"), "{scraped}");
        relay.signal("TERM");
        let status = relay.wait();
        let log = relay.log();
        assert!(status.success(), "exit {status}; log:\n{log}");
        if let Some(secret) = password {
            assert!(!log.contains(secret), "the password is in the log:\n{log}");
            assert!(
                !scraped.contains(secret),
                "the password is in a metric:\n{scraped}"
            );
            assert!(log.contains(":***@"), "the URL is logged redacted:\n{log}");
        }
        assert_eq!(
            snapshot(db),
            before,
            "an outage changed the outbox; log:\n{log}"
        );
    }
}

#[test]
fn postgres_relay_with_a_wrong_redis_password_spends_no_retries() {
    relay_with_a_wrong_redis_password(&TestDb::postgres());
}

#[test]
fn mariadb_relay_with_a_wrong_redis_password_spends_no_retries() {
    relay_with_a_wrong_redis_password(&TestDb::mysql());
}

/// A relay whose database and Redis URLs both carry their (right) passwords runs,
/// publishes, serves metrics and stops, at `RUST_LOG=debug`: neither password appears in
/// any log line or metric.
fn relay_never_shows_passwords(database_url: &str, db_password: &str) {
    let out = run(&["--database-url", database_url, "migrate"]);
    assert!(out.status.success(), "{}", printed(&out));
    assert!(!printed(&out).contains(db_password), "{}", printed(&out));
    let emit = |n: u32| {
        use outbox_diesel::Emit as _;
        let ping = fixtures::Ping { n };
        if database_url.starts_with("mysql") {
            let mut c = MysqlConnection::establish(database_url).unwrap();
            c.transaction(|c| c.emit(ping).map(drop)).unwrap();
        } else {
            let mut c = PgConnection::establish(database_url).unwrap();
            c.transaction(|c| c.emit(ping).map(drop)).unwrap();
        }
    };
    (1..=3).for_each(emit);
    let redis = PasswordRedis::start();
    let redis_url = redis.url_with_password(PasswordRedis::PASSWORD);
    let prefix = format!("{}:", unique("bad_input"));
    let metrics = free_addr();
    let mut relay = Background::spawn(
        &[
            "--database-url",
            database_url,
            "relay",
            "--redis-url",
            &redis_url,
            "--stream-prefix",
            &prefix,
            "--admin-addr",
            &metrics.to_string(),
        ],
        "debug",
    );
    let mut con = redis::Client::open(redis_url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    wait_until_within("three messages published", PATIENCE, || {
        assert!(
            relay.child.try_wait().unwrap().is_none(),
            "log:\n{}",
            relay.log()
        );
        let n: usize = redis::cmd("XLEN")
            .arg(format!("{prefix}cli.ping"))
            .query(&mut con)
            .unwrap();
        n == 3
    });
    let scraped = scrape(metrics);
    relay.signal("TERM");
    let status = relay.wait();
    let log = relay.log();
    assert!(status.success(), "exit {status}; log:\n{log}");
    assert_eq!(
        log.matches(":***@").count(),
        2,
        "both URLs logged, redacted:\n{log}"
    );
    for secret in [db_password, PasswordRedis::PASSWORD] {
        assert!(!log.contains(secret), "a password is in the log:\n{log}");
        assert!(
            !scraped.contains(secret),
            "a password is in a metric:\n{scraped}"
        );
    }
}

#[test]
fn postgres_relay_never_shows_passwords() {
    let server = ScratchPostgres::start();
    relay_never_shows_passwords(
        &server.url_with_password(ScratchPostgres::PASSWORD),
        ScratchPostgres::PASSWORD,
    );
}

#[test]
fn mariadb_relay_never_shows_passwords() {
    let user = MariadbUser::new("bad_input");
    relay_never_shows_passwords(
        &user.url_with_password(MariadbUser::PASSWORD),
        MariadbUser::PASSWORD,
    );
}

// ---- unreachable hosts ----

#[test]
fn unreachable_hosts_are_reported_without_the_password() {
    let secret = "Unreach4ble-Secret";
    // Port 1 of the loopback refuses at once; `.invalid` never resolves (RFC 2606).
    // A service that does not answer is one line saying which, where and why, and one
    // saying how to start it.
    let assert_two_lines = |out: &Output| {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 2, "{err}");
    };
    for (url, backend, needle, compose) in [
        (
            format!("postgres://u:{secret}@127.0.0.1:1/db"),
            "PostgreSQL",
            "Connection refused",
            "postgres",
        ),
        (
            format!("postgres://u:{secret}@db.invalid/db"),
            "PostgreSQL",
            "could not translate host name",
            "postgres",
        ),
        (
            format!("mysql://u:{secret}@127.0.0.1:1/db"),
            "MySQL",
            "Can't connect",
            "mariadb",
        ),
        (
            format!("mysql://u:{secret}@db.invalid/db"),
            "MySQL",
            "Unknown server host",
            "mariadb",
        ),
    ] {
        for args in database_commands(&url, &redis_url()) {
            let out = run(&args);
            assert_fails(
                &out,
                1,
                &[
                    &format!(
                        "error: {backend} is not reachable at {} (",
                        url.replace(secret, "***")
                    ),
                    needle,
                    &format!("`docker compose up -d {compose}` elsewhere) or fix --database-url"),
                ],
                Some(secret),
            );
            assert_two_lines(&out);
        }
    }
    for url in [
        format!("redis://:{secret}@127.0.0.1:1"),
        format!("redis://:{secret}@redis.invalid:6379"),
    ] {
        let out = run(&["trim", "--redis-url", &url]);
        assert_fails(
            &out,
            1,
            &[
                &format!(
                    "error: Redis is not reachable at {} (",
                    url.replace(secret, "***")
                ),
                "hint: start it (from the outbox repository: `bash scripts/services.sh` on Debian/Ubuntu",
                "`docker compose up -d redis` elsewhere) or fix --broker",
            ],
            Some(secret),
        );
        assert_two_lines(&out);
    }
    let sqlite = std::env::temp_dir().join(format!("{}.db", unique("missing")));
    let out = run(&["--database-url", sqlite.to_str().unwrap(), "status"]);
    assert_fails(
        &out,
        1,
        &["does not exist (`outbox migrate` creates it)"],
        None,
    );
    assert!(!sqlite.exists(), "status created the SQLite file");
}

/// The relay against an unreachable Redis keeps its rows NEW with no retry spent and
/// stops with 0 on SIGTERM.
#[test]
fn relay_with_an_unreachable_redis_spends_no_retries() {
    let db = TestDb::postgres();
    db.migrate();
    db.emit(1..=3);
    let before = snapshot(&db);
    let mut relay = spawn_relay(&db, "redis://:Unreach4ble-Secret@127.0.0.1:1", &[]);
    relay.wait_for_log("broker unavailable", 2);
    relay.signal("TERM");
    let status = relay.wait();
    let log = relay.log();
    assert!(status.success(), "exit {status}; log:\n{log}");
    assert!(!log.contains("Unreach4ble-Secret"), "{log}");
    assert_eq!(snapshot(&db), before);
}

// ---- missing tables, tables of a newer release ----

fn missing_tables_suggest_migrate<B: Backend>() {
    let db = &TestDb::new(B::ENGINE);
    // The database exists (SQLite: the file), the outbox tables do not.
    if db.kind == Engine::Sqlite {
        db.exec("CREATE TABLE unrelated (x INTEGER)");
    }
    for args in [
        vec!["status"],
        vec!["dead", "list"],
        vec!["dead", "show", "1"],
        vec!["purge", "sent", "--older-than", "1d"],
        vec!["purge", "consumed", "--older-than", "1d"],
        vec!["relay", "--redis-url", &redis_url()],
    ] {
        let mut full = vec!["--database-url", &db.url];
        full.extend(args);
        let out = run(&full);
        assert_fails(
            &out,
            1,
            &["hint: the outbox tables are missing: run `outbox migrate` first"],
            None,
        );
    }
    db.migrate();
    assert_eq!(db.status()["due"], 0);
}

/// Marks the tables as migrated by a newer release: version 2 recorded, one index gone.
fn newer_release(db: &TestDb) {
    match db.kind {
        Engine::Postgres => {
            db.exec("INSERT INTO outbox_migrations (version) VALUES (2); DROP INDEX outbox_sent;")
        }
        Engine::Mariadb => db.exec(
            "INSERT INTO outbox_migrations (version, applied_at) VALUES (2, UTC_TIMESTAMP(6)); \
             DROP INDEX outbox_sent ON outbox;",
        ),
        Engine::Sqlite => {
            db.exec("INSERT INTO outbox_migrations (version) VALUES (2); DROP INDEX outbox_sent;")
        }
    }
}

fn migrate_refuses_tables_of_a_newer_release<B: Backend>() {
    let db = &TestDb::new(B::ENGINE);
    db.migrate();
    db.emit(1..=2);
    newer_release(db);
    let before = snapshot(db);
    for args in [
        vec!["migrate"],
        vec!["relay", "--migrate", "--redis-url", &redis_url()],
    ] {
        let mut full = vec!["--database-url", &db.url];
        full.extend(args);
        let out = run(&full);
        assert_fails(
            &out,
            1,
            &[
                "the outbox tables are at migration version 2, newer than this release knows (1): \
               nothing was changed",
            ],
            None,
        );
    }
    assert_eq!(snapshot(db), before);
    let index_sql = match db.kind {
        Engine::Postgres => {
            "SELECT COUNT(*) AS n FROM pg_indexes WHERE indexname = 'outbox_sent' \
                           AND schemaname = current_schema()"
        }
        Engine::Mariadb => {
            "SELECT COUNT(*) AS n FROM information_schema.statistics \
                        WHERE table_schema = DATABASE() AND index_name = 'outbox_sent'"
        }
        Engine::Sqlite => "SELECT COUNT(*) AS n FROM sqlite_master WHERE name = 'outbox_sent'",
    };
    assert_eq!(
        db.scalar(index_sql),
        0,
        "migrate re-created a dropped index"
    );
}

outbox_tests::on_every_backend! {
    postgres => Postgres, mariadb => Mariadb, sqlite => Sqlite;
    missing_tables_suggest_migrate,
    migrate_refuses_tables_of_a_newer_release,
    sql_in_arguments_is_data,
    a_retention_beyond_any_timestamp_deletes_nothing,
}

// ---- SIGTERM during `outbox migrate` ----

/// Spawns `outbox migrate` with its stderr in a file.
fn spawn_migrate(db: &TestDb) -> Background {
    Background::spawn(&["--database-url", &db.url, "migrate"], "debug")
}

#[derive(QueryableByName)]
struct Pid {
    #[diesel(sql_type = Integer)]
    pid: i32,
}

/// PostgreSQL runs the migration as one transaction: a SIGTERM while it waits in the
/// middle (after `outbox`, at `consumed_msg`, which another session is creating) leaves
/// either every table or none, and `outbox migrate` then completes cleanly.
#[test]
fn postgres_sigterm_during_migrate_leaves_all_or_nothing() {
    let db = TestDb::postgres();
    let mut blocker = PgConnection::establish(&db.url).expect("PostgreSQL");
    let blocker_pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
        .get_result::<Pid>(&mut blocker)
        .unwrap()
        .pid;
    blocker
        .batch_execute("BEGIN; CREATE TABLE consumed_msg (x INT);")
        .unwrap();
    let mut admin = PgConnection::establish(&database_url()).expect("PostgreSQL");
    let mut migrate = spawn_migrate(&db);
    let blocked = format!(
        "SELECT pid FROM pg_stat_activity WHERE {blocker_pid} = ANY(pg_blocking_pids(pid))"
    );
    let mut waiting = Vec::new();
    wait_until_within(
        "the migration waits for the other session",
        PATIENCE,
        || {
            waiting = diesel::sql_query(&blocked).load::<Pid>(&mut admin).unwrap();
            !waiting.is_empty()
        },
    );
    assert!(
        migrate.log().is_empty() && migrate.child.try_wait().unwrap().is_none(),
        "migrate ended early: {}",
        migrate.log()
    );
    migrate.signal("TERM");
    let status = migrate.wait();
    assert_eq!(status.signal(), Some(15), "{status}: {}", migrate.log());
    blocker.batch_execute("ROLLBACK").unwrap();
    // The orphaned server session finishes or aborts the migration on its own.
    let backend = waiting[0].pid;
    wait_until_within("the killed migration's session ends", PATIENCE, || {
        diesel::sql_query(format!(
            "SELECT pid FROM pg_stat_activity WHERE pid = {backend}"
        ))
        .load::<Pid>(&mut admin)
        .unwrap()
        .is_empty()
    });
    let tables = |db: &TestDb| {
        db.scalar(
            "SELECT COUNT(*) AS n FROM pg_tables WHERE schemaname = current_schema() \
             AND tablename IN ('outbox', 'consumed_msg', 'outbox_relay_idle', 'outbox_migrations')",
        )
    };
    let after_kill = tables(&db);
    assert!(
        after_kill == 0 || after_kill == 4,
        "{after_kill} of 4 tables: a half-done migration"
    );
    db.migrate();
    assert_eq!(tables(&db), 4);
    assert_eq!(db.scalar("SELECT COUNT(*) AS n FROM outbox_migrations"), 1);
    db.emit([1]);
    assert_eq!(db.status()["due"], 1);
}

/// MariaDB commits each `CREATE TABLE` on its own, so a SIGTERM in the middle (after
/// `outbox`, waiting for `consumed_msg`, which another session has locked) leaves some
/// tables; `outbox migrate` run again completes them cleanly.
#[test]
fn mariadb_sigterm_during_migrate_can_be_rerun() {
    let db = TestDb::mysql();
    // consumed_msg is there from an earlier run; the session below holds it.
    db.migrate();
    db.exec("DROP TABLE outbox; DROP TABLE outbox_migrations;");
    let mut blocker = MysqlConnection::establish(&db.url).expect("MariaDB");
    blocker
        .batch_execute("LOCK TABLES consumed_msg WRITE")
        .unwrap();
    let mut migrate = spawn_migrate(&db);
    let database = db.url.rsplit('/').next().unwrap().to_owned();
    let mut admin = MysqlConnection::establish(&mysql_url()).expect("MariaDB");
    let waiting_sql = format!(
        "SELECT CAST(id AS SIGNED) AS n FROM information_schema.processlist \
         WHERE db = '{database}' AND state = 'Waiting for table metadata lock'"
    );
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let mut waiting = Vec::new();
    wait_until_within("the migration waits for the lock", PATIENCE, || {
        waiting = diesel::sql_query(&waiting_sql)
            .load::<N>(&mut admin)
            .unwrap();
        !waiting.is_empty()
    });
    migrate.signal("TERM");
    let status = migrate.wait();
    assert_eq!(status.signal(), Some(15), "{status}: {}", migrate.log());
    blocker.batch_execute("UNLOCK TABLES").unwrap();
    let thread = waiting[0].n;
    wait_until_within("the killed migration's session ends", PATIENCE, || {
        diesel::sql_query(format!(
            "SELECT CAST(id AS SIGNED) AS n FROM information_schema.processlist WHERE id = {thread}"
        ))
        .load::<N>(&mut admin)
        .unwrap()
        .is_empty()
    });
    db.migrate();
    assert_eq!(
        db.scalar(
            "SELECT COUNT(*) AS n FROM information_schema.tables WHERE table_schema = DATABASE() \
             AND table_name IN ('outbox', 'consumed_msg', 'outbox_migrations')"
        ),
        3
    );
    assert_eq!(db.scalar("SELECT COUNT(*) AS n FROM outbox_migrations"), 1);
    db.emit([1]);
    assert_eq!(db.status()["due"], 1);
}

// ---- hostile argument values ----

#[test]
fn out_of_range_numbers_and_negative_durations_are_usage_errors() {
    let db = TestDb::postgres();
    db.migrate();
    db.emit(1..=2);
    let before = snapshot(&db);
    let redis = redis_url();
    let relay = |extra: &[&'static str]| {
        let mut v = vec![
            "--database-url".to_owned(),
            db.url.clone(),
            "relay".to_owned(),
        ];
        v.extend(["--redis-url".to_owned(), redis.clone()]);
        v.extend(extra.iter().map(|s| (*s).to_owned()));
        v
    };
    let with_db = |args: &[&'static str]| {
        let mut v = vec!["--database-url".to_owned(), db.url.clone()];
        v.extend(args.iter().map(|s| (*s).to_owned()));
        v
    };
    for args in [
        relay(&["--batch-size", "99999999999999999999999"]),
        relay(&["--batch-size", "0"]),
        relay(&["--batch-size", "-1"]),
        relay(&["--max-attempts", "0"]),
        relay(&["--max-attempts", "4294967296"]),
        // A pool of four billion connections used to abort the process allocating it.
        relay(&["--pool-size", "4294967295"]),
        relay(&["--pool-size", "0"]),
        // MAXLEN 0 would trim every message away; it used to be reported as a bad URL.
        relay(&["--max-stream-len", "0"]),
        relay(&["--max-stream-len", "-5"]),
        // Above Redis's signed 64-bit MAXLEN every XADD failed, spending each message's
        // retries.
        relay(&["--max-stream-len", "9223372036854775808"]),
        relay(&["--poll-interval", "-1s"]),
        relay(&["--poll-interval", "1 fortnight"]),
        relay(&["--shutdown-timeout", "99999999999999999999999y"]),
        relay(&["--stall-timeout", "-30s"]),
        relay(&["--admin-addr", "999.1.1.1:99999"]),
        // The former name of --admin-addr, removed before 0.1.0.
        relay(&["--metrics-addr", "127.0.0.1:9464"]),
        relay(&["--order", "random"]),
        with_db(&["purge", "sent", "--older-than", "-7d"]),
        with_db(&["purge", "sent", "--older-than", "7d", "--batch-size", "0"]),
        with_db(&["purge", "consumed", "--older-than", ""]),
        with_db(&["dead", "list", "--limit", "0"]),
        with_db(&["dead", "list", "--after", "99999999999999999999"]),
        with_db(&["dead", "redrive"]),
        with_db(&["dead", "purge", "1", "--all"]),
    ] {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run(&refs);
        assert_fails(&out, 2, &["error: "], None);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            [
                "invalid value",
                "unexpected argument",
                "required",
                "cannot be used"
            ]
            .iter()
            .any(|usage| stderr.contains(usage)),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    assert_eq!(snapshot(&db), before);
    // Arguments that are not UTF-8.
    let mut args: Vec<OsString> = ["--database-url", &db.url, "relay", "--redis-url", &redis]
        .iter()
        .map(OsString::from)
        .collect();
    args.push("--stream-prefix".into());
    args.push(OsString::from_vec(b"outbox\xff:".to_vec()));
    let out = run_os(args);
    assert_fails(&out, 2, &["invalid UTF-8"], None);
    let out = run_os(vec![
        "--database-url".into(),
        OsString::from_vec(b"postgres://\xfe@h/db".to_vec()),
        "status".into(),
    ]);
    assert_fails(&out, 2, &["invalid UTF-8"], None);
    assert_eq!(snapshot(&db), before);
}

/// Values at the top of their range are accepted and harmless: the relay starts with
/// them, publishes, and stops with 0 on SIGTERM at once (no deadline overflows).
#[test]
fn extreme_but_valid_values_start_publish_and_stop() {
    let db = TestDb::postgres();
    db.migrate();
    db.emit(1..=3);
    let prefix = format!("{}:", unique("bad_input"));
    let mut relay = spawn_relay_with_prefix(
        &db,
        &redis_url(),
        &prefix,
        &[
            "--batch-size",
            "4294967295",
            "--max-attempts",
            "4294967295",
            "--poll-interval",
            "100000000y",
            "--shutdown-timeout",
            "100000000y",
            "--stall-timeout",
            "100000000y",
            "--max-stream-len",
            "9223372036854775807",
            "--pool-size",
            "64",
        ],
    );
    let stream = format!("{prefix}cli.ping");
    wait_until_within("the three messages published", PATIENCE, || {
        assert!(
            relay.child.try_wait().unwrap().is_none(),
            "the relay exited; log:\n{}",
            relay.log()
        );
        xlen(&stream) == 3
    });
    relay.signal("TERM");
    let status = relay.wait();
    assert!(status.success(), "exit {status}; log:\n{}", relay.log());
    assert_eq!(db.status()["due"], 0);
    del(&stream);
}

/// Operator arguments that look like SQL or Redis patterns are only data: the relay
/// publishes to a stream of that odd name, and lookups find nothing and touch nothing.
fn sql_in_arguments_is_data<B: Backend>() {
    let db = &TestDb::new(B::ENGINE);
    db.migrate();
    db.emit(1..=3);
    db.kill(&[2]);
    let before = snapshot(db);
    for target in [
        "' OR '1'='1",
        "1 OR 1=1",
        "2; DELETE FROM outbox",
        "x'); DROP TABLE outbox; --",
        "%",
        "*",
    ] {
        for cmd in [
            &["dead", "show"][..],
            &["dead", "redrive"],
            &["dead", "purge"],
        ] {
            let mut args = vec!["--database-url", &db.url];
            args.extend_from_slice(cmd);
            args.push(target);
            let out = run(&args);
            let stderr = String::from_utf8_lossy(&out.stderr);
            // `show` fails on a missing message; `redrive`/`purge` warn and change nothing.
            assert!(
                stderr.contains(&format!("no outbox message with id or msg_id `{target}`")),
                "{cmd:?} {target}: {stderr}"
            );
        }
    }
    assert_eq!(snapshot(db), before);
    let out = run(&["--database-url", &db.url, "dead", "list", "--json"]);
    assert!(out.status.success(), "{}", printed(&out));

    // A stream prefix with SQL and glob characters: published under exactly that name.
    let prefix = format!("{}'; DROP TABLE outbox; -- *?[", unique("x"));
    let stream = format!("{prefix}cli.ping");
    let mut relay = spawn_relay_with_prefix(db, &redis_url(), &prefix, &[]);
    wait_until_within("published under the odd prefix", PATIENCE, || {
        assert!(
            relay.child.try_wait().unwrap().is_none(),
            "log:\n{}",
            relay.log()
        );
        xlen(&stream) == 2
    });
    relay.signal("TERM");
    assert!(relay.wait().success(), "log:\n{}", relay.log());
    assert_eq!(db.status()["dead"], 1);
    let out = run(&[
        "trim",
        "--redis-url",
        &redis_url(),
        "--stream-prefix",
        &prefix,
    ]);
    assert!(out.status.success(), "{}", printed(&out));
    del(&stream);
}

/// `--older-than` far beyond any stored time deletes nothing, on every backend (on
/// PostgreSQL it used to fail with `timestamp out of range`).
fn a_retention_beyond_any_timestamp_deletes_nothing<B: Backend>() {
    let db = &TestDb::new(B::ENGINE);
    db.migrate();
    db.emit(1..=2);
    db.exec("UPDATE outbox SET status = 1");
    let before = snapshot(db);
    for (what, older_than) in [
        ("sent", "500000y"),
        ("sent", "100000000000y"),
        ("consumed", "500000y"),
        ("consumed", "100000000000y"),
    ] {
        let out = run(&[
            "--database-url",
            &db.url,
            "purge",
            what,
            "--older-than",
            older_than,
        ]);
        assert!(
            out.status.success(),
            "purge {what} --older-than {older_than}: {}",
            printed(&out)
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).starts_with("deleted 0 "),
            "{}",
            printed(&out)
        );
    }
    assert_eq!(snapshot(db), before);
}

// ---- helpers: subprocesses, Redis ----

fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], outbox_tests::ports::free_port()))
}

fn redis_conn() -> redis::Connection {
    redis::Client::open(redis_url())
        .unwrap()
        .get_connection()
        .expect("Redis at REDIS_URL")
}

fn xlen(stream: &str) -> usize {
    redis::cmd("XLEN")
        .arg(stream)
        .query(&mut redis_conn())
        .expect("XLEN")
}

fn del(key: &str) {
    let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(key).query(&mut redis_conn());
}

/// `outbox relay` at `RUST_LOG=debug` under a stream prefix of its own.
fn spawn_relay(db: &TestDb, redis: &str, extra: &[&str]) -> Background {
    spawn_relay_with_prefix(db, redis, &format!("{}:", unique("bad_input")), extra)
}

/// `outbox relay` at `RUST_LOG=debug` under `prefix`.
fn spawn_relay_with_prefix(db: &TestDb, redis: &str, prefix: &str, extra: &[&str]) -> Background {
    let mut args = vec!["--database-url", &db.url, "relay", "--redis-url", redis];
    args.extend(["--stream-prefix", prefix]);
    args.extend_from_slice(extra);
    Background::spawn(&args, "debug")
}
