//! The `outbox-projector` process against a real PostgreSQL and a real Kafka-protocol broker,
//! tried as an operator would: a topic holds the relay's events and records another producer
//! wrote (no headers, garbage headers, a non-numeric version, an empty value). Before, the
//! first malformed record stopped the projector at the same offset on every restart; now each
//! is parked in PostgreSQL with its raw record, the partition continues, the committed offset
//! reaches the end, and a restart does not stop at them again. Needs `DATABASE_URL` and
//! `KAFKA_BROKERS` (`scripts/test` sets both); skips only with `OUTBOX_SKIP_SERVICE_TESTS=1`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use outbox_core::{wire, Envelope, Publisher};
use outbox_kafka::KafkaPublisher;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

struct Projector(Child);

impl Projector {
    fn start(url: &str, brokers: &str, schema: &str, topic: &str, group: &str) -> Self {
        let child = Command::new(env!("CARGO_BIN_EXE_outbox-projector"))
            .args([
                "--database-url",
                url,
                "--schema",
                schema,
                "--brokers",
                brokers,
                "--topic",
                topic,
                "--group",
                group,
            ])
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn outbox-projector");
        Self(child)
    }

    /// SIGTERM: the projector finishes what runs and commits what is final.
    fn stop(mut self) {
        let pid = self.0.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.0.try_wait() {
                assert!(status.success(), "projector exited with {status}");
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("projector did not stop on SIGTERM");
    }

    fn assert_running(&mut self) {
        assert!(
            self.0.try_wait().expect("try_wait").is_none(),
            "the projector exited"
        );
    }
}

impl Drop for Projector {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn event(agg: &str, v: i64) -> Envelope {
    Envelope::builder("order", agg, v, "order.changed")
        .json(&serde_json::json!({ "v": v }))
        .unwrap()
        .build()
        .unwrap()
}

async fn produce_raw(
    brokers: &str,
    topic: &str,
    headers: Option<Vec<(String, Vec<u8>)>>,
    value: &[u8],
) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    let mut r: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic).key("m").payload(value);
    if let Some(hs) = headers {
        let mut oh = OwnedHeaders::new();
        for (k, v) in &hs {
            oh = oh.insert(Header {
                key: k,
                value: Some(v),
            });
        }
        r = r.headers(oh);
    }
    producer
        .send(r, Duration::from_secs(5))
        .await
        .expect("produce");
}

fn group_committed(brokers: &str, group: &str, topic: &str) -> Option<i64> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, 0);
    let got = c.committed_offsets(tpl, Duration::from_secs(5)).ok()?;
    match got.elements()[0].offset() {
        Offset::Offset(o) => Some(o),
        _ => None,
    }
}

async fn count(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_projector_parks_malformed_records_and_continues_across_restarts() {
    let (Some(url), Some(brokers)) = (
        outbox_test_support::required_var(module_path!(), "DATABASE_URL"),
        outbox_test_support::required_var(module_path!(), "KAFKA_BROKERS"),
    ) else {
        return;
    };
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..10];
    let (schema, topic, group) = (
        format!("proj_{suffix}"),
        format!("proj-{suffix}"),
        format!("proj-{suffix}"),
    );
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&pool)
        .await
        .unwrap();
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .unwrap();
    for r in admin
        .create_topics(
            [&NewTopic::new(&topic, 1, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .unwrap()
    {
        r.unwrap();
    }
    // Good events and malformed records, interleaved. One record per produce request (see the
    // outbox-kafka crate docs on tansu).
    let publisher = KafkaPublisher::builder(&brokers, &topic)
        .delivery_timeout(Duration::from_secs(10))
        .start()
        .await
        .unwrap();
    let publish = |e: Envelope| {
        let publisher = &publisher;
        async move {
            assert!(publisher.publish(&[&e]).await[0].is_ok());
        }
    };
    publish(event("a", 1)).await;
    produce_raw(&brokers, &topic, None, b"no headers").await;
    produce_raw(
        &brokers,
        &topic,
        Some(vec![("x".into(), vec![0xff])]),
        b"{}",
    )
    .await;
    let bad_version: Vec<(String, Vec<u8>)> = wire::encode_headers(&event("m", 1))
        .into_iter()
        .map(|(k, v)| {
            if k == wire::AGGREGATE_VERSION {
                (k, b"one".to_vec())
            } else {
                (k, v)
            }
        })
        .collect();
    produce_raw(&brokers, &topic, Some(bad_version), b"{}").await;
    produce_raw(&brokers, &topic, None, b"").await;
    publish(event("a", 2)).await;
    publish(event("b", 1)).await;
    publish(event("m", 2)).await;
    let end = 8;

    let effects = format!("SELECT count(*) FROM {schema}.effects");
    let parked = format!("SELECT count(*) FROM {schema}.processed_events_parked");
    let mut projector = Projector::start(&url, &brokers, &schema, &topic, &group);
    let deadline = Instant::now() + Duration::from_secs(60);
    while count(&pool, &effects).await < 3 || count(&pool, &parked).await < 5 {
        projector.assert_running();
        assert!(
            Instant::now() < deadline,
            "effects {} parked {}",
            count(&pool, &effects).await,
            count(&pool, &parked).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    projector.assert_running();
    projector.stop();
    assert_eq!(count(&pool, &effects).await, 3, "a v1, a v2, b v1");
    let statuses: Vec<(String, Option<String>, i64)> = sqlx::query_as(&format!(
        "SELECT status, kind, \"offset\" FROM {schema}.processed_events_parked ORDER BY \"offset\""
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        statuses,
        vec![
            ("parked".into(), Some("unprocessable".into()), 1),
            ("parked".into(), Some("unprocessable".into()), 2),
            ("parked".into(), Some("unprocessable".into()), 3),
            ("parked".into(), Some("unprocessable".into()), 4),
            ("waiting".into(), None, 7),
        ],
        "m v2 waits behind m's undecodable record"
    );
    assert_eq!(group_committed(&brokers, &group, &topic), Some(end));

    // A restart resumes at the end: nothing stops it, nothing is applied or parked again.
    let mut projector = Projector::start(&url, &brokers, &schema, &topic, &group);
    tokio::time::sleep(Duration::from_secs(8)).await;
    projector.assert_running();
    projector.stop();
    assert_eq!(count(&pool, &effects).await, 3);
    assert_eq!(count(&pool, &parked).await, 5);
    assert_eq!(group_committed(&brokers, &group, &topic), Some(end));
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
}
