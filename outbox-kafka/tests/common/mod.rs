//! Helpers of the broker tests: broker address, unique names, topics, a plain reader, and a
//! tansu process of a test's own for fault injection.
#![allow(dead_code, unreachable_pub)]

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};

// The skip switch and its notice are the workspace's one policy (outbox-test-support).
const SKIP_VAR: &str = outbox_test_support::SKIP_VAR;

fn skipping(test: &str, what: &str) -> bool {
    if outbox_test_support::skip_allowed() {
        outbox_test_support::report_skip(test, &format!("{what} is not set"));
        return true;
    }
    false
}

/// Logs to the test output, filtered by `RUST_LOG` (default: warnings).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// The broker address from `KAFKA_BROKERS`; `None` (after printing that the test skipped) only
/// when `OUTBOX_SKIP_SERVICE_TESTS=1`; otherwise the test fails with what to do.
pub fn brokers(test: &str) -> Option<String> {
    init_tracing();
    match std::env::var("KAFKA_BROKERS") {
        Ok(b) if !b.trim().is_empty() => Some(b),
        _ if skipping(test, "KAFKA_BROKERS") => None,
        _ => panic!(
            "{test}: KAFKA_BROKERS is not set. Run `scripts/test` (it starts tansu and exports \
             KAFKA_BROKERS and TANSU_BIN), or point KAFKA_BROKERS at a Kafka cluster, or set \
             {SKIP_VAR}=1 to skip the broker tests on purpose"
        ),
    }
}

/// The tansu binary, for tests that stop and restart their own broker: `TANSU_BIN`, else
/// `~/.cargo/bin/tansu` (where `scripts/test` installs it) if it exists.
pub fn tansu_bin(test: &str) -> Option<String> {
    init_tracing();
    match std::env::var("TANSU_BIN") {
        Ok(b) if !b.trim().is_empty() => return Some(b),
        _ => {}
    }
    if let Some(home) = std::env::var_os("HOME") {
        let installed = std::path::Path::new(&home).join(".cargo/bin/tansu");
        if installed.is_file() {
            return Some(installed.to_string_lossy().into_owned());
        }
    }
    if skipping(test, "TANSU_BIN") {
        return None;
    }
    panic!(
        "{test}: TANSU_BIN is not set and ~/.cargo/bin/tansu does not exist. This test starts, \
         stops and restarts a broker of its own; run `scripts/test` (it installs tansu and \
         exports TANSU_BIN) or set TANSU_BIN to the path of the tansu binary, or set \
         {SKIP_VAR}=1 to skip on purpose"
    )
}

/// Unwraps an `Option` from `brokers`/`tansu_bin`, returning from the test on `None`.
#[macro_export]
macro_rules! require {
    ($e:expr) => {
        match $e {
            Some(v) => v,
            None => return,
        }
    };
}

/// A name no other test (or earlier run against the same broker) uses.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "{prefix}-{}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        nanos % 1_000_000_000
    )
}

fn admin(brokers: &str) -> AdminClient<DefaultClientContext> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client")
}

/// Creates `topic` and waits until its metadata shows all partitions.
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32, config: &[(&str, &str)]) {
    let admin = admin(brokers);
    let mut new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    for (k, v) in config {
        new = new.set(k, v);
    }
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let res = admin
        .create_topics([&new], &opts)
        .await
        .expect("create_topics request");
    for r in res {
        r.unwrap_or_else(|(t, code)| panic!("creating topic {t}: {code}"));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let md = admin
            .inner()
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .expect("metadata");
        if md.topics().iter().any(|t| {
            t.name() == topic && t.error().is_none() && t.partitions().len() == partitions as usize
        }) {
            return;
        }
        assert!(Instant::now() < deadline, "topic {topic} did not appear");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A record as read back by a plain rdkafka consumer.
#[derive(Debug, Clone)]
pub struct Read {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub headers: Vec<(String, Vec<u8>)>,
    pub payload: Vec<u8>,
}

impl Read {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| std::str::from_utf8(v).unwrap())
    }
}

fn to_read(m: &OwnedMessage) -> Read {
    Read {
        partition: m.partition(),
        offset: m.offset(),
        key: m.key().map(<[u8]>::to_vec),
        headers: m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_owned(), h.value.unwrap_or(&[]).to_vec()))
                    .collect()
            })
            .unwrap_or_default(),
        payload: m.payload().unwrap_or(&[]).to_vec(),
    }
}

/// A plain rdkafka consumer (no group, manual assignment) at the beginning of all
/// `partitions` of `topic`.
fn reader(brokers: &str, topic: &str, partitions: i32) -> BaseConsumer {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .expect("reader");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).expect("assign");
    consumer
}

/// Reads `topic` from the beginning of all `partitions` with a plain rdkafka consumer (no group,
/// manual assignment) until `expect` records arrived or `timeout` passed. Counts records rather
/// than trusting the high watermark (tansu understates it).
pub fn read_all(
    brokers: &str,
    topic: &str,
    partitions: i32,
    expect: usize,
    timeout: Duration,
) -> Vec<Read> {
    let consumer = reader(brokers, topic, partitions);
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < expect && Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => out.push(to_read(&m.detach())),
            Some(Err(e)) => eprintln!("reader: {e}"),
            None => {}
        }
    }
    // Anything beyond `expect` would be a surprise worth seeing: drain briefly.
    let quiet = Instant::now() + Duration::from_millis(300);
    while Instant::now() < quiet {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            out.push(to_read(&m.detach()));
        }
    }
    out
}

/// Reads `topic` from the beginning of all `partitions` (as [`read_all`]) until every event id
/// of `wanted` was seen in an `event_id` header or `timeout` passed; returns those seen.
/// Duplicates and other records are read past.
pub fn read_event_ids(
    brokers: &str,
    topic: &str,
    partitions: i32,
    wanted: &std::collections::HashSet<String>,
    timeout: Duration,
) -> std::collections::HashSet<String> {
    let consumer = reader(brokers, topic, partitions);
    let deadline = Instant::now() + timeout;
    let mut seen = std::collections::HashSet::new();
    while seen.len() < wanted.len() && Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                if let Some(id) = to_read(&m.detach()).header("event_id") {
                    if wanted.contains(id) {
                        seen.insert(id.to_owned());
                    }
                }
            }
            Some(Err(e)) => eprintln!("reader: {e}"),
            None => {}
        }
    }
    seen
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A tansu broker owned by one test (memory storage), killed when dropped.
pub struct Tansu {
    bin: String,
    pub port: u16,
    /// The port clients are told to connect to (a proxy in front of `port`, or `port`).
    advertised: u16,
    child: Option<Child>,
}

impl Tansu {
    pub fn start(bin: &str) -> Self {
        let port = free_port();
        Self::start_advertising(bin, port, port)
    }

    /// A broker listening on `port` that tells clients to connect to `advertised` (where a
    /// proxy of the test forwards to `port`).
    pub fn start_advertising(bin: &str, port: u16, advertised: u16) -> Self {
        let mut t = Tansu {
            bin: bin.to_owned(),
            port,
            advertised,
            child: None,
        };
        t.spawn();
        t
    }

    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn spawn(&mut self) {
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let advertised = format!("tcp://127.0.0.1:{}", self.advertised);
        let child = Command::new(&self.bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &advertised,
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start tansu from {}: {e}", self.bin));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "tansu did not open port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        let ok = Command::new("kill")
            .args([sig, &pid])
            .status()
            .expect("kill")
            .success();
        assert!(ok, "kill {sig} {pid} failed");
    }

    /// Freezes the broker (SIGSTOP): connections stay open, nothing is answered.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Resumes a paused broker (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// Kills the broker (SIGKILL); memory storage loses everything.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the broker again on the same port (empty: topics must be created again).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        if let Some(c) = &self.child {
            // A paused process must be resumed to die cleanly.
            let _ = Command::new("kill")
                .args(["-CONT", &c.id().to_string()])
                .status();
        }
        self.kill();
    }
}
