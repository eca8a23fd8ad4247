//! What the transport tests of the `outbox` binary share: a JetStream stream and a RabbitMQ
//! exchange with a quorum queue of the test's own (deleted when dropped), and reading back
//! what the relay stored there, in the order the broker keeps it, as (aggregate id, event id,
//! version) from the wire headers.
#![allow(dead_code, unreachable_pub)]

use std::time::{Duration, Instant};

use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use async_nats::jetstream::{self, Context};
use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties, ExchangeKind};

/// One stored record: (aggregate id, event id, version).
pub type Record = (String, uuid::Uuid, i64);

fn record(header: impl Fn(&str) -> Option<String>) -> Record {
    let get = |name: &str| header(name).unwrap_or_else(|| panic!("header {name} missing"));
    (
        get("aggregate_id"),
        get("event_id").parse().expect("event id"),
        get("aggregate_version").parse().expect("version"),
    )
}

/// A JetStream stream of the test's own capturing `<prefix>.>`; deleted when dropped.
pub struct NatsStream {
    pub url: String,
    pub name: String,
    pub prefix: String,
    js: Context,
}

impl NatsStream {
    /// A file-storage stream with `duplicate_window` capturing `<prefix>.>` (`prefix` unique).
    pub async fn create(url: &str, duplicate_window: Duration) -> Self {
        let prefix = outbox_test_support::unique("outbox");
        let name = prefix.to_uppercase();
        let client = async_nats::connect(url).await.expect("connect to NATS");
        let js = jetstream::new(client);
        js.create_stream(StreamConfig {
            name: name.clone(),
            subjects: vec![format!("{prefix}.>")],
            storage: StorageType::File,
            duplicate_window,
            ..Default::default()
        })
        .await
        .expect("create stream");
        Self {
            url: url.to_owned(),
            name,
            prefix,
            js,
        }
    }

    /// The stream named after `prefix` (as `outbox topics create` names it), made by someone
    /// else: deleted when dropped, whether it was made or not.
    pub async fn adopt(url: &str, prefix: &str) -> Self {
        let client = async_nats::connect(url).await.expect("connect to NATS");
        Self {
            url: url.to_owned(),
            name: prefix.to_uppercase(),
            prefix: prefix.to_owned(),
            js: jetstream::new(client),
        }
    }

    /// The stream's configuration as the server holds it.
    pub async fn config(&self) -> StreamConfig {
        self.js
            .get_stream(&self.name)
            .await
            .expect("the stream exists")
            .cached_info()
            .config
            .clone()
    }

    /// Every stored message in stream order.
    pub async fn read_all(&self) -> Vec<Record> {
        let mut stream = self.js.get_stream(&self.name).await.expect("stream");
        let state = stream.info().await.expect("info").state.clone();
        let mut out = Vec::new();
        if state.messages == 0 {
            return out;
        }
        for seq in state.first_sequence..=state.last_sequence {
            let m = stream.get_raw_message(seq).await.expect("stored message");
            out.push(record(|name| {
                m.headers.get(name).map(|v| v.as_str().to_owned())
            }));
        }
        out
    }

    /// Reads until at least `at_least` messages are stored and none arrived for 2 s.
    pub async fn read_settled(&self, at_least: usize) -> Vec<Record> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = (0, Instant::now());
        loop {
            let mut stream = self.js.get_stream(&self.name).await.expect("stream");
            let n = stream.info().await.expect("info").state.messages as usize;
            if n != last.0 {
                last = (n, Instant::now());
            }
            if n >= at_least && last.1.elapsed() > Duration::from_secs(2) {
                return self.read_all().await;
            }
            assert!(Instant::now() < deadline, "{n} of {at_least} stored");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for NatsStream {
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

async fn amqp_connect(url: &str) -> Connection {
    Connection::connect(
        url,
        ConnectionProperties::default()
            .with_executor(tokio_executor_trait::Tokio::current())
            .with_reactor(tokio_reactor_trait::Tokio),
    )
    .await
    .expect("connect to RabbitMQ")
}

/// A durable topic exchange and a durable quorum queue bound to it with `#`, both the test's
/// own; deleted when dropped.
pub struct RabbitTopology {
    pub url: String,
    pub exchange: String,
    pub queue: String,
    conn: Connection,
}

impl RabbitTopology {
    /// Declares the exchange and the queue.
    pub async fn create(url: &str) -> Self {
        let conn = amqp_connect(url).await;
        let ch = conn.create_channel().await.expect("channel");
        let exchange = outbox_test_support::unique("outbox");
        let queue = outbox_test_support::unique("q");
        ch.exchange_declare(
            &exchange,
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare exchange");
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        ch.queue_declare(
            &queue,
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .expect("declare queue");
        ch.queue_bind(
            &queue,
            &exchange,
            "#",
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind");
        Self {
            url: url.to_owned(),
            exchange,
            queue,
            conn,
        }
    }

    /// Messages ready in the queue.
    pub async fn depth(&self) -> u32 {
        let ch = self.conn.create_channel().await.expect("channel");
        let q = ch
            .queue_declare(
                &self.queue,
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

    /// Takes every message of the queue, in queue order.
    pub async fn drain(&self) -> Vec<Record> {
        let ch = self.conn.create_channel().await.expect("channel");
        let mut out = Vec::new();
        while let Some(m) = ch
            .basic_get(&self.queue, BasicGetOptions { no_ack: true })
            .await
            .expect("basic.get")
        {
            let headers = m.delivery.properties.headers().clone().unwrap_or_default();
            out.push(record(|name| {
                headers.inner().get(name).map(|v| match v {
                    AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                    other => panic!("header {name} is {other:?}"),
                })
            }));
        }
        let _ = ch.close(200, "done").await;
        out
    }

    /// Waits until at least `at_least` messages are ready and none arrived for 2 s, then
    /// drains the queue.
    pub async fn drain_settled(&self, at_least: usize) -> Vec<Record> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = (0, Instant::now());
        loop {
            let n = self.depth().await as usize;
            if n != last.0 {
                last = (n, Instant::now());
            }
            if n >= at_least && last.1.elapsed() > Duration::from_secs(2) {
                return self.drain().await;
            }
            assert!(Instant::now() < deadline, "{n} of {at_least} in the queue");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl RabbitTopology {
    /// `exchange`, declared by someone else (no queue): deleted when dropped.
    pub async fn adopt(url: &str, exchange: &str) -> Self {
        Self {
            url: url.to_owned(),
            exchange: exchange.to_owned(),
            queue: String::new(),
            conn: amqp_connect(url).await,
        }
    }

    /// Whether `exchange` exists as a durable exchange of `kind` (a passive declare, then an
    /// equivalent one).
    pub async fn exchange_is(&self, kind: ExchangeKind) -> bool {
        let Ok(ch) = self.conn.create_channel().await else {
            return false;
        };
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        };
        if ch
            .exchange_declare(&self.exchange, kind.clone(), passive, FieldTable::default())
            .await
            .is_err()
        {
            return false;
        }
        let Ok(ch) = self.conn.create_channel().await else {
            return false;
        };
        ch.exchange_declare(
            &self.exchange,
            kind,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .is_ok()
            && {
                let _ = ch.close(200, "checked").await;
                true
            }
    }
}

impl Drop for RabbitTopology {
    fn drop(&mut self) {
        let (url, exchange, queue) = (self.url.clone(), self.exchange.clone(), self.queue.clone());
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(async move {
                    let Ok(conn) =
                        tokio::time::timeout(Duration::from_secs(5), amqp_connect(&url)).await
                    else {
                        return;
                    };
                    if let Ok(ch) = conn.create_channel().await {
                        if !queue.is_empty() {
                            let _ = ch.queue_delete(&queue, QueueDeleteOptions::default()).await;
                        }
                        let _ = ch
                            .exchange_delete(&exchange, ExchangeDeleteOptions::default())
                            .await;
                    }
                    let _ = conn.close(200, "done").await;
                });
        })
        .join();
    }
}

/// The end-to-end invariants over what the broker stored: every committed event is there,
/// nothing rolled back is, every record is a copy of a committed event (duplicates only as
/// re-sends), and per aggregate the first deliveries come in version order 1, 2, 3, ...
/// Returns the number of duplicate records.
pub fn check_invariants(
    records: &[Record],
    committed: &[(uuid::Uuid, String, i64)],
    rolled_back: &std::collections::HashSet<uuid::Uuid>,
    context: &str,
) -> usize {
    use std::collections::{BTreeMap, HashMap, HashSet};
    let by_id: HashMap<uuid::Uuid, (&str, i64)> = committed
        .iter()
        .map(|(id, agg, v)| (*id, (agg.as_str(), *v)))
        .collect();
    let stored: HashSet<uuid::Uuid> = records.iter().map(|r| r.1).collect();
    for (id, agg, v) in committed {
        assert!(
            stored.contains(id),
            "committed event {id} ({agg} v{v}) missing from the broker ({context})"
        );
    }
    for id in rolled_back {
        assert!(
            !stored.contains(id),
            "rolled-back event {id} was published ({context})"
        );
    }
    for (agg, id, v) in records {
        match by_id.get(id) {
            Some((a, version)) => assert!(
                a == agg && version == v,
                "record {id} says {agg} v{v}, the event was {a} v{version} ({context})"
            ),
            None => panic!("record {id} ({agg} v{v}) is no committed event ({context})"),
        }
    }
    let mut firsts: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    let mut seen = HashSet::new();
    for (agg, id, v) in records {
        if seen.insert(*id) {
            firsts.entry(agg.as_str()).or_default().push(*v);
        }
    }
    for (agg, vs) in &firsts {
        let expected: Vec<i64> = (1..=vs.len() as i64).collect();
        assert_eq!(
            vs, &expected,
            "first deliveries of {agg} out of order ({context})"
        );
    }
    records.len() - seen.len()
}
