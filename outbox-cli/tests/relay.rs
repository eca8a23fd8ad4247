//! `outbox relay` driven as a user would: start-up failures with clear errors and exit codes,
//! relaying with /healthz, /readyz and /metrics, SIGTERM during a batch, a permanent error while
//! running. Needs `DATABASE_URL` and `KAFKA_BROKERS` (`scripts/test`), unless
//! `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;

use std::time::{Duration, Instant};

use common::text;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_drains_serves_health_and_metrics_and_stops_on_sigterm() {
    let env = env_or_skip!("relay_drains", 3);
    env.migrate();
    let events = env.append(20, 3).await;
    let mut relay = env.spawn_relay(&["--workers", "2", "--batch-size", "16"]);
    relay.wait_ready(Duration::from_secs(30));
    assert_eq!(relay.get("/healthz").map(|r| r.0), Some(200));
    env.wait_count("published", events.len() as i64, Duration::from_secs(60))
        .await;
    // Metrics moved by relaying (each scraped from /metrics).
    let n = events.len() as f64;
    relay.wait_metric(
        "outbox_published_total",
        "",
        |v| v >= n,
        Duration::from_secs(10),
    );
    relay.wait_metric(
        "outbox_publish_latency_seconds_count",
        "",
        |v| v >= n,
        Duration::from_secs(10),
    );
    relay.wait_metric(
        "outbox_claim_seconds_count",
        "",
        |v| v > 0.0,
        Duration::from_secs(10),
    );
    relay.wait_metric(
        "outbox_complete_seconds_count",
        "",
        |v| v > 0.0,
        Duration::from_secs(10),
    );
    relay.wait_metric(
        "outbox_unpublished",
        "",
        |v| v == 0.0,
        Duration::from_secs(10),
    );
    relay.wait_metric(
        "outbox_db_pool_connections",
        "state=\"idle\"",
        |v| v >= 1.0,
        Duration::from_secs(10),
    );
    relay.wait_metric(
        "outbox_store_total_bytes",
        "",
        |v| v > 0.0,
        Duration::from_secs(10),
    );
    // Marking rows published leaves dead tuples until a vacuum.
    relay.wait_metric(
        "outbox_store_dead_tuples",
        "",
        |v| v > 0.0,
        Duration::from_secs(15),
    );
    relay.wait_metric("outbox_relay_up", "", |v| v == 1.0, Duration::from_secs(10));
    sqlx::raw_sql(&format!("VACUUM \"{}\".outbox_events", env.schema))
        .execute(&env.pool)
        .await
        .unwrap();
    // Just vacuumed: the age is that of this VACUUM, not of the table.
    relay.wait_metric(
        "outbox_store_last_vacuum_age_seconds",
        "",
        |v| (0.0..60.0).contains(&v),
        Duration::from_secs(10),
    );

    // The application's conflict counter reaches the daemon.
    let store = env.store();
    store.record_conflict(&env.pool, "order").await.unwrap();
    store.record_conflict(&env.pool, "order").await.unwrap();
    relay.wait_metric(
        "outbox_conditional_update_conflicts_total",
        "aggregate_type=\"order\"",
        |v| v == 2.0,
        Duration::from_secs(10),
    );
    let (code, stdout, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert!(stderr.contains("relay stopped (signal)"), "{stderr}");
    assert!(
        stderr.contains(&format!("{} published", events.len())),
        "{stderr}"
    );
    assert!(
        !stderr.contains("\u{1b}["),
        "no colour codes without a terminal: {stderr}"
    );
    // Every event once or more in the topic, first deliveries in version order per aggregate.
    let records = common::read_topic(&env.brokers, &env.topic, 3, events.len());
    let mut firsts: std::collections::BTreeMap<String, Vec<i64>> = Default::default();
    let mut seen = std::collections::HashSet::new();
    for r in &records {
        if seen.insert(r.event_id.clone()) {
            firsts
                .entry(r.aggregate_id.clone())
                .or_default()
                .push(r.version);
        }
    }
    assert_eq!(seen.len(), events.len());
    for (agg, vs) in firsts {
        assert_eq!(vs, vec![1, 2, 3], "{agg}");
    }
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_logs_json_lines_when_asked() {
    let env = env_or_skip!("relay_json_logs", 1);
    env.migrate();
    let relay = env.spawn_relay(&["--no-cleanup"]);
    let mut relay = relay;
    relay.wait_ready(Duration::from_secs(30));
    let (code, _, stderr) = {
        common::signal(relay.child.id(), "TERM");
        relay.wait(Duration::from_secs(30))
    };
    assert_eq!(code, 0);
    let out = env
        .cmd()
        .args([
            "--log-format",
            "json",
            "relay",
            "--listen",
            "127.0.0.1:0",
            "--no-cleanup",
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    common::signal(out.id(), "TERM");
    let out = out.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let json_lines = err
        .lines()
        .filter(|l| l.starts_with('{'))
        .filter(|l| serde_json::from_str::<serde_json::Value>(l).is_ok())
        .count();
    assert!(json_lines >= 2, "JSON log lines expected: {err}");
    assert!(stderr.contains("relay starting"), "{stderr}");
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_fails_fast_with_the_fix_when_it_cannot_start() {
    let env = env_or_skip!("relay_start_failures", 1);
    // Missing table: exit 4, says `outbox migrate`.
    let out = env.run(&["relay", "--no-http"]);
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("outbox migrate"),
        "{}",
        text(&out)
    );
    env.migrate();
    // Unreachable database: exit 3 fast, naming host and port, never the password.
    let started = Instant::now();
    let out = env
        .cmd()
        .env("DATABASE_URL", "postgres://app:hunter2@127.0.0.1:1/shop")
        .args(["relay", "--no-http"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("127.0.0.1:1") && err.contains("connection refused"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    // A database that does not answer at all (a dropped packet): within connect_timeout.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let started = Instant::now();
    let out = env
        .cmd()
        .env(
            "DATABASE_URL",
            format!("postgres://app@127.0.0.1:{port}/shop"),
        )
        .env("OUTBOX_DATABASE__CONNECT_TIMEOUT", "1s")
        .args(["relay", "--no-http"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no answer within 1s"),
        "{}",
        text(&out)
    );
    assert!(started.elapsed() < Duration::from_secs(8));
    drop(silent);
    // Unreachable broker: exit 3, naming the brokers.
    let out = env
        .cmd()
        .env("KAFKA_BROKERS", "127.0.0.1:1")
        .env("OUTBOX_KAFKA__METADATA_TIMEOUT", "2s")
        .args(["relay", "--no-http"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("127.0.0.1:1"),
        "{}",
        text(&out)
    );
    // Missing topic: exit 4, names it.
    let out = env.run(&["relay", "--no-http", "--topic", "no-such-topic-here"]);
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no-such-topic-here"));
    // A lease that does not outlive the delivery timeout: exit 2.
    let out = env.run(&[
        "relay",
        "--no-http",
        "--lease",
        "3s",
        "--delivery-timeout",
        "5s",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("outbox.lease"),
        "{}",
        text(&out)
    );
    // An unsafe producer property: exit 2, names it.
    let out = env.run(&["relay", "--no-http", "--producer-property", "acks=1"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("acks=1"),
        "{}",
        text(&out)
    );
    // A missing privilege: exit 4 with the GRANT.
    let role = format!("r_{}", env.schema);
    sqlx::raw_sql(&format!(
        "CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA \"{s}\" TO {role}; GRANT SELECT ON ALL TABLES IN SCHEMA \"{s}\" TO {role};",
        s = env.schema
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    let url = env.url.replacen("postgres@", &format!("{role}@"), 1);
    let out = env
        .cmd()
        .env("DATABASE_URL", &url)
        .args(["relay", "--no-http"])
        .output()
        .unwrap();
    let _ = sqlx::raw_sql(&format!("DROP OWNED BY {role}; DROP ROLE {role};"))
        .execute(&env.pool)
        .await;
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("lacks privileges") && err.contains("GRANT INSERT"),
        "{err}"
    );
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_error_while_running_stops_the_relay_with_the_fix() {
    let env = env_or_skip!("relay_permanent_error", 1);
    env.migrate();
    let mut relay = env.spawn_relay(&["--no-cleanup"]);
    relay.wait_ready(Duration::from_secs(30));
    sqlx::raw_sql(&format!(
        "DROP TABLE \"{}\".outbox_events CASCADE",
        env.schema
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    // Until it exits, /readyz says why.
    let mut saw_reason = false;
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        match relay.get("/readyz") {
            Some((503, body)) => {
                saw_reason |= body.contains("outbox");
            }
            None => break,
            _ => {}
        }
        if relay.child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, _, stderr) = relay.wait(Duration::from_secs(30));
    assert_eq!(code, 4, "{stderr}");
    assert!(stderr.contains("outbox migrate"), "{stderr}");
    assert!(stderr.contains("relay stopped (fatal)"), "{stderr}");
    let _ = saw_reason; // the relay may exit before a scrape; the exit is what matters
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_batch_finishes_or_releases_it_and_nothing_is_lost() {
    let env = env_or_skip!("relay_sigterm", 4);
    env.migrate();
    let events = env.append(400, 2).await;
    // Small batches, one record per producer request: many batches in flight when TERM comes.
    let mut relay = env.spawn_relay(&[
        "--workers",
        "2",
        "--batch-size",
        "50",
        "--producer-property",
        "batch.num.messages=1",
        "--no-cleanup",
    ]);
    relay.wait_ready(Duration::from_secs(30));
    relay.wait_metric(
        "outbox_published_total",
        "",
        |v| v > 0.0,
        Duration::from_secs(30),
    );
    let (code, _, stderr) = relay.terminate(Duration::from_secs(60));
    assert_eq!(code, 0, "{stderr}");
    // Nothing is left claimed: every batch was recorded or given back.
    let leased: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".outbox_events_aggregate WHERE lease_token IS NOT NULL AND lease_until > now()",
        env.schema
    ))
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(leased, 0, "claims left after a graceful stop: {stderr}");
    let published = env.count("published").await;
    assert!(published > 0);
    // A second relay drains the rest at once (no lease to wait for).
    let mut again = env.spawn_relay(&["--no-cleanup"]);
    again.wait_ready(Duration::from_secs(30));
    env.wait_count("published", events.len() as i64, Duration::from_secs(8))
        .await;
    assert_eq!(env.count("parked").await, 0);
    let (code, _, _) = again.terminate(Duration::from_secs(30));
    assert_eq!(code, 0);
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_of_a_relay_that_died_mid_batch_count_as_republished() {
    use outbox_core::prelude::*;
    use outbox_core::{ClaimMode, ClaimRequest};
    let env = env_or_skip!("relay_resend", 1);
    env.migrate();
    let events = env.append(3, 1).await;
    // A relay claims the batch and dies before marking it (sent or not, nobody knows): its
    // claim is never completed nor released, and its one-second lease runs out.
    let dying = outbox_postgres::PostgresOutboxStore::builder(env.pool.clone())
        .schema(env.schema.clone())
        .claim_mode(ClaimMode::lease(Duration::from_secs(1)).unwrap())
        .build()
        .unwrap();
    let batch = dying
        .claim(&ClaimRequest::new("dies-mid-batch", 10))
        .await
        .unwrap();
    assert_eq!(batch.records.len(), events.len());
    drop(batch);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut relay = env.spawn_relay(&["--no-cleanup"]);
    relay.wait_ready(Duration::from_secs(30));
    let t = Duration::from_secs(30);
    let n = events.len() as f64;
    relay.wait_metric("outbox_published_total", "", |v| v >= n, t);
    relay.wait_metric("outbox_republished_total", "", |v| v == n, t);
    // First sends of new events do not move it.
    env.append_versions(3, 2..=2).await;
    relay.wait_metric("outbox_published_total", "", |v| v >= 2.0 * n, t);
    assert_eq!(relay.metric("outbox_republished_total", ""), Some(n));
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "{stderr}");
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduled_cleanup_removes_finished_rows() {
    let env = env_or_skip!("relay_cleanup", 1);
    env.migrate();
    let events = env.append(10, 1).await;
    let mut relay = env.spawn_relay_env(
        &[
            ("OUTBOX_CLEANUP__INTERVAL", "300ms"),
            ("OUTBOX_CLEANUP__RETENTION", "0s"),
            ("OUTBOX_CLEANUP__BATCH_SIZE", "3"),
        ],
        &[],
    );
    relay.wait_ready(Duration::from_secs(30));
    let n = events.len() as f64;
    relay.wait_metric(
        "outbox_cleanup_removed_total",
        "",
        |v| v >= n,
        Duration::from_secs(30),
    );
    assert_eq!(env.count("published").await, 0);
    assert_eq!(env.count("pending").await, 0);
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains(&format!("{} rows cleaned up", events.len())),
        "{stderr}"
    );
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_parks_nothing_and_drains_when_it_returns() {
    let env = env_or_skip!("relay_broker_outage", 0);
    let Some(bin) = outbox_test_support::tansu_bin("relay_broker_outage") else {
        return;
    };
    let mut tansu = outbox_test_support::Tansu::start(bin);
    let brokers = tansu.brokers();
    common::create_topic(&brokers, &env.topic, 2, &[]).await;
    env.migrate();
    let first = env.append(10, 1).await;
    let mut relay = env.spawn_relay_env(
        &[
            ("KAFKA_BROKERS", brokers.as_str()),
            ("OUTBOX_KAFKA__DELIVERY_TIMEOUT", "2s"),
            ("OUTBOX_OUTBOX__LEASE", "8s"),
            ("OUTBOX_RELAY__CIRCUIT_MAX", "1s"),
            ("OUTBOX_RELAY__MAX_ATTEMPTS", "2"),
        ],
        &["--no-cleanup"],
    );
    relay.wait_ready(Duration::from_secs(30));
    env.wait_count("published", first.len() as i64, Duration::from_secs(30))
        .await;
    // The broker goes away; the business keeps appending.
    tansu.stop();
    env.append_versions(10, 2..=2).await;
    relay.wait_metric(
        "outbox_relay_circuit_open",
        "",
        |v| v == 1.0,
        Duration::from_secs(30),
    );
    relay.wait_metric(
        "outbox_relay_circuit_opened_total",
        "",
        |v| v >= 1.0,
        Duration::from_secs(5),
    );
    // Longer than the attempt limit would allow for the records' own failures.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(env.count("parked").await, 0, "an outage parks nothing");
    // It comes back (memory storage: the topic is created again).
    tansu.restart();
    common::create_topic(&brokers, &env.topic, 2, &[]).await;
    env.wait_count("published", 20, Duration::from_secs(90))
        .await;
    assert_eq!(env.count("parked").await, 0);
    relay.wait_metric(
        "outbox_relay_circuit_open",
        "",
        |v| v == 0.0,
        Duration::from_secs(10),
    );
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "{stderr}");
    // Logged per state change, not per event.
    let warns = stderr.lines().filter(|l| l.contains("WARN")).count();
    assert!(warns < 20, "{warns} warnings for 10 events: {stderr}");
    env.drop_schema().await;
}

/// The upgrade note's answer for aggregates whose earlier rows are gone (adopted with a history,
/// or cleaned up without archiving before migration 3): `outbox.accept_first_version`. Without
/// it the deployed relay holds such an aggregate's first stored version as a version gap; with
/// it (file or environment) the relay publishes it. A value that is not a boolean is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_first_version_lets_the_deployed_relay_publish_an_aggregate_that_starts_late() {
    let env = env_or_skip!("relay_accept_first_version", 1);
    env.migrate();
    let late = env.append_versions(1, 5..=5).await;
    let t = Duration::from_secs(30);

    // Default: version 5 of an aggregate without state skips 1..=4, and is held.
    let mut relay = env.spawn_relay(&["--no-cleanup"]);
    relay.wait_ready(t);
    relay.wait_metric("outbox_version_gaps_held", "", |v| v == 1.0, t);
    assert_eq!(env.count("published").await, 0);
    let (code, _, stderr) = relay.terminate(t);
    assert_eq!(code, 0, "{stderr}");

    // A bad value: exit 2 naming the key, before anything runs.
    let out = env
        .cmd()
        .env("OUTBOX_OUTBOX__ACCEPT_FIRST_VERSION", "maybe")
        .args(["relay", "--no-http"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("outbox.accept_first_version") && err.contains("expected a boolean"),
        "{}",
        text(&out)
    );
    // The file form is read and shown by `outbox config`.
    std::fs::write(
        env.dir.join("outbox.toml"),
        "[outbox]\naccept_first_version = true\n",
    )
    .unwrap();
    let (code, shown, stderr) = env.json(&["config"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(shown["outbox"]["accept_first_version"], true, "{shown}");
    std::fs::remove_file(env.dir.join("outbox.toml")).unwrap();

    // On (from the environment): the lowest pending version is the aggregate's first.
    let mut relay = env.spawn_relay_env(&[("OUTBOX_OUTBOX__ACCEPT_FIRST_VERSION", "true")], &[]);
    relay.wait_ready(t);
    env.wait_count("published", 1, t).await;
    assert_eq!(env.count("parked").await, 0);
    let (code, _, stderr) = relay.terminate(t);
    assert_eq!(code, 0, "{stderr}");
    let records = common::read_topic(&env.brokers, &env.topic, 1, 1);
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0].event_id, late[0].event_id.to_string());
    assert_eq!(records[0].version, 5);
    env.drop_schema().await;
}

/// A topic that accepts smaller record batches (`max.message.bytes`) than the producer builds
/// (`batch.size`, librdkafka's default 1,000,000): the broker would refuse whole batches of
/// small records. `outbox check` names it as a violation with the fix, and the relay refuses to
/// start (exit 2); with `batch.size` within the limit both pass and the relay publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_and_the_relay_refuse_producer_batches_larger_than_the_topic_accepts() {
    let env = env_or_skip!("relay_batch_vs_topic_limit", 0);
    common::create_topic(
        &env.brokers,
        &env.topic,
        1,
        &[("max.message.bytes", "50000")],
    )
    .await;
    env.migrate();
    let batch_finding = |v: &serde_json::Value, severity: &str| {
        v["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["check"] == "batch_size" && f["severity"] == severity)
            .cloned()
    };
    let (code, v, _) = env.json(&["check"]);
    assert_eq!(code, 1, "{v}");
    let found = batch_finding(&v, "error").unwrap_or_else(|| panic!("{v}"));
    assert!(
        found["message"]
            .as_str()
            .unwrap()
            .contains("at most 50000 bytes"),
        "{found}"
    );
    assert!(
        found["fix"]
            .as_str()
            .unwrap()
            .contains("\"batch.size\" = 50000"),
        "{found}"
    );
    let out = env.run(&["relay", "--no-http"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("max.message.bytes") && err.contains("\"batch.size\" = 50000"),
        "{err}"
    );

    std::fs::write(
        env.dir.join("outbox.toml"),
        "[kafka.producer]\n\"batch.size\" = 50000\n",
    )
    .unwrap();
    let (code, v, _) = env.json(&["check"]);
    assert_eq!(code, 0, "{v}");
    assert!(batch_finding(&v, "ok").is_some(), "{v}");
    let events = env.append(3, 1).await;
    let mut relay = env.spawn_relay(&["--no-cleanup"]);
    relay.wait_ready(Duration::from_secs(30));
    env.wait_count("published", events.len() as i64, Duration::from_secs(30))
        .await;
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "{stderr}");
    env.drop_schema().await;
}
