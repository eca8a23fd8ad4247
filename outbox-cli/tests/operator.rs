//! What an operator trial of the `outbox` command found broken (issue 23): exit codes that say
//! what a supervisor should do, configuration errors reported before any service is contacted,
//! exact GRANT statements, `/readyz` that follows the broker both ways, and failure metrics
//! labelled with what the relay did. Each drives the binary as an operator would.

mod common;

use std::time::{Duration, Instant};

use common::text;
use outbox_core::Envelope;

/// A broker address where nothing listens.
const NO_BROKER: &str = "127.0.0.1:1";

/// Runs `outbox relay --no-http` with a broker that cannot be reached and `envs`.
fn relay_without_broker(
    env: &common::TestEnv,
    envs: &[(&str, &str)],
    args: &[&str],
) -> std::process::Output {
    env.cmd()
        .env("KAFKA_BROKERS", NO_BROKER)
        .env("OUTBOX_KAFKA__METADATA_TIMEOUT", "2s")
        .envs(envs.iter().copied())
        .args(["relay", "--no-http"])
        .args(args)
        .output()
        .unwrap()
}

/// Environment, flags, and the key or value the error must name.
type BadValue<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str], &'a str);

/// A configuration error exits 2 with the key and its fix while the broker (or the database) is
/// unreachable, instead of 3 "cannot reach the broker", which hid it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configuration_errors_exit_2_before_any_service_is_contacted() {
    let env = env_or_skip!("op_config_before_network", 0);
    env.migrate();
    // Control: a sound configuration with the broker down is exit 3, naming the broker.
    let out = relay_without_broker(&env, &[], &[]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(NO_BROKER),
        "{}",
        text(&out)
    );
    let no_database = [("DATABASE_URL", "postgres://app@127.0.0.1:1/shop")];
    // Each bad value, once with the database reachable and once with it unreachable too.
    let cases: &[BadValue<'_>] = &[
        // The trial's case: a lease shorter than the delivery timeout plus the margin.
        (
            &[
                ("OUTBOX_OUTBOX__LEASE", "10s"),
                ("OUTBOX_KAFKA__DELIVERY_TIMEOUT", "30s"),
            ],
            &[],
            "outbox.lease",
        ),
        // A lease above the store's limit.
        (&[("OUTBOX_OUTBOX__LEASE", "2h")], &[], "outbox.lease"),
        // An unsafe producer property.
        (&[], &["--producer-property", "acks=1"], "acks=1"),
        // A retry policy whose first ceiling exceeds its largest.
        (
            &[
                ("OUTBOX_RELAY__RETRY_BASE", "10s"),
                ("OUTBOX_RELAY__RETRY_MAX", "1s"),
            ],
            &[],
            "[relay] retry",
        ),
    ];
    for (envs, args, named) in cases {
        for database_down in [false, true] {
            let mut all: Vec<(&str, &str)> = envs.to_vec();
            if database_down {
                all.extend_from_slice(&no_database);
            }
            let out = relay_without_broker(&env, &all, args);
            assert_eq!(
                out.status.code(),
                Some(2),
                "{envs:?} {args:?} (database down: {database_down}): {}",
                text(&out)
            );
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains(named), "{named}: {err}");
            assert!(!err.contains("cannot reach"), "{err}");
            assert!(!err.contains("cannot connect"), "{err}");
        }
    }
    env.drop_schema().await;
}

/// The statements of a hint: each line of stderr that starts with `GRANT`.
fn grants(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("GRANT "))
        .map(str::to_owned)
        .collect()
}

/// A role without its grants is told the exact statements for its schema, tables and name
/// (no `<schema>`/`<role>` template, every table it lacks, none it has); running them as the
/// owner is enough for the relay to get past the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_lacking_grants_is_given_the_exact_statements() {
    let env = env_or_skip!("op_exact_grants", 0);
    env.migrate();
    let role = format!("r_{}", env.schema);
    sqlx::raw_sql(&format!("CREATE ROLE {role} LOGIN"))
        .execute(&env.pool)
        .await
        .unwrap();
    let url = env.url.replacen("postgres@", &format!("{role}@"), 1);
    let as_role = [("DATABASE_URL", url.as_str())];
    let s = &env.schema;

    // Nothing granted, not even the schema.
    let out = relay_without_broker(&env, &as_role, &[]);
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !err.contains("<schema>") && !err.contains("<role>"),
        "{err}"
    );
    let all = grants(&err);
    let expected = [
        format!("GRANT USAGE ON SCHEMA \"{s}\" TO \"{role}\";"),
        format!("GRANT SELECT ON \"{s}\".\"outbox_schema_migrations\" TO \"{role}\";"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON \"{s}\".\"outbox_events\" TO \"{role}\";"),
        format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON \"{s}\".\"outbox_events_aggregate\" TO \"{role}\";"
        ),
        format!("GRANT SELECT, INSERT ON \"{s}\".\"outbox_events_audit\" TO \"{role}\";"),
        format!("GRANT SELECT, INSERT, UPDATE ON \"{s}\".\"outbox_events_topics\" TO \"{role}\";"),
        format!("GRANT SELECT ON \"{s}\".\"outbox_events_conflicts\" TO \"{role}\";"),
        format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON \"{s}\".\"outbox_events_relays\" TO \"{role}\";"
        ),
    ];
    assert_eq!(all, expected, "{err}");

    // Schema and reads granted: only the writes are asked for, table by table.
    sqlx::raw_sql(&format!(
        "GRANT USAGE ON SCHEMA \"{s}\" TO {role}; GRANT SELECT ON ALL TABLES IN SCHEMA \"{s}\" TO {role};"
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    let out = relay_without_broker(&env, &as_role, &[]);
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let writes = grants(&err);
    assert_eq!(
        writes,
        [
            format!("GRANT INSERT, UPDATE, DELETE ON \"{s}\".\"outbox_events\" TO \"{role}\";"),
            format!(
                "GRANT INSERT, UPDATE, DELETE ON \"{s}\".\"outbox_events_aggregate\" TO \"{role}\";"
            ),
            format!("GRANT INSERT ON \"{s}\".\"outbox_events_audit\" TO \"{role}\";"),
            format!("GRANT INSERT, UPDATE ON \"{s}\".\"outbox_events_topics\" TO \"{role}\";"),
            format!(
                "GRANT INSERT, UPDATE, DELETE ON \"{s}\".\"outbox_events_relays\" TO \"{role}\";"
            ),
        ],
        "{err}"
    );

    // The printed statements, run as the owner, are all it takes: the relay gets past the
    // database and stops at the (unreachable) broker.
    for g in &writes {
        sqlx::raw_sql(g).execute(&env.pool).await.unwrap();
    }
    let out = relay_without_broker(&env, &as_role, &[]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(NO_BROKER),
        "{}",
        text(&out)
    );
    let _ = sqlx::raw_sql(&format!("DROP OWNED BY {role}; DROP ROLE {role};"))
        .execute(&env.pool)
        .await;
    env.drop_schema().await;
}

/// A privilege revoked while the relay runs stops it (exit 4) with the statement for the table
/// that lost it, not a template naming the outbox table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_privilege_revoked_while_running_is_named_with_its_table() {
    let env = env_or_skip!("op_grant_revoked", 1);
    env.migrate();
    let role = format!("r_{}", env.schema);
    let s = &env.schema;
    sqlx::raw_sql(&format!(
        "CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA \"{s}\" TO {role}; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA \"{s}\" TO {role};"
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    let url = env.url.replacen("postgres@", &format!("{role}@"), 1);
    let mut relay = env.spawn_relay_env(&[("DATABASE_URL", url.as_str())], &["--no-cleanup"]);
    relay.wait_ready(std::time::Duration::from_secs(30));
    sqlx::raw_sql(&format!(
        "REVOKE UPDATE ON \"{s}\".outbox_events_aggregate FROM {role}"
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    env.append(2, 1).await;
    let (code, _, stderr) = relay.wait(std::time::Duration::from_secs(60));
    let _ = sqlx::raw_sql(&format!("DROP OWNED BY {role}; DROP ROLE {role};"))
        .execute(&env.pool)
        .await;
    assert_eq!(code, 4, "{stderr}");
    assert!(!stderr.contains("<schema>"), "{stderr}");
    assert_eq!(
        grants(&stderr),
        [format!(
            "GRANT UPDATE ON \"{s}\".\"outbox_events_aggregate\" TO \"{role}\";"
        )],
        "{stderr}"
    );
    env.drop_schema().await;
}

/// The forecast follows the backlog's current trend: after a drain of 2,000 older events (which
/// dominates any 15-minute average of created minus published), a backlog that grows now is
/// forecast to reach capacity (not -1, "not growing").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backlog_forecast_follows_the_current_trend() {
    let env = env_or_skip!("op_forecast_trend", 1);
    env.migrate();
    let old = env.append(500, 4).await;
    sqlx::raw_sql(&format!(
        "UPDATE \"{}\".outbox_events SET created_at = created_at - interval '20 minutes'",
        env.schema
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    // A short trend window, so that the slope is the current growth within seconds.
    let mut relay = env.spawn_relay_env(
        &[
            ("OUTBOX_STATUS__CAPACITY", "100000"),
            ("OUTBOX_STATUS__TREND_WINDOW", "5s"),
        ],
        &["--no-cleanup"],
    );
    relay.wait_ready(Duration::from_secs(30));
    env.wait_count("published", old.len() as i64, Duration::from_secs(120))
        .await;
    relay.wait_metric(
        "outbox_unpublished",
        "",
        |v| v == 0.0,
        Duration::from_secs(10),
    );
    // Now the backlog grows, 20 events a round (heads that skip a version are held,
    // unpublished): at least 10 a second, so the forecast must come under 10,000 s, and before
    // 2,000 events were appended (100 rounds, 20 s at least): until then an average of created
    // minus published over 15 minutes still reads the drain (-1).
    let store = env.store();
    let mut forecast = None;
    for round in 0..100 {
        // New aggregates whose first stored version is 2: held as version gaps.
        let held: Vec<Envelope> = (0..20)
            .map(|a| {
                Envelope::builder("order", format!("held-{round}-{a}"), 2, "order.paid")
                    .build()
                    .unwrap()
            })
            .collect();
        store.append_many(&env.pool, &held).await.unwrap();
        forecast = relay.metric("outbox_backlog_forecast_seconds", "");
        if forecast.is_some_and(|f| f > 0.0 && f < 10_000.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        forecast.is_some_and(|f| f > 0.0 && f < 10_000.0),
        "2,000 events appended, the backlog grows, but the forecast reads {forecast:?}"
    );
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "{stderr}");
    env.drop_schema().await;
}

/// A poison event larger than the producer accepts, and one behind it.
async fn append_poison(env: &common::TestEnv) {
    let poison = Envelope::builder("order", "big", 1, "order.placed")
        .json(&serde_json::json!({"note": "x".repeat(4096)}))
        .unwrap()
        .build()
        .unwrap();
    env.store().append_many(&env.pool, &[poison]).await.unwrap();
}

/// Exit 0 after a signal means nothing waits for an operator; a relay that parked events in
/// its run exits 1 and says where to look, as the exit-code table says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_parked_events_exits_1_after_a_signal() {
    let env = env_or_skip!("op_exit_after_parking", 1);
    env.migrate();
    let events = env.append(3, 1).await;
    let mut relay = env.spawn_relay(&["--no-cleanup"]);
    relay.wait_ready(Duration::from_secs(30));
    env.wait_count("published", events.len() as i64, Duration::from_secs(30))
        .await;
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "nothing left for an operator: {stderr}");

    append_poison(&env).await;
    let mut relay = env.spawn_relay(&[
        "--no-cleanup",
        "--producer-property",
        "message.max.bytes=2048",
    ]);
    relay.wait_ready(Duration::from_secs(30));
    env.wait_count("parked", 1, Duration::from_secs(30)).await;
    let (code, stdout, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 1, "a parked event waits for an operator: {stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert!(stderr.contains("1 parked"), "{stderr}");
    assert!(stderr.contains("outbox parked list"), "{stderr}");
    env.drop_schema().await;
}

/// Stopped while the broker is down and events wait: exit 1, still failing, not 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_stopped_during_an_outage_exits_1() {
    let env = env_or_skip!("op_exit_during_outage", 0);
    let Some(bin) = outbox_test_support::tansu_bin("op_exit_during_outage") else {
        return;
    };
    let mut tansu = outbox_test_support::Tansu::start(bin);
    let brokers = tansu.brokers();
    common::create_topic(&brokers, &env.topic, 1, &[]).await;
    env.migrate();
    let mut relay = env.spawn_relay_env(
        &[
            ("KAFKA_BROKERS", brokers.as_str()),
            ("OUTBOX_KAFKA__DELIVERY_TIMEOUT", "2s"),
            ("OUTBOX_OUTBOX__LEASE", "8s"),
            ("OUTBOX_RELAY__CIRCUIT_MAX", "1s"),
        ],
        &["--no-cleanup"],
    );
    relay.wait_ready(Duration::from_secs(30));
    tansu.stop();
    env.append(3, 1).await;
    relay.wait_metric(
        "outbox_relay_circuit_open",
        "",
        |v| v == 1.0,
        Duration::from_secs(30),
    );
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("still failing"), "{stderr}");
    assert_eq!(env.count("parked").await, 0);
    env.drop_schema().await;
}

/// `/readyz` answers what the relay sees now: 503 soon after the broker goes away, 503 naming
/// the topic while it is missing after a restart, 200 soon after it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_broker_both_ways() {
    let env = env_or_skip!("op_readyz_follows", 0);
    let Some(bin) = outbox_test_support::tansu_bin("op_readyz_follows") else {
        return;
    };
    let mut tansu = outbox_test_support::Tansu::start(bin);
    let brokers = tansu.brokers();
    common::create_topic(&brokers, &env.topic, 1, &[]).await;
    env.migrate();
    let mut relay = env.spawn_relay_env(
        &[
            ("KAFKA_BROKERS", brokers.as_str()),
            ("OUTBOX_KAFKA__METADATA_TIMEOUT", "1s"),
        ],
        &["--no-cleanup"],
    );
    relay.wait_ready(Duration::from_secs(30));
    // Well within the 30 s the readiness used to lag by.
    let bound = Duration::from_secs(10);
    let wait_readyz =
        |relay: &common::Daemon, want: u16, ok: &dyn Fn(&serde_json::Value) -> bool| {
            let deadline = Instant::now() + bound;
            loop {
                let got = relay.get("/readyz");
                if let Some((code, body)) = &got {
                    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
                    if *code == want && ok(&v) {
                        return;
                    }
                }
                assert!(
                    Instant::now() < deadline,
                    "/readyz never answered {want} as expected within {bound:?}: {got:?}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        };
    tansu.stop();
    wait_readyz(&relay, 503, &|v| v["broker"]["ok"] == false);
    // Back, but its memory storage lost the topic: not ready, and the topic is named.
    tansu.restart();
    let topic = env.topic.clone();
    wait_readyz(&relay, 503, &|v| {
        v["broker"]["ok"] == false
            && v["broker"]["detail"]
                .as_str()
                .is_some_and(|d| d.contains(&topic))
    });
    common::create_topic(&brokers, &env.topic, 1, &[]).await;
    wait_readyz(&relay, 200, &|v| {
        v["ready"] == true && v["broker"]["ok"] == true
    });
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "{stderr}");
    env.drop_schema().await;
}

/// While the broker is down every record is deferred as a transport failure, no attempt
/// spent: the failure counter says `action="deferred"`, `class="transient"`, whatever the
/// record's own error (the trial saw `class="permanent", kind="unknown_topic"` for a broker back
/// without its topics; that mapping is unit-tested in outbox-core's telemetry, since tansu
/// creates a topic on produce and does not reproduce it reliably).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_metrics_say_what_the_relay_did() {
    let env = env_or_skip!("op_failure_labels", 0);
    let Some(bin) = outbox_test_support::tansu_bin("op_failure_labels") else {
        return;
    };
    let mut tansu = outbox_test_support::Tansu::start(bin);
    let brokers = tansu.brokers();
    common::create_topic(&brokers, &env.topic, 1, &[]).await;
    env.migrate();
    let mut relay = env.spawn_relay_env(
        &[
            ("KAFKA_BROKERS", brokers.as_str()),
            ("OUTBOX_KAFKA__DELIVERY_TIMEOUT", "2s"),
            ("OUTBOX_OUTBOX__LEASE", "8s"),
            ("OUTBOX_RELAY__CIRCUIT_MAX", "1s"),
        ],
        &["--no-cleanup"],
    );
    relay.wait_ready(Duration::from_secs(30));
    tansu.stop();
    env.append(5, 1).await;
    let t = Duration::from_secs(60);
    relay.wait_metric("outbox_relay_circuit_open", "", |v| v == 1.0, t);
    let (_, body) = relay.get("/metrics").unwrap();
    let samples = failure_samples(&body);
    assert!(!samples.is_empty(), "{body}");
    for sample in &samples {
        assert!(
            sample.contains("action=\"deferred\"") && sample.contains("class=\"transient\""),
            "{samples:?}"
        );
    }
    assert_eq!(env.count("parked").await, 0);
    tansu.restart();
    common::create_topic(&brokers, &env.topic, 1, &[]).await;
    env.wait_count("published", 5, t).await;
    let (_, body) = relay.get("/metrics").unwrap();
    let other: Vec<&str> = failure_samples(&body)
        .into_iter()
        .filter(|l| !l.contains("action=\"deferred\"") || l.contains("permanent"))
        .collect();
    assert!(other.is_empty(), "nothing but deferrals: {other:?}");
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "{stderr}");
    env.drop_schema().await;
}

/// The samples of `outbox_publish_failures_total` in a scrape.
fn failure_samples(body: &str) -> Vec<&str> {
    body.lines()
        .filter(|l| l.starts_with("outbox_publish_failures_total{"))
        .collect()
}
