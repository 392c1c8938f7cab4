//! The binlog relay over TLS, with the URL the application's emit uses (diesel's
//! `ssl_mode` and `ssl_ca`), against a private MariaDB serving a certificate of a
//! private CA (made here with `openssl`) to a user that must use TLS (`REQUIRE SSL`).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{TOPIC, fast, msg_id, publisher, wait_for_all};
use mysql_async::prelude::Queryable as _;
use outbox_cdc::mysql::{self as binlog, MysqlCdcRelay};
use outbox_cdc::{CdcConfig, CdcError};
use outbox_tests::ScratchMariadb;

/// A CA and a server certificate for 127.0.0.1 and localhost, in a directory of their own.
struct Certs {
    dir: PathBuf,
}

impl Certs {
    fn make() -> Self {
        let dir = std::env::temp_dir().join(outbox_tests::unique("mysql-tls"));
        std::fs::create_dir_all(&dir).expect("cert dir");
        std::fs::write(
            dir.join("ext.cnf"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n",
        )
        .expect("ext.cnf");
        for ca in ["ca", "other-ca"] {
            openssl(
                &dir,
                &format!(
                    "req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=outbox-test-{ca} -keyout {ca}.key -out {ca}.pem"
                ),
            );
        }
        openssl(
            &dir,
            "req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout server.key -out server.csr",
        );
        openssl(
            &dir,
            "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile ext.cnf -out server.pem",
        );
        Self { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn openssl(dir: &Path, args: &str) {
    let out = Command::new("openssl")
        .args(args.split(' '))
        .current_dir(dir)
        .output()
        .expect("openssl on the PATH");
    assert!(
        out.status.success(),
        "openssl {args}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_reads_the_binlog_over_tls_with_the_emit_s_url() {
    let certs = Certs::make();
    let tls = [
        format!("--ssl-ca={}", certs.path("ca.pem")),
        format!("--ssl-cert={}", certs.path("server.pem")),
        format!("--ssl-key={}", certs.path("server.key")),
    ];
    let settings: Vec<&str> = ScratchMariadb::BINLOG
        .iter()
        .copied()
        .chain(tls.iter().map(String::as_str))
        .collect();
    let server = ScratchMariadb::start_with(&settings);
    server.exec(outbox_diesel::MYSQL_MIGRATION.up);
    for host in ["localhost", "127.0.0.1"] {
        server.exec(&format!(
            "CREATE USER 'relay'@'{host}' REQUIRE SSL; GRANT ALL ON test.* TO 'relay'@'{host}'; \
             GRANT REPLICATION SLAVE, BINLOG MONITOR, PROCESS ON *.* TO 'relay'@'{host}'"
        ));
    }
    let base = format!("mysql://relay@127.0.0.1:{}/test", server.port());
    let url = |query: &str| format!("{base}?{query}");
    let verified = url(&format!(
        "ssl_mode=VERIFY_IDENTITY&ssl_ca={}",
        certs.path("ca.pem")
    ));

    // The session is TLS, and the server's certificate was checked against the CA.
    let mut conn = binlog::connect(&verified).await.expect("TLS session");
    let cipher: Option<(String, String)> = conn
        .query_first("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
        .await
        .expect("status");
    assert!(cipher.is_some_and(|(_, c)| !c.is_empty()), "not TLS");
    binlog::setup(&mut conn, &CdcConfig::default())
        .await
        .expect("setup over TLS");

    // What TLS refuses, or the server refuses without TLS, is an error, not a session.
    for (query, says) in [
        ("ssl_mode=DISABLED", "Access denied"),
        (
            &*format!("ssl_mode=VERIFY_CA&ssl_ca={}", certs.path("other-ca.pem")),
            "certificate",
        ),
    ] {
        let err = binlog::connect(&url(query)).await.unwrap_err();
        assert!(matches!(err, CdcError::Database(_)), "{query}: {err:?}");
        let chain = std::iter::successors(Some(&err as &dyn std::error::Error), |e| e.source())
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(": ");
        assert!(chain.contains(says), "{query}: {chain}");
    }

    // The relay reads the binlog (its dump session and its pool) over TLS.
    let ids: Vec<String> = (0..3).map(|n| msg_id("tls", n)).collect();
    for (n, id) in ids.iter().enumerate() {
        conn.exec_drop(
            "INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload, headers, \
             next_retry_at, created_at) VALUES (?, ?, 'Ping', 'tls', ?, '{}', \
             UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))",
            (id, TOPIC, format!("{{\"n\": {n}}}")),
        )
        .await
        .expect("insert");
    }
    let (p, stream) = publisher();
    let relay = MysqlCdcRelay::new(&verified, p)
        .expect("relay")
        .with_config(fast())
        .expect("config");
    let (stop, task) =
        outbox_tests::spawn_until(move |stop| async move { relay.run_until(stop).await });
    let got = tokio::task::spawn_blocking(move || wait_for_all(&stream, &ids))
        .await
        .expect("stream");
    assert_eq!(got.len(), 3, "{got:?}");
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("the relay stops")
        .expect("relay task")
        .expect("the relay ends cleanly");
}
