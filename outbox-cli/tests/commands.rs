//! The one-shot commands driven as a user would: migrate, status, parked, cleanup, check,
//! replay, reconcile, config; bad configuration. Needs `DATABASE_URL` and `KAFKA_BROKERS`
//! (`scripts/test`), unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;

use std::time::Duration;

use common::text;
use outbox_core::Envelope;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_idempotent_prints_sql_and_reports_json() {
    let env = env_or_skip!("migrate", 0);
    let (code, v, _) = env.json(&["migrate"]);
    assert_eq!(code, 0);
    assert_eq!(v["outbox"]["applied"], 4);
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
    // The inbox table and the consumer's parking tables: two migrations.
    assert_eq!(v["inboxes"][0]["applied"], 2);
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
    relay.wait_metric("outbox_oldest_unpublished_age_seconds", "", |v| v > 0.0, t);
    relay.wait_metric("outbox_oldest_head_age_seconds", "", |v| v > 0.0, t);
    relay.wait_metric("outbox_version_gaps_held", "", |v| v == 1.0, t);
    relay.wait_metric("outbox_unpublished", "", |v| v == 2.0, t);
    relay.wait_metric("outbox_backpressure_active", "", |v| v == 1.0, t);
    relay.wait_metric("outbox_backlog_forecast_seconds", "", |v| v > 0.0, t);

    // status shows it all.
    let (code, s, _) = env.json(&["status", "--no-consumers"]);
    assert_eq!(code, 0);
    assert_eq!(s["backlog"]["parked"], 1);
    assert_eq!(s["backlog"]["version_gaps_held"], 1);
    assert!(s["backlog"]["oldest_parked_age_seconds"].as_f64().unwrap() > 0.0);
    assert!(s["flow"]["rate_per_second"].as_f64().unwrap() > 0.0, "{s}");
    assert!(s["flow"]["forecast_seconds"].as_f64().is_some(), "{s}");
    let human = env.run(&["status", "--no-consumers"]);
    let human = String::from_utf8_lossy(&human.stdout);
    assert!(
        human.contains("parked") && human.contains("version gaps held"),
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
    // Consumer side: not available yet, said so, non-zero.
    let out = env.run(&["parked", "list", "--consumer", "billing"]);
    assert_eq!(out.status.code(), Some(5), "{}", text(&out));
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
         finished_at = now() - interval '2 days', ack_topic = 't', ack_partition = 0, ack_offset = id",
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
        store.append_many(&mut *tx, &[e]).await.unwrap();
        tx.commit().await.unwrap();
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
    let human = env.run(&["reconcile", "--since", "1h"]);
    assert_eq!(human.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&human.stdout).contains("MISMATCH"));
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
    assert!(
        c["parked"].is_null(),
        "consumer parking is not available yet: {v}"
    );
    let human = env.run(&["status"]);
    assert!(String::from_utf8_lossy(&human.stdout).contains("billing"));
    env.drop_schema().await;
}
