//! Shared setup of the `outbox` binary tests: each test gets its own schema and topic on the
//! services `scripts/test` provides (found through `outbox-test-support`, which also holds the
//! skip switch), and drives the binary as a user would.
#![allow(dead_code, unreachable_pub)]

pub mod consumer_ops;
pub mod mysql;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use outbox_core::{ClaimMode, Envelope};
use outbox_postgres::PostgresOutboxStore;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::PgPool;

/// Returns from the test when the services are missing and skipping is allowed.
#[macro_export]
macro_rules! env_or_skip {
    ($test:expr, $partitions:expr) => {
        match common::TestEnv::new($test, $partitions).await {
            Some(env) => env,
            None => return,
        }
    };
}

/// One test's services and names.
pub struct TestEnv {
    pub url: String,
    pub brokers: String,
    pub schema: String,
    pub topic: String,
    pub pool: PgPool,
    pub dir: PathBuf,
}

impl TestEnv {
    /// Services from the environment, a fresh schema name (not created) and a fresh topic
    /// with `partitions` (none when 0).
    pub async fn new(test: &str, partitions: i32) -> Option<Self> {
        let url = outbox_test_support::database_url(test)?;
        let brokers = outbox_test_support::brokers(test)?;
        let schema = outbox_test_support::unique("cli");
        let topic = schema.replace('_', "-");
        let pool = PgPool::connect(&url).await.expect("PostgreSQL");
        if partitions > 0 {
            create_topic(&brokers, &topic, partitions, &[]).await;
        }
        let dir = std::env::temp_dir().join(&schema);
        std::fs::create_dir_all(&dir).unwrap();
        Some(Self {
            url,
            brokers,
            schema,
            topic,
            pool,
            dir,
        })
    }

    /// Like [`new`](Self::new) without Kafka: for the relay on another transport
    /// (`KAFKA_BROKERS` is left empty; the test sets `[transport]` in the environment).
    pub async fn without_kafka(test: &str) -> Option<Self> {
        let url = outbox_test_support::database_url(test)?;
        let schema = outbox_test_support::unique("cli");
        let topic = schema.replace('_', "-");
        let pool = PgPool::connect(&url).await.expect("PostgreSQL");
        let dir = std::env::temp_dir().join(&schema);
        std::fs::create_dir_all(&dir).unwrap();
        Some(Self {
            url,
            brokers: String::new(),
            schema,
            topic,
            pool,
            dir,
        })
    }

    /// The `outbox` binary with this test's database, broker, schema and topic in its
    /// environment, run in an empty directory (no `outbox.toml`). `OUTBOX_TEST_BIN` names
    /// another build of the binary to run instead (e.g. an earlier commit's, to see a new test
    /// fail against it).
    pub fn cmd(&self) -> Command {
        let bin = std::env::var("OUTBOX_TEST_BIN")
            .ok()
            .filter(|b| !b.trim().is_empty())
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_outbox").to_owned());
        let mut c = Command::new(bin);
        c.current_dir(&self.dir)
            .env_remove("RUST_LOG")
            .env_remove("OUTBOX_CONFIG")
            .env("DATABASE_URL", &self.url)
            .env("KAFKA_BROKERS", &self.brokers)
            .env("OUTBOX_OUTBOX__SCHEMA", &self.schema)
            .env("OUTBOX_KAFKA__TOPIC", &self.topic)
            .env("OUTBOX_KAFKA__DELIVERY_TIMEOUT", "5s")
            .env("OUTBOX_NATS__DELIVERY_TIMEOUT", "5s")
            .env("OUTBOX_RABBITMQ__DELIVERY_TIMEOUT", "5s")
            .env("OUTBOX_OUTBOX__LEASE", "10s")
            .env("OUTBOX_RELAY__STATS_INTERVAL", "200ms")
            .env("OUTBOX_RELAY__IDLE_MAX", "100ms")
            .stdin(Stdio::null());
        c
    }

    /// Runs `outbox <args>` to completion.
    pub fn run(&self, args: &[&str]) -> Output {
        self.cmd().args(args).output().expect("run outbox")
    }

    /// Runs `outbox --json <args>` and parses stdout.
    pub fn json(&self, args: &[&str]) -> (i32, serde_json::Value, String) {
        self.json_env(&[], args)
    }

    /// [`json`](Self::json) with extra environment variables.
    pub fn json_env(
        &self,
        envs: &[(&str, &str)],
        args: &[&str],
    ) -> (i32, serde_json::Value, String) {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = self
            .cmd()
            .envs(envs.iter().copied())
            .args(&all)
            .output()
            .expect("run outbox");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout of {args:?} is not JSON ({e}): {}\nstderr: {stderr}",
                String::from_utf8_lossy(&out.stdout)
            )
        });
        (out.status.code().unwrap_or(-1), value, stderr)
    }

    /// `outbox migrate`, asserting success.
    pub fn migrate(&self) {
        let out = self.run(&["migrate"]);
        assert!(out.status.success(), "migrate: {}", text(&out));
    }

    /// The store on this test's schema.
    pub fn store(&self) -> PostgresOutboxStore {
        PostgresOutboxStore::builder(self.pool.clone())
            .schema(self.schema.clone())
            .claim_mode(ClaimMode::lease(Duration::from_secs(10)).unwrap())
            .build()
            .unwrap()
    }

    /// Appends `versions` events for each of `aggregates` aggregates (committed); returns them.
    pub async fn append(&self, aggregates: usize, versions: i64) -> Vec<Envelope> {
        self.append_versions(aggregates, 1..=versions).await
    }

    /// Appends `versions` of each of `aggregates` aggregates (committed); returns them.
    pub async fn append_versions(
        &self,
        aggregates: usize,
        versions: std::ops::RangeInclusive<i64>,
    ) -> Vec<Envelope> {
        let store = self.store();
        let mut all = Vec::new();
        for v in versions {
            let events: Vec<Envelope> = (0..aggregates)
                .map(|a| {
                    Envelope::builder("order", format!("o-{a}"), v, "order.changed")
                        .json(&serde_json::json!({"v": v}))
                        .unwrap()
                        .build()
                        .unwrap()
                })
                .collect();
            store.append_many(&self.pool, &events).await.unwrap();
            all.extend(events);
        }
        all
    }

    /// Starts `outbox relay` with `args` on a free port; returns the process and the port.
    pub fn spawn_relay(&self, args: &[&str]) -> Daemon {
        self.spawn_relay_env(&[], args)
    }

    /// [`spawn_relay`](Self::spawn_relay) with extra environment variables.
    pub fn spawn_relay_env(&self, envs: &[(&str, &str)], args: &[&str]) -> Daemon {
        let port = outbox_test_support::free_port();
        let listen = format!("127.0.0.1:{port}");
        let child = self
            .cmd()
            .envs(envs.iter().copied())
            .args(["relay", "--listen", &listen])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn outbox relay");
        Daemon { child, port }
    }

    /// Counts of rows by status.
    pub async fn count(&self, status: &str) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM \"{}\".outbox_events WHERE status = $1",
            self.schema
        ))
        .bind(status)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    /// Waits until `status` has `n` rows.
    pub async fn wait_count(&self, status: &str, n: i64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let c = self.count(status).await;
            if c >= n {
                return;
            }
            assert!(Instant::now() < deadline, "{c} {status}, expected {n}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Drops the schema (the topic stays: tansu's memory storage goes with the run).
    pub async fn drop_schema(&self) {
        let _ = sqlx::raw_sql(&format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.schema
        ))
        .execute(&self.pool)
        .await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A running daemon, killed on drop.
pub struct Daemon {
    pub child: Child,
    pub port: u16,
}

impl Daemon {
    /// `GET path` → (status code, body); `None` while nothing listens.
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        http_get(self.port, path)
    }

    /// Waits until `/readyz` answers 200.
    pub fn wait_ready(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((200, _)) = self.get("/readyz") {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                let mut err = String::new();
                if let Some(mut e) = self.child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                panic!("relay exited with {status} before it was ready: {err}");
            }
            assert!(
                Instant::now() < deadline,
                "relay not ready: {:?}",
                self.get("/readyz")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The value of the first sample of `metric` whose labels contain `labels`.
    pub fn metric(&self, metric: &str, labels: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics")?;
        metric_value(&body, metric, labels)
    }

    /// Waits until `metric{labels}` satisfies `ok`.
    pub fn wait_metric(
        &mut self,
        metric: &str,
        labels: &str,
        ok: impl Fn(f64) -> bool,
        timeout: Duration,
    ) -> f64 {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(v) = self.metric(metric, labels) {
                if ok(v) {
                    return v;
                }
            }
            if Instant::now() >= deadline {
                let now = self.metric(metric, labels);
                signal(self.child.id(), "KILL");
                let mut err = String::new();
                if let Some(mut e) = self.child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                panic!("{metric}{{{labels}}} = {now:?} never satisfied the condition; relay log:\n{err}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Sends SIGTERM and waits for the exit (bounded): (code, stdout, stderr).
    pub fn terminate(mut self, timeout: Duration) -> (i32, String, String) {
        signal(self.child.id(), "TERM");
        self.wait(timeout)
    }

    /// Waits for the exit (bounded): (code, stdout, stderr).
    pub fn wait(&mut self, timeout: Duration) -> (i32, String, String) {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("outbox relay did not exit within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut out = String::new();
        let mut err = String::new();
        if let Some(mut o) = self.child.stdout.take() {
            let _ = o.read_to_string(&mut out);
        }
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        (status.code().unwrap_or(-1), out, err)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends a signal by pid with `kill(1)` (no unsafe code in tests).
pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "kill -{sig} {pid}");
}

/// A minimal HTTP/1.0 GET on 127.0.0.1.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let code = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((code, body))
}

/// The value of the first sample of `metric` whose label set contains `labels`.
pub fn metric_value(body: &str, metric: &str, labels: &str) -> Option<f64> {
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (name_labels, value) = l.rsplit_once(' ')?;
        let (name, rest) = match name_labels.split_once('{') {
            Some((n, r)) => (n, r),
            None => (name_labels, ""),
        };
        (name == metric && rest.contains(labels)).then(|| value.parse().ok())?
    })
}

/// stdout and stderr of an output, for assertion messages.
pub fn text(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Creates a topic with `config` and waits for its metadata.
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32, config: &[(&str, &str)]) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    let mut new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    for (k, v) in config {
        new = new.set(k, v);
    }
    let res = admin
        .create_topics(
            [&new],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .unwrap();
    for r in res {
        r.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(md) = admin
            .inner()
            .fetch_metadata(Some(topic), Duration::from_secs(2))
        {
            if md
                .topics()
                .iter()
                .any(|t| t.name() == topic && t.partitions().len() == partitions as usize)
            {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("topic {topic} not visible");
}

/// A record read back: aggregate id, version, event id, headers.
#[derive(Debug, Clone)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub aggregate_id: String,
    pub version: i64,
    pub event_id: String,
    pub headers: BTreeMap<String, String>,
}

/// Reads `topic` from the start until `at_least` records arrived and it stayed quiet for 1 s.
pub fn read_topic(brokers: &str, topic: &str, partitions: i32, at_least: usize) -> Vec<Record> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set(
            "group.id",
            format!("reader-{topic}-{}", outbox_test_support::unique("g")),
        )
        .set("enable.auto.commit", "false")
        .set("session.timeout.ms", "6000")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let mut out = Vec::new();
    let mut last = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(60);
    while (out.len() < at_least || last.elapsed() < Duration::from_secs(1))
        && Instant::now() < deadline
    {
        let Some(m) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        let m = m.unwrap();
        let mut headers = BTreeMap::new();
        if let Some(h) = m.headers() {
            for h in h.iter() {
                if let Some(v) = h.value {
                    headers.insert(h.key.to_owned(), String::from_utf8_lossy(v).into_owned());
                }
            }
        }
        out.push(Record {
            partition: m.partition(),
            offset: m.offset(),
            aggregate_id: String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned(),
            version: headers
                .get("aggregate_version")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            event_id: headers.get("event_id").cloned().unwrap_or_default(),
            headers,
        });
        last = Instant::now();
    }
    out.sort_by_key(|r| (r.partition, r.offset));
    out
}

/// The inbox store of `schema` (default table), migrated.
pub async fn inbox(pool: &PgPool, schema: &str) -> outbox_postgres::PostgresInboxStore {
    let inbox = outbox_postgres::PostgresInboxStore::builder(pool.clone())
        .schema(schema.to_owned())
        .build()
        .unwrap();
    inbox.migrate().await.unwrap();
    inbox
}

/// Parks `e` for `consumer` as its engine does when it cannot apply it (`park_as` head or
/// waiting), as read at `offset` of partition 0 of `topic`. Returns its id.
pub async fn park_consumer_message<I: outbox_core::InboxStore>(
    inbox: &I,
    consumer: &str,
    topic: &str,
    offset: i64,
    e: &Envelope,
    park_as: outbox_core::ParkAs,
    reason: &str,
) -> outbox_core::ParkedId {
    let position = outbox_core::LogPosition::new(topic, 0, offset);
    park_consumer_message_at(inbox, consumer, position, e, park_as, reason).await
}

/// Parks `e` for `consumer` as read at `position` (any transport's).
pub async fn park_consumer_message_at<I: outbox_core::InboxStore>(
    inbox: &I,
    consumer: &str,
    position: outbox_core::LogPosition,
    e: &Envelope,
    park_as: outbox_core::ParkAs,
    reason: &str,
) -> outbox_core::ParkedId {
    use outbox_core::{NewParkedMessage, ParkedRecord, Parking, RecordHeader};
    let headers = outbox_core::wire::encode_headers(e)
        .into_iter()
        .map(|(name, value)| RecordHeader::new(name, value))
        .collect();
    let record = ParkedRecord::new(
        position,
        Some(e.aggregate_id.clone().into_bytes()),
        headers,
        Some(e.payload.bytes.clone()),
    );
    let mut tx = inbox.begin().await.unwrap();
    let parked = inbox
        .park(
            &mut tx,
            consumer,
            &[NewParkedMessage::new(record, park_as, reason, 1)],
        )
        .await
        .unwrap();
    inbox.commit(tx).await.unwrap();
    match parked[0] {
        Parking::Head(id) | Parking::Waiting(id) => id,
        Parking::AlreadyParked => panic!("{} is parked already", e.event_id),
    }
}
