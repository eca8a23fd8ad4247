//! The relay registry through the `outbox` binary, on PostgreSQL and MariaDB: `outbox status`
//! lists the relays (none, one, two; live and stale), `outbox parked release-claims` without an
//! owner lists the dead relays that still hold claims with the command for each and refuses to
//! end a live relay's claims without `--force`; the relay daemon registers each worker,
//! heartbeats, reports a failing registry write on `/readyz`, deregisters on SIGTERM and
//! leaves stale entries when killed; and the events a release hands over are counted in
//! `outbox_republished_total` when they go out again.
//!
//! The relays publish to NATS JetStream (no Kafka broker needed). Needs `DATABASE_URL`,
//! `MYSQL_URL` and NATS (`NATS_URL`), unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;
mod transport_support;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{text, Daemon, TestEnv};
use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimRequest, Envelope, RelayRegistration};
use transport_support::NatsStream;

macro_rules! require {
    ($e:expr) => {
        match $e {
            Some(v) => v,
            None => return,
        }
    };
}

fn nats_env(stream: &NatsStream) -> Vec<(&'static str, String)> {
    vec![
        ("OUTBOX_TRANSPORT__KIND", "nats".into()),
        ("NATS_URL", stream.url.clone()),
        ("OUTBOX_NATS__SUBJECT_PREFIX", stream.prefix.clone()),
        ("OUTBOX_NATS__DELIVERY_TIMEOUT", "5s".into()),
        ("OUTBOX_RELAY__HEARTBEAT_INTERVAL", "200ms".into()),
    ]
}

fn borrowed<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

fn registration(owner: &str, interval: Duration) -> RelayRegistration {
    RelayRegistration::new(owner, "host-x", 4242, "9.9.9", "lease", interval)
}

fn events(n: usize) -> Vec<Envelope> {
    (0..n)
        .map(|a| {
            Envelope::builder("order", format!("reg-{a}"), 1, "order.changed")
                .json(&serde_json::json!({ "a": a }))
                .unwrap()
                .build()
                .unwrap()
        })
        .collect()
}

fn owners(doc: &serde_json::Value) -> Vec<(String, String)> {
    doc["relays"]["entries"]
        .as_array()
        .unwrap_or_else(|| panic!("no relays in {doc}"))
        .iter()
        .map(|e| {
            (
                e["owner"].as_str().unwrap().to_owned(),
                e["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// Runs the checks of `status` and `release-claims` against a store whose registry the test
/// fills itself: `outbox` is `run(args) -> (code, stdout, stderr)`.
async fn status_and_release_claims<S: RelayRegistry + RelayStore>(
    store: &S,
    run: impl Fn(&[&str]) -> (i32, String, String),
) {
    let json = |args: &[&str]| {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let (code, out, err) = run(&all);
        let doc: serde_json::Value = serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {out}\n{err}"));
        (code, doc, err)
    };
    // No relay.
    let (code, doc, err) = json(&["status", "--no-consumers"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(doc["relays"]["live"], 0, "{doc}");
    assert_eq!(owners(&doc), vec![]);
    let (code, out, err) = run(&["status", "--no-consumers"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("relays: NONE RUNS"), "{out}");

    // One live relay.
    store
        .register_relay(&registration("live-0", Duration::from_secs(60)))
        .await
        .unwrap();
    let (code, doc, err) = json(&["status", "--no-consumers"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        (
            doc["relays"]["live"].as_u64(),
            doc["relays"]["stale"].as_u64()
        ),
        (Some(1), Some(0)),
        "{doc}"
    );
    let e = &doc["relays"]["entries"][0];
    assert_eq!(
        (
            &e["owner"],
            &e["host"],
            &e["pid"],
            &e["version"],
            &e["claim_mode"]
        ),
        (
            &serde_json::json!("live-0"),
            &serde_json::json!("host-x"),
            &serde_json::json!(4242),
            &serde_json::json!("9.9.9"),
            &serde_json::json!("lease")
        ),
        "{doc}"
    );
    let (code, out, err) = run(&["--wide", "status", "--no-consumers"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("live-0") && out.contains("host-x") && out.contains("relays: 1 live"),
        "{out}"
    );
    assert!(!out.contains("NONE RUNS"), "{out}");

    // A dead relay holding two claims, beside the live one.
    store
        .register_relay(&registration("dead-0", Duration::from_millis(100)))
        .await
        .unwrap();
    let held = store.claim(&ClaimRequest::new("dead-0", 2)).await.unwrap();
    assert_eq!(held.records.len(), 2);
    store.heartbeat_relay("dead-0", 2).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (code, doc, err) = json(&["status", "--no-consumers"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        owners(&doc),
        vec![
            ("dead-0".to_owned(), "stale".to_owned()),
            ("live-0".to_owned(), "live".to_owned())
        ]
    );
    assert_eq!(doc["relays"]["entries"][0]["claims_now"], 2, "{doc}");
    assert!(
        doc["warnings"].as_array().unwrap().iter().any(|w| w
            .as_str()
            .unwrap()
            .contains("outbox parked release-claims dead-0")),
        "{doc}"
    );

    // release-claims without an owner lists the dead relay with its command, not the live one.
    let (code, doc, err) = json(&["parked", "release-claims"]);
    assert_eq!(code, 0, "{err}");
    let dead = doc["dead_relays_holding_claims"].as_array().unwrap();
    assert_eq!(dead.len(), 1, "{doc}");
    assert_eq!(dead[0]["owner"], "dead-0");
    assert_eq!(dead[0]["claims_now"], 2);
    assert_eq!(dead[0]["command"], "outbox parked release-claims dead-0");
    let (code, out, err) = run(&["--wide", "parked", "release-claims"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("outbox parked release-claims dead-0"), "{out}");
    assert!(!out.contains("live-0"), "{out}");

    // A live relay's claims are not released without --force.
    let (code, out, err) = run(&["parked", "release-claims", "live-0", "--yes"]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        err.contains("is live") && err.contains("duplicates") && err.contains("--force"),
        "{err}"
    );
    // The dead one's are, and its entry goes.
    let (code, doc, err) = json(&["parked", "release-claims", "dead-0", "--yes"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(doc["released_aggregates"], 2, "{doc}");
    assert_eq!(store.live_claims_of("dead-0").await.unwrap(), 0);
    let (code, out, err) = run(&["parked", "release-claims"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("no dead relay holds claims"), "{out}");
    let (code, doc, err) = json(&["parked", "release-claims", "live-0", "--yes", "--force"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(doc["released_aggregates"], 0, "{doc}");

    // Two live relays.
    store
        .register_relay(&registration("live-1", Duration::from_secs(60)))
        .await
        .unwrap();
    let (code, doc, err) = json(&["status", "--no-consumers"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(doc["relays"]["live"], 2, "{doc}");
    assert_eq!(
        owners(&doc),
        vec![
            ("live-0".to_owned(), "live".to_owned()),
            ("live-1".to_owned(), "live".to_owned())
        ]
    );
}

fn output(out: std::process::Output) -> (i32, String, String) {
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_release_claims_read_the_registry_on_postgres() {
    let env = require!(TestEnv::without_kafka("registry_status_pg").await);
    env.migrate();
    let store = env.store();
    store.append_many(&env.pool, &events(2)).await.unwrap();
    status_and_release_claims(&store, |args| output(env.run(args))).await;
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_release_claims_read_the_registry_on_mariadb() {
    let db = require!(common::mysql::Db::new("registry_status_mysql").await);
    let url = db.url();
    let out = db.outbox(&url, &[], &["migrate"]);
    assert!(out.status.success(), "{}", text(&out));
    let store = outbox_mysql::MySqlOutboxStore::builder(db.pool().await)
        .claim_mode(ClaimMode::lease(Duration::from_secs(10)).unwrap())
        .build()
        .unwrap();
    let mut conn = store.pool().acquire().await.unwrap();
    AppendStore::append(&store, &mut conn, &events(2))
        .await
        .unwrap();
    drop(conn);
    status_and_release_claims(&store, |args| {
        output(db.outbox(&url, &[("OUTBOX_OUTBOX__LEASE", "10s")], args))
    })
    .await;
    db.drop().await;
}

/// Waits until `f` holds for `/readyz`'s JSON.
fn wait_readyz(relay: &Daemon, want: u16, f: impl Fn(&serde_json::Value) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let got = relay.get("/readyz");
        if let Some((code, body)) = &got {
            if *code == want && f(&serde_json::from_str(body).unwrap()) {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "/readyz never answered {want} as expected: {got:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The relay registers each worker with what it is, heartbeats, reports a failing registry
/// write on `/readyz` (and registers again once it can), counts the events a release handed
/// over as re-published, and deregisters on SIGTERM; killed, it leaves stale entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_registers_heartbeats_and_deregisters_on_postgres() {
    let test = "registry_relay_pg";
    let env = require!(TestEnv::without_kafka(test).await);
    let url = require!(outbox_test_support::nats_url(test));
    let stream = NatsStream::create(&url, Duration::from_secs(120)).await;
    let mut vars = nats_env(&stream);
    let owner = format!("reg-{}", env.schema);
    vars.push(("OUTBOX_RELAY__OWNER", owner.clone()));
    env.migrate();
    let store = env.store();
    // Two events a relay that died holds: released, they go out as re-publications.
    store.append_many(&env.pool, &events(2)).await.unwrap();
    let ghost = store
        .claim(&ClaimRequest::new("ghost-0", 10))
        .await
        .unwrap();
    assert_eq!(ghost.records.len(), 2);
    let out = env
        .cmd()
        .envs(borrowed(&vars))
        .args(["parked", "release-claims", "ghost-0", "--yes"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));

    let mut relay = env.spawn_relay_env(&borrowed(&vars), &["--workers", "2"]);
    relay.wait_ready(Duration::from_secs(30));
    wait_readyz(&relay, 200, |v| v["registry"]["ok"] == true);
    env.wait_count("published", 2, Duration::from_secs(30))
        .await;
    relay.wait_metric(
        "outbox_published_total",
        "",
        |v| v >= 2.0,
        Duration::from_secs(10),
    );
    assert_eq!(
        relay.metric("outbox_republished_total", ""),
        Some(2.0),
        "the events a release handed over were possibly sent before"
    );
    relay.wait_metric(
        "outbox_relays",
        "state=\"live\"",
        |v| v == 2.0,
        Duration::from_secs(10),
    );

    let (code, doc, err) = env.json_env(&borrowed(&vars), &["status", "--no-consumers"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(doc["relays"]["live"], 2, "{doc}");
    let workers = owners(&doc);
    assert_eq!(
        workers,
        vec![
            (format!("{owner}-0"), "live".to_owned()),
            (format!("{owner}-1"), "live".to_owned())
        ]
    );
    let e = &doc["relays"]["entries"][0];
    assert_eq!(e["pid"], relay.child.id(), "{doc}");
    assert_eq!(e["claim_mode"], "lease");
    assert_eq!(e["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(e["heartbeat_interval_seconds"], 0.2);
    // The heartbeat moves.
    let first = store.relays().await.unwrap()[0].heartbeat_at;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let later = store.relays().await.unwrap()[0].heartbeat_at;
    assert!(later > first, "{first} -> {later}");

    // The registry write failing is reported on /readyz; restored, the relay registers again.
    let table = format!("\"{}\".outbox_events_relays", env.schema);
    sqlx::raw_sql(&format!(
        "ALTER TABLE {table} RENAME TO outbox_events_relays_away"
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    wait_readyz(&relay, 503, |v| {
        v["registry"]["ok"] == false
            && v["registry"]["detail"]
                .as_str()
                .unwrap()
                .contains("relay registry write failed")
    });
    sqlx::raw_sql(&format!(
        "ALTER TABLE \"{}\".outbox_events_relays_away RENAME TO outbox_events_relays; \
         DELETE FROM {table}",
        env.schema
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    wait_readyz(&relay, 200, |v| v["registry"]["ok"] == true);
    assert_eq!(store.relays().await.unwrap().len(), 2, "registered again");

    // SIGTERM: deregistered.
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "{stderr}");
    assert!(store.relays().await.unwrap().is_empty());
    let (_, doc, _) = env.json_env(&borrowed(&vars), &["status", "--no-consumers"]);
    assert_eq!(doc["relays"]["live"], 0, "{doc}");

    // SIGKILL: the entries stay and turn stale; status says none runs.
    let mut relay = env.spawn_relay_env(&borrowed(&vars), &["--workers", "1"]);
    relay.wait_ready(Duration::from_secs(30));
    common::signal(relay.child.id(), "KILL");
    let _ = relay.wait(Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(800)).await;
    let (_, doc, _) = env.json_env(&borrowed(&vars), &["status", "--no-consumers"]);
    assert_eq!(
        owners(&doc),
        vec![(format!("{owner}-0"), "stale".to_owned())],
        "{doc}"
    );
    assert_eq!(doc["relays"]["live"], 0);
    env.drop_schema().await;
}

/// On MariaDB the daemon registers and deregisters the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_registers_and_deregisters_on_mariadb() {
    let test = "registry_relay_mysql";
    let db = require!(common::mysql::Db::new(test).await);
    let nats = require!(outbox_test_support::nats_url(test));
    let stream = NatsStream::create(&nats, Duration::from_secs(120)).await;
    let mut vars = nats_env(&stream);
    vars.push(("OUTBOX_RELAY__OWNER", format!("my-{}", db.name)));
    vars.push(("OUTBOX_RELAY__STATS_INTERVAL", "200ms".into()));
    let url = db.url();
    let out = db.outbox(&url, &[], &["migrate"]);
    assert!(out.status.success(), "{}", text(&out));
    let port = outbox_test_support::free_port();
    let listen = format!("127.0.0.1:{port}");
    let child = db
        .command(
            &url,
            &borrowed(&vars),
            &["relay", "--workers", "2", "--listen", &listen],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut relay = Daemon { child, port };
    relay.wait_ready(Duration::from_secs(30));
    wait_readyz(&relay, 200, |v| v["registry"]["ok"] == true);
    relay.wait_metric(
        "outbox_relays",
        "state=\"live\"",
        |v| v == 2.0,
        Duration::from_secs(10),
    );
    let (code, stdout, err) = output(db.outbox(
        &url,
        &borrowed(&vars),
        &["--json", "status", "--no-consumers"],
    ));
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(doc["relays"]["live"], 2, "{doc}");
    assert_eq!(doc["relays"]["entries"][1]["pid"], relay.child.id());
    let live = doc["relays"]["entries"][0]["owner"]
        .as_str()
        .unwrap()
        .to_owned();
    let (code, _, err) = output(db.outbox(
        &url,
        &borrowed(&vars),
        &["parked", "release-claims", &live, "--yes"],
    ));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("is live"), "{err}");
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "{stderr}");
    let (_, stdout, _) = output(db.outbox(
        &url,
        &borrowed(&vars),
        &["--json", "status", "--no-consumers"],
    ));
    let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(owners(&doc), vec![], "deregistered on SIGTERM: {doc}");
    db.drop().await;
}
