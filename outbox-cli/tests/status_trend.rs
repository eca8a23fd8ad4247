//! `outbox status` forecasts by the relay's rule: the backlog's trend over
//! `status.trend_window` (the rule of `outbox_backlog_forecast_seconds`, `outbox_cli::trend`),
//! not created minus published over the 15-minute latency window, where a drain of older
//! events cancels a backlog that grows now. Real PostgreSQL with the rows' times set, no broker.
//!
//! Needs `DATABASE_URL`, unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;

use common::{text, TestEnv};

/// An outage 40 s old with the backlog growing 20 a second (800 pending events created over
/// the last 40 s), after 2,000 older events (created 20 minutes ago) drained between 14
/// minutes and 90 s ago. Over 15 minutes, created minus published is 800 - 2,000: "not
/// growing". The trend over the last 30 s is +20/s, and the forecast says when it is full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_forecasts_a_live_outage_that_a_long_drain_would_cancel() {
    let test = "status_forecasts_a_live_outage_that_a_long_drain_would_cancel";
    let Some(env) = TestEnv::without_kafka(test).await else {
        return;
    };
    env.migrate();
    env.append(2800, 1).await;
    sqlx::raw_sql(&format!(
        "WITH r AS (SELECT id, row_number() OVER (ORDER BY id) - 1 AS n FROM \"{s}\".outbox_events), \
              t AS (SELECT id, n, CASE WHEN n < 2000 THEN now() - interval '20 minutes' \
                                  ELSE now() - (40 - (n - 2000) * 0.05) * interval '1 second' END AS created, \
                                  now() - (840 - n * 0.375) * interval '1 second' AS published FROM r) \
         UPDATE \"{s}\".outbox_events e SET created_at = t.created, inserted_at = t.created, \
           status = CASE WHEN t.n < 2000 THEN 'published' ELSE 'pending' END, \
           published_at = CASE WHEN t.n < 2000 THEN t.published END, \
           finished_at = CASE WHEN t.n < 2000 THEN t.published END, \
           ack_transport = CASE WHEN t.n < 2000 THEN 'kafka' END, \
           ack_destination = CASE WHEN t.n < 2000 THEN 't' END, \
           ack_partition = CASE WHEN t.n < 2000 THEN 0 END, \
           ack_position = CASE WHEN t.n < 2000 THEN e.id END \
         FROM t WHERE e.id = t.id",
        s = env.schema
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    assert_eq!(env.count("pending").await, 800);

    let trend = [
        ("OUTBOX_STATUS__TREND_WINDOW", "30s"),
        ("OUTBOX_RELAY__STATS_INTERVAL", "1s"),
        ("OUTBOX_STATUS__CAPACITY", "100000"),
    ];
    let (code, s, stderr) = env.json_env(&trend, &["status", "--no-consumers"]);
    assert_eq!(code, 0, "{s} {stderr}");
    let flow = &s["flow"];
    // The 15-minute figures are still shown: they are what cancels the outage.
    assert_eq!(flow["window_seconds"], 900.0, "{flow}");
    assert_eq!(flow["published"], 2000, "{flow}");
    assert_eq!(flow["created"], 800, "{flow}");
    // 2,000 finished events in the window: counted and read in full, labelled exact.
    assert_eq!(flow["published_estimated"], false, "{flow}");
    assert_eq!(flow["created_estimated"], false, "{flow}");
    assert_eq!(s["latency"]["estimated"], false, "{s}");
    assert!(s["latency"]["sample_size"].is_null(), "{s}");
    let rate = flow["rate_per_second"].as_f64().expect("a rate");
    assert!((rate - 20.0).abs() < 0.5, "the outage's +20/s: {flow}");
    let until_full = flow["forecast_seconds"]
        .as_f64()
        .expect("growing: a forecast");
    let expected = (100_000.0 - 800.0) / rate;
    assert!(
        (until_full - expected).abs() < 1.0,
        "{until_full} vs {expected}: {flow}"
    );
    assert_eq!(flow["trend_window_seconds"], 30.0, "{flow}");
    assert_eq!(
        flow["trend_points"], 31,
        "one point per stats interval: {flow}"
    );

    // The human report says the same, naming the window.
    let out = env
        .cmd()
        .envs(trend)
        .args(["status", "--no-consumers"])
        .output()
        .unwrap();
    let human = text(&out);
    assert!(out.status.success(), "{human}");
    assert!(human.contains("backlog trend (last 30s)"), "{human}");
    assert!(!human.contains("not growing"), "{human}");
    assert!(!human.contains("estimated"), "{human}");

    // The trend window ends now: once the outage is over (the backlog published a while
    // ago, nothing since), the trend is flat and nothing is forecast, while the 15-minute
    // window still counts the outage's events as created.
    sqlx::raw_sql(&format!(
        "UPDATE \"{s}\".outbox_events SET status = 'published', \
           published_at = now() - interval '35 seconds', finished_at = now() - interval '35 seconds', \
           created_at = created_at - interval '40 seconds', inserted_at = inserted_at - interval '40 seconds', \
           ack_transport = 'kafka', ack_destination = 't', ack_partition = 0, ack_position = id \
         WHERE status = 'pending'",
        s = env.schema
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    let (code, s, stderr) = env.json_env(&trend, &["status", "--no-consumers"]);
    assert_eq!(code, 0, "{s} {stderr}");
    assert_eq!(s["flow"]["rate_per_second"], 0.0, "{s}");
    assert!(s["flow"]["forecast_seconds"].is_null(), "{s}");
    env.drop_schema().await;
}

/// Above 5,000 finished events in the window (the PostgreSQL store's default
/// `latency_sample`), `status` shows the latency as an estimate over the latest 5,000
/// publications, in the text and in `--json`. 6,000 events published over the last ten
/// minutes: the oldest 1,000 took 100 s, the latest 5,000 took 1 s, so the estimate's largest
/// is 1 s (the exact one would be 100 s); the published count stays 6,000.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_labels_the_latency_of_a_busy_window_as_an_estimate() {
    let test = "status_labels_the_latency_of_a_busy_window_as_an_estimate";
    let Some(env) = TestEnv::without_kafka(test).await else {
        return;
    };
    env.migrate();
    env.append(6000, 1).await;
    sqlx::raw_sql(&format!(
        "WITH r AS (SELECT id, row_number() OVER (ORDER BY id) - 1 AS n FROM \"{s}\".outbox_events), \
              t AS (SELECT id, n, now() - (600 - n * 0.1) * interval '1 second' AS published FROM r) \
         UPDATE \"{s}\".outbox_events e SET status = 'published', published_at = t.published, \
           finished_at = t.published, \
           created_at = t.published - CASE WHEN t.n < 1000 THEN 100 ELSE 1 END * interval '1 second', \
           inserted_at = t.published - CASE WHEN t.n < 1000 THEN 100 ELSE 1 END * interval '1 second', \
           ack_transport = 'kafka', ack_destination = 't', ack_partition = 0, ack_position = e.id \
         FROM t WHERE e.id = t.id",
        s = env.schema
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    assert_eq!(env.count("published").await, 6000);

    let (code, s, stderr) = env.json_env(&[], &["status", "--no-consumers"]);
    assert_eq!(code, 0, "{s} {stderr}");
    let latency = &s["latency"];
    assert_eq!(latency["estimated"], true, "{latency}");
    assert_eq!(latency["sample_size"], 5000, "{latency}");
    assert_eq!(latency["published"], 6000, "{latency}");
    assert_eq!(
        latency["max_seconds"], 1.0,
        "the latest 5,000 only: {latency}"
    );
    assert_eq!(latency["p99_seconds"], 1.0, "{latency}");
    assert_eq!(s["flow"]["published_estimated"], true, "{s}");

    let out = env
        .cmd()
        .args(["status", "--no-consumers"])
        .output()
        .unwrap();
    let human = text(&out);
    assert!(out.status.success(), "{human}");
    assert!(
        human.contains("(estimated over the latest 5000 publications)"),
        "{human}"
    );
    assert!(human.contains("6000 (estimated)"), "{human}");
    env.drop_schema().await;
}

/// Up to 10,000 events created in the window the PostgreSQL store counts them; above, it
/// estimates them from the ids, and `status` says so, in the text and in `--json`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_labels_a_busy_windows_created_count_as_an_estimate() {
    let test = "status_labels_a_busy_windows_created_count_as_an_estimate";
    let Some(env) = TestEnv::without_kafka(test).await else {
        return;
    };
    env.migrate();
    env.append(10_000, 1).await;
    let (code, s, stderr) = env.json_env(&[], &["status", "--no-consumers"]);
    assert_eq!(code, 0, "{s} {stderr}");
    assert_eq!(s["flow"]["created"], 10_000, "{s}");
    assert_eq!(s["flow"]["created_estimated"], false, "{s}");

    env.append_versions(2_000, 2..=2).await;
    let (code, s, stderr) = env.json_env(&[], &["status", "--no-consumers"]);
    assert_eq!(code, 0, "{s} {stderr}");
    assert_eq!(
        s["flow"]["created"], 12_000,
        "the ids issued since the window's start: {s}"
    );
    assert_eq!(s["flow"]["created_estimated"], true, "{s}");
    let out = env
        .cmd()
        .args(["status", "--no-consumers"])
        .output()
        .unwrap();
    let human = text(&out);
    assert!(out.status.success(), "{human}");
    assert!(human.contains("12000 (estimated)"), "{human}");
    env.drop_schema().await;
}
