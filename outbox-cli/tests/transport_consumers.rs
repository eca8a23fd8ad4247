//! The `[[consumers]]` sections on NATS JetStream and RabbitMQ, driven through the binary:
//! `outbox check` judges each consumer's RabbitMQ queue (`consumers.group`), and `outbox
//! status` reads each consumer's lag from the transport (the NATS durable consumer, the
//! RabbitMQ queue) without joining it. Needs `DATABASE_URL`, NATS (`NATS_URL`) and RabbitMQ
//! (`AMQP_URL`), unless `OUTBOX_SKIP_SERVICE_TESTS=1`. Every queue, stream and consumer is the
//! test's own.

mod common;
mod transport_support;

use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy};
use common::TestEnv;
use futures::StreamExt;
use lapin::options::{BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use transport_support::{NatsStream, RabbitTopology};

macro_rules! require {
    ($e:expr) => {
        match $e {
            Some(v) => v,
            None => return,
        }
    };
}

fn borrowed<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

fn rabbit_env(t: &RabbitTopology) -> Vec<(&'static str, String)> {
    vec![
        ("OUTBOX_TRANSPORT__KIND", "rabbitmq".into()),
        ("AMQP_URL", t.url.clone()),
        ("OUTBOX_RABBITMQ__EXCHANGE", t.exchange.clone()),
    ]
}

fn nats_env(stream: &NatsStream) -> Vec<(&'static str, String)> {
    vec![
        ("OUTBOX_TRANSPORT__KIND", "nats".into()),
        ("NATS_URL", stream.url.clone()),
        ("OUTBOX_NATS__SUBJECT_PREFIX", stream.prefix.clone()),
    ]
}

/// `[[consumers]]` sections, one per (name, group), written to the test's `outbox.toml`.
fn consumers(env: &TestEnv, entries: &[(&str, &str)]) {
    let mut toml = String::new();
    for (name, group) in entries {
        toml.push_str(&format!(
            "[[consumers]]\nname = \"{name}\"\ngroup = \"{group}\"\ninbox_schema = \"{}\"\n",
            env.schema
        ));
    }
    std::fs::write(env.dir.join("outbox.toml"), toml).unwrap();
}

/// The findings of `check --json` as (check, severity, message, fix).
fn findings(doc: &serde_json::Value) -> Vec<(String, String, String, String)> {
    doc["findings"]
        .as_array()
        .unwrap_or_else(|| panic!("findings: {doc}"))
        .iter()
        .map(|f| {
            (
                f["check"].as_str().unwrap().to_owned(),
                f["severity"].as_str().unwrap().to_owned(),
                f["message"].as_str().unwrap().to_owned(),
                f["fix"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

fn find<'a>(
    fs: &'a [(String, String, String, String)],
    check: &str,
    severity: &str,
    text: &str,
) -> Option<&'a (String, String, String, String)> {
    fs.iter()
        .find(|(c, s, m, _)| c == check && s == severity && m.contains(text))
}

/// Queues of the test's own beside the topology's, deleted when dropped.
struct Queues {
    url: String,
    names: Vec<String>,
    conn: lapin::Connection,
}

impl Queues {
    async fn new(url: &str) -> Self {
        let conn = lapin::Connection::connect(
            url,
            lapin::ConnectionProperties::default()
                .with_executor(tokio_executor_trait::Tokio::current())
                .with_reactor(tokio_reactor_trait::Tokio),
        )
        .await
        .expect("connect to RabbitMQ");
        Self {
            url: url.to_owned(),
            names: Vec::new(),
            conn,
        }
    }

    /// A durable queue with `args`.
    async fn declare(&mut self, args: &[(&str, AMQPValue)]) -> String {
        let name = outbox_test_support::unique("cq");
        let mut table = FieldTable::default();
        for (k, v) in args {
            table.insert((*k).into(), v.clone());
        }
        let ch = self.conn.create_channel().await.unwrap();
        ch.queue_declare(
            &name,
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            table,
        )
        .await
        .expect("declare");
        self.names.push(name.clone());
        name
    }

    /// Publishes `n` messages straight to `queue` (the default exchange).
    async fn fill(&self, queue: &str, n: usize) {
        let ch = self.conn.create_channel().await.unwrap();
        ch.confirm_select(Default::default()).await.unwrap();
        for i in 0..n {
            ch.basic_publish(
                "",
                queue,
                BasicPublishOptions::default(),
                format!("m{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        }
    }
}

impl Drop for Queues {
    fn drop(&mut self) {
        let (url, names) = (self.url.clone(), self.names.clone());
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async move {
                    let Ok(Ok(conn)) = tokio::time::timeout(
                        Duration::from_secs(5),
                        lapin::Connection::connect(
                            &url,
                            lapin::ConnectionProperties::default()
                                .with_executor(tokio_executor_trait::Tokio::current())
                                .with_reactor(tokio_reactor_trait::Tokio),
                        ),
                    )
                    .await
                    else {
                        return;
                    };
                    if let Ok(ch) = conn.create_channel().await {
                        for q in names {
                            let _ = ch.queue_delete(&q, QueueDeleteOptions::default()).await;
                        }
                    }
                    let _ = conn.close(200, "done").await;
                })
        })
        .join();
    }
}

fn quorum() -> (&'static str, AMQPValue) {
    ("x-queue-type", AMQPValue::LongString("quorum".into()))
}

fn sac() -> (&'static str, AMQPValue) {
    ("x-single-active-consumer", AMQPValue::Boolean(true))
}

/// `outbox check` on RabbitMQ judges each consumer's queue: a good one is ok, one without
/// single active consumer a warning, one with a message TTL and a missing one violations
/// (exit 1), each with what to declare; the binding, which AMQP cannot read, is a warning
/// naming the routing and the command to verify it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_judges_each_consumers_queue_on_rabbitmq() {
    let test = "check_judges_each_consumers_queue_on_rabbitmq";
    let env = require!(TestEnv::without_kafka(test).await);
    let url = require!(outbox_test_support::amqp_url(test));
    env.migrate();
    let topology = RabbitTopology::create(&url).await;
    let mut queues = Queues::new(&url).await;
    let good = queues.declare(&[quorum(), sac()]).await;
    let ttl = queues
        .declare(&[
            quorum(),
            sac(),
            ("x-message-ttl", AMQPValue::LongLongInt(60_000)),
        ])
        .await;
    let missing = outbox_test_support::unique("cq-missing");
    // Only good ones first: exit 0, ok and the binding warning.
    consumers(&env, &[("billing", &good), ("shipping", &topology.queue)]);
    let vars = rabbit_env(&topology);
    let (code, doc, err) = env.json_env(&borrowed(&vars), &["check"]);
    let fs = findings(&doc);
    assert_eq!(code, 0, "warnings only: {doc} {err}");
    assert!(
        find(
            &fs,
            "queue",
            "ok",
            &format!("consumer billing: \"{good}\" is a durable quorum queue with single active consumer")
        )
        .is_some(),
        "{fs:#?}"
    );
    let nosac = find(
        &fs,
        "queue",
        "warning",
        &format!(
            "consumer shipping: queue \"{}\" has no single active consumer",
            topology.queue
        ),
    )
    .unwrap_or_else(|| panic!("{fs:#?}"));
    assert!(nosac.3.contains("x-single-active-consumer"), "{nosac:?}");
    let binding = find(
        &fs,
        "binding",
        "warning",
        &format!("consumer billing: the bindings of \"{good}\" cannot be read over AMQP"),
    )
    .unwrap_or_else(|| panic!("{fs:#?}"));
    assert!(
        binding.2.contains(&format!(
            "the relay publishes to topic exchange \"{}\" with the aggregate type as routing key",
            topology.exchange
        )),
        "{binding:?}"
    );
    assert!(
        binding.3.contains("rabbitmqctl list_bindings"),
        "{binding:?}"
    );
    // A queue that drops events and a missing one: violations, exit 1.
    consumers(&env, &[("billing", &ttl), ("audit", &missing)]);
    let (code, doc, _) = env.json_env(&borrowed(&vars), &["check"]);
    let fs = findings(&doc);
    assert_eq!(code, 1, "{doc}");
    let dropped = find(
        &fs,
        "queue",
        "error",
        &format!("consumer billing: queue \"{ttl}\" has x-message-ttl = 60000 ms"),
    )
    .unwrap_or_else(|| panic!("{fs:#?}"));
    assert!(
        dropped.3.contains("rabbitmqadmin declare queue"),
        "{dropped:?}"
    );
    let absent = find(
        &fs,
        "queue",
        "error",
        &format!("consumer audit: queue \"{missing}\" does not exist"),
    )
    .unwrap_or_else(|| panic!("{fs:#?}"));
    assert!(
        absent.3.contains(&format!("name={missing} durable=true"))
            && absent
                .3
                .contains(&format!("exchange \"{}\"", topology.exchange)),
        "{absent:?}"
    );
    // --no-broker: no queue is looked at.
    let (code, doc, _) = env.json_env(&borrowed(&vars), &["check", "--no-broker"]);
    assert_eq!(code, 0, "{doc}");
    assert!(
        find(&findings(&doc), "queue", "error", "").is_none(),
        "{doc}"
    );
    env.drop_schema().await;
}

/// The consumer section of `status --json` for `name`.
fn consumer<'a>(doc: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    doc["consumers"]
        .as_array()
        .unwrap_or_else(|| panic!("consumers: {doc}"))
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("consumer {name}: {doc}"))
}

/// `outbox status` reads a RabbitMQ consumer's lag as its queue's ready messages; a missing
/// queue is a lag error naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reads_the_queue_depth_as_lag_on_rabbitmq() {
    let test = "status_reads_the_queue_depth_as_lag_on_rabbitmq";
    let env = require!(TestEnv::without_kafka(test).await);
    let url = require!(outbox_test_support::amqp_url(test));
    env.migrate();
    let topology = RabbitTopology::create(&url).await;
    let mut queues = Queues::new(&url).await;
    let q = queues.declare(&[quorum(), sac()]).await;
    queues.fill(&q, 7).await;
    let missing = outbox_test_support::unique("cq-missing");
    consumers(&env, &[("billing", &q), ("audit", &missing)]);
    let (code, doc, err) = env.json_env(&borrowed(&rabbit_env(&topology)), &["status"]);
    assert_eq!(code, 0, "{doc} {err}");
    let billing = consumer(&doc, "billing");
    assert_eq!(billing["lag"], 7, "{billing}");
    assert_eq!(billing["lag_error"], serde_json::Value::Null, "{billing}");
    assert_eq!(billing["partitions"][0]["queue"], q.as_str(), "{billing}");
    assert_eq!(billing["partitions"][0]["ready"], 7, "{billing}");
    let audit = consumer(&doc, "audit");
    assert_eq!(audit["lag"], serde_json::Value::Null, "{audit}");
    assert!(
        audit["lag_error"]
            .as_str()
            .unwrap()
            .contains(&format!("queue \"{missing}\" does not exist")),
        "{audit}"
    );
    // Reading took nothing from the queue.
    assert_eq!(topology.depth().await, 0);
    let (_, doc, _) = env.json_env(&borrowed(&rabbit_env(&topology)), &["status"]);
    assert_eq!(consumer(&doc, "billing")["lag"], 7, "{doc}");
    env.drop_schema().await;
}

/// `outbox status` reads a NATS consumer's lag from its durable consumer: messages not yet
/// delivered plus those delivered and not acknowledged; a consumer that has not started (no
/// durable) is a lag error with the fix, and reading creates none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reads_the_durable_consumer_as_lag_on_nats() {
    let test = "status_reads_the_durable_consumer_as_lag_on_nats";
    let env = require!(TestEnv::without_kafka(test).await);
    let url = require!(outbox_test_support::nats_url(test));
    env.migrate();
    let stream = NatsStream::create(&url, Duration::from_secs(120)).await;
    let client = async_nats::connect(&url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    for i in 0..6 {
        js.publish(format!("{}.order", stream.prefix), format!("m{i}").into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let durable = outbox_test_support::unique("billing");
    let s = js.get_stream(&stream.name).await.unwrap();
    let c = s
        .create_consumer(pull::Config {
            durable_name: Some(durable.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(300),
            ..Default::default()
        })
        .await
        .unwrap();
    // Two delivered, one of them acknowledged: 4 pending + 1 awaiting its ack.
    let mut batch = c.fetch().max_messages(2).messages().await.unwrap();
    let first = batch.next().await.unwrap().unwrap();
    first.double_ack().await.unwrap();
    let _second = batch.next().await.unwrap().unwrap();
    let unstarted = outbox_test_support::unique("audit");
    consumers(&env, &[("billing", &durable), ("audit", &unstarted)]);
    let (code, doc, err) = env.json_env(&borrowed(&nats_env(&stream)), &["status"]);
    assert_eq!(code, 0, "{doc} {err}");
    let billing = consumer(&doc, "billing");
    assert_eq!(billing["lag"], 5, "{billing}");
    let part = &billing["partitions"][0];
    assert_eq!(part["stream"], stream.name.as_str(), "{billing}");
    assert_eq!(part["consumer"], durable.as_str(), "{billing}");
    assert_eq!(part["pending"], 4, "{billing}");
    assert_eq!(part["ack_pending"], 1, "{billing}");
    let audit = consumer(&doc, "audit");
    assert_eq!(audit["lag"], serde_json::Value::Null, "{audit}");
    assert!(
        audit["lag_error"]
            .as_str()
            .unwrap()
            .contains(&format!("no durable consumer \"{unstarted}\"")),
        "{audit}"
    );
    // Reading created no consumer.
    assert!(s.consumer_info(&unstarted).await.is_err());
    env.drop_schema().await;
}
