//! The `transfer` example as a newcomer runs it: on SQLite and the local Redis by default,
//! and, when a service is down, one error that names it, its address (password hidden)
//! and how to start it.

use std::process::{Command, Output};

fn transfer(args: &[&str], env: &[(&str, &str)]) -> Output {
    // Its own temporary directory: the example's SQLite file lives under TMPDIR.
    let tmp = std::env::temp_dir().join(format!("transfer-test-{}", fastrand::u64(..)));
    std::fs::create_dir_all(&tmp).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_transfer"))
        .args(args)
        .env("TMPDIR", &tmp)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(tmp);
    out
}

/// A local port nothing listens on.
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn runs_on_sqlite_and_redis_by_default() {
    let out = transfer(&[], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", stderr(&out));
    assert!(stdout.starts_with("SQLite "), "{stdout}");
    assert!(stdout.contains("status=SENT retries=2"), "{stdout}");
}

#[test]
fn an_unreachable_redis_is_named_with_its_address_and_how_to_start_it() {
    let port = closed_port();
    let out = transfer(
        &[],
        &[("REDIS_URL", &format!("redis://:hunter2@127.0.0.1:{port}"))],
    );
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.starts_with(&format!(
            "error: Redis is not reachable at redis://:***@127.0.0.1:{port} ("
        )),
        "{err}"
    );
    assert!(err.contains("bash scripts/services.sh"), "{err}");
    assert!(err.contains("docker compose up -d redis"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
    assert!(err.lines().count() <= 2, "{err}");
}

#[test]
fn an_unreachable_postgres_is_named_with_its_address_and_how_to_start_it() {
    let port = closed_port();
    let url = format!("postgres://postgres:hunter2@127.0.0.1:{port}/test");
    let out = transfer(&["--postgres"], &[("DATABASE_URL", &url)]);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.starts_with(&format!(
            "error: PostgreSQL is not reachable at postgres://postgres:***@127.0.0.1:{port}/test ("
        )),
        "{err}"
    );
    assert!(err.contains("docker compose up -d postgres"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
    assert!(err.lines().count() <= 2, "{err}");
}
