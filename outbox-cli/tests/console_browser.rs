//! The web console in a real browser: headless Chromium driven through chromedriver
//! (WebDriver, with fantoccini), against a real `outbox console` process (`OUTBOX_TEST_BIN`, else
//! this build's binary) on a PostgreSQL outbox with a parked event, a live relay and a dead one
//! that still holds a claim. The operator sees both relays on the overview, the dead one with
//! the command that ends its claims, then opens the event, sees its payload escaped, retries it with a reason, a name, the operator token and a
//! ticked confirmation; the database then holds the event as pending with its audit row.
//! Screenshots are kept in `target/test-artefacts/console*.png` (or under
//! `$CARGO_TARGET_DIR`, or `$OUTBOX_TEST_ARTEFACTS`).
//!
//! Chromium and chromedriver are Debian's `chromium` and `chromium-driver` (`scripts/test`
//! installs them; `CHROMEDRIVER` / `CHROMIUM_BIN` name others). Without them the test fails
//! with the command that installs them; only outside CI, with `OUTBOX_SKIP_SERVICE_TESTS=1`, it
//! is skipped, saying so.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{ClientBuilder, Locator};
use futures::FutureExt;
use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, ClaimRequest, Envelope, ErrorClass, LastError, Outcome, ParkKind, ParkReason,
    RelayRegistration,
};
use serde_json::json;

const TOKEN: &str = "browser-operator-token";

/// A child process killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn find(var: &str, name: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(var).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// chromedriver and Chromium, or why not (a failure in CI; a printed skip only outside CI
/// with the skip switch).
fn browser(test: &str) -> Option<(PathBuf, PathBuf)> {
    match (
        find("CHROMEDRIVER", "chromedriver"),
        find("CHROMIUM_BIN", "chromium"),
    ) {
        (Some(d), Some(b)) => Some((d, b)),
        _ => {
            let why = "headless Chromium or chromedriver is not installed";
            let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false");
            if !ci && outbox_test_support::skip_allowed() {
                outbox_test_support::report_skip(test, why);
                return None;
            }
            panic!(
                "{test}: {why}. Install them as root with `apt-get install -y chromium \
                 chromium-driver` (scripts/test does), or set CHROMEDRIVER and CHROMIUM_BIN"
            )
        }
    }
}

/// Where screenshots go.
fn artefacts() -> PathBuf {
    let dir = match (
        std::env::var_os("OUTBOX_TEST_ARTEFACTS"),
        std::env::var_os("CARGO_TARGET_DIR"),
    ) {
        (Some(d), _) => PathBuf::from(d),
        (None, Some(t)) => PathBuf::from(t).join("test-artefacts"),
        (None, None) => Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-artefacts"),
    };
    std::fs::create_dir_all(&dir).expect("artefact directory");
    dir
}

async fn park_all<S: RelayStore>(store: &S) {
    let batch = store
        .claim(&ClaimRequest::new("relay-browser-test", 100))
        .await
        .unwrap();
    let outcomes: Vec<Outcome> = batch
        .records
        .iter()
        .filter(|r| r.envelope.aggregate_version == 1)
        .map(|r| Outcome::Park {
            event_id: r.envelope.event_id,
            reason: ParkReason {
                kind: ParkKind::PermanentError,
                error: LastError {
                    class: ErrorClass::Permanent,
                    kind: "invalid_record".into(),
                    message: "the broker refused the record".into(),
                },
            },
        })
        .collect();
    store.complete(&batch.handle, &outcomes).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_retries_a_parked_event_in_headless_chromium() {
    let test = "console_browser";
    let Some((driver_bin, chromium)) = browser(test) else {
        return;
    };
    let Some(env) = common::TestEnv::without_kafka(test).await else {
        return;
    };
    env.migrate();
    let store = env.store();
    let event = Envelope::builder("order", "o-17", 1, "order.placed")
        .json(&json!({"note": "<script>window.owned = true</script>", "total": 42}))
        .unwrap()
        .build()
        .unwrap();
    let next = Envelope::builder("order", "o-17", 2, "order.paid")
        .json(&json!({"total": 42}))
        .unwrap()
        .build()
        .unwrap();
    store
        .append_many(&env.pool, &[event.clone(), next])
        .await
        .unwrap();
    park_all(&store).await;
    let id = event.event_id.to_string();
    // The registry: a live relay, and a dead one (heartbeat every 100 ms, silent since) that
    // holds a claim on another aggregate under a lease that outlasts the test.
    let other = Envelope::builder("order", "o-18", 1, "order.placed")
        .json(&json!({"total": 7}))
        .unwrap()
        .build()
        .unwrap();
    store.append_many(&env.pool, &[other]).await.unwrap();
    let leased = outbox_postgres::PostgresOutboxStore::builder(env.pool.clone())
        .schema(env.schema.clone())
        .claim_mode(ClaimMode::lease(Duration::from_secs(600)).unwrap())
        .build()
        .unwrap();
    for (owner, every) in [("browser-live-0", 60_000), ("browser-gone-0", 100)] {
        leased
            .register_relay(&RelayRegistration::new(
                owner,
                "browser-host",
                4242,
                "9.9.9",
                "lease",
                Duration::from_millis(every),
            ))
            .await
            .unwrap();
    }
    let held = leased
        .claim(&ClaimRequest::new("browser-gone-0", 10))
        .await
        .unwrap();
    assert_eq!(held.records.len(), 1, "the dead relay holds o-18");
    leased.heartbeat_relay("browser-gone-0", 1).await.unwrap();

    // The console, as an operator starts it.
    let port = outbox_test_support::free_port();
    let listen = format!("127.0.0.1:{port}");
    let console = Killed(
        env.cmd()
            .args(["console", "--listen", &listen])
            .env("OUTBOX_CONSOLE__OPERATOR_TOKEN", TOKEN)
            .env("OUTBOX_CONSOLE__SAMPLE_INTERVAL", "1s")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start outbox console"),
    );
    assert!(
        outbox_test_support::wait_port(&listen, Duration::from_secs(30)),
        "outbox console listens on {listen}"
    );

    // chromedriver on a free port of its own.
    let driver_port = outbox_test_support::free_port();
    let driver = Killed(
        Command::new(&driver_bin)
            .arg(format!("--port={driver_port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", driver_bin.display())),
    );
    assert!(
        outbox_test_support::wait_port(
            &format!("127.0.0.1:{driver_port}"),
            Duration::from_secs(30)
        ),
        "chromedriver listens on {driver_port}"
    );
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": chromium,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,1100"],
        }),
    );
    let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{driver_port}"))
        .await
        .expect("a WebDriver session in headless Chromium");
    let dir = artefacts();
    let base = format!("http://{listen}/console");

    // The session is closed whatever happens in it (a failed assertion included): a browser
    // left without its session would outlive the test.
    let run = std::panic::AssertUnwindSafe(async {
        // The overview, with its charts.
        client.goto(&base).await?;
        client.find(Locator::Css("svg")).await?;
        let parked = client.find(Locator::Css("#parked")).await?.text().await?;
        assert_eq!(parked.trim(), "1");
        std::fs::write(dir.join("console-overview.png"), client.screenshot().await?).unwrap();

        // The relays: the live one, and the dead one with the command that ends its claims.
        client.goto(&format!("{base}#relays")).await?;
        let live = client
            .find(Locator::Css("#relay-list tr.relay-live"))
            .await?
            .text()
            .await?;
        assert!(
            live.contains("browser-live-0") && live.contains("live"),
            "{live}"
        );
        let dead = client
            .find(Locator::Css("#relay-list tr.relay-stale"))
            .await?
            .text()
            .await?;
        assert!(
            dead.contains("browser-gone-0") && dead.contains("stale"),
            "{dead}"
        );
        let command = client
            .find(Locator::Css("#relay-list tr.relay-stale code.release"))
            .await?
            .text()
            .await?;
        assert_eq!(command, "outbox parked release-claims browser-gone-0");
        assert!(client
            .find_all(Locator::Css("#relay-list tr.relay-live code"))
            .await?
            .is_empty());
        std::fs::write(dir.join("console-relays.png"), client.screenshot().await?).unwrap();

        // The parked events, then the event: its payload is text, not markup.
        client
            .find(Locator::LinkText("Parked events"))
            .await?
            .click()
            .await?;
        client.find(Locator::LinkText(&id)).await?.click().await?;
        let payload = client.find(Locator::Css("#payload")).await?.text().await?;
        assert!(
            payload.contains("<script>window.owned = true</script>"),
            "{payload}"
        );
        let owned = client
            .execute("return window.owned === true;", vec![])
            .await?;
        assert_eq!(owned, json!(false), "the payload's script did not run");
        std::fs::write(dir.join("console-event.png"), client.screenshot().await?).unwrap();

        // Retry, with the confirmation step.
        client.find(Locator::Id("retry")).await?.click().await?;
        client
            .find(Locator::Id("reason"))
            .await?
            .send_keys("broker limit raised")
            .await?;
        client
            .find(Locator::Id("actor"))
            .await?
            .send_keys("browser-test")
            .await?;
        client
            .find(Locator::Id("token"))
            .await?
            .send_keys(TOKEN)
            .await?;
        client.find(Locator::Id("confirm")).await?.click().await?;
        std::fs::write(dir.join("console-confirm.png"), client.screenshot().await?).unwrap();
        client.find(Locator::Id("submit")).await?.click().await?;
        let shown = client
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::Css("#outcome, p.error"))
            .await?;
        let outcome = shown.text().await?;
        assert_eq!(
            shown.attr("id").await?.as_deref(),
            Some("outcome"),
            "{outcome}"
        );
        assert!(outcome.contains("Retried"), "{outcome}");
        assert!(outcome.contains("browser-test (console)"), "{outcome}");
        std::fs::write(dir.join("console-done.png"), client.screenshot().await?).unwrap();
        // The event's page: no longer parked, the audit trail names the actor.
        client
            .find(Locator::LinkText("See the event's audit trail"))
            .await?
            .click()
            .await?;
        let trail = client.find(Locator::Css("#audit")).await?.text().await?;
        assert!(trail.contains("browser-test (console)"), "{trail}");
        assert!(trail.contains("broker limit raised"), "{trail}");
        std::fs::write(dir.join("console.png"), client.screenshot().await?).unwrap();
        Ok::<(), fantoccini::error::CmdError>(())
    })
    .catch_unwind()
    .await;
    let closed = client.close().await;
    drop(driver);
    drop(console);
    match run {
        Ok(r) => r.expect("the browser session"),
        Err(panic) => std::panic::resume_unwind(panic),
    }
    closed.expect("the browser session ends");

    // The database: the event is claimable again, and the audit row names the actor.
    let (status, attempts): (String, i32) = sqlx::query_as(&format!(
        "SELECT status::text, attempts FROM \"{}\".outbox_events WHERE event_id = $1",
        env.schema
    ))
    .bind(event.event_id.as_uuid())
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), attempts), ("pending", 0));
    let audit: Vec<(String, String, String)> = sqlx::query_as(&format!(
        "SELECT action, actor, reason FROM \"{}\".outbox_events_audit WHERE event_id = $1",
        env.schema
    ))
    .bind(event.event_id.as_uuid())
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        [(
            "retry".to_owned(),
            "browser-test (console)".to_owned(),
            "broker limit raised".to_owned()
        )]
    );
    for shot in [
        "console-overview.png",
        "console-relays.png",
        "console-event.png",
        "console-confirm.png",
        "console-done.png",
        "console.png",
    ] {
        let len = std::fs::metadata(dir.join(shot))
            .map(|m| m.len())
            .unwrap_or(0);
        assert!(len > 1000, "{} is a screenshot", dir.join(shot).display());
    }
    eprintln!("screenshots in {}", dir.display());
    env.drop_schema().await;
}
