//! The one-shot commands driven as a user would: migrate, status, parked, cleanup, check,
//! replay, reconcile, config; bad configuration. Needs `DATABASE_URL` and `KAFKA_BROKERS`
//! (`scripts/test`), unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;

use std::time::Duration;

use common::consumer_ops::{self, PgInbox};
use common::text;
use outbox_core::Envelope;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_idempotent_prints_sql_and_reports_json() {
    let env = env_or_skip!("migrate", 0);
    let (code, v, _) = env.json(&["migrate"]);
    assert_eq!(code, 0);
    assert_eq!(v["outbox"]["applied"], 11);
    assert_eq!(v["outbox"]["schema"], env.schema.as_str());
    let (code, v, _) = env.json(&["migrate"]);
    assert_eq!(code, 0);
    assert_eq!(v["outbox"]["applied"], 0, "second run changes nothing");
    let out = env.run(&["migrate", "--print-sql"]);
    assert!(out.status.success());
    let sql = String::from_utf8_lossy(&out.stdout);
    assert!(
        sql.contains(&format!("\"{}\".\"outbox_events_aggregate\"", env.schema)),
        "{sql}"
    );
    // With --inbox, the consumers' inboxes too.
    std::fs::write(
        env.dir.join("outbox.toml"),
        format!(
            "[[consumers]]\nname = \"billing\"\ninbox_schema = \"{}\"\n",
            env.schema
        ),
    )
    .unwrap();
    let (code, v, _) = env.json(&["migrate", "--inbox"]);
    assert_eq!(code, 0);
    assert_eq!(v["inboxes"][0]["consumer"], "billing");
    // The inbox table, the consumer's parking tables, retry requests, and each registration's
    // aggregate (dedupe scoped to it), and the transport's own position of parked messages:
    // five migrations.
    assert_eq!(v["inboxes"][0]["applied"], 5);
    let (code, v, _) = env.json(&["migrate", "--inbox"]);
    assert_eq!(code, 0);
    assert_eq!(v["inboxes"][0]["applied"], 0, "second run changes nothing");
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configuration_is_refused_with_the_key_and_never_shows_secrets() {
    let env = env_or_skip!("bad_config", 0);
    // Unknown key in the file.
    std::fs::write(env.dir.join("outbox.toml"), "[relay]\nworkerz = 3\n").unwrap();
    let out = env.run(&["status"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("workerz") && err.contains("outbox.toml"),
        "{err}"
    );
    // A bad duration from the environment.
    std::fs::remove_file(env.dir.join("outbox.toml")).unwrap();
    let out = env
        .cmd()
        .env("OUTBOX_RELAY__IDLE_MAX", "soon")
        .args(["status"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("idle_max"),
        "{}",
        text(&out)
    );
    // A hostile schema name never reaches SQL.
    let out = env
        .cmd()
        .env("OUTBOX_OUTBOX__SCHEMA", "x\"; DROP TABLE victim; --")
        .args(["status"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    // A missing --config file.
    let out = env.run(&["--config", "nope.toml", "status"]);
    assert_eq!(out.status.code(), Some(2));
    // --json errors are JSON on stdout.
    let (code, v, _) = env.json(&["--config", "nope.toml", "status"]);
    assert_eq!(code, 2);
    assert_eq!(v["error"]["kind"], "config");
    // Secrets: not in `outbox config`, not in errors.
    std::fs::write(
        env.dir.join("outbox.toml"),
        "[kafka.producer]\n\"sasl.password\" = \"s3cr3t-kafka\"\n",
    )
    .unwrap();
    let out = env
        .cmd()
        .env("DATABASE_URL", "postgres://app:hunter2@127.0.0.1:1/shop")
        .env("OUTBOX_DATABASE__PASSWORD", "pw-from-env")
        .args(["config"])
        .output()
        .unwrap();
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    for secret in ["hunter2", "s3cr3t-kafka", "pw-from-env"] {
        assert!(!all.contains(secret), "{secret} shown: {all}");
    }
    let out = env
        .cmd()
        .env("DATABASE_URL", "postgres://app:hunter2@127.0.0.1:1/shop")
        .args(["status"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(!text(&out).contains("hunter2"), "{}", text(&out));
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_events_are_listed_shown_and_worked_with_an_audit_trail() {
    let env = env_or_skip!("parked", 1);
    env.migrate();
    let store = env.store();
    // A poison event (larger than the producer accepts) and one queued behind it; a version
    // gap on another aggregate.
    let poison = Envelope::builder("order", "big", 1, "order.placed")
        .json(&serde_json::json!({"note": "x".repeat(4096)}))
        .unwrap()
        .build()
        .unwrap();
    let follower = Envelope::builder("order", "big", 2, "order.paid")
        .build()
        .unwrap();
    let gap = Envelope::builder("order", "gappy", 2, "order.paid")
        .build()
        .unwrap();
    store
        .append_many(&env.pool, &[poison.clone(), follower.clone(), gap])
        .await
        .unwrap();
    let mut relay = env.spawn_relay_env(
        &[("OUTBOX_BACKPRESSURE__MAX_BACKLOG", "1")],
        &[
            "--no-cleanup",
            "--producer-property",
            "message.max.bytes=2048",
        ],
    );
    relay.wait_ready(Duration::from_secs(30));
    env.wait_count("parked", 1, Duration::from_secs(30)).await;
    // Metrics a parked event and a held gap must move.
    let t = Duration::from_secs(15);
    relay.wait_metric("outbox_parked", "", |v| v == 1.0, t);
    relay.wait_metric(
        "outbox_parked_total",
        "kind=\"permanent_error\"",
        |v| v >= 1.0,
        t,
    );
    relay.wait_metric(
        "outbox_publish_failures_total",
        "kind=\"record_too_large\"",
        |v| v >= 1.0,
        t,
    );
    relay.wait_metric("outbox_oldest_parked_age_seconds", "", |v| v > 0.0, t);
    // The follower waits behind the parked event, the gap head is held: nothing is claimable.
    relay.wait_metric("outbox_blocked", "", |v| v == 1.0, t);
    relay.wait_metric("outbox_oldest_blocked_age_seconds", "", |v| v > 0.0, t);
    relay.wait_metric("outbox_gap_held", "", |v| v == 1.0, t);
    relay.wait_metric("outbox_oldest_claimable_age_seconds", "", |v| v == 0.0, t);
    relay.wait_metric("outbox_version_gaps_held", "", |v| v == 1.0, t);
    relay.wait_metric("outbox_unpublished", "", |v| v == 2.0, t);
    relay.wait_metric("outbox_backpressure_active", "", |v| v == 1.0, t);
    // The backlog went down by the parked event and is flat since: not growing.
    relay.wait_metric("outbox_backlog_forecast_seconds", "", |v| v == -1.0, t);

    // status shows it all.
    let (code, s, _) = env.json(&["status", "--no-consumers"]);
    assert_eq!(code, 0);
    assert_eq!(s["backlog"]["parked"], 1);
    assert_eq!(s["backlog"]["version_gaps_held"], 1);
    assert_eq!(s["backlog"]["blocked"], 1, "{s}");
    assert_eq!(s["backlog"]["gap_held"], 1, "{s}");
    assert!(s["backlog"]["oldest_parked_age_seconds"].as_f64().unwrap() > 0.0);
    assert!(s["flow"]["rate_per_second"].as_f64().unwrap() > 0.0, "{s}");
    assert!(s["flow"]["forecast_seconds"].as_f64().is_some(), "{s}");
    let human = env.run(&["status", "--no-consumers"]);
    let human = String::from_utf8_lossy(&human.stdout);
    assert!(
        human.contains("parked") && human.contains("held behind version gaps"),
        "{human}"
    );

    // list, show.
    let (code, l, _) = env.json(&["parked", "list"]);
    assert_eq!(code, 0);
    let parked = l["parked"].as_array().unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0]["event_id"], poison.event_id.to_string());
    assert_eq!(parked[0]["park_kind"], "permanent_error");
    assert_eq!(parked[0]["delivery_uncertain"], false);
    assert!(
        parked[0].get("payload").is_none(),
        "payloads are never printed"
    );
    let id = poison.event_id.to_string();
    let out = env.run(&["parked", "show", &id]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("record_too_large"));
    // discard needs a reason; reissue needs a confirmation.
    let out = env.run(&["parked", "discard", &id]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let out = env.run(&["parked", "reissue", &id, "--reason", "shrunk the note"]);
    assert_eq!(out.status.code(), Some(6), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("broker refused"),
        "{}",
        text(&out)
    );
    // Consumer side: a consumer that is not configured is a usage error naming the fix.
    let out = env.run(&["parked", "list", "--consumer", "billing"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no consumer \"billing\""),
        "{}",
        text(&out)
    );
    // retry (it fails again and parks again), then discard with a reason.
    let out = env.run(&["parked", "retry", &id, "--actor", "alice"]);
    assert!(out.status.success(), "{}", text(&out));
    env.wait_count("parked", 1, Duration::from_secs(30)).await;
    let mut parked_again = false;
    for _ in 0..100 {
        let (_, l, _) = env.json(&["parked", "list"]);
        if l["parked"].as_array().is_some_and(|a| a.len() == 1) {
            parked_again = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(parked_again);
    let (code, d, _) = env.json(&[
        "parked",
        "discard",
        &id,
        "--reason",
        "customer cancelled",
        "--actor",
        "bob",
    ]);
    assert_eq!(code, 0, "{d}");
    assert_eq!(d["action"], "discard");
    // Its follower flows now.
    env.wait_count("published", 1, Duration::from_secs(30))
        .await;
    let (code, shown, _) = env.json(&["parked", "show", &id]);
    assert_eq!(code, 0);
    let audit = shown["audit"].as_array().unwrap();
    let actions: Vec<&str> = audit
        .iter()
        .map(|a| a["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, vec!["retry", "discard"]);
    assert_eq!(audit[1]["actor"], "bob");
    assert_eq!(audit[1]["reason"], "customer cancelled");
    // The gap parks after its timeout; reissue with --yes replaces it and is audited.
    let (code, _, stderr) = {
        common::signal(relay.child.id(), "TERM");
        relay.wait(Duration::from_secs(30))
    };
    assert_eq!(code, 0, "{stderr}");
    sqlx::raw_sql(&format!(
        "UPDATE \"{}\".outbox_events SET status = 'parked', park_kind = 'version_gap', parked_at = now(), \
         last_error_class = 'permanent', last_error_kind = 'version_gap', last_error_message = 'v1 missing' \
         WHERE aggregate_id = 'gappy'",
        env.schema
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    let (_, l, _) = env.json(&["parked", "list"]);
    let gap_id = l["parked"][0]["event_id"].as_str().unwrap().to_owned();
    let (code, r, stderr) = env.json(&["parked", "reissue", &gap_id, "--reason", "copy", "--yes"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(r["new_event_id"].as_str().is_some());
    let (_, shown, _) = env.json(&["parked", "show", &gap_id]);
    assert_eq!(shown["audit"][0]["action"], "reissue");
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_dry_run_counts_and_the_real_run_removes_in_batches() {
    let env = env_or_skip!("cleanup", 1);
    env.migrate();
    let events = env.append(10, 2).await;
    sqlx::raw_sql(&format!(
        "UPDATE \"{}\".outbox_events SET status = 'published', published_at = now() - interval '2 days', \
         finished_at = now() - interval '2 days', ack_transport = 'kafka', ack_destination = 't', ack_partition = 0, ack_position = id",
        env.schema
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    let (code, v, _) = env.json(&["cleanup", "--retention", "1d", "--dry-run"]);
    assert_eq!(code, 0);
    assert_eq!(v["would_remove"], events.len() as u64);
    assert_eq!(
        env.count("published").await,
        events.len() as i64,
        "dry run changes nothing"
    );
    let (code, v, _) = env.json(&["cleanup", "--retention", "1d", "--batch-size", "7"]);
    assert_eq!(code, 0);
    assert_eq!(v["removed"], events.len() as u64);
    assert_eq!(v["batches"], 3);
    assert_eq!(env.count("published").await, 0);
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_passes_a_sound_configuration_and_names_each_violation() {
    let env = env_or_skip!("check", 2);
    env.migrate();
    let (code, v, stderr) = env.json(&["check"]);
    assert_eq!(code, 0, "{v} {stderr}");
    assert_eq!(v["ok"], true);
    let finding = |v: &serde_json::Value, check: &str, severity: &str| {
        v["findings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["check"] == check && f["severity"] == severity)
    };
    let has = |v: &serde_json::Value, severity: &str, text: &str| {
        v["findings"].as_array().unwrap().iter().any(|f| {
            f["check"] == "retention"
                && f["severity"] == severity
                && f["message"].as_str().unwrap().contains(text)
        })
    };
    // The retention chain by the library's rule: the topic does not report retention.ms, so
    // Kafka's default (7 days) is assumed, with a warning; 7 d + 1 d lag + 3 d replay fit in
    // the default 14 d dedup window. An outbox retention shorter than the replay window is a
    // warning.
    std::fs::write(
        env.dir.join("outbox.toml"),
        "[cleanup]\nretention = \"1d\"\n[[consumers]]\nname = \"billing\"\n",
    )
    .unwrap();
    let (code, v, _) = env.json(&["check"]);
    assert_eq!(code, 0, "{v}");
    assert!(has(&v, "warning", "assuming Kafka's default of 7d"), "{v}");
    assert!(
        has(
            &v,
            "warning",
            "outbox retention 1d is shorter than the replay window 3d"
        ),
        "{v}"
    );
    assert!(!has(&v, "error", ""), "{v}");
    // A dedup window shorter than 7 d + 1 d + 3 d violates it.
    std::fs::write(
        env.dir.join("outbox.toml"),
        "[[consumers]]\nname = \"billing\"\ndedup_retention = \"10d\"\n",
    )
    .unwrap();
    let (code, v, _) = env.json(&["check"]);
    assert_eq!(code, 1, "{v}");
    assert!(
        has(
            &v,
            "error",
            "dedup retention 10d is shorter than the longest possible redelivery 11d"
        ),
        "{v}"
    );
    // Unsafe producer property.
    std::fs::write(env.dir.join("outbox.toml"), "[kafka.producer]\nacks = 1\n").unwrap();
    let (code, v, _) = env.json(&["check"]);
    assert_eq!(code, 1, "{v}");
    assert!(finding(&v, "producer", "error"), "{v}");
    // A lease shorter than the delivery timeout.
    std::fs::remove_file(env.dir.join("outbox.toml")).unwrap();
    let (code, v, _) = env.json_env(&[("OUTBOX_OUTBOX__LEASE", "4s")], &["check"]);
    assert_eq!(code, 1);
    assert!(finding(&v, "lease", "error"), "{v}");
    // A missing topic; a compacted critical topic on one replica; a dedup window shorter than
    // the topic's retention.
    let compacted = format!("{}-c", env.topic);
    common::create_topic(
        &env.brokers,
        &compacted,
        1,
        &[("cleanup.policy", "compact"), ("retention.ms", "604800000")],
    )
    .await;
    std::fs::write(
        env.dir.join("outbox.toml"),
        format!(
            "[kafka]\nroutes = {{ payment = \"{compacted}\", refund = \"missing-{t}\" }}\ncritical_topics = [\"{compacted}\"]\n\
             [[consumers]]\nname = \"billing\"\ntopics = [\"{compacted}\"]\ndedup_retention = \"1d\"\n",
            t = env.topic
        ),
    )
    .unwrap();
    let (code, v, _) = env.json(&["check"]);
    assert_eq!(code, 1, "{v}");
    assert!(finding(&v, "topic", "error"), "missing topic: {v}");
    assert!(finding(&v, "compaction", "warning"), "{v}");
    assert!(finding(&v, "replication", "warning"), "{v}");
    assert!(finding(&v, "retention", "error"), "dedup window: {v}");
    // A partition count that changed since the relay recorded it.
    std::fs::remove_file(env.dir.join("outbox.toml")).unwrap();
    env.store()
        .record_topics(&[outbox_postgres::RecordedTopic::new(
            &env.topic,
            5,
            "murmur2_random",
        )])
        .await
        .unwrap();
    let (code, v, _) = env.json(&["check"]);
    assert_eq!(code, 1);
    assert!(finding(&v, "partitions", "error"), "{v}");
    let human = env.run(&["check"]);
    assert!(String::from_utf8_lossy(&human.stdout).contains("VIOLATION"));
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_republishes_selected_events_marked_as_replays() {
    let env = env_or_skip!("replay", 2);
    env.migrate();
    let events = env.append(5, 2).await;
    let mut relay = env.spawn_relay(&["--no-cleanup"]);
    relay.wait_ready(Duration::from_secs(30));
    env.wait_count("published", events.len() as i64, Duration::from_secs(30))
        .await;
    let (code, _, _) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0);
    let (code, v, _) = env.json(&["replay", "--aggregate-id", "o-1", "--dry-run"]);
    assert_eq!(code, 0);
    assert_eq!(v["matched"], 2);
    let out = env.run(&["replay", "--aggregate-id", "o-1"]);
    assert_eq!(
        out.status.code(),
        Some(6),
        "needs --yes without a terminal: {}",
        text(&out)
    );
    let out = env.run(&["replay"]);
    assert_eq!(out.status.code(), Some(2), "needs a selection");
    let (code, v, stderr) = env.json(&["replay", "--aggregate-id", "o-1", "--yes"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(v["replayed"], 2);
    let replay_id = v["replay_id"].as_str().unwrap().to_owned();
    let records = common::read_topic(&env.brokers, &env.topic, 2, events.len() + 2);
    let replays: Vec<_> = records
        .iter()
        .filter(|r| r.headers.get("outbox_replay") == Some(&replay_id))
        .collect();
    assert_eq!(replays.len(), 2);
    assert!(replays.iter().all(|r| r.aggregate_id == "o-1"));
    assert_eq!(replays[0].version, 1);
    assert_eq!(replays[1].version, 2);
    env.drop_schema().await;
}

/// A replay the broker refuses names, for the refused event, where it was first stored in its
/// transport's own form (here Kafka's `topic/partition@offset`, as the relay recorded it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_replay_names_where_the_event_was_first_stored() {
    let env = env_or_skip!("replay_refused", 1);
    env.migrate();
    let big = Envelope::builder("order", "big", 1, "order.placed")
        .json(&serde_json::json!({"note": "x".repeat(4096)}))
        .unwrap()
        .build()
        .unwrap();
    env.store().append(&env.pool, &big).await.unwrap();
    let mut relay = env.spawn_relay(&["--no-cleanup"]);
    relay.wait_ready(Duration::from_secs(30));
    env.wait_count("published", 1, Duration::from_secs(30))
        .await;
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "{stderr}");
    let (transport, partition, offset): (String, i32, i64) = sqlx::query_as(&format!(
        "SELECT ack_transport, ack_partition, ack_position FROM \"{}\".outbox_events",
        env.schema
    ))
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(transport, "kafka");
    // The replay's producer refuses the 4 KiB record.
    std::fs::write(
        env.dir.join("outbox.toml"),
        "[kafka.producer]\n\"message.max.bytes\" = 2048\n",
    )
    .unwrap();
    let out = env.run(&["replay", "--aggregate-id", "big", "--yes"]);
    let shown = text(&out);
    assert_ne!(out.status.code(), Some(0), "{shown}");
    let first = format!(
        "{} (first stored at {}/{partition}@{offset})",
        big.event_id, env.topic
    );
    assert!(shown.contains(&first), "{first:?} not in: {shown}");
    env.drop_schema().await;
}

// FOUND (issue 20, items 4 and 5, reproduced): one parked event with one more of its
// aggregate behind it made the main age (and backpressure by age) grow without bound, and an
// event whose producer's clock ran behind (or an import keeping its original time) looked
// decades old. The daemon's metrics and `outbox status` now report the oldest claimable age,
// from the insertion time, with blocked and gap-held events apart; backpressure by age stays
// off for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_keeps_blocked_and_held_events_out_of_the_main_age() {
    let env = env_or_skip!("status_ages", 1);
    env.migrate();
    let store = env.store();
    let poison = Envelope::builder("order", "big", 1, "order.placed")
        .json(&serde_json::json!({"note": "x".repeat(4096)}))
        .unwrap()
        .build()
        .unwrap();
    let follower = Envelope::builder("order", "big", 2, "order.paid")
        .build()
        .unwrap();
    let gap = Envelope::builder("order", "gappy", 2, "order.paid")
        .build()
        .unwrap();
    store
        .append_many(&env.pool, &[poison, follower, gap])
        .await
        .unwrap();
    let max_age = [("OUTBOX_BACKPRESSURE__MAX_AGE", "2s")];
    let mut relay = env.spawn_relay_env(
        &max_age,
        &[
            "--no-cleanup",
            "--producer-property",
            "message.max.bytes=2048",
        ],
    );
    relay.wait_ready(Duration::from_secs(30));
    env.wait_count("parked", 1, Duration::from_secs(30)).await;
    let t = Duration::from_secs(15);
    relay.wait_metric("outbox_oldest_blocked_age_seconds", "", |v| v > 2.5, t);
    relay.wait_metric("outbox_blocked", "", |v| v == 1.0, t);
    relay.wait_metric("outbox_gap_held", "", |v| v == 1.0, t);
    relay.wait_metric("outbox_oldest_claimable_age_seconds", "", |v| v == 0.0, t);
    relay.wait_metric("outbox_backpressure_active", "", |v| v == 0.0, t);
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    // The event it parked is still parked: exit 1, for an operator.
    assert_eq!(code, 1, "{stderr}");
    // An event from a producer whose clock is decades behind, with no relay running.
    let mut imported = Envelope::builder("order", "imported", 1, "order.placed")
        .build()
        .unwrap();
    imported.created_at = "2000-01-01T00:00:00Z".parse().unwrap();
    store.append(&env.pool, &imported).await.unwrap();
    let (code, s, stderr) = env.json_env(&max_age, &["status", "--no-consumers"]);
    assert_eq!(code, 0, "{stderr}");
    let b = &s["backlog"];
    assert_eq!(b["unpublished"], 3, "{s}");
    assert_eq!(b["blocked"], 1, "{s}");
    assert_eq!(b["gap_held"], 1, "{s}");
    let claimable = b["oldest_claimable_age_seconds"]
        .as_f64()
        .expect("the imported event is claimable");
    assert!(
        claimable < 60.0,
        "aged from its insertion, not from its created_at in 2000: {s}"
    );
    assert!(
        b["oldest_blocked_age_seconds"].as_f64().unwrap() > 2.5,
        "{s}"
    );
    assert_eq!(s["backpressure"]["active"], false, "{s}");
    let human = env
        .cmd()
        .envs(max_age.iter().copied())
        .args(["status", "--no-consumers"])
        .output()
        .unwrap();
    let human = String::from_utf8_lossy(&human.stdout);
    assert!(
        human.contains("oldest claimable") && human.contains("blocked behind parked events"),
        "{human}"
    );
    env.drop_schema().await;
}

// FOUND (issue 20, item 3, reproduced end to end): replay re-published an aggregate's events
// in insertion order, so a lower version that committed after a higher one (and was published
// first, the higher one held until it arrived) was replayed after the higher one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_sends_an_aggregate_in_the_order_it_was_published() {
    let env = env_or_skip!("replay_order", 1);
    env.migrate();
    // o-0 version 2 commits first, version 1 after it.
    let mut events = env.append_versions(1, 2..=2).await;
    events.extend(env.append_versions(1, 1..=1).await);
    let mut relay = env.spawn_relay(&["--no-cleanup"]);
    relay.wait_ready(Duration::from_secs(30));
    env.wait_count("published", 2, Duration::from_secs(30))
        .await;
    let (code, _, _) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0);
    let live = common::read_topic(&env.brokers, &env.topic, 1, 2);
    assert_eq!(
        live.iter().map(|r| r.version).collect::<Vec<_>>(),
        [1, 2],
        "the relay published version 1 first"
    );
    let (code, v, stderr) = env.json(&["replay", "--aggregate-id", "o-0", "--yes"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(v["replayed"], 2);
    let replay_id = v["replay_id"].as_str().unwrap().to_owned();
    let records = common::read_topic(&env.brokers, &env.topic, 1, 4);
    let replayed: Vec<i64> = records
        .iter()
        .filter(|r| r.headers.get("outbox_replay") == Some(&replay_id))
        .map(|r| r.version)
        .collect();
    assert_eq!(replayed, [1, 2], "replayed in the order it was published");
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_reports_mismatches_per_interval_and_type() {
    let env = env_or_skip!("reconcile", 1);
    env.migrate();
    let s = &env.schema;
    sqlx::raw_sql(&format!(
        "CREATE TABLE \"{s}\".orders (id text PRIMARY KEY, placed_at timestamptz NOT NULL DEFAULT now());"
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    // Three orders placed, each with its event.
    let store = env.store();
    let mut placed = Vec::new();
    for i in 0..3 {
        let mut tx = env.pool.begin().await.unwrap();
        sqlx::query(&format!("INSERT INTO \"{s}\".orders (id) VALUES ($1)"))
            .bind(format!("o-{i}"))
            .execute(&mut *tx)
            .await
            .unwrap();
        let e = Envelope::builder("order", format!("o-{i}"), 1, "order.placed")
            .build()
            .unwrap();
        store
            .append_many(&mut *tx, std::slice::from_ref(&e))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        placed.push(e);
    }
    let mut relay = env.spawn_relay(&["--no-cleanup"]);
    relay.wait_ready(Duration::from_secs(30));
    env.wait_count("published", 3, Duration::from_secs(30))
        .await;
    relay.terminate(Duration::from_secs(30));
    // The consumer applied two of them.
    let inbox = outbox_postgres::PostgresInboxStore::builder(env.pool.clone())
        .schema(s.clone())
        .build()
        .unwrap();
    inbox.migrate().await.unwrap();
    sqlx::raw_sql(&format!(
        "INSERT INTO \"{s}\".processed_events (consumer, event_id) \
         SELECT 'billing', event_id FROM \"{s}\".outbox_events ORDER BY id LIMIT 2"
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    let config = |consumer: bool| {
        format!(
            "[reconcile]\ngrace = \"0s\"\n[[reconcile.checks]]\nevent_type = \"order.placed\"\n\
             query = \"SELECT count(*) FROM \\\"{s}\\\".orders WHERE placed_at >= $1 AND placed_at < $2\"\n{}",
            if consumer {
                format!("[[consumers]]\nname = \"billing\"\ninbox_schema = \"{s}\"\n")
            } else {
                String::new()
            }
        )
    };
    std::fs::write(env.dir.join("outbox.toml"), config(false)).unwrap();
    let (code, v, stderr) = env.json(&["reconcile", "--since", "1d", "--interval", "1d"]);
    assert_eq!(code, 0, "{v} {stderr}");
    assert_eq!(v["ok"], true);
    // A transition whose event is missing (appended outside the outbox).
    sqlx::query(&format!(
        "INSERT INTO \"{s}\".orders (id) VALUES ('o-lost')"
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    let (code, v, _) = env.json(&["reconcile", "--since", "1d", "--interval", "1d"]);
    assert_eq!(code, 1, "{v}");
    let text_all = v.to_string();
    assert!(
        text_all.contains("4 state transition(s) but 3 outbox event(s)"),
        "{text_all}"
    );
    // The consumer's missing effect.
    sqlx::query(&format!("DELETE FROM \"{s}\".orders WHERE id = 'o-lost'"))
        .execute(&env.pool)
        .await
        .unwrap();
    std::fs::write(env.dir.join("outbox.toml"), config(true)).unwrap();
    let (code, v, _) = env.json(&["reconcile", "--since", "1d", "--interval", "1d"]);
    assert_eq!(code, 1, "{v}");
    assert!(
        v.to_string().contains("consumer billing applied 2 of 3"),
        "{v}"
    );
    assert_eq!(v["rows"][0]["effects"][0]["parked"], 0, "{v}");
    let human = env.run(&["reconcile", "--since", "1h"]);
    assert_eq!(human.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&human.stdout).contains("MISMATCH"));
    // The consumer parked the third event: shown beside the effects, not a mismatch.
    common::park_consumer_message(
        &inbox,
        "billing",
        &env.topic,
        2,
        &placed[2],
        outbox_core::ParkAs::Head(outbox_core::ParkKind::Unprocessable),
        "unknown customer",
    )
    .await;
    let (code, v, _) = env.json(&["reconcile", "--since", "1d", "--interval", "1d"]);
    assert_eq!(code, 0, "{v}");
    let effects = &v["rows"][0]["effects"][0];
    assert_eq!(
        (
            &effects["expected"],
            &effects["applied"],
            &effects["parked"]
        ),
        (
            &serde_json::json!(3),
            &serde_json::json!(2),
            &serde_json::json!(1)
        ),
        "{v}"
    );
    let human = env.run(&["reconcile", "--since", "1d", "--interval", "1d"]);
    assert!(human.status.success(), "{}", text(&human));
    assert!(
        String::from_utf8_lossy(&human.stdout).contains("billing: 2/3 (1 parked)"),
        "{}",
        text(&human)
    );
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_refuses_hostile_identifiers_before_any_sql() {
    let env = env_or_skip!("hostile_identifiers", 0);
    let vs = &env.schema;
    sqlx::raw_sql(&format!(
        "CREATE SCHEMA \"{vs}\"; CREATE TABLE \"{vs}\".victim (id int); INSERT INTO \"{vs}\".victim VALUES (1);"
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    let hostile = [
        r#"x"; DROP TABLE victim; --"#.to_owned(),
        format!("{vs}.victim"),
        "Upper".to_owned(),
        String::new(),
        "a".repeat(64),
        format!(
            "{vs}.a (i int); DROP TABLE IF EXISTS {vs}.victim; CREATE TABLE IF NOT EXISTS {vs}"
        ),
    ];
    let commands: [&[&str]; 8] = [
        &["migrate"],
        &["relay", "--no-http"],
        &["status"],
        &["parked", "list"],
        &["cleanup", "--dry-run"],
        &["check"],
        &["replay", "--since", "1h", "--dry-run"],
        &["reconcile", "--since", "1h"],
    ];
    for bad in &hostile {
        for (var, what) in [
            ("OUTBOX_OUTBOX__SCHEMA", "schema"),
            ("OUTBOX_OUTBOX__TABLE", "table"),
        ] {
            for args in commands {
                let out = env.cmd().env(var, bad).args(args).output().unwrap();
                assert_eq!(
                    out.status.code(),
                    Some(2),
                    "{args:?} {what}={bad:?}: {}",
                    text(&out)
                );
                assert!(
                    String::from_utf8_lossy(&out.stderr)
                        .contains(&format!("invalid outbox.{what} name")),
                    "{args:?} {what}={bad:?}: {}",
                    text(&out)
                );
            }
        }
    }
    for bad in [
        "x\"; DROP TABLE victim; --",
        "..",
        "orders topic",
        "^orders.*",
        "",
    ] {
        let out = env
            .cmd()
            .env("OUTBOX_KAFKA__TOPIC", bad)
            .args(["relay", "--no-http"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "topic {bad:?}: {}", text(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("kafka.topic"),
            "{}",
            text(&out)
        );
    }
    let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM \"{vs}\".victim"))
        .fetch_one(&env.pool)
        .await
        .expect("the victim table survives");
    assert_eq!(n, 1);
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_consumer_lag_from_committed_offsets_and_inbox_counts() {
    use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
    let env = env_or_skip!("status_consumers", 1);
    env.migrate();
    env.append(4, 1).await;
    let mut relay = env.spawn_relay(&[
        "--no-cleanup",
        "--producer-property",
        "batch.num.messages=1",
    ]);
    relay.wait_ready(Duration::from_secs(30));
    env.wait_count("published", 4, Duration::from_secs(30))
        .await;
    relay.terminate(Duration::from_secs(30));
    // The consumer group committed offset 2; its inbox registered two events.
    let group = format!("g-{}", env.topic);
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &env.brokers)
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = rdkafka::TopicPartitionList::new();
    tpl.add_partition_offset(&env.topic, 0, rdkafka::Offset::Offset(2))
        .unwrap();
    consumer.commit(&tpl, CommitMode::Sync).unwrap();
    drop(consumer);
    let s = &env.schema;
    outbox_postgres::PostgresInboxStore::builder(env.pool.clone())
        .schema(s.clone())
        .build()
        .unwrap()
        .migrate()
        .await
        .unwrap();
    sqlx::raw_sql(&format!(
        "INSERT INTO \"{s}\".processed_events (consumer, event_id) \
         SELECT 'billing', event_id FROM \"{s}\".outbox_events ORDER BY id LIMIT 2"
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    std::fs::write(
        env.dir.join("outbox.toml"),
        format!("[[consumers]]\nname = \"billing\"\ngroup = \"{group}\"\ninbox_schema = \"{s}\"\n"),
    )
    .unwrap();
    let (code, v, stderr) = env.json(&["status"]);
    assert_eq!(code, 0, "{stderr}");
    let c = &v["consumers"][0];
    assert_eq!(c["name"], "billing");
    assert_eq!(c["inbox_registrations"], 2, "{v}");
    assert_eq!(c["partitions"][0]["committed"], 2, "{v}");
    assert!(c["lag"].as_i64().is_some(), "{v}");
    assert_eq!(c["parked"], 0, "{v}");
    assert_eq!(c["waiting"], 0, "{v}");
    assert!(c["oldest_parked_age_seconds"].is_null(), "{v}");
    let human = env.run(&["status"]);
    assert!(String::from_utf8_lossy(&human.stdout).contains("billing"));
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumers_parked_messages_are_listed_shown_discarded_and_counted() {
    let env = env_or_skip!("consumer_parked", 0);
    let s = env.schema.clone();
    std::fs::write(
        env.dir.join("outbox.toml"),
        format!("[[consumers]]\nname = \"billing\"\ninbox_schema = \"{s}\"\n"),
    )
    .unwrap();
    // Before its inbox exists: the fix is named.
    env.migrate();
    let out = env.run(&["parked", "list", "--consumer", "billing"]);
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    assert!(
        text(&out).contains("outbox migrate --inbox"),
        "{}",
        text(&out)
    );
    let out = env.run(&["migrate", "--inbox"]);
    assert!(out.status.success(), "{}", text(&out));
    let side = PgInbox::new(&env).await;
    consumer_ops::parked_messages_are_listed_shown_discarded_and_counted(&side).await;
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumers_parked_message_shows_its_transports_position() {
    let env = env_or_skip!("consumer_parked_native", 0);
    let s = env.schema.clone();
    std::fs::write(
        env.dir.join("outbox.toml"),
        format!("[[consumers]]\nname = \"billing\"\ninbox_schema = \"{s}\"\n"),
    )
    .unwrap();
    env.migrate();
    let out = env.run(&["migrate", "--inbox"]);
    assert!(out.status.success(), "{}", text(&out));
    let side = PgInbox::new(&env).await;
    consumer_ops::parked_messages_show_their_transports_position(&side).await;
    env.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_inbox_removes_registrations_past_the_dedup_window_in_batches() {
    let env = env_or_skip!("cleanup_inbox", 0);
    env.migrate();
    let side = PgInbox::new(&env).await;
    consumer_ops::cleanup_inbox_removes_registrations_past_the_dedup_window(&side, |c| {
        side.write_config(c)
    })
    .await;
    env.drop_schema().await;
}

/// The consumer's handler in the retry test: records what it applied, in the effect's
/// transaction.
struct Recorder {
    schema: String,
}

#[outbox_core::async_trait]
impl outbox_inbox::Handler<sqlx::Transaction<'static, sqlx::Postgres>> for Recorder {
    async fn handle(
        &self,
        tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
        e: &Envelope,
    ) -> Result<(), outbox_inbox::HandlerError> {
        sqlx::query(&format!(
            "INSERT INTO \"{}\".applied (aggregate_id, version) VALUES ($1, $2)",
            self.schema
        ))
        .bind(&e.aggregate_id)
        .bind(e.aggregate_version)
        .execute(&mut **tx)
        .await
        .map_err(|err| outbox_inbox::HandlerError::transient(err.to_string()))?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_retry_is_requested_and_performed_by_the_consumer_engine() {
    let env = env_or_skip!("retry_request", 0);
    env.migrate();
    let s = env.schema.clone();
    let side = PgInbox::new(&env).await;
    let inbox = side.inbox.clone();
    sqlx::raw_sql(&format!(
        "CREATE TABLE \"{s}\".applied (n bigserial, aggregate_id text, version bigint)"
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    let (id1, id2, _) = consumer_ops::retry_is_requested(&side).await;
    let applied = || async {
        sqlx::query_as::<_, (String, i64)>(&format!(
            "SELECT aggregate_id, version FROM \"{s}\".applied ORDER BY n"
        ))
        .fetch_all(&env.pool)
        .await
        .unwrap()
    };
    assert_eq!(
        applied().await,
        vec![],
        "a request applies nothing by itself"
    );

    // The consumer service's engine performs it at start, with its handler, in order.
    let log = outbox_testkit::MemoryLog::new("orders", 1);
    let processor =
        outbox_inbox::InboxProcessor::new("billing", inbox.clone(), Recorder { schema: s.clone() });
    let mut engine = outbox_inbox::ConsumerEngine::new(
        log.consumer("billing", &["orders"]),
        processor,
        outbox_inbox::EngineConfig::default(),
        7,
    )
    .unwrap();
    let report = engine
        .run_until_quiet(Duration::from_millis(200))
        .await
        .unwrap();
    assert_eq!(report.requested_retries, 1, "{report:?}");
    assert_eq!(
        applied().await,
        vec![("o-9".to_owned(), 1), ("o-9".to_owned(), 2)]
    );
    consumer_ops::retry_was_performed(&side, id1, id2).await;
    env.drop_schema().await;
}

/// `outbox parked discard --consumer --skip-to`: a discard never moves over versions that were
/// not seen unless the operator says how far; with `--skip-to` the applied version moves there
/// and the number of unseen versions swallowed is reported and audited. A skip below the
/// message's version, or on the producer side, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_discard_skips_versions_only_when_told_how_far() {
    let env = env_or_skip!("consumer_skip_to", 0);
    let s = env.schema.clone();
    std::fs::write(
        env.dir.join("outbox.toml"),
        format!("[[consumers]]\nname = \"billing\"\ninbox_schema = \"{s}\"\n"),
    )
    .unwrap();
    env.migrate();
    let out = env.run(&["migrate", "--inbox"]);
    assert!(out.status.success(), "{}", text(&out));
    let side = PgInbox::new(&env).await;
    consumer_ops::a_discard_skips_versions_only_when_told_how_far(&side).await;
    env.drop_schema().await;
}

/// Operators racing on a consumer's parked messages: each action lands once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_consumer_actions_land_once() {
    let env = env_or_skip!("consumer_race", 0);
    env.migrate();
    let side = PgInbox::new(&env).await;
    consumer_ops::concurrent_consumer_actions_land_once(&side).await;
    env.drop_schema().await;
}

/// A consumer's discard without `--skip-to` never moves the applied version over versions that
/// were never seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_discard_never_skips_unseen_versions() {
    let env = env_or_skip!("consumer_no_skip", 0);
    env.migrate();
    let side = PgInbox::new(&env).await;
    consumer_ops::a_discard_never_skips_unseen_versions(&side).await;
    env.drop_schema().await;
}
