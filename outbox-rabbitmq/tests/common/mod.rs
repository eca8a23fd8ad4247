//! Shared by the RabbitMQ tests: the broker (`AMQP_URL`, else the local one; a missing broker
//! fails the test unless `OUTBOX_SKIP_SERVICE_TESTS=1`), an exchange and a quorum queue of the
//! test's own (deleted when dropped), and reading a queue's messages.
#![allow(dead_code, unused_macros, unused_imports, unreachable_pub)]

use std::time::Duration;

use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox_core::Envelope;

/// The inbox engine's PostgreSQL side: [`outbox_test_support::pg_inbox`].
pub use outbox_test_support::pg_inbox as inbox;
pub use outbox_test_support::pg_inbox::poll_n;

pub use outbox_test_support::unique;

macro_rules! require {
    ($e:expr) => {
        match $e {
            Some(v) => v,
            None => return,
        }
    };
}
pub(crate) use require;

/// A PostgreSQL schema of the test's own for the inbox engine (named `rmqinbox_…`), or `None`
/// after a printed skip.
pub async fn inbox_db(test: &str) -> Option<inbox::Db> {
    inbox::Db::new(test, "rmqinbox").await
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// The shared broker's URL (skip or panic as `outbox_test_support::amqp_url`).
pub fn amqp_url(test: &str) -> Option<String> {
    init_tracing();
    outbox_test_support::amqp_url(test)
}

pub async fn connect(url: &str) -> Connection {
    Connection::connect(
        url,
        ConnectionProperties::default()
            .with_executor(tokio_executor_trait::Tokio::current())
            .with_reactor(tokio_reactor_trait::Tokio),
    )
    .await
    .expect("connect to RabbitMQ")
}

/// An exchange and queues of the test's own; deleted when dropped.
pub struct Topology {
    url: String,
    pub conn: Connection,
    pub channel: Channel,
    pub exchange: String,
    pub queues: Vec<String>,
}

impl Topology {
    /// A durable exchange of `kind`.
    pub async fn exchange(url: &str, prefix: &str, kind: ExchangeKind, durable: bool) -> Self {
        let conn = connect(url).await;
        let channel = conn.create_channel().await.unwrap();
        let exchange = unique(prefix);
        channel
            .exchange_declare(
                &exchange,
                kind,
                ExchangeDeclareOptions {
                    durable,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare exchange");
        Self {
            url: url.to_owned(),
            conn,
            channel,
            exchange,
            queues: Vec::new(),
        }
    }

    /// A durable queue (`args`: e.g. `outbox_rabbitmq::quorum_arguments(true)`) bound with `key`.
    pub async fn queue(&mut self, key: &str, args: FieldTable) -> String {
        let q = unique("q");
        self.channel
            .queue_declare(
                &q,
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
            )
            .await
            .expect("declare queue");
        self.channel
            .queue_bind(
                &q,
                &self.exchange,
                key,
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind");
        self.queues.push(q.clone());
        q
    }

    /// Takes every message of `queue` (acknowledging them): message id, headers, body.
    pub async fn drain(&self, queue: &str) -> Vec<(String, Vec<(String, Vec<u8>)>, Vec<u8>)> {
        let mut out = Vec::new();
        while let Some(m) = self
            .channel
            .basic_get(queue, BasicGetOptions { no_ack: true })
            .await
            .expect("basic.get")
        {
            let d = m.delivery;
            let id = d
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_owned())
                .unwrap_or_default();
            let mut headers: Vec<(String, Vec<u8>)> = d
                .properties
                .headers()
                .as_ref()
                .map(|t| {
                    t.inner()
                        .iter()
                        // The broker's own annotations (x-delivery-count) are not the record's.
                        .filter(|(k, _)| !k.as_str().starts_with("x-delivery-count"))
                        .map(|(k, v)| match v {
                            AMQPValue::LongString(s) => {
                                (k.as_str().to_owned(), s.as_bytes().to_vec())
                            }
                            other => panic!("header {k} is {other:?}"),
                        })
                        .collect()
                })
                .unwrap_or_default();
            headers.sort();
            out.push((id, headers, d.data));
        }
        out
    }

    /// Ready messages in `queue`.
    pub async fn depth(&self, queue: &str) -> u32 {
        let ch = self.conn.create_channel().await.unwrap();
        let q = ch
            .queue_declare(
                queue,
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("queue exists");
        let _ = ch.close(200, "done").await;
        q.message_count()
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        let (url, exchange, queues) =
            (self.url.clone(), self.exchange.clone(), self.queues.clone());
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async move {
                    let Ok(Ok(conn)) = tokio::time::timeout(Duration::from_secs(5), async {
                        Connection::connect(
                            &url,
                            ConnectionProperties::default()
                                .with_executor(tokio_executor_trait::Tokio::current())
                                .with_reactor(tokio_reactor_trait::Tokio),
                        )
                        .await
                    })
                    .await
                    else {
                        return;
                    };
                    if let Ok(ch) = conn.create_channel().await {
                        for q in queues {
                            let _ = ch.queue_delete(&q, QueueDeleteOptions::default()).await;
                        }
                        let _ = ch
                            .exchange_delete(&exchange, ExchangeDeleteOptions::default())
                            .await;
                    }
                    let _ = conn.close(200, "done").await;
                })
        })
        .join();
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
