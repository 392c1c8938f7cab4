//! The HTML pages, rendered on the server with maud (which escapes every value), usable
//! without JavaScript: filters and selections are plain forms, the chart an inline SVG.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Query, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use maud::{DOCTYPE, Markup, PreEscaped, html};

use super::App;
use super::api::ItemQuery;
use super::data::{self, Action, ConsumerDead, Failure, Filter, Item, Minute, OutboxDead};

const STYLE: &str = "
body{font-family:system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
nav{background:#24292f;padding:.6em 1em}nav a{color:#fff;margin-right:1.5em;text-decoration:none}
main{padding:1em 1.5em;max-width:1200px}
table{border-collapse:collapse;margin:.5em 0 1.5em;background:#fff}
th,td{border:1px solid #ddd;padding:.3em .6em;text-align:left;vertical-align:top;font-size:.92em}
th{background:#f0f0f0}.num{text-align:right}
pre{background:#fff;border:1px solid #ddd;padding:.6em;overflow:auto;max-width:100%}
.err{color:#a00}.ok{color:#060}.muted{color:#777}
.cards{display:flex;gap:1em;flex-wrap:wrap}.card{background:#fff;border:1px solid #ddd;padding:.8em 1.2em}
.card b{display:block;font-size:1.6em}
form.filters input{width:10em}button{margin-right:.5em}
";

fn layout(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { (title) " · outbox" }
                style { (PreEscaped(STYLE)) }
            }
            body {
                nav {
                    a href="/" { "Overview" }
                    a href="/dead" { "Dead letters" }
                    a href="/groups" { "Consumer groups" }
                }
                main {
                    h1 { (title) }
                    (body)
                }
            }
        }
    }
}

/// A page of the layout with this status.
pub(super) fn page(status: StatusCode, title: &str, body: Markup) -> Response {
    (status, Html(layout(title, body).into_string())).into_response()
}

fn failure_page(f: &Failure) -> Response {
    page(f.status, "Error", html! { p.err #error { (f.message) } })
}

fn seconds(s: f64) -> String {
    if s < 60.0 {
        format!("{s:.1} s")
    } else if s < 3600.0 {
        format!("{:.1} min", s / 60.0)
    } else if s < 86_400.0 {
        format!("{:.1} h", s / 3600.0)
    } else {
        format!("{:.1} d", s / 86_400.0)
    }
}

/// `GET /`.
pub(super) async fn overview(State(app): State<Arc<App>>) -> Response {
    let reads_need_token = app.auth.reads_need_token();
    let read = tokio::task::spawn_blocking(move || data::overview(&app)).await;
    let o = match read
        .map_err(|e| Failure::server(e.to_string()))
        .and_then(|r| r)
    {
        Ok(o) => o,
        Err(f) => return failure_page(&f),
    };
    let body = html! {
        p.muted {
            "Database " code { (o.database) }
            @if let Some(broker) = &o.redis { " · broker " code { (broker) } }
        }
        @if let Some(cdc) = &o.cdc {
            (cdc_cards(cdc, o.dead))
        } @else {
            div.cards {
                div.card { b #due { (o.due) } "due messages" }
                div.card { b #oldest { (o.oldest_due_age_seconds.map_or("–".to_owned(), seconds)) } "oldest due" }
                div.card { b #dead { (o.dead) } "dead letters" }
            }
        }
        h2 { "Published, last " (data::CHART_MINUTES) " minutes" }
        (chart(&o.published))
        h2 { "Per topic" }
        @if o.topics.is_empty() {
            p.muted { "No NEW or DEAD messages." }
        } @else {
            table #topics {
                tr { th { "topic" } th.num { "NEW" } th.num { "DEAD" } }
                @for t in &o.topics {
                    tr {
                        td { (t.topic) }
                        td.num { (t.new) }
                        td.num {
                            @if t.dead > 0 {
                                a href={ "/dead?topic=" (urlencode(&t.topic)) } { (t.dead) }
                            } @else { "0" }
                        }
                    }
                }
            }
        }
        h2 { "Relays" }
        p.muted { (o.relays.note) }
        @if o.relays.tracked {
            @if o.relays.seen.is_empty() { p { "None seen." } }
            ul { @for r in &o.relays.seen { li { (r) } } }
        }
        @if reads_need_token {
            form #logout method="post" action="/logout" { button type="submit" { "Log out" } }
        }
    };
    page(StatusCode::OK, "Overview", body)
}

/// CDC mode's cards: the slot's lag and oldest unconfirmed commit in place of the due
/// messages (the CDC relay leaves its rows NEW), and a lost slot with its recovery.
fn cdc_cards(cdc: &crate::cdc::CdcStatus, dead: u64) -> Markup {
    html! {
        p.muted {
            @if cdc.database == "mariadb" {
                "CDC relay on the binlog, lock " code { (cdc.slot) } " · "
                @match cdc.holder_pid {
                    Some(id) => { "held by connection " (id) }
                    None => { "no relay reading the binlog now" }
                }
            } @else {
                "CDC relay, slot " code { (cdc.slot) } " · "
                @match cdc.holder_pid {
                    Some(pid) => { "read by walsender " (pid) }
                    None => { "no relay reading it now" }
                }
            }
            " · NEW counts below include published messages (their rows stay NEW)"
        }
        @if let Some(hint) = cdc.hint { p.err #cdc-lost { (hint) } }
        div.cards {
            @if let Some(n) = cdc.lag_transactions {
                div.card { b #lag { (n) } "transactions behind" }
            } @else {
                div.card { b #lag { (cdc.lag_bytes.map_or("–".to_owned(), crate::cdc::bytes)) } "slot lag" }
            }
            div.card { b #oldest { (cdc.oldest_unconfirmed_age_seconds.map_or("–".to_owned(), seconds)) } "oldest unconfirmed" }
            div.card { b #parked { (cdc.parked) } "parked for retry" }
            div.card { b #dead { (dead) } "dead letters" }
        }
    }
}

/// Bars of messages per second and a line of the mean latency, per minute.
fn chart(minutes: &[Minute]) -> Markup {
    const W: f64 = 600.0;
    const H: f64 = 160.0;
    let n = minutes.len().max(1) as f64;
    let bar = W / n;
    let max_rate = minutes
        .iter()
        .map(|m| m.per_second)
        .fold(0.0, f64::max)
        .max(0.001);
    let max_latency = minutes
        .iter()
        .filter_map(|m| m.avg_latency_seconds)
        .fold(0.0, f64::max)
        .max(0.001);
    let mut line = String::new();
    for (i, m) in minutes.iter().enumerate() {
        if let Some(l) = m.avg_latency_seconds {
            let x = bar * (i as f64 + 0.5);
            let y = H - l / max_latency * (H - 10.0);
            let _ = write!(line, "{x:.1},{y:.1} ");
        }
    }
    html! {
        svg #chart width=(W) height=(H + 20.0) viewBox={ "0 0 " (W) " " (H + 20.0) }
            xmlns="http://www.w3.org/2000/svg" role="img"
            aria-label="published per second and commit to publish latency per minute" {
            rect x="0" y="0" width=(W) height=(H) fill="#fff" stroke="#ddd" {}
            @for (i, m) in minutes.iter().enumerate() {
                @let h = m.per_second / max_rate * (H - 10.0);
                rect x=(format!("{:.1}", bar * i as f64 + 2.0)) y=(format!("{:.1}", H - h))
                    width=(format!("{:.1}", bar - 4.0)) height=(format!("{h:.1}")) fill="#4a90d9" {
                    title { (m.minutes_ago) " min ago: " (m.published) " published, "
                        (format!("{:.2}", m.per_second)) "/s"
                        @if let Some(l) = m.avg_latency_seconds { ", latency " (seconds(l)) } }
                }
            }
            @if !line.is_empty() {
                polyline points=(line.trim_end()) fill="none" stroke="#d9534f" stroke-width="2" {}
            }
            text x="4" y=(H + 15.0) font-size="11" fill="#4a90d9" {
                "bars: published/s (max " (format!("{max_rate:.2}")) ")"
            }
            text x=(W / 2.0) y=(H + 15.0) font-size="11" fill="#d9534f" {
                "line: commit→publish latency (max " (seconds(max_latency)) ")"
            }
        }
    }
}

/// The query string's key/value pairs, repeated keys kept.
fn pairs(text: &[u8]) -> Vec<(String, String)> {
    form_urlencoded::parse(text).into_owned().collect()
}

fn urlencode(text: &str) -> String {
    form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

/// The filter's query string with another page.
fn page_link(filter: &Filter, page: usize) -> String {
    let mut q = form_urlencoded::Serializer::new(String::new());
    q.append_pair("topic", &filter.topic)
        .append_pair("type", &filter.event_type)
        .append_pair("error", &filter.error)
        .append_pair("older_than", &filter.older_than)
        .append_pair("page", &page.to_string());
    if let Some(per) = filter.per_page {
        q.append_pair("per_page", &per.to_string());
    }
    format!("/dead?{}", q.finish())
}

/// `GET /dead`.
pub(super) async fn dead_letters(
    State(app): State<Arc<App>>,
    Query(filter): Query<Filter>,
) -> Response {
    let dead = match data::dead_page(&app, &filter).await {
        Ok(d) => d,
        Err(f) => return failure_page(&f),
    };
    let per = filter.per_page();
    let more = (filter.page + 1) * per < dead.outbox_total.max(dead.consumers_total);
    let body = html! {
        form.filters method="get" action="/dead" {
            "topic " input name="topic" value=(filter.topic);
            " type " input name="type" value=(filter.event_type);
            " error contains " input name="error" value=(filter.error);
            " older than " input name="older_than" placeholder="e.g. 1h" value=(filter.older_than);
            " " button type="submit" { "Filter" }
            a href="/dead" { "clear" }
        }
        @if dead.truncated { p.err { "Only the newest dead letters of each source were read." } }
        form #selection method="get" action="/dead/confirm" {
            h2 { "Outbox (" (dead.outbox_total) ")" }
            @if dead.outbox.is_empty() { p.muted { "None." } } @else { (outbox_table(&dead.outbox)) }
            h2 { "Consumers (" (dead.consumers_total) ")" }
            @if !dead.redis {
                p.muted { "Not read: start with --broker to see the consumers' dead-letter streams." }
            } @else if let Some(error) = &dead.redis_error {
                p.err #redis-error { "Cannot read them from " (dead.broker.unwrap_or("the broker")) ": " (error) }
            } @else if dead.consumers.is_empty() {
                p.muted { "None." }
            } @else {
                (consumer_table(&dead.consumers))
            }
            p {
                button #redrive-selected type="submit" name="action" value="redrive" { "Redrive selected…" }
                button #purge-selected type="submit" name="action" value="purge" { "Purge selected…" }
            }
        }
        p {
            @if filter.page > 0 { a href=(page_link(&filter, filter.page - 1)) { "← newer" } " " }
            "page " (filter.page + 1)
            @if more { " " a href=(page_link(&filter, filter.page + 1)) { "older →" } }
        }
    };
    page(StatusCode::OK, "Dead letters", body)
}

fn outbox_table(rows: &[OutboxDead]) -> Markup {
    html! {
        table #outbox-dead {
            tr { th {} th { "id" } th { "msg_id" } th { "topic" } th { "type" } th.num { "attempts" } th { "age" } th { "last error" } }
            @for d in rows {
                @let r = &d.record;
                @let unreadable = r["unreadable"].as_str();
                tr class=[unreadable.map(|_| "unreadable")] {
                    td { input type="checkbox" name="item" value=(d.item); }
                    td { a href={ "/dead/show?item=" (urlencode(&d.item)) } { (r["id"]) } }
                    td { (r["msg_id"].as_str().unwrap_or_default()) }
                    td { (r["topic"].as_str().unwrap_or_default()) }
                    td { (r["event_type"].as_str().unwrap_or_default()) }
                    td.num { (r["retries"]) }
                    td { (seconds(d.age_seconds)) }
                    @if let Some(reason) = unreadable {
                        td.err { b { "unreadable: " } (reason) }
                    } @else {
                        td.err { (r["last_error"].as_str().unwrap_or_default()) }
                    }
                }
            }
        }
    }
}

fn consumer_table(rows: &[ConsumerDead]) -> Markup {
    html! {
        table #consumer-dead {
            tr { th {} th { "id" } th { "stream" } th { "group" } th { "msg_id" } th { "type" } th.num { "deliveries" } th { "age" } th { "reason" } }
            @for d in rows {
                tr {
                    td { input type="checkbox" name="item" value=(d.item); }
                    td { a href={ "/dead/show?item=" (urlencode(&d.item)) } { (d.id) } }
                    td { (d.stream) }
                    td { (d.group) }
                    td { (d.msg_id) }
                    td { (d.event_type) }
                    td.num { (d.delivery_count.map_or("?".to_owned(), |n| n.to_string())) }
                    td { (seconds(d.age_seconds)) }
                    td.err { (d.reason) }
                }
            }
        }
    }
}

fn pretty(text: &str) -> String {
    serde_json::from_str::<serde_json::Value>(text)
        .and_then(|v| serde_json::to_string_pretty(&v))
        .unwrap_or_else(|_| text.to_owned())
}

/// `GET /dead/show?item=…`.
pub(super) async fn dead_letter(
    State(app): State<Arc<App>>,
    Query(q): Query<ItemQuery>,
) -> Response {
    let item = match app.item(&q.item) {
        Ok(i) => i,
        Err(f) => return page(f.status, "Dead letter", html! { p.err { (f.message) } }),
    };
    let detail = match item {
        Item::Outbox(id) => {
            let app = app.clone();
            let read = tokio::task::spawn_blocking(move || data::outbox_row(&app, id)).await;
            match read
                .map_err(|e| Failure::server(e.to_string()))
                .and_then(|r| r)
            {
                Ok(found) => found.map(|r| outbox_detail(&data::outbox_item(&r))),
                Err(f) => return failure_page(&f),
            }
        }
        Item::Consumer { dead_stream, id } => {
            match data::consumer_entry(&app, &dead_stream, &id).await {
                Ok(found) => found.map(|d| consumer_detail(&d)),
                Err(f) => return failure_page(&f),
            }
        }
    };
    let Some(detail) = detail else {
        return page(
            StatusCode::NOT_FOUND,
            "Dead letter",
            html! { p { "No such dead letter (redriven or purged already?)." } },
        );
    };
    let body = html! {
        (detail)
        form method="get" action="/dead/confirm" {
            input type="hidden" name="item" value=(q.item);
            button type="submit" name="action" value="redrive" { "Redrive…" }
            button type="submit" name="action" value="purge" { "Purge…" }
        }
    };
    page(StatusCode::OK, "Dead letter", body)
}

fn outbox_detail(d: &OutboxDead) -> Markup {
    let r = &d.record;
    let payload = serde_json::to_string_pretty(&r["payload"]).unwrap_or_default();
    let headers = serde_json::to_string_pretty(&r["headers"]).unwrap_or_default();
    html! {
        @if let Some(reason) = r["unreadable"].as_str() {
            p.err #unreadable {
                b { "Unreadable: " } (reason)
                br;
                "Its fields are shown as stored. Fix the row before a redrive (the relay would \
                 dead-letter it again), or purge it."
            }
        }
        table #detail {
            tr { th { "source" } td { "outbox row " (r["id"]) } }
            tr { th { "status" } td { (r["status"].as_str().unwrap_or_default()) } }
            tr { th { "msg_id" } td { (r["msg_id"].as_str().unwrap_or_default()) } }
            tr { th { "topic" } td { (r["topic"].as_str().unwrap_or_default()) } }
            tr { th { "type" } td { (r["event_type"].as_str().unwrap_or_default()) " (schema version " (r["schema_version"]) ")" } }
            tr { th { "key" } td { (r["key"].as_str().unwrap_or_default()) } }
            tr { th { "attempts" } td { (r["retries"]) } }
            tr { th { "created" } td { (r["created_at"].as_str().unwrap_or_default()) " (" (seconds(d.age_seconds)) " ago)" } }
            tr { th { "last error" } td.err { (r["last_error"].as_str().unwrap_or_default()) } }
        }
        h2 { "Headers" } pre #headers { (headers) }
        h2 { "Payload" } pre #payload { (payload) }
    }
}

fn consumer_detail(d: &ConsumerDead) -> Markup {
    let field = |name: &str| d.fields.get(name).cloned().unwrap_or_default();
    html! {
        table #detail {
            tr { th { "source" } td { "dead-letter stream " code { (d.dead_stream) } ", entry " (d.id) } }
            tr { th { "stream" } td { (d.stream) " (entry " (d.entry_id) ")" } }
            tr { th { "group" } td { (d.group) } }
            tr { th { "msg_id" } td { (d.msg_id) } }
            tr { th { "topic" } td { (d.topic) } }
            tr { th { "type" } td { (d.event_type) " (schema version " (field("version")) ")" } }
            tr { th { "key" } td { (field("key")) } }
            tr { th { "deliveries" } td { (d.delivery_count.map_or("?".to_owned(), |n| n.to_string())) } }
            tr { th { "dead-lettered" } td { (seconds(d.age_seconds)) " ago" } }
            tr { th { "reason" } td.err { (d.reason) } }
        }
        h2 { "Headers" } pre #headers { (pretty(&field("headers"))) }
        h2 { "Payload" } pre #payload { (pretty(&field("payload"))) }
    }
}

/// The action and the items of a selection form.
fn selection(pairs: &[(String, String)]) -> (Option<Action>, Vec<String>) {
    let action = pairs
        .iter()
        .find(|(k, _)| k == "action")
        .and_then(|(_, v)| match v.as_str() {
            "redrive" => Some(Action::Redrive),
            "purge" => Some(Action::Purge),
            _ => None,
        });
    let items = pairs
        .iter()
        .filter(|(k, _)| k == "item")
        .map(|(_, v)| v.clone())
        .collect();
    (action, items)
}

/// `GET /dead/confirm?action=…&item=…`: what will happen, and the form that does it.
pub(super) async fn confirm(State(app): State<Arc<App>>, RawQuery(query): RawQuery) -> Response {
    let pairs = pairs(query.unwrap_or_default().as_bytes());
    let (action, items) = selection(&pairs);
    let Some(action) = action else {
        return page(
            StatusCode::BAD_REQUEST,
            "Confirm",
            html! { p.err { "Choose redrive or purge." } },
        );
    };
    if let Err(f) = items.iter().try_for_each(|i| Item::parse(i).map(drop)) {
        return page(
            StatusCode::BAD_REQUEST,
            "Confirm",
            html! { p.err { (f.message) } },
        );
    }
    let what = match action {
        Action::Redrive => {
            "Redrive: outbox rows go back to NEW (retries reset, due now); consumer dead letters go back on their stream for the group that gave up on them alone (the stream's other groups acknowledge them without applying them)."
        }
        Action::Purge => "Purge: these dead letters are deleted for good.",
    };
    let body = html! {
        @if items.is_empty() {
            p { "Nothing selected. " a href="/dead" { "Back" } }
        } @else {
            p { (what) }
            ul #confirm-items { @for i in &items { li { code { (i) } } } }
            @if !app.auth.has_token() {
                p.err { "This server is read-only: it was started without --token." }
            }
            form #confirm method="post" action={ "/dead/" (action.name()) } {
                @for i in &items { input type="hidden" name="item" value=(i); }
                input type="hidden" name="csrf" value=(app.auth.csrf());
                label { "Token " input #token type="password" name="token" autocomplete="off" required; }
                " "
                button #confirm-button type="submit" { (action.name()) " " (items.len()) " dead letter(s)" }
                a href="/dead" { "Cancel" }
            }
        }
    };
    page(StatusCode::OK, "Confirm", body)
}

/// `POST /dead/redrive`.
pub(super) async fn redrive(State(app): State<Arc<App>>, body: Bytes) -> Response {
    act(app, Action::Redrive, &body).await
}

/// `POST /dead/purge`.
pub(super) async fn purge(State(app): State<Arc<App>>, body: Bytes) -> Response {
    act(app, Action::Purge, &body).await
}

async fn act(app: Arc<App>, action: Action, body: &[u8]) -> Response {
    let pairs = pairs(body);
    let value = |name: &str| {
        pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .unwrap_or_default()
    };
    if let Err(denied) = app.auth.check_form(value("csrf"), value("token")) {
        let denied = app.auth.refused(denied).await;
        return page(
            denied.status(StatusCode::FORBIDDEN),
            "Refused",
            html! { p.err #refused { (denied.message()) } },
        );
    }
    let (_, items) = selection(&pairs);
    let items: Result<Vec<Item>, Failure> = items.iter().map(|i| Item::parse(i)).collect();
    let done = match items {
        Ok(items) => data::apply(&app, action, &items).await,
        Err(f) => {
            return page(
                StatusCode::BAD_REQUEST,
                "Refused",
                html! { p.err { (f.message) } },
            );
        }
    };
    match done {
        Ok(done) => {
            tracing::info!(
                action = action.name(),
                outbox = done.outbox,
                consumers = done.consumers,
                skipped = done.skipped,
                "dead letters handled from the page"
            );
            let verb = match action {
                Action::Redrive => "Re-drove",
                Action::Purge => "Purged",
            };
            page(
                StatusCode::OK,
                "Done",
                html! {
                    p.ok #done { (verb) " " (done.outbox) " outbox message(s) and " (done.consumers) " consumer dead letter(s), each for the group that gave up on it." }
                    @if done.skipped > 0 { p { (done.skipped) " selected were gone already or not DEAD: left alone." } }
                    p { a href="/dead" { "Back to the dead letters" } }
                },
            )
        }
        Err(f) => failure_page(&f),
    }
}

/// `GET /groups`.
pub(super) async fn groups(State(app): State<Arc<App>>) -> Response {
    let groups = match data::groups(&app).await {
        Ok(g) => g,
        Err(f) => return failure_page(&f),
    };
    let body = html! {
        @match groups {
            None => p.muted { "Start with --broker to see the consumer groups." },
            Some(groups) if groups.is_empty() => p { "No consumer groups on the streams of this prefix." },
            Some(groups) => table #groups {
                tr { th { "stream" } th { "group" } th.num { "lag" } th.num { "pending" } th { "oldest pending" } th { "last delivered" } th { "consumers (pending, idle)" } }
                @for g in &groups {
                    tr {
                        td { (g.stream) }
                        td { (g.group) }
                        td.num { (g.lag.map_or("?".to_owned(), |l| l.to_string())) }
                        td.num { (g.pending) }
                        td { @if let (Some(id), Some(age)) = (&g.oldest_pending_id, g.oldest_pending_age_seconds) { (id) " (" (seconds(age)) ")" } @else { "–" } }
                        td { (g.last_delivered_id) }
                        td { ul { @for c in &g.consumers { li { (c.name) ": " (c.pending) ", idle " (seconds(c.idle_ms as f64 / 1000.0)) } } } }
                    }
                }
            },
        }
    };
    page(StatusCode::OK, "Consumer groups", body)
}
