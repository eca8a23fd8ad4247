//! The web console's handlers (`outbox_cli::console`), called through the router as a browser
//! would (`tower::ServiceExt::oneshot`), against real PostgreSQL (a schema per test) and
//! MariaDB (a database per test): pages render and escape user data, a read-only console
//! refuses actions, a missing or bad CSRF token, a wrong operator token, another origin, a
//! missing reason or confirmation are refused and change nothing, and a confirmed retry
//! changes the event and writes the audit row with the actor. The overview's "Live relays" on
//! both stores: none runs; then a live relay, a stale one and a holder the registry does not
//! know, each with the claims it holds, and the command that ends the stale one's. Also the
//! relay's `/console` (over NATS JetStream, no Kafka needed), which lists the relay itself.

mod common;
mod transport_support;

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, HeaderMap, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use outbox_cli::console::{app, Action, ConsoleState, ConsoleStore, History};
use outbox_cli::Config;
use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, ClaimRequest, Envelope, ErrorClass, EventId, LastError, Outcome, ParkKind,
    ParkReason, RelayRegistration,
};
use serde_json::{json, Value};
use tower::ServiceExt;

const TOKEN: &str = "op-token-\u{e9}-42";
const HOST: &str = "console.test";

/// The console of `config`, as `outbox console` serves it.
async fn console(config: &Config) -> Router {
    let store = ConsoleStore::connect(config).await.expect("console store");
    app(ConsoleState::new(
        config,
        store,
        History::new(Duration::from_secs(3600)),
        None,
    ))
}

fn config(overrides: Value) -> Config {
    Config::load(None, &overrides).expect("configuration").0
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

async fn call(app: &Router, req: Request<Body>) -> Reply {
    let r = app.clone().oneshot(req).await.expect("the router answers");
    let status = r.status();
    let headers = r.headers().clone();
    let bytes = r.into_body().collect().await.expect("body").to_bytes();
    Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

async fn get(app: &Router, path: &str) -> Reply {
    let req = Request::get(path)
        .header(header::HOST, HOST)
        .body(Body::empty())
        .unwrap();
    call(app, req).await
}

fn urlencode(fields: &[(&str, &str)]) -> String {
    fields
        .iter()
        .map(|(k, v)| {
            let enc = |s: &str| {
                s.bytes()
                    .map(|b| match b {
                        b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                            (b as char).to_string()
                        }
                        b' ' => "+".into(),
                        b => format!("%{b:02X}"),
                    })
                    .collect::<String>()
            };
            format!("{}={}", enc(k), enc(v))
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// POSTs `fields` as a form, with the CSRF cookie when given and extra headers.
async fn post(
    app: &Router,
    path: &str,
    cookie: Option<&str>,
    fields: &[(&str, &str)],
    extra: &[(&str, &str)],
) -> Reply {
    let mut req = Request::post(path)
        .header(header::HOST, HOST)
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
    if let Some(c) = cookie {
        req = req.header(
            header::COOKIE,
            format!(
                "other=1; {}={c}",
                outbox_cli::console::security::CSRF_COOKIE
            ),
        );
    }
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    call(app, req.body(Body::from(urlencode(fields))).unwrap()).await
}

/// The confirmation page of `action` on `id`: its CSRF token (cookie and form field alike).
async fn confirmation(app: &Router, id: EventId, action: &str) -> String {
    let r = get(app, &format!("/console/parked/{id}/{action}")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let cookie = r
        .headers
        .get(header::SET_COOKIE)
        .expect("the confirmation page sets the CSRF cookie")
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let token = cookie
        .split(';')
        .next()
        .and_then(|kv| kv.split_once('='))
        .map(|(_, v)| v.to_owned())
        .unwrap();
    assert!(
        r.body.contains(&format!(r#"name="csrf" value="{token}""#)),
        "the form carries the cookie's token: {}",
        r.body
    );
    token
}

/// An event whose aggregate id, type and payload hold markup.
fn hostile(agg: &str, v: i64) -> Envelope {
    Envelope::builder("order", agg, v, "order.<i>changed</i>")
        .json(&json!({"note": "<script>alert('owned')</script>", "v": v}))
        .unwrap()
        .build()
        .unwrap()
}

/// Claims everything claimable and parks what `park` picks (the rest is published).
async fn relay_round<S: RelayStore>(store: &S, park: impl Fn(&Envelope) -> bool) {
    let batch = store
        .claim(&ClaimRequest::new("relay-console-test", 100))
        .await
        .unwrap();
    let outcomes: Vec<Outcome> = batch
        .records
        .iter()
        .filter(|r| park(&r.envelope))
        .map(|r| Outcome::Park {
            event_id: r.envelope.event_id,
            reason: ParkReason {
                kind: ParkKind::PermanentError,
                error: LastError {
                    class: ErrorClass::Permanent,
                    kind: "invalid_record".into(),
                    message: "schema <mismatch> & more".into(),
                },
            },
        })
        .collect();
    store.complete(&batch.handle, &outcomes).await.unwrap();
}

/// A POST that must be refused: what it lacks, its CSRF cookie, its form, extra headers, and
/// the status it gets.
type Refusal<'a> = (
    &'a str,
    Option<&'a str>,
    Vec<(&'a str, &'a str)>,
    Vec<(&'a str, &'a str)>,
    StatusCode,
);

/// Everything an action's POST must carry, with the fields overridden by `over`.
fn fields<'a>(csrf: &'a str, over: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut f = vec![
        ("csrf", csrf),
        ("token", TOKEN),
        ("actor", "alice"),
        ("reason", "schema registry fixed"),
        ("confirm", "yes"),
    ];
    for (k, v) in over {
        f.retain(|(name, _)| name != k);
        if !v.is_empty() || *k == "reason" {
            f.push((k, v));
        }
    }
    f
}

/// The whole console on one store: pages render and escape, refusals change nothing, and a
/// confirmed retry with a reason is done and audited with the actor. `still_parked` reads the
/// event's state through the store's operator role.
async fn exercise<S: OperatorStore>(cfg: &Config, read_only_cfg: &Config, id: EventId, store: &S) {
    let app = console(cfg).await;

    // Pages render; user data is escaped wherever it appears.
    let r = get(&app, "/console").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(r.body.contains("<svg"), "charts are inline SVG: {}", r.body);
    assert!(r.body.contains("Live relays"), "{}", r.body);
    assert!(
        r.headers
            .get(header::CONTENT_SECURITY_POLICY)
            .is_some_and(|v| v.to_str().unwrap().contains("default-src 'none'")),
        "{:?}",
        r.headers
    );
    let r = get(&app, "/console/parked").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(r.body.contains(&id.to_string()), "{}", r.body);
    assert!(
        r.body.contains("&lt;b&gt;a"),
        "aggregate id escaped: {}",
        r.body
    );
    assert!(!r.body.contains("<b>a"), "{}", r.body);
    assert!(
        r.body.contains("order.&lt;i&gt;changed&lt;/i&gt;"),
        "{}",
        r.body
    );
    assert!(
        r.body.contains("schema &lt;mismatch&gt; &amp; more"),
        "{}",
        r.body
    );
    let r = get(&app, &format!("/console/parked/{id}")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(
        r.body
            .contains("&lt;script&gt;alert('owned')&lt;/script&gt;"),
        "the payload is shown, escaped: {}",
        r.body
    );
    assert!(
        !r.body.contains("<script"),
        "no markup from user data: {}",
        r.body
    );
    let r = get(&app, "/console/consumers").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = get(&app, "/console/api/parked").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let doc: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(doc["parked"][0]["event_id"], id.to_string(), "{doc}");
    let r = get(&app, "/console/api/overview").await;
    let doc: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(doc["backlog"]["parked"], 1, "{doc}");
    assert_eq!(doc["operator_actions"], true, "{doc}");
    assert!(!doc["history"].as_array().unwrap().is_empty(), "{doc}");

    // Read-only (no token): neither the confirmation nor the action, whatever they carry.
    let ro = console(read_only_cfg).await;
    let r = get(&ro, &format!("/console/parked/{id}/retry")).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.body);
    assert!(
        r.body.contains("no operator token is configured"),
        "{}",
        r.body
    );
    let csrf = confirmation(&app, id, "retry").await;
    let r = post(
        &ro,
        &format!("/console/parked/{id}/retry"),
        Some(csrf.as_str()),
        &fields(&csrf, &[]),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.body);
    assert!(
        r.body.contains("no operator token is configured"),
        "{}",
        r.body
    );
    let event_page = get(&ro, &format!("/console/parked/{id}")).await;
    assert!(!event_page.body.contains("Retry…"), "{}", event_page.body);

    // With the token: each guard refuses on its own, and nothing changes.
    let csrf = confirmation(&app, id, "retry").await;
    let other = confirmation(&console(cfg).await, id, "retry").await;
    let path = format!("/console/parked/{id}/retry");
    let refused: Vec<Refusal<'_>> = vec![
        (
            "no CSRF field",
            Some(csrf.as_str()),
            fields(&csrf, &[("csrf", "")]),
            vec![],
            StatusCode::FORBIDDEN,
        ),
        (
            "no CSRF cookie",
            None,
            fields(&csrf, &[]),
            vec![],
            StatusCode::FORBIDDEN,
        ),
        (
            "a bad CSRF token",
            Some("forged"),
            fields("forged", &[]),
            vec![],
            StatusCode::FORBIDDEN,
        ),
        (
            "another console's CSRF token",
            Some(other.as_str()),
            fields(&other, &[]),
            vec![],
            StatusCode::FORBIDDEN,
        ),
        (
            "cookie and field differ",
            Some(csrf.as_str()),
            fields(&other, &[]),
            vec![],
            StatusCode::FORBIDDEN,
        ),
        (
            "no operator token",
            Some(csrf.as_str()),
            fields(&csrf, &[("token", "")]),
            vec![],
            StatusCode::FORBIDDEN,
        ),
        (
            "a wrong operator token",
            Some(csrf.as_str()),
            fields(&csrf, &[("token", "op-token")]),
            vec![],
            StatusCode::FORBIDDEN,
        ),
        (
            "another origin",
            Some(csrf.as_str()),
            fields(&csrf, &[]),
            vec![("origin", "http://evil.example")],
            StatusCode::FORBIDDEN,
        ),
        (
            "no reason",
            Some(csrf.as_str()),
            fields(&csrf, &[("reason", "  ")]),
            vec![],
            StatusCode::BAD_REQUEST,
        ),
        (
            "no actor",
            Some(csrf.as_str()),
            fields(&csrf, &[("actor", "")]),
            vec![],
            StatusCode::BAD_REQUEST,
        ),
        (
            "no confirmation",
            Some(csrf.as_str()),
            fields(&csrf, &[("confirm", "")]),
            vec![],
            StatusCode::BAD_REQUEST,
        ),
    ];
    for (what, cookie, form, extra, code) in refused {
        let r = post(&app, &path, cookie, &form, &extra).await;
        assert_eq!(r.status, code, "{what}: {}", r.body);
        store
            .parked_event(id)
            .await
            .unwrap_or_else(|e| panic!("{what} left the event parked: {e}"));
    }
    assert!(store.audit_trail(Some(id)).await.unwrap().is_empty());

    // The confirmed retry: done, and audited with the actor and the reason.
    let r = post(&app, &path, Some(csrf.as_str()), &fields(&csrf, &[]), &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(r.body.contains("Retried"), "{}", r.body);
    assert!(r.body.contains("alice (console)"), "{}", r.body);
    let err = store.parked_event(id).await.unwrap_err();
    assert_eq!(err.kind, outbox_core::StoreErrorKind::NotFound, "{err}");
    let trail = store.audit_trail(Some(id)).await.unwrap();
    assert_eq!(trail.len(), 1, "{trail:?}");
    assert_eq!(trail[0].action.as_str(), Action::Retry.name());
    assert_eq!(trail[0].actor, "alice (console)");
    assert_eq!(trail[0].reason, "schema registry fixed");
    // The event's page shows the trail; a second retry is refused by the store.
    let r = get(&app, &format!("/console/parked/{id}")).await;
    assert!(r.body.contains("alice (console)"), "{}", r.body);
    let r = post(&app, &path, Some(csrf.as_str()), &fields(&csrf, &[]), &[]).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_on_postgres_renders_escapes_guards_and_audits_a_retry() {
    let Some(env) = common::TestEnv::without_kafka("console_postgres").await else {
        return;
    };
    env.migrate();
    let store = env.store();
    let parked = hostile("<b>a", 1);
    store
        .append_many(&env.pool, &[parked.clone(), hostile("<b>a", 2)])
        .await
        .unwrap();
    relay_round(&store, |e| e.event_id == parked.event_id).await;
    // A consumer with an inbox and a parked message: the consumers pages show it.
    let inbox = common::inbox(&env.pool, &env.schema).await;
    common::park_consumer_message(
        &inbox,
        "billing",
        "orders",
        7,
        &hostile("<b>c", 1),
        outbox_core::ParkAs::Head(ParkKind::Unprocessable),
        "handler <refused> it",
    )
    .await;
    let base = json!({
        "database": {"url": env.url},
        "outbox": {"schema": env.schema},
        "consumers": [{"name": "billing", "inbox_schema": env.schema}],
    });
    let mut with_token = base.clone();
    with_token["console"] = json!({"operator_token": TOKEN});
    let (cfg, ro) = (config(with_token), config(base));

    let app = console(&cfg).await;
    let r = get(&app, "/console/consumers").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(
        r.body.contains(r#"href="/console/consumers/billing""#),
        "{}",
        r.body
    );
    let r = get(&app, "/console/api/consumers").await;
    let doc: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(doc["consumers"][0]["parked"], 1, "{doc}");
    assert_eq!(doc["consumers"][0]["waiting"], 0, "{doc}");
    let r = get(&app, "/console/consumers/billing").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(r.body.contains("handler &lt;refused&gt; it"), "{}", r.body);
    assert_eq!(
        get(&app, "/console/consumers/nobody").await.status,
        StatusCode::NOT_FOUND
    );

    exercise(&cfg, &ro, parked.event_id, &store).await;
    // The retried event is claimable again, its attempts reset.
    assert_eq!(env.count("pending").await, 2);
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_on_mariadb_renders_escapes_guards_and_audits_a_retry() {
    let Some(db) = common::mysql::Db::new("console_mariadb").await else {
        return;
    };
    let pool = db.pool().await;
    let store = outbox_mysql::MySqlOutboxStore::builder(pool.clone())
        .claim_mode(outbox_core::ClaimMode::lease(Duration::from_secs(30)).unwrap())
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let parked = hostile("<b>a", 1);
    store
        .append_many(&pool, &[parked.clone(), hostile("<b>a", 2)])
        .await
        .unwrap();
    relay_round(&store, |e| e.event_id == parked.event_id).await;
    let base = json!({"database": {"url": db.url()}});
    let mut with_token = base.clone();
    with_token["console"] = json!({"operator_token": TOKEN});
    exercise(&config(with_token), &config(base), parked.event_id, &store).await;
    let pending: i64 = outbox_mysql::sqlx::query_scalar(
        "SELECT COUNT(*) FROM outbox_events WHERE status = 'pending' AND attempts = 0",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(pending, 2);
    db.drop().await;
}

/// The `<tr>` of `owner` in the overview's relay table.
fn relay_row<'a>(page: &'a str, owner: &str) -> &'a str {
    let table = page
        .split(r#"<table id="relay-list">"#)
        .nth(1)
        .and_then(|t| t.split("</table>").next())
        .unwrap_or_else(|| panic!("no relay table: {page}"));
    table
        .split("<tr")
        .find(|row| row.contains(&format!("<td>{owner}</td>")))
        .unwrap_or_else(|| panic!("no row of {owner}: {page}"))
}

/// The relay `owner` in `/console/api/overview`'s `relays`.
fn relay_entry<'a>(doc: &'a Value, owner: &str) -> &'a Value {
    doc["relays"]["entries"]
        .as_array()
        .unwrap_or_else(|| panic!("no relay entries: {doc}"))
        .iter()
        .find(|e| e["owner"] == owner)
        .unwrap_or_else(|| panic!("no entry of {owner}: {doc}"))
}

/// The overview's relays on a store with three claimable aggregates and an empty registry: no
/// relay runs; then `live-0` (heartbeat every minute), `dead-0` (every 100 ms, silent since)
/// and `ghost-0` (never registered) claim one aggregate each: each is listed with its state
/// and its claim, and only `dead-0` gets the command that ends its claims.
async fn relays_listed<S: RelayRegistry + RelayStore>(cfg: &Config, store: &S) {
    let app = console(cfg).await;
    let r = get(&app, "/console").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(
        r.body
            .contains("No relay runs: no live relay in the registry"),
        "{}",
        r.body
    );
    assert!(!r.body.contains("relay-list"), "{}", r.body);
    let doc: Value = serde_json::from_str(&get(&app, "/console/api/overview").await.body).unwrap();
    assert_eq!(doc["relays"]["live"], 0, "{doc}");
    assert_eq!(doc["relays"]["entries"], json!([]), "{doc}");

    store
        .register_relay(&RelayRegistration::new(
            "live-0",
            "host-<b>a",
            4242,
            "9.9.9",
            "lease",
            Duration::from_secs(60),
        ))
        .await
        .unwrap();
    store
        .register_relay(&RelayRegistration::new(
            "dead-0",
            "host-b",
            4343,
            "9.9.8",
            "lease",
            Duration::from_millis(100),
        ))
        .await
        .unwrap();
    for owner in ["live-0", "dead-0", "ghost-0"] {
        let batch = store.claim(&ClaimRequest::new(owner, 1)).await.unwrap();
        assert_eq!(batch.records.len(), 1, "{owner} claims an aggregate");
    }
    // What a relay reports at its heartbeat is its own count; the claims column is read now.
    assert!(store.heartbeat_relay("live-0", 5).await.unwrap());
    assert!(store.heartbeat_relay("dead-0", 1).await.unwrap());
    // dead-0 heartbeats no more: 500 ms is 5 of its intervals, stale after 3.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let r = get(&app, "/console").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(!r.body.contains("No relay runs"), "{}", r.body);
    assert!(r.body.contains("1 live relay(s)"), "{}", r.body);
    let live = relay_row(&r.body, "live-0");
    assert!(live.contains(r#"class="relay-live""#), "{live}");
    assert!(
        live.contains("host-&lt;b&gt;a") && !live.contains("host-<b>"),
        "{live}"
    );
    for cell in [
        "<td class=\"num\">4242</td>",
        "<td>9.9.9</td>",
        "<td>lease</td>",
    ] {
        assert!(live.contains(cell), "{cell} in {live}");
    }
    assert!(
        live.contains("<td class=\"num\">5</td><td class=\"num\">1</td>"),
        "live-0 held 5 at its heartbeat and holds one aggregate now: {live}"
    );
    assert!(!live.contains("release-claims"), "{live}");
    let dead = relay_row(&r.body, "dead-0");
    assert!(dead.contains(r#"class="relay-stale""#), "{dead}");
    assert!(dead.contains("<td>host-b</td>"), "{dead}");
    assert!(
        dead.contains("<td class=\"num\">1 (now 1)</td><td class=\"num\">1</td>"),
        "held at its heartbeat and now, and one aggregate claimed: {dead}"
    );
    assert!(
        dead.contains(r#"<code class="release">outbox parked release-claims dead-0</code>"#),
        "the command that ends the dead relay's claims: {dead}"
    );
    let ghost = relay_row(&r.body, "ghost-0");
    assert!(ghost.contains(r#"class="relay-unregistered""#), "{ghost}");
    assert!(ghost.contains("<td class=\"num\">1</td>"), "{ghost}");
    assert!(ghost.contains("not in the registry"), "{ghost}");
    assert!(!ghost.contains("release-claims"), "{ghost}");
    assert_eq!(
        r.body.matches("release-claims").count(),
        1,
        "one command, the dead relay's: {}",
        r.body
    );

    let doc: Value = serde_json::from_str(&get(&app, "/console/api/overview").await.body).unwrap();
    assert_eq!(
        (&doc["relays"]["live"], &doc["relays"]["stale"]),
        (&json!(1), &json!(1)),
        "{doc}"
    );
    let e = relay_entry(&doc, "live-0");
    assert_eq!(
        (&e["state"], &e["host"], &e["pid"], &e["aggregates_claimed"]),
        (&json!("live"), &json!("host-<b>a"), &json!(4242), &json!(1)),
        "{doc}"
    );
    assert_eq!(e["release_command"], Value::Null, "{doc}");
    let e = relay_entry(&doc, "dead-0");
    assert_eq!(
        (&e["state"], &e["claims_now"], &e["aggregates_claimed"]),
        (&json!("stale"), &json!(1), &json!(1)),
        "{doc}"
    );
    assert_eq!(
        e["release_command"], "outbox parked release-claims dead-0",
        "{doc}"
    );
    let e = relay_entry(&doc, "ghost-0");
    assert_eq!(
        (&e["state"], &e["registered"], &e["aggregates_claimed"]),
        (&json!("unregistered"), &json!(false), &json!(1)),
        "{doc}"
    );
    assert_eq!(e["release_command"], Value::Null, "{doc}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_lists_live_stale_and_unregistered_relays_on_postgres() {
    let Some(env) = common::TestEnv::without_kafka("console_relays_pg").await else {
        return;
    };
    env.migrate();
    env.append(3, 1).await;
    // Leases that outlast the test.
    let store = outbox_postgres::PostgresOutboxStore::builder(env.pool.clone())
        .schema(env.schema.clone())
        .claim_mode(ClaimMode::lease(Duration::from_secs(120)).unwrap())
        .build()
        .unwrap();
    let cfg = config(json!({"database": {"url": env.url}, "outbox": {"schema": env.schema}}));
    relays_listed(&cfg, &store).await;
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_lists_live_stale_and_unregistered_relays_on_mariadb() {
    let Some(db) = common::mysql::Db::new("console_relays_maria").await else {
        return;
    };
    let pool = db.pool().await;
    let store = outbox_mysql::MySqlOutboxStore::builder(pool.clone())
        .claim_mode(ClaimMode::lease(Duration::from_secs(120)).unwrap())
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let events: Vec<Envelope> = (0..3).map(|a| hostile(&format!("r-{a}"), 1)).collect();
    store.append_many(&pool, &events).await.unwrap();
    relays_listed(&config(json!({"database": {"url": db.url()}})), &store).await;
    db.drop().await;
}

/// `outbox relay` serves the console under `/console` on its HTTP port (read-only here: no
/// token), shows itself and the claims, and feeds the charts from its stats reads; with
/// `console.enabled = false` there is no `/console`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_serves_the_console_on_its_http_port() {
    let test = "the_relay_serves_the_console_on_its_http_port";
    let Some(env) = common::TestEnv::without_kafka(test).await else {
        return;
    };
    let Some(url) = outbox_test_support::nats_url(test) else {
        return;
    };
    let stream = transport_support::NatsStream::create(&url, Duration::from_secs(60)).await;
    let vars = [
        ("OUTBOX_TRANSPORT__KIND", "nats".to_owned()),
        ("NATS_URL", stream.url.clone()),
        ("OUTBOX_NATS__SUBJECT_PREFIX", stream.prefix.clone()),
        ("OUTBOX_RELAY__OWNER", "relay-under-test".to_owned()),
        // A minute of history: samples 83 ms apart, so each stats read (200 ms) is kept.
        ("OUTBOX_CONSOLE__HISTORY", "1m".to_owned()),
    ];
    let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    env.migrate();
    env.append(3, 2).await;
    let mut relay = env.spawn_relay_env(&vars, &[]);
    relay.wait_ready(Duration::from_secs(30));
    env.wait_count("published", 6, Duration::from_secs(30))
        .await;
    let deadline = Instant::now() + Duration::from_secs(15);
    let doc = loop {
        let (code, body) = relay.get("/console/api/overview").unwrap();
        assert_eq!(code, 200, "{body}");
        let doc: Value = serde_json::from_str(&body).unwrap();
        if doc["history"].as_array().unwrap().len() >= 3 {
            break doc;
        }
        assert!(
            Instant::now() < deadline,
            "the monitor feeds the history: {doc}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(doc["this_relay"]["owner"], "relay-under-test", "{doc}");
    assert_eq!(doc["this_relay"]["readiness"]["ready"], true, "{doc}");
    // The relay's worker is registered, live, and listed with its host and pid.
    let me = relay_entry(&doc, "relay-under-test-0");
    assert_eq!(me["state"], "live", "{doc}");
    assert_eq!(me["pid"], relay.child.id(), "{doc}");
    assert_eq!(doc["operator_actions"], false, "{doc}");
    let (code, page) = relay.get("/console").unwrap();
    assert_eq!(code, 200, "{page}");
    assert!(page.contains("relay-under-test"), "{page}");
    assert!(
        relay_row(&page, "relay-under-test-0").contains(r#"class="relay-live""#),
        "{page}"
    );
    let (code, page) = relay.get("/console/parked").unwrap();
    assert_eq!(code, 200, "{page}");
    assert!(page.contains("No parked events"), "{page}");
    let (code, _) = relay.get("/metrics").unwrap();
    assert_eq!(code, 200);
    relay.terminate(Duration::from_secs(20));

    let mut vars = vars.clone();
    vars.push(("OUTBOX_CONSOLE__ENABLED", "false"));
    let mut relay = env.spawn_relay_env(&vars, &[]);
    relay.wait_ready(Duration::from_secs(30));
    let (code, _) = relay.get("/console").unwrap();
    assert_eq!(code, 404);
    relay.terminate(Duration::from_secs(20));
    env.drop_schema().await;
}
