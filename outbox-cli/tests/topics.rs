//! `outbox topics create|check` driven as a user would: against the Kafka-protocol broker
//! (`KAFKA_BROKERS`, tansu in `scripts/test`) the configured topics (`kafka.topic` and
//! `kafka.routes`) are created with their settings, a second run changes nothing, an
//! existing topic with another partition count is reported and left alone; `--dry-run`
//! prints the `kafka-topics.sh` commands without a broker; bad input exits 2, an unreachable
//! broker 3, a missing topic under `check` 4. On NATS and RabbitMQ (`NATS_URL`, `AMQP_URL`)
//! the commands to run are printed and `check` runs the relay's own check. Each test uses
//! topics, streams and exchanges of its own. No database is needed.

mod common;
mod transport_support;

use std::time::Duration;

use common::{text, TestEnv};
use serde_json::Value;
use transport_support::{NatsStream, RabbitTopology};

macro_rules! require {
    ($e:expr) => {
        match $e {
            Some(v) => v,
            None => return,
        }
    };
}

/// The row of `topic` in a `topics` document.
fn row<'a>(doc: &'a Value, topic: &str) -> &'a Value {
    doc["topics"]
        .as_array()
        .unwrap_or_else(|| panic!("no topics in {doc}"))
        .iter()
        .find(|r| r["topic"] == topic)
        .unwrap_or_else(|| panic!("no row for {topic} in {doc}"))
}

/// A configuration routing `payment` to a second topic of the test's own.
fn with_route(env: &TestEnv) -> String {
    let routed = format!("{}-payments", env.topic);
    std::fs::write(
        env.dir.join("outbox.toml"),
        format!("[kafka.routes]\npayment = \"{routed}\"\n"),
    )
    .unwrap();
    routed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_create_makes_the_routed_topics_once_and_never_changes_them() {
    let env = require!(TestEnv::new("topics_create", 0).await);
    let routed = with_route(&env);
    let single = ["--replication-factor", "1"];

    // Missing: `check` says so (exit 4) and creates nothing.
    let (code, doc, err) =
        env.json(&["topics", "check", "--partitions", "3", single[0], single[1]]);
    assert_eq!(code, 4, "{doc} {err}");
    assert_eq!(row(&doc, &env.topic)["action"], "missing", "{doc}");
    assert_eq!(row(&doc, &routed)["action"], "missing", "{doc}");

    // Created, both, with the requested partition count.
    let args = [
        "topics",
        "create",
        "--partitions",
        "3",
        single[0],
        single[1],
    ];
    let (code, doc, err) = env.json(&args);
    assert_eq!(code, 0, "{doc} {err}");
    for t in [&env.topic, &routed] {
        let r = row(&doc, t);
        assert_eq!(r["action"], "created", "{doc}");
        assert_eq!(r["on_broker"]["partitions"], 3, "{doc}");
        assert_eq!(r["on_broker"]["replication_factor"], 1, "{doc}");
        assert_eq!(r["min_insync_replicas"], 1, "{doc}");
        assert_eq!(r["retention_ms"], 7 * 86_400_000u64, "by the rule: {doc}");
        assert_eq!(r["differences"], serde_json::json!([]), "{doc}");
    }

    // Again: nothing to do, exit 0.
    let (code, doc, err) = env.json(&args);
    assert_eq!(code, 0, "{doc} {err}");
    assert_eq!(row(&doc, &env.topic)["action"], "ok", "{doc}");
    assert_eq!(row(&doc, &routed)["action"], "ok", "{doc}");

    // Another partition count: reported with the way to accept or change it, exit 1, and
    // the topic keeps its 3 partitions.
    let out = env
        .cmd()
        .args([
            "topics",
            "create",
            "--partitions",
            "5",
            single[0],
            single[1],
        ])
        .output()
        .unwrap();
    let shown = text(&out);
    assert_eq!(out.status.code(), Some(1), "{shown}");
    assert!(
        shown.contains("partitions: 3 on the broker, 5 requested; not changed"),
        "{shown}"
    );
    assert!(shown.contains("--partitions 3"), "{shown}");
    let (code, doc, err) =
        env.json(&["topics", "check", "--partitions", "3", single[0], single[1]]);
    assert_eq!(code, 0, "still 3 partitions: {doc} {err}");
    assert_eq!(row(&doc, &env.topic)["on_broker"]["partitions"], 3);

    // Retention: a topic created with 2 days matches the rule's range (1 to 10 days with the
    // defaults) when --retention is not given, and differs from an explicit 3 days.
    std::fs::remove_file(env.dir.join("outbox.toml")).unwrap();
    let short = format!("{}-short", env.topic);
    let on_short = [("OUTBOX_KAFKA__TOPIC", short.as_str())];
    let (code, doc, err) = env.json_env(
        &on_short,
        &[
            "topics",
            "create",
            "--partitions",
            "1",
            single[0],
            single[1],
            "--retention",
            "2d",
        ],
    );
    assert_eq!(code, 0, "{doc} {err}");
    assert_eq!(
        row(&doc, &short)["on_broker"]["retention_ms"],
        2 * 86_400_000u64,
        "{doc}"
    );
    let (code, doc, err) = env.json_env(
        &on_short,
        &["topics", "check", "--partitions", "1", single[0], single[1]],
    );
    assert_eq!(code, 0, "within the rule: {doc} {err}");
    let (code, doc, _) = env.json_env(
        &on_short,
        &[
            "topics",
            "check",
            "--partitions",
            "1",
            single[0],
            single[1],
            "--retention",
            "3d",
        ],
    );
    assert_eq!(code, 1, "{doc}");
    assert!(
        row(&doc, &short)["differences"][0]
            .as_str()
            .unwrap()
            .starts_with("retention.ms: 172800000 on the broker, 259200000 requested"),
        "{doc}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_create_dry_run_prints_the_commands_and_touches_no_broker() {
    let env = require!(TestEnv::new("topics_dry_run", 0).await);
    let routed = with_route(&env);
    // No broker answers here: a dry run does not need one.
    let nowhere = format!("127.0.0.1:{}", outbox_test_support::free_port());
    let out = env
        .cmd()
        .env("KAFKA_BROKERS", &nowhere)
        .args(["topics", "create", "--dry-run", "--partitions", "6"])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    for t in [&env.topic, &routed] {
        let line = format!(
            "kafka-topics.sh --bootstrap-server {nowhere} --create --if-not-exists --topic {t} \
             --partitions 6 --replication-factor 3 --config min.insync.replicas=2 --config \
             retention.ms=604800000 --config cleanup.policy=delete"
        );
        assert!(shown.lines().any(|l| l == line), "{line}\nnot in\n{shown}");
    }
    // The real broker still has neither.
    let (code, doc, _) = env.json(&["topics", "check"]);
    assert_eq!(code, 4, "{doc}");
}

/// Arguments, extra environment, the exit code and what the output must say.
type BadInput<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], i32, &'a str);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_bad_input_and_an_unreachable_broker_exit_by_the_table() {
    let env = require!(TestEnv::new("topics_bad_input", 0).await);
    let cases: &[BadInput<'_>] = &[
        (
            &["topics", "create", "--partitions", "0"],
            &[],
            2,
            "at least one partition",
        ),
        (
            &[
                "topics",
                "create",
                "--replication-factor",
                "1",
                "--min-insync-replicas",
                "2",
            ],
            &[],
            2,
            "--min-insync-replicas 2 with replication factor 1",
        ),
        (
            &["topics", "create", "--retention", "1h"],
            &[],
            2,
            "shorter than retention.max_consumer_lag",
        ),
        (
            &["topics", "create", "--retention", "soon"],
            &[],
            2,
            "is not a duration",
        ),
        (
            &["topics", "check"],
            &[("OUTBOX_TRANSPORT__KIND", "carrier-pigeon")],
            2,
            "transport",
        ),
        // tansu is one broker: a replication factor of 3 cannot be met.
        (&["topics", "create"], &[], 2, "has 1 broker(s)"),
    ];
    for (args, envs, code, says) in cases {
        let out = env
            .cmd()
            .envs(envs.iter().copied())
            .args(*args)
            .output()
            .unwrap();
        let shown = text(&out);
        assert_eq!(out.status.code(), Some(*code), "{args:?}: {shown}");
        assert!(shown.contains(says), "{args:?}: {says:?} not in {shown}");
    }
    // Nothing was created by any of them.
    let (code, doc, _) = env.json(&["topics", "check", "--replication-factor", "1"]);
    assert_eq!(code, 4, "{doc}");
    // An unreachable broker: exit 3, naming it.
    let nowhere = format!("127.0.0.1:{}", outbox_test_support::free_port());
    let out = env
        .cmd()
        .env("KAFKA_BROKERS", &nowhere)
        .env("OUTBOX_KAFKA__METADATA_TIMEOUT", "2s")
        .args(["topics", "create", "--replication-factor", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(text(&out).contains(&nowhere), "{}", text(&out));
    let (code, doc, _) = env.json_env(
        &[
            ("KAFKA_BROKERS", &nowhere),
            ("OUTBOX_KAFKA__METADATA_TIMEOUT", "2s"),
        ],
        &["topics", "check"],
    );
    assert_eq!(code, 3, "{doc}");
    assert_eq!(doc["error"]["kind"], "unreachable", "{doc}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_on_nats_create_the_stream_once_and_check_it() {
    let test = "topics_on_nats_create_the_stream_once_and_check_it";
    let env = require!(TestEnv::without_kafka(test).await);
    let url = require!(outbox_test_support::nats_url(test));
    let prefix = outbox_test_support::unique("topics");
    let stream = NatsStream::adopt(&url, &prefix).await;
    let nats = [
        ("OUTBOX_TRANSPORT__KIND", "nats"),
        ("NATS_URL", url.as_str()),
        ("OUTBOX_NATS__SUBJECT_PREFIX", prefix.as_str()),
    ];
    let name = prefix.to_uppercase();
    // --dry-run: the command, nothing made.
    let out = env
        .cmd()
        .envs(nats)
        .args(["topics", "create", "--dry-run", "--replication-factor", "1"])
        .output()
        .unwrap();
    let shown = text(&out);
    assert_eq!(out.status.code(), Some(0), "{shown}");
    assert!(
        shown.contains(&format!(
            "stream add {name} --subjects \"{prefix}.>\" --storage file --replicas 1 \
             --retention limits --discard old --dupe-window 2m --max-age 7days"
        )),
        "{shown}"
    );
    // Missing: the relay's check says so (exit 4) and names the way to make it.
    let out = env
        .cmd()
        .envs(nats)
        .args(["topics", "check"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    assert!(
        text(&out).contains("outbox topics create"),
        "{}",
        text(&out)
    );
    // One server: 3 replicas cannot be held (exit 2, with the flag to pass).
    let out = env
        .cmd()
        .envs(nats)
        .args(["topics", "create"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("--replication-factor 1"),
        "{}",
        text(&out)
    );
    // Created with what the relay's check wants; a second run changes nothing.
    let create = ["topics", "create", "--replication-factor", "1"];
    let (code, doc, err) = env.json_env(&nats, &create);
    assert_eq!(code, 0, "{doc} {err}");
    assert_eq!(doc["action"], "created", "{doc}");
    let config = stream.config().await;
    assert_eq!(config.subjects, vec![format!("{prefix}.>")]);
    assert_eq!(
        config.storage,
        async_nats::jetstream::stream::StorageType::File
    );
    assert_eq!(config.num_replicas, 1);
    assert!(
        config.duplicate_window >= Duration::from_secs(10),
        "the lease: {config:?}"
    );
    assert_eq!(
        config.max_age,
        Duration::from_secs(7 * 86_400),
        "by the rule"
    );
    let (code, doc, err) = env.json_env(&nats, &create);
    assert_eq!(code, 0, "{doc} {err}");
    assert_eq!(doc["action"], "ok", "{doc}");
    let (code, doc, err) = env.json_env(&nats, &["topics", "check"]);
    assert_eq!(code, 0, "{doc} {err}");
    assert!(doc["findings"].to_string().contains(&name), "{doc}");
    // Kafka-only flags are refused.
    let out = env
        .cmd()
        .envs(nats)
        .args(["topics", "create", "--partitions", "3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_on_rabbitmq_declare_the_exchange_once_and_check_it() {
    let test = "topics_on_rabbitmq_declare_the_exchange_once_and_check_it";
    let env = require!(TestEnv::without_kafka(test).await);
    let url = require!(outbox_test_support::amqp_url(test));
    let exchange = outbox_test_support::unique("topics");
    let topology = RabbitTopology::adopt(&url, &exchange).await;
    let rabbit = [
        ("OUTBOX_TRANSPORT__KIND", "rabbitmq"),
        ("AMQP_URL", url.as_str()),
        ("OUTBOX_RABBITMQ__EXCHANGE", exchange.as_str()),
    ];
    let out = env
        .cmd()
        .envs(rabbit)
        .args(["topics", "create", "--dry-run"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains(&format!(
            "rabbitmqadmin declare exchange name={exchange} type=topic durable=true"
        )),
        "{}",
        text(&out)
    );
    assert!(
        !topology.exchange_is(lapin::ExchangeKind::Topic).await,
        "a dry run makes nothing"
    );
    let out = env
        .cmd()
        .envs(rabbit)
        .args(["topics", "check"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    let (code, doc, err) = env.json_env(&rabbit, &["topics", "create"]);
    assert_eq!(code, 0, "{doc} {err}");
    assert_eq!(doc["action"], "created", "{doc}");
    assert!(
        topology.exchange_is(lapin::ExchangeKind::Topic).await,
        "durable topic exchange"
    );
    let (code, doc, err) = env.json_env(&rabbit, &["topics", "create"]);
    assert_eq!(code, 0, "{doc} {err}");
    assert_eq!(doc["action"], "ok", "{doc}");
    let out = env
        .cmd()
        .envs(rabbit)
        .args(["topics", "check"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains(&exchange), "{}", text(&out));
    // Unreachable: exit 3.
    let nowhere = format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f",
        outbox_test_support::free_port()
    );
    let out = env
        .cmd()
        .envs(rabbit)
        .env("AMQP_URL", &nowhere)
        .env("OUTBOX_RABBITMQ__CONNECT_TIMEOUT", "2s")
        .args(["topics", "create"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
}
