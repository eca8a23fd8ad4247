//! `outbox relay`, `check` and `status` on NATS JetStream and RabbitMQ, chosen by
//! `[transport] kind`, driven as a user would: the relay drains a PostgreSQL outbox into a
//! stream of the test's own (or an exchange with a quorum queue of its own) with nothing lost,
//! nothing from a rolled-back transaction, first deliveries in order per aggregate; `check`
//! reports a too-short duplicate window and a missing stream or exchange; configuration
//! mistakes exit 2 before any network access, an unreachable server exits 3. Needs
//! `DATABASE_URL`, NATS (`NATS_URL`, default 127.0.0.1:4222) and RabbitMQ (`AMQP_URL`, default
//! guest@127.0.0.1:5672), unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;
mod transport_support;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::{text, TestEnv};
use outbox_core::Envelope;
use transport_support::{check_invariants, NatsStream, RabbitTopology};

macro_rules! require {
    ($e:expr) => {
        match $e {
            Some(v) => v,
            None => return,
        }
    };
}

/// The environment of a relay publishing to `stream`.
fn nats_env(stream: &NatsStream) -> Vec<(&'static str, String)> {
    vec![
        ("OUTBOX_TRANSPORT__KIND", "nats".into()),
        ("NATS_URL", stream.url.clone()),
        ("OUTBOX_NATS__SUBJECT_PREFIX", stream.prefix.clone()),
        ("OUTBOX_NATS__DELIVERY_TIMEOUT", "5s".into()),
    ]
}

/// The environment of a relay publishing to `t`'s exchange.
fn rabbit_env(t: &RabbitTopology) -> Vec<(&'static str, String)> {
    vec![
        ("OUTBOX_TRANSPORT__KIND", "rabbitmq".into()),
        ("AMQP_URL", t.url.clone()),
        ("OUTBOX_RABBITMQ__EXCHANGE", t.exchange.clone()),
        ("OUTBOX_RABBITMQ__DELIVERY_TIMEOUT", "5s".into()),
    ]
}

fn borrowed<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// Committed events (`aggregates` x versions 1..=`versions`), with a rolled-back
/// transaction's event between them for every aggregate; returns (committed, rolled back).
async fn load(
    env: &TestEnv,
    aggregates: usize,
    versions: i64,
) -> (Vec<(uuid::Uuid, String, i64)>, HashSet<uuid::Uuid>) {
    let store = env.store();
    let mut committed = Vec::new();
    let mut rolled_back = HashSet::new();
    for v in 1..=versions {
        for a in 0..aggregates {
            let agg = format!("o-{a}");
            // A transaction that appends and rolls back (the same version: the business
            // change it belonged to never happened).
            let ghost = Envelope::builder("order", &agg, v, "order.changed")
                .build()
                .unwrap();
            let mut tx = env.pool.begin().await.unwrap();
            store.append(&mut *tx, &ghost).await.unwrap();
            tx.rollback().await.unwrap();
            rolled_back.insert(ghost.event_id.as_uuid());
            let e = Envelope::builder("order", &agg, v, "order.changed")
                .json(&serde_json::json!({ "v": v }))
                .unwrap()
                .build()
                .unwrap();
            let mut tx = env.pool.begin().await.unwrap();
            store.append(&mut *tx, &e).await.unwrap();
            tx.commit().await.unwrap();
            committed.push((e.event_id.as_uuid(), agg, v));
        }
    }
    (committed, rolled_back)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_drains_postgres_into_nats_jetstream() {
    let test = "relay_drains_postgres_into_nats_jetstream";
    let env = require!(TestEnv::without_kafka(test).await);
    let url = require!(outbox_test_support::nats_url(test));
    let stream = NatsStream::create(&url, Duration::from_secs(120)).await;
    let vars = nats_env(&stream);
    env.migrate();
    let (committed, rolled_back) = load(&env, 12, 4).await;
    let mut relay = env.spawn_relay_env(&borrowed(&vars), &["--workers", "2", "--batch-size", "7"]);
    relay.wait_ready(Duration::from_secs(30));
    // The readiness watcher checks the stream itself (within a stats interval).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, ready) = relay.get("/readyz").unwrap();
        if ready.contains(&format!("stream(s) [\\\"{}\\\"]", stream.name)) {
            break;
        }
        assert!(Instant::now() < deadline, "{ready}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    env.wait_count("published", committed.len() as i64, Duration::from_secs(60))
        .await;
    // `status` names the transport.
    let (code, doc, err) = env.json_env(&borrowed(&vars), &["status", "--no-consumers"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(doc["transport"]["kind"], "nats", "{doc}");
    assert_eq!(doc["transport"]["subject_prefix"], stream.prefix.as_str());
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains(&format!("{} published", committed.len())),
        "{stderr}"
    );
    assert!(stderr.contains("transport=nats"), "{stderr}");
    let records = stream.read_settled(committed.len()).await;
    check_invariants(&records, &committed, &rolled_back, "nats");
    // An operator replay inside the stream's duplicate window (120 s here) reaches the stream:
    // the window must not take it for the relay's re-send of the same event.
    let (code, doc, err) = env.json_env(
        &borrowed(&vars),
        &["replay", "--aggregate-id", "o-1", "--yes"],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(doc["replayed"], 4, "{doc}");
    let after = stream.read_settled(committed.len() + 4).await;
    assert_eq!(after.len(), committed.len() + 4, "replayed records stored");
    let replayed: Vec<_> = after[committed.len()..].to_vec();
    assert!(
        replayed.iter().all(|(agg, _, _)| agg == "o-1"),
        "{replayed:?}"
    );
    assert_eq!(
        replayed.iter().map(|r| r.2).collect::<Vec<_>>(),
        vec![1, 2, 3, 4],
        "a replay keeps the published order"
    );
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_drains_postgres_into_rabbitmq() {
    let test = "relay_drains_postgres_into_rabbitmq";
    let env = require!(TestEnv::without_kafka(test).await);
    let url = require!(outbox_test_support::amqp_url(test));
    let topology = RabbitTopology::create(&url).await;
    let vars = rabbit_env(&topology);
    env.migrate();
    let (committed, rolled_back) = load(&env, 12, 4).await;
    let mut relay = env.spawn_relay_env(&borrowed(&vars), &["--workers", "2", "--batch-size", "7"]);
    relay.wait_ready(Duration::from_secs(30));
    let (_, ready) = relay.get("/readyz").unwrap();
    assert!(ready.contains(&topology.exchange), "{ready}");
    env.wait_count("published", committed.len() as i64, Duration::from_secs(60))
        .await;
    let out = env
        .cmd()
        .envs(borrowed(&vars))
        .args(["status", "--no-consumers"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("transport: rabbitmq") && shown.contains(&topology.exchange),
        "{shown}"
    );
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains(&format!("{} published", committed.len())),
        "{stderr}"
    );
    let records = topology.drain_settled(committed.len()).await;
    check_invariants(&records, &committed, &rolled_back, "rabbitmq");
    env.drop_schema().await;
}

/// The findings of `check --json` as (check, severity, message).
fn findings(doc: &serde_json::Value) -> Vec<(String, String, String)> {
    doc["findings"]
        .as_array()
        .unwrap_or_else(|| panic!("findings: {doc}"))
        .iter()
        .map(|f| {
            (
                f["check"].as_str().unwrap().to_owned(),
                f["severity"].as_str().unwrap().to_owned(),
                f["message"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn has(fs: &[(String, String, String)], check: &str, severity: &str, text: &str) -> bool {
    fs.iter()
        .any(|(c, s, m)| c == check && s == severity && m.contains(text))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_the_duplicate_window_and_a_missing_stream_on_nats() {
    let test = "check_reports_the_duplicate_window_and_a_missing_stream_on_nats";
    let env = require!(TestEnv::without_kafka(test).await);
    let url = require!(outbox_test_support::nats_url(test));
    env.migrate();
    // A duplicate window of 2 s under a 10 s lease: a warning naming both, with the fix.
    let short = NatsStream::create(&url, Duration::from_secs(2)).await;
    let (code, doc, err) = env.json_env(&borrowed(&nats_env(&short)), &["check"]);
    let fs = findings(&doc);
    assert_eq!(code, 0, "warnings only: {doc} {err}");
    assert!(
        has(
            &fs,
            "duplicate_window",
            "warning",
            "duplicate window 2s is shorter than the claim (10s)"
        ),
        "{fs:#?}"
    );
    assert!(has(&fs, "stream", "ok", &short.name), "{fs:#?}");
    assert!(has(&fs, "storage", "ok", "file storage"), "{fs:#?}");
    assert!(has(&fs, "publisher", "ok", "PubAck"), "{fs:#?}");
    assert!(has(&fs, "lease", "ok", "delivery timeout 5s"), "{fs:#?}");
    // A window that covers the lease: ok.
    let long = NatsStream::create(&url, Duration::from_secs(120)).await;
    let (code, doc, _) = env.json_env(&borrowed(&nats_env(&long)), &["check"]);
    let fs = findings(&doc);
    assert_eq!(code, 0, "{doc}");
    assert!(
        has(&fs, "duplicate_window", "ok", "covers the claim"),
        "{fs:#?}"
    );
    // No stream captures the subjects: a violation (exit 1) naming them and the fix; the
    // relay refuses to start (exit 4).
    let mut vars = nats_env(&long);
    vars[2].1 = outbox_test_support::unique("nostream");
    let (code, doc, _) = env.json_env(&borrowed(&vars), &["check"]);
    let fs = findings(&doc);
    assert_eq!(code, 1, "{doc}");
    assert!(
        has(
            &fs,
            "stream",
            "error",
            &format!("no JetStream stream captures \"{}.>\"", vars[2].1)
        ),
        "{fs:#?}"
    );
    let out = env
        .cmd()
        .envs(borrowed(&vars))
        .args(["relay", "--no-http"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("create a stream capturing"),
        "{}",
        text(&out)
    );
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_the_exchange_on_rabbitmq() {
    let test = "check_reports_the_exchange_on_rabbitmq";
    let env = require!(TestEnv::without_kafka(test).await);
    let url = require!(outbox_test_support::amqp_url(test));
    env.migrate();
    let topology = RabbitTopology::create(&url).await;
    let (code, doc, err) = env.json_env(&borrowed(&rabbit_env(&topology)), &["check"]);
    let fs = findings(&doc);
    assert_eq!(code, 0, "{doc} {err}");
    assert!(
        has(
            &fs,
            "exchange",
            "ok",
            &format!("{}: durable topic exchange", topology.exchange)
        ),
        "{fs:#?}"
    );
    assert!(
        has(&fs, "confirms", "ok", "publisher confirms on"),
        "{fs:#?}"
    );
    // The wrong type: a violation naming what was expected.
    let mut vars = rabbit_env(&topology);
    vars.push(("OUTBOX_RABBITMQ__EXCHANGE_KIND", "direct".into()));
    let (code, doc, _) = env.json_env(&borrowed(&vars), &["check"]);
    assert_eq!(code, 1, "{doc}");
    assert!(
        has(
            &findings(&doc),
            "exchange",
            "error",
            "is not a durable direct exchange"
        ),
        "{doc}"
    );
    // A missing exchange: a violation (exit 1); the relay refuses to start (exit 4).
    let mut vars = rabbit_env(&topology);
    vars[2].1 = outbox_test_support::unique("noexchange");
    let (code, doc, _) = env.json_env(&borrowed(&vars), &["check"]);
    assert_eq!(code, 1, "{doc}");
    assert!(
        has(
            &findings(&doc),
            "exchange",
            "error",
            &format!("exchange {:?} does not exist", vars[2].1)
        ),
        "{doc}"
    );
    let out = env
        .cmd()
        .envs(borrowed(&vars))
        .args(["relay", "--no-http"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("declare exchange"),
        "{}",
        text(&out)
    );
    env.drop_schema().await;
}

/// Runs `outbox relay --no-http` with `vars`; (exit code, stderr), bounded.
fn relay_exit(env: &TestEnv, vars: &[(&str, &str)], remove: &[&str]) -> (Option<i32>, String) {
    let mut cmd = env.cmd();
    for r in remove {
        cmd.env_remove(r);
    }
    let started = Instant::now();
    let out = cmd
        .envs(vars.iter().copied())
        .args(["relay", "--no-http"])
        .output()
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_configuration_errors_exit_2_before_any_network_access() {
    let test = "transport_configuration_errors_exit_2_before_any_network_access";
    let env = require!(TestEnv::without_kafka(test).await);
    // No database answers here: a configuration error must still be reported as one (exit 2),
    // not as the unreachable database (exit 3).
    let down = [("DATABASE_URL", "postgres://app@127.0.0.1:1/shop")];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut v: Vec<(&str, &str)> = down.to_vec();
        v.extend_from_slice(extra);
        v
    };
    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (
            with(&[("OUTBOX_TRANSPORT__KIND", "kafak")]),
            "transport.kind: unknown variant: found `kafak`, expected `one of `kafka`, `nats`, `rabbitmq``",
        ),
        (
            with(&[("OUTBOX_TRANSPORT__KIND", "nats")]),
            "no NATS server is configured",
        ),
        (
            with(&[("OUTBOX_TRANSPORT__KIND", "rabbitmq")]),
            "no RabbitMQ URI is configured",
        ),
        (
            with(&[
                ("OUTBOX_TRANSPORT__KIND", "nats"),
                ("NATS_URL", "http://relay:hunter2@127.0.0.1:4222"),
            ]),
            "is not a NATS server URL",
        ),
        (
            with(&[
                ("OUTBOX_TRANSPORT__KIND", "rabbitmq"),
                ("AMQP_URL", "amqp://relay:hunter2@127.0.0.1:99999/%2f"),
            ]),
            "is not an AMQP URI",
        ),
        (
            with(&[
                ("OUTBOX_TRANSPORT__KIND", "nats"),
                ("NATS_URL", "nats://127.0.0.1:4222"),
                ("OUTBOX_NATS__SUBJECT_PREFIX", "out box"),
            ]),
            "subject_prefix",
        ),
        (
            with(&[
                ("OUTBOX_TRANSPORT__KIND", "rabbitmq"),
                ("AMQP_URL", "amqp://127.0.0.1:5672/%2f"),
                ("OUTBOX_RABBITMQ__EXCHANGE", "amq.topic"),
            ]),
            "predefined",
        ),
        (
            // The lease must outlive the chosen transport's delivery timeout.
            with(&[
                ("OUTBOX_TRANSPORT__KIND", "rabbitmq"),
                ("AMQP_URL", "amqp://127.0.0.1:5672/%2f"),
                ("OUTBOX_RABBITMQ__DELIVERY_TIMEOUT", "30s"),
            ]),
            "relay configuration refused",
        ),
        (
            with(&[
                ("OUTBOX_TRANSPORT__KIND", "nats"),
                ("NATS_URL", "nats://127.0.0.1:4222"),
                ("OUTBOX_NATS__DELIVERY_TIMEOUT", "30s"),
            ]),
            "does not fit in the relay's lease",
        ),
        (
            // Run claims (`relay.run`): 0 is no run at all (1 turns them off).
            with(&[
                ("OUTBOX_TRANSPORT__KIND", "nats"),
                ("NATS_URL", "nats://127.0.0.1:4222"),
                ("OUTBOX_RELAY__RUN", "0"),
            ]),
            "run must be in 1..=",
        ),
        (
            with(&[
                ("OUTBOX_TRANSPORT__KIND", "nats"),
                ("NATS_URL", "nats://127.0.0.1:4222"),
                ("OUTBOX_RELAY__RUN", "10001"),
            ]),
            "run must be in 1..=",
        ),
        (
            // The waves' time budget (`relay.run_budget`): below 1 ms, and above 60 s.
            with(&[
                ("OUTBOX_TRANSPORT__KIND", "nats"),
                ("NATS_URL", "nats://127.0.0.1:4222"),
                ("OUTBOX_RELAY__RUN_BUDGET", "500us"),
            ]),
            "run_budget must be in 1ms..=60s",
        ),
        (
            with(&[
                ("OUTBOX_TRANSPORT__KIND", "nats"),
                ("NATS_URL", "nats://127.0.0.1:4222"),
                ("OUTBOX_RELAY__RUN_BUDGET", "61s"),
            ]),
            "run_budget must be in 1ms..=60s",
        ),
    ];
    for (vars, expected) in &cases {
        let (code, err) = relay_exit(&env, vars, &["NATS_URL", "AMQP_URL"]);
        assert_eq!(code, Some(2), "{vars:?}: {err}");
        assert!(
            err.contains(expected),
            "{vars:?}: expected {expected:?} in {err}"
        );
        assert!(!err.contains("hunter2"), "{err}");
    }
    // A [nats] section beside kind = "kafka" is kept for later, not validated now: loading
    // succeeds (`outbox config`), and the Kafka relay goes on to its own checks.
    std::fs::write(
        env.dir.join("outbox.toml"),
        "[nats]\nsubject_prefix = \"orders\"\n[rabbitmq]\nexchange = \"orders\"\n",
    )
    .unwrap();
    let out = env
        .cmd()
        .env_remove("NATS_URL")
        .args(["config"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(shown.lines().any(|l| l == "kind = \"kafka\""), "{shown}");
    let (code, err) = relay_exit(&env, &down, &["NATS_URL", "AMQP_URL"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("no Kafka brokers configured"), "{err}");
    std::fs::remove_file(env.dir.join("outbox.toml")).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_transport_exits_3_naming_it() {
    let test = "an_unreachable_transport_exits_3_naming_it";
    let env = require!(TestEnv::without_kafka(test).await);
    env.migrate();
    let cases: [(&[(&str, &str)], &str); 2] = [
        (
            &[
                ("OUTBOX_TRANSPORT__KIND", "nats"),
                ("NATS_URL", "nats://relay:hunter2@127.0.0.1:1"),
                ("OUTBOX_NATS__CONNECT_TIMEOUT", "1s"),
            ],
            "cannot reach NATS JetStream at nats://relay:***@127.0.0.1:1",
        ),
        (
            &[
                ("OUTBOX_TRANSPORT__KIND", "rabbitmq"),
                ("AMQP_URL", "amqp://relay:hunter2@127.0.0.1:1/%2f"),
                ("OUTBOX_RABBITMQ__CONNECT_TIMEOUT", "1s"),
            ],
            "cannot reach RabbitMQ at amqp://relay:***@127.0.0.1:1/%2f",
        ),
    ];
    for (vars, expected) in cases {
        let (code, err) = relay_exit(&env, vars, &[]);
        assert_eq!(code, Some(3), "{vars:?}: {err}");
        assert!(err.contains(expected), "{vars:?}: {err}");
        assert!(!err.contains("hunter2"), "{err}");
        // `check` reports it as a violation.
        let (code, doc, _) = env.json_env(vars, &["check"]);
        assert_eq!(code, 1, "{doc}");
        assert!(doc.to_string().contains("cannot reach"), "{doc}");
    }
    env.drop_schema().await;
}
