//! The benchmark program builds and runs the smallest version of every scenario against the real
//! PostgreSQL and broker (the test command provides both): a check that it works, not a figure.
//! Each scenario must exit 0 and write a JSON report with figures.

use std::path::Path;
use std::process::Command;

fn run(env: &(String, String), name: &str, json: &Path, args: &[&str]) {
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
    run(
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
    run(
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
            "none,gate,notify",
        ],
    );
    run(
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
