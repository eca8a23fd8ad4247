//! The benchmark program builds and runs the smallest version of every scenario against the real
//! PostgreSQL and broker (the test command provides both): a check that it works, not a figure.
//! Each scenario must exit 0 and write a JSON report with figures.

use std::path::Path;
use std::process::Command;

fn run(env: &(String, String), name: &str, json: &Path, args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-bench"))
        .env("DATABASE_URL", &env.0)
        .env("KAFKA_BROKERS", &env.1)
        .args(["--rounds", "1", "--json"])
        .arg(json)
        .args(args)
        .output()
        .expect("outbox-bench starts");
    assert!(
        out.status.success(),
        "outbox-bench {name} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(json).expect("the JSON report is written"))
            .expect("the JSON report parses");
    let figures = &report["reports"][0]["figures"];
    assert!(
        figures.as_array().is_some_and(|f| !f.is_empty())
            || figures.as_object().is_some_and(|f| !f.is_empty()),
        "{name}: no figures in {report}"
    );
    report
}

#[test]
fn every_scenario_runs_at_its_smallest() {
    let Some(db) = outbox_test_support::database_url("outbox-bench smoke") else {
        return;
    };
    let Some(brokers) = outbox_test_support::brokers("outbox-bench smoke") else {
        return;
    };
    // The program reads both from the environment, as a user runs it.
    let env = (db, brokers);
    let dir = std::env::temp_dir().join(outbox_test_support::unique("bench_smoke"));
    std::fs::create_dir_all(&dir).unwrap();
    let j = |n: &str| dir.join(format!("{n}.json"));
    let drain = run(
        &env,
        "drain",
        &j("drain"),
        &[
            "drain",
            "--events",
            "2000",
            "--aggregates",
            "200",
            "--await-each-fraction",
            "10",
        ],
    );
    // The broker group is held against the lean relay (issue 25); the old minimal relay and
    // the lean relay's variants are measured beside it and compared with it.
    let figures = drain["reports"][0]["figures"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let reference_of = |contender: &str| {
        figures
            .iter()
            .find(|f| f["contender"].as_str() == Some(contender) && f["metric"] == "events/s")
            .unwrap_or_else(|| panic!("no figure of {contender:?}: {figures:?}"))["reference"]
            .clone()
    };
    let lean = "broker: lean unordered relay (reference) [200 aggs]";
    for c in [
        "broker: relay lease x1 [200 aggs]",
        "broker: raw producer ceiling [200 aggs]",
        "broker: minimal unordered relay (old reference) [200 aggs]",
        "broker: lean relay, linger.ms=5 [200 aggs]",
        "broker: lean relay, headers as text[]/bytea[] [200 aggs]",
        "broker: lean relay, no partial index [200 aggs]",
        "broker: lean relay WITHOUT headers (sends less) [200 aggs]",
        "broker: lean relay, producer not warmed up [200 aggs]",
    ] {
        assert_eq!(reference_of(c), lean, "{c}");
    }
    assert!(reference_of(lean).is_null(), "the reference has none");
    let append = run(
        &env,
        "append",
        &j("append"),
        &[
            "append",
            "--clients",
            "2",
            "--seconds",
            "0.5",
            "--warmup",
            "0.2",
            "--orders",
            "100",
            "--only",
            "none,gate,notify,gate-bare,bare,only,only-no-event-id-key",
        ],
    );
    // The ratio: the append alone against a bare insert of the same row, both
    // measured (a contender that fails to write its row fails the run above).
    let append = &append["reports"][0];
    let target = append["targets"]
        .as_array()
        .and_then(|t| {
            t.iter().find(|t| {
                t["target"]
                    .as_str()
                    .is_some_and(|s| s.contains("1 append alone") && s.contains("bare INSERT"))
            })
        })
        .unwrap_or_else(|| panic!("no target of the append alone against a bare insert: {append}"));
    assert!(
        target["measured"].as_f64().is_some_and(|m| m > 0.0),
        "{target}"
    );
    let bare = append["figures"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|f| {
            f["contender"].as_str()
                == Some("alone: 1 append, without the event_id unique key [2 clients]")
                && f["metric"] == "txn/s"
        })
        .unwrap_or_else(|| panic!("no figure of the index experiment: {append}"));
    assert_eq!(
        bare["reference"].as_str(),
        Some("alone: bare INSERT of the row, PK-only table (reference) [2 clients]"),
        "{bare}"
    );
    let latency = run(
        &env,
        "latency",
        &j("latency"),
        &[
            "latency",
            "--rate",
            "100",
            "--seconds",
            "1",
            "--only",
            "notify",
        ],
    );
    // The wait before the publish call is split into its stages, from the timed store.
    let figures = latency["reports"][0]["figures"]
        .as_array()
        .expect("figures");
    for metric in [
        "commit->claim start p50 ms",
        "claim p50 ms",
        "cycle: claim p50 ms",
        "cycle: completion p50 ms",
    ] {
        let f = figures
            .iter()
            .find(|f| f["metric"] == metric)
            .unwrap_or_else(|| panic!("no figure {metric:?}: {figures:?}"));
        let v = f["median"].as_f64().expect("a number");
        assert!(v.is_finite() && v >= 0.0, "{metric}: {f}");
    }
    let claim = |m: &str| {
        figures
            .iter()
            .find(|f| f["metric"] == m)
            .and_then(|f| f["median"].as_f64())
            .unwrap()
    };
    assert!(
        claim("cycle: claim p50 ms") > 0.0,
        "a relay claim takes time: {figures:?}"
    );
    // The publisher alone, no database load.
    run(
        &env,
        "latency-probe",
        &j("latency-probe"),
        &["latency", "--probe", "--probe-calls", "3"],
    );
    run(
        &env,
        "consumer",
        &j("consumer"),
        &["consumer", "--events", "2000", "--aggregates", "200"],
    );
    run(
        &env,
        "scale",
        &j("scale"),
        &[
            "scale",
            "--sizes",
            "2000",
            "--claims",
            "2",
            "--soak-seconds",
            "4",
            "--sample-every",
            "1",
            "--soak-rate",
            "100",
        ],
    );
    run(
        &env,
        "status",
        &j("status"),
        &["status", "--sizes", "10000", "--reads", "2"],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn indexes_reads_which_index_each_operation_used_from_the_server() {
    let Some(db) = outbox_test_support::database_url("outbox-bench smoke (indexes)") else {
        return;
    };
    let dir = std::env::temp_dir().join(outbox_test_support::unique("bench_smoke_i"));
    std::fs::create_dir_all(&dir).unwrap();
    let report = run(
        &(db, String::new()),
        "indexes",
        &dir.join("indexes.json"),
        &[
            "indexes",
            "--rows",
            "10000",
            "--pending",
            "2000",
            "--parked",
            "5",
            "--variants",
            "all,outbox_events_claim_idx",
        ],
    );
    let report = &report["reports"][0];
    let by_op = &report["details"]["index_scans_by_operation"];
    // The claim's candidates come from the claim index; the append reads no index (its
    // uniqueness check is not an index scan); the parked list from the parked index.
    assert!(
        by_op["claim 100 (lease)"]["outbox_events_claim_idx"]
            .as_i64()
            .is_some_and(|n| n > 0),
        "{by_op}"
    );
    assert_eq!(by_op["append 1 event"], serde_json::json!({}), "{by_op}");
    assert!(
        by_op["list_parked 100"]["outbox_events_parked_idx"]
            .as_i64()
            .is_some_and(|n| n > 0),
        "{by_op}"
    );
    // Without the claim index the claim still works, on another plan (compared with [all]).
    let figures = report["figures"].as_array().expect("figures");
    let claim = figures
        .iter()
        .find(|f| {
            f["contender"] == "claim 100 (lease) [outbox_events_claim_idx]" && f["metric"] == "ms"
        })
        .unwrap_or_else(|| panic!("no claim without the claim index: {report}"));
    assert_eq!(claim["reference"], "claim 100 (lease) [all]", "{claim}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `hot` (issue 25) at its smallest with the instant publisher: it reports, for each run
/// length, the hot aggregate's rate and the trickle's latency with and without it.
#[test]
fn hot_runs_at_its_smallest() {
    let Some(db) = outbox_test_support::database_url("outbox-bench smoke (hot)") else {
        return;
    };
    let dir = std::env::temp_dir().join(outbox_test_support::unique("bench_smoke_h"));
    std::fs::create_dir_all(&dir).unwrap();
    let report = run(
        &(db, String::new()),
        "hot",
        &dir.join("hot.json"),
        &[
            "hot",
            "--versions",
            "500",
            "--rate",
            "50",
            "--aggregates",
            "5",
            "--seconds",
            "1",
            "--publishers",
            "instant",
        ],
    );
    let figures = report["reports"][0]["figures"]
        .as_array()
        .expect("figures")
        .clone();
    let has = |contender: &str, metric: &str| {
        figures
            .iter()
            .any(|f| f["contender"] == contender && f["metric"] == metric)
    };
    // One contender pair per run length (`--run`, default 1 and 100).
    for run in [1, 100] {
        let (with, alone) = (
            format!("instant run {run}: hot aggregate + trickle"),
            format!("instant run {run}: trickle only"),
        );
        assert!(has(&with, "hot events/s"), "{figures:?}");
        for c in [&with, &alone] {
            assert!(has(c, "trickle p99 ms"), "{c}: {figures:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_arguments_are_refused_with_the_option_named() {
    // No service is reached before the arguments are checked.
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-bench"))
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .env("KAFKA_BROKERS", "127.0.0.1:1")
        .args(["drain", "--events", "many"])
        .output()
        .expect("outbox-bench starts");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--events"), "{err}");
}

#[test]
fn drain_runs_into_nats_and_rabbitmq_beside_their_minimal_relays() {
    let Some(db) = outbox_test_support::database_url("outbox-bench smoke (transports)") else {
        return;
    };
    let Some(nats) = outbox_test_support::nats_url("outbox-bench smoke (transports)") else {
        return;
    };
    let Some(amqp) = outbox_test_support::amqp_url("outbox-bench smoke (transports)") else {
        return;
    };
    let dir = std::env::temp_dir().join(outbox_test_support::unique("bench_smoke_t"));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("drain.json");
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-bench"))
        .env("DATABASE_URL", &db)
        .env("NATS_URL", &nats)
        .env("AMQP_URL", &amqp)
        .env_remove("KAFKA_BROKERS")
        .args(["--rounds", "1", "--json"])
        .arg(&json)
        .args([
            "drain",
            "--transport",
            "nats,rabbitmq",
            "--events",
            "2000",
            "--aggregates",
            "200",
            "--only",
            "nats-minimal,nats-lease-1,rabbitmq-minimal,rabbitmq-lease-1",
        ])
        .output()
        .expect("outbox-bench starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "outbox-bench drain --transport nats,rabbitmq failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the JSON report is written"))
            .expect("the JSON report parses");
    let text = report.to_string();
    for c in [
        "nats: minimal unordered relay",
        "nats: relay lease x1",
        "rabbitmq: minimal unordered relay",
        "rabbitmq: relay lease x1",
    ] {
        assert!(text.contains(c), "no figure for {c:?} in {text}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_transport_without_its_server_is_refused_before_any_work() {
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-bench"))
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .env_remove("NATS_URL")
        .args(["drain", "--transport", "nats"])
        .output()
        .expect("outbox-bench starts");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("NATS_URL"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-bench"))
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .args(["drain", "--transport", "nats,kafak"])
        .output()
        .expect("outbox-bench starts");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown transport \"kafak\""), "{err}");
}
