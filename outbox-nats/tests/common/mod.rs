//! Shared by the NATS tests: the server (`NATS_URL`, else the local one; a missing server fails
//! the test unless `OUTBOX_SKIP_SERVICE_TESTS=1`), a stream of the test's own, and reading
//! stored messages back by stream sequence.
#![allow(dead_code, unused_macros, unused_imports, unreachable_pub)]

use std::time::Duration;

use async_nats::jetstream::consumer::Info as ConsumerInfo;
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use async_nats::jetstream::{self, Context};
use outbox_core::{Envelope, Publisher};
use outbox_nats::NatsPublisher;

pub mod proxy;

/// The inbox engine's PostgreSQL side: [`outbox_test_support::pg_inbox`].
pub use outbox_test_support::pg_inbox as inbox;
pub use outbox_test_support::pg_inbox::poll_n;

pub use outbox_test_support::unique;

/// `Some(url)`, or returns from the test after a printed skip.
macro_rules! require {
    ($e:expr) => {
        match $e {
            Some(v) => v,
            None => return,
        }
    };
}
pub(crate) use require;

/// A PostgreSQL schema of the test's own for the inbox engine (named `natsinbox_…`), or `None`
/// after a printed skip.
pub async fn inbox_db(test: &str) -> Option<inbox::Db> {
    inbox::Db::new(test, "natsinbox").await
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// The shared server's URL (skip or panic as `outbox_test_support::nats_url`).
pub fn nats_url(test: &str) -> Option<String> {
    init_tracing();
    outbox_test_support::nats_url(test)
}

/// A JetStream context on `url`.
pub async fn js(url: &str) -> Context {
    let client = async_nats::connect(url).await.expect("connect to NATS");
    let mut js = jetstream::new(client);
    // async-nats's default timeout for a JetStream API request was seen running out once when
    // creating a file-storage stream on a loaded 2-core machine; a test's setup waits longer.
    js.set_timeout(Duration::from_secs(30));
    js
}

/// A stream of the test's own, named `name` (upper-cased), capturing `subjects`.
/// Deleted when dropped (by a connection of its own, on a thread of its own, so it works
/// from any test's teardown).
pub struct TestStream {
    pub js: Context,
    pub name: String,
    url: String,
}

impl Drop for TestStream {
    fn drop(&mut self) {
        let (url, name) = (self.url.clone(), self.name.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                if let Ok(Ok(client)) =
                    tokio::time::timeout(Duration::from_secs(5), async_nats::connect(&url)).await
                {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(5),
                        jetstream::new(client).delete_stream(&name),
                    )
                    .await;
                }
            });
        })
        .join();
    }
}

impl TestStream {
    /// Creates the stream (file storage, one replica, 2 min duplicate window unless given).
    pub async fn create(
        url: &str,
        name: &str,
        subjects: &[String],
        duplicate_window: Option<Duration>,
        max_message_size: Option<i32>,
    ) -> Self {
        let js = js(url).await;
        let name = name.to_uppercase();
        js.create_stream(StreamConfig {
            name: name.clone(),
            subjects: subjects.to_vec(),
            storage: StorageType::File,
            duplicate_window: duplicate_window.unwrap_or(Duration::from_secs(120)),
            max_message_size: max_message_size.unwrap_or(-1),
            ..Default::default()
        })
        .await
        .expect("create stream");
        Self {
            js,
            name,
            url: url.to_owned(),
        }
    }

    /// The stored message at `seq`: subject, headers (name, value) and payload.
    pub async fn read(&self, seq: u64) -> (String, Vec<(String, Vec<u8>)>, Vec<u8>) {
        let stream = self.js.get_stream(&self.name).await.expect("stream");
        let m = stream.get_raw_message(seq).await.expect("stored message");
        let mut headers: Vec<(String, Vec<u8>)> = m
            .headers
            .iter()
            .flat_map(|(k, vs)| {
                let k: &str = k.as_ref();
                vs.iter()
                    .map(move |v| (k.to_owned(), v.as_str().as_bytes().to_vec()))
            })
            .collect();
        headers.sort();
        (m.subject.to_string(), headers, m.payload.to_vec())
    }

    /// Messages stored.
    pub async fn count(&self) -> u64 {
        let mut stream = self.js.get_stream(&self.name).await.expect("stream");
        stream.info().await.expect("info").state.messages
    }
}

/// A stream of the test's own capturing `<prefix>.>` ([`TestStream::create`] with its
/// defaults) and the name of a durable consumer of the test's own (`<durable>_…`): the setup
/// of the source tests.
pub async fn stream_and_durable(url: &str, prefix: &str, durable: &str) -> (TestStream, String) {
    let stream = TestStream::create(url, prefix, &[format!("{prefix}.>")], None, None).await;
    (stream, unique(durable))
}

/// `host:port` of a NATS URL: the upstream of a [`proxy::Proxy`].
pub fn upstream(url: &str) -> String {
    url.split("://")
        .last()
        .expect("a URL")
        .trim_end_matches('/')
        .to_owned()
}

/// The durable consumer's info, read by a connection of its own.
pub async fn consumer_info(url: &str, stream: &str, durable: &str) -> ConsumerInfo {
    js(url)
        .await
        .get_stream(stream)
        .await
        .expect("stream")
        .consumer_info(durable)
        .await
        .expect("consumer info")
}

/// The durable consumer's deliveries not acknowledged, and messages not delivered yet.
pub async fn pending(url: &str, stream: &str, durable: &str) -> (usize, u64) {
    let info = consumer_info(url, stream, durable).await;
    (info.num_ack_pending, info.num_pending)
}

/// Publishes `events`, each confirmed stored.
pub async fn publish_all(publisher: &NatsPublisher, events: &[Envelope]) {
    for r in publisher.publish(&events.iter().collect::<Vec<_>>()).await {
        r.unwrap();
    }
}

/// An event of aggregate `agg` at `version`, with a JSON payload and two user headers.
pub fn event(aggregate_type: &str, agg: &str, version: i64) -> Envelope {
    Envelope::builder(aggregate_type, agg, version, "thing.happened")
        .json(&serde_json::json!({ "v": version }))
        .expect("json")
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .header("tenant", "acme")
        .build()
        .expect("valid envelope")
}
