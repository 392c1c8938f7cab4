//! `outbox serve` in a real browser: headless Chromium (Debian's `chromium` and
//! `chromium-driver`) driven over WebDriver by fantoccini opens the dead-letter page,
//! redrives a dead letter of the outbox and one of a consumer, purges another of each
//! (clicking through the confirmation and typing the token), and the test checks the
//! database and the streams afterwards. A second run sees a dead letter that does not
//! decode, is refused its redrive and purges it, types a bad filter, and opens the page
//! by a rebound host name. A third logs in to a server on every address before it sees
//! any dead letter, and sees them at once on one started with `--public-reads`. With `OUTBOX_SCREENSHOTS=docs/serve` (a path
//! relative to the workspace) it saves PNG screenshots of the pages there.
#![cfg(feature = "serve")]

mod fixtures;
mod serve_support;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use fixtures::TestDb;
use outbox_tests::redis_url;
use serve_support::{Server, Streams, TOKEN};

/// A chromedriver on a free port; killed on drop.
struct Chromedriver {
    child: Child,
    url: String,
}

impl Chromedriver {
    fn start() -> Self {
        let port = outbox_tests::ports::free_port();
        let child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver is installed (Debian: apt-get install chromium chromium-driver)");
        outbox_tests::ports::wait_for_port(port, "chromedriver", Duration::from_secs(30));
        Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }
}

impl Drop for Chromedriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A headless Chromium session, with `extra` command-line arguments.
async fn browser(driver: &Chromedriver, extra: &[&str]) -> Client {
    // --no-sandbox: CI runs as root, where Chromium's sandbox cannot start.
    let mut args = vec![
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
    ];
    args.extend_from_slice(extra);
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({"binary": "/usr/bin/chromium", "args": args}),
    );
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .expect("a Chromium session")
}

/// Where to save screenshots, if anywhere.
fn screenshot_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("OUTBOX_SCREENSHOTS")?;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(dir);
    std::fs::create_dir_all(&dir).expect("screenshot directory");
    Some(dir)
}

async fn snap(client: &Client, name: &str) {
    if let Some(dir) = screenshot_dir() {
        let png = client.screenshot().await.expect("screenshot");
        std::fs::write(dir.join(format!("{name}.png")), png).expect("save screenshot");
    }
}

async fn text(client: &Client, css: &str) -> String {
    client
        .wait()
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no `{css}`: {e}"))
        .text()
        .await
        .expect("text")
}

/// Clicks `css`, waiting for it: a click before it may have started a navigation that
/// has not finished, and `find` does not wait (a confirmation page not yet loaded failed
/// CI with `NoSuchElement`).
async fn click(client: &Client, css: &str) {
    client
        .wait()
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no `{css}`: {e}"))
        .click()
        .await
        .unwrap_or_else(|e| panic!("click `{css}`: {e}"));
}

/// Types `keys` into the field `css`, once it is there (after a navigation).
async fn type_into(client: &Client, css: &str, keys: &str) {
    client
        .wait()
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no `{css}`: {e}"))
        .send_keys(keys)
        .await
        .unwrap_or_else(|e| panic!("type into `{css}`: {e}"));
}

/// On the login form the server answers with: types `token` and logs in.
async fn log_in(client: &Client, token: &str) {
    type_into(client, "#login-token", token).await;
    click(client, "#login-button").await;
}

/// On the confirmation page: checks what it lists, types the token and confirms.
async fn confirm(client: &Client, items: &[&str]) -> String {
    let listed = text(client, "#confirm-items").await;
    for item in items {
        assert!(
            listed.contains(item),
            "{item} not in the confirmation: {listed}"
        );
    }
    type_into(client, "#token", TOKEN).await;
    click(client, "#confirm-button").await;
    text(client, "#done").await
}

/// Messages published over the last minutes, for the chart.
fn published_recently(db: &TestDb) {
    db.emit(100..=160);
    db.exec(
        "UPDATE outbox SET status = 1, \
         sent_at = now() - (id % 12) * interval '55 seconds', \
         created_at = now() - (id % 12) * interval '55 seconds' - (id % 4 + 1) * interval '40 milliseconds' \
         WHERE msg_id LIKE '1__:Ping'",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redrive_and_purge_in_a_browser() {
    let db = TestDb::postgres();
    db.migrate();
    db.emit(1..=3);
    db.kill(&[1, 2]);
    published_recently(&db);
    let streams = Streams::new(&redis_url());
    let server = Server::start(
        &db.url,
        &[
            "--redis-url",
            &redis_url(),
            "--stream-prefix",
            &streams.prefix,
            "--token",
            TOKEN,
        ],
    );
    let dead = server.json("/api/dead");
    let consumer_item = |msg_id: &str| {
        dead["consumers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["msg_id"] == msg_id)
            .and_then(|d| d["item"].as_str())
            .unwrap_or_else(|| panic!("no consumer dead letter {msg_id}: {dead}"))
            .to_owned()
    };
    let (nine, eight) = (consumer_item("9:Ping"), consumer_item("8:Ping"));
    let (one, two) = (
        format!("outbox:{}", db.id_of(1)),
        format!("outbox:{}", db.id_of(2)),
    );

    let driver = Chromedriver::start();
    let client = browser(&driver, &[]).await;
    let base = &server.base;

    client.goto(&format!("{base}/")).await.expect("overview");
    log_in(&client, TOKEN).await;
    assert!(text(&client, "#dead").await.contains('2'));
    snap(&client, "overview").await;

    // Redrive 1:Ping and the consumer's 9:Ping, selected on the list.
    client
        .goto(&format!("{base}/dead"))
        .await
        .expect("dead letters");
    snap(&client, "dead-letters").await;
    click(&client, &format!("input[value=\"{one}\"]")).await;
    click(&client, &format!("input[value=\"{nine}\"]")).await;
    click(&client, "#redrive-selected").await;
    snap(&client, "confirm").await;
    let done = confirm(&client, &[&one, &nine]).await;
    assert!(
        done.contains("Re-drove 1 outbox message(s) and 1 consumer dead letter(s)"),
        "{done}"
    );

    // Purge 2:Ping from the list, and the consumer's 8:Ping from its detail page.
    client
        .goto(&format!("{base}/dead"))
        .await
        .expect("dead letters");
    click(&client, &format!("input[value=\"{two}\"]")).await;
    click(&client, "#purge-selected").await;
    let done = confirm(&client, &[&two]).await;
    assert!(done.contains("Purged 1 outbox message(s)"), "{done}");
    let detail = format!(
        "{base}/dead/show?item={}",
        form_urlencoded::byte_serialize(eight.as_bytes()).collect::<String>()
    );
    client.goto(&detail).await.expect("detail");
    assert!(text(&client, "#payload").await.contains("\"n\": 8"));
    snap(&client, "dead-letter").await;
    click(&client, "button[value=\"purge\"]").await;
    let done = confirm(&client, &[&eight]).await;
    assert!(done.contains("and 1 consumer dead letter(s)"), "{done}");

    client
        .goto(&format!("{base}/groups"))
        .await
        .expect("groups");
    assert!(text(&client, "#groups").await.contains("billing"));
    snap(&client, "groups").await;
    client.close().await.expect("close the browser");

    // The database and the streams.
    assert_eq!(
        db.json(&["dead", "show", "1:Ping", "--json"])["status"],
        "NEW"
    );
    db.outbox()
        .args(["dead", "show", "2:Ping"])
        .assert()
        .failure();
    assert_eq!(db.status()["dead"], 0);
    assert_eq!(streams.msg_ids(&streams.stream), ["7:Ping", "9:Ping"]);
    assert!(streams.msg_ids(&streams.dead).is_empty());
}

/// A dead letter that does not decode (`acc <b>bad</b> id`, written around the library
/// and dead-lettered as the relay does) is listed and shown as stored, escaped, with the
/// reason; its redrive is refused with the reason, its purge goes through. A bad filter
/// is a clear error, and a host name rebound to 127.0.0.1 (DNS rebinding, here by
/// Chromium's resolver rules) gets no page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_dead_letter_bad_input_and_a_rebound_host_in_a_browser() {
    let db = TestDb::postgres();
    db.migrate();
    db.emit(1..=2);
    db.kill(&[2]);
    let bad = db.forge_dead("acc <b>bad</b> id", "cli.ping", "{}");
    let server = Server::start(&db.url, &["--token", TOKEN]);
    let item = format!("outbox:{bad}");
    let port = server.base.rsplit(':').next().unwrap().to_owned();

    let driver = Chromedriver::start();
    let client = browser(
        &driver,
        &["--host-resolver-rules=MAP rebind.example 127.0.0.1"],
    )
    .await;
    let base = &server.base;
    client
        .goto(&format!("{base}/dead"))
        .await
        .expect("dead letters");
    log_in(&client, TOKEN).await;
    let row = text(&client, "tr.unreadable").await;
    assert!(
        row.contains("acc <b>bad</b> id")
            && row.contains("unreadable: msg_id \"acc <b>bad</b> id\" contains whitespace"),
        "{row}"
    );
    assert!(text(&client, "#outbox-dead").await.contains("2:Ping"));
    snap(&client, "dead-letters-unreadable").await;

    // Its detail, then a redrive: refused with the reason, nothing changes.
    click(
        &client,
        &format!("a[href=\"/dead/show?item=outbox%3A{bad}\"]"),
    )
    .await;
    let why = text(&client, "#unreadable").await;
    assert!(
        why.contains("Unreadable: msg_id") && why.contains("Fix the row"),
        "{why}"
    );
    click(&client, "button[value=\"redrive\"]").await;
    type_into(&client, "#token", TOKEN).await;
    click(&client, "#confirm-button").await;
    let refused = text(&client, "#error").await;
    assert!(
        refused.contains(&format!("outbox row {bad} cannot be re-driven"))
            && refused.contains("fix the row or purge it"),
        "{refused}"
    );
    assert_eq!(db.status()["dead"], 2);

    // Purged from the list.
    client
        .goto(&format!("{base}/dead"))
        .await
        .expect("dead letters");
    click(&client, &format!("input[value=\"{item}\"]")).await;
    click(&client, "#purge-selected").await;
    let done = confirm(&client, &[&item]).await;
    assert!(done.contains("Purged 1 outbox message(s)"), "{done}");
    assert_eq!(db.status()["dead"], 1);

    // A filter that is no duration: the page says why.
    client
        .goto(&format!("{base}/dead"))
        .await
        .expect("dead letters");
    type_into(&client, "input[name=\"older_than\"]", "banana").await;
    click(&client, "form.filters button").await;
    assert!(
        text(&client, "#error")
            .await
            .contains("older_than `banana`")
    );

    // The same server by a rebound name: refused; by localhost (a site of its own, so
    // a login of its own): served.
    client
        .goto(&format!("http://rebind.example:{port}/dead"))
        .await
        .expect("rebound page");
    let body = text(&client, "body").await;
    assert!(
        body.contains("does not serve host `rebind.example"),
        "{body}"
    );
    assert!(!body.contains("2:Ping"), "{body}");
    client
        .goto(&format!("http://localhost:{port}/dead"))
        .await
        .expect("localhost page");
    log_in(&client, TOKEN).await;
    assert!(text(&client, "#outbox-dead").await.contains("2:Ping"));
    client.close().await.expect("close the browser");
}

/// A server on every address with a token shows no dead letter before a login: the
/// login form, a wrong token refused, then the token and the page asked for with the
/// dead letters of the outbox and of a consumer, and their details (the session cookie
/// holds across pages). The same with `--public-reads`: the dead letters at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_off_loopback_need_a_login_unless_public_in_a_browser() {
    let db = TestDb::postgres();
    db.migrate();
    db.emit(1..=2);
    db.kill(&[1]);
    let redis = redis_url();
    let streams = Streams::new(&redis);
    let serve = |extra: &[&str]| {
        let mut args = vec![
            "--redis-url",
            &redis,
            "--stream-prefix",
            &streams.prefix,
            "--token",
            TOKEN,
        ];
        args.extend_from_slice(extra);
        Server::start_on("0.0.0.0", &db.url, &args)
    };
    let guarded = serve(&[]);
    let driver = Chromedriver::start();
    let client = browser(&driver, &[]).await;

    let asked = format!("{}/dead?type=Ping", guarded.base);
    client.goto(&asked).await.expect("dead letters");
    let body = text(&client, "body").await;
    assert!(
        body.contains("Log in") && !body.contains("1:Ping"),
        "{body}"
    );
    snap(&client, "login").await;
    log_in(&client, "wrong").await;
    let refused = text(&client, "#refused").await;
    assert!(refused.contains("wrong token"), "{refused}");
    assert!(!text(&client, "body").await.contains("1:Ping"));
    log_in(&client, TOKEN).await;
    assert!(text(&client, "#outbox-dead").await.contains("1:Ping"));
    assert!(text(&client, "#consumer-dead").await.contains("9:Ping"));
    assert_eq!(client.current_url().await.unwrap().as_str(), asked);
    click(&client, "#consumer-dead a").await;
    assert!(text(&client, "#payload").await.contains("\"n\": 9"));

    let public = serve(&["--public-reads"]);
    client
        .delete_all_cookies()
        .await
        .expect("forget the session");
    client
        .goto(&format!("{}/dead", public.base))
        .await
        .expect("dead letters");
    assert!(text(&client, "#outbox-dead").await.contains("1:Ping"));
    assert!(text(&client, "#consumer-dead").await.contains("9:Ping"));
    assert!(client.find(Locator::Css("#login")).await.is_err());
    client.close().await.expect("close the browser");
}
