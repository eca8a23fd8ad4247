//! Drain into NATS JetStream and RabbitMQ, each beside a minimal relay written for that
//! transport (`outbox-bench drain --transport nats,rabbitmq`).
//!
//! The minimal relay of a transport is the Kafka one's twin, written directly on the client
//! (async-nats, lapin): claim 1,000 rows with `SKIP LOCKED`, hand every message to the client,
//! await every `PubAck` / publisher confirm, one `UPDATE`, commit. No ordering, no retry, no
//! per-record error handling: the first failure fails the run. It sends what the relay sends:
//! the same payload and wire headers, the same subject (`<prefix>.<aggregate_type>`) with
//! `Nats-Msg-Id` = event id on NATS; on RabbitMQ the same routing key (the aggregate type),
//! `mandatory`, persistent, with `message_id`, `content_type`, `timestamp` and the wire
//! headers as long strings.
//!
//! Each contender gets a stream (file storage) or a durable topic exchange with one durable
//! quorum queue bound to `#` of its own, named after the run, deleted when it ends.

use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::header::{HeaderMap, NATS_MESSAGE_ID};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use outbox_nats::NatsPublisher;
use outbox_rabbitmq::RabbitPublisher;
use sqlx::{PgPool, Row};

use crate::drain::{check_drained, drain_relay, DrainArgs, Mode};
use crate::env::{self, Env};

/// A broker the drain scenario publishes into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Transport {
    Kafka,
    Nats,
    Rabbitmq,
}

impl Transport {
    const ALL: [Transport; 3] = [Transport::Kafka, Transport::Nats, Transport::Rabbitmq];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Transport::Kafka => "kafka",
            Transport::Nats => "nats",
            Transport::Rabbitmq => "rabbitmq",
        }
    }
}

impl FromStr for Transport {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        Transport::ALL
            .into_iter()
            .find(|t| t.name() == s.trim())
            .with_context(|| {
                format!("unknown transport {s:?}: expected kafka, nats, rabbitmq or all")
            })
    }
}

/// The transports named by `--transport` (`all` names every one), without repeats, in a fixed
/// order.
pub(crate) fn selected(names: &[String]) -> anyhow::Result<Vec<Transport>> {
    let mut out = Vec::new();
    for n in names {
        if n.trim() == "all" {
            out.extend(Transport::ALL);
        } else {
            out.push(n.parse()?);
        }
    }
    anyhow::ensure!(!out.is_empty(), "--transport names no transport");
    out.sort();
    out.dedup();
    Ok(out)
}

/// The servers of the selected transports: an error naming the flag and variable of the first
/// one missing.
pub(crate) fn check_servers(
    transports: &[Transport],
    kafka: Option<&str>,
    nats: Option<&str>,
    amqp: Option<&str>,
) -> anyhow::Result<()> {
    let given = |s: Option<&str>| s.is_some_and(|s| !s.trim().is_empty());
    for t in transports {
        match t {
            Transport::Kafka => anyhow::ensure!(
                given(kafka),
                "--transport kafka needs a broker: set KAFKA_BROKERS or pass --brokers \
                 (scripts/services.sh: ensure_kafka)"
            ),
            Transport::Nats => anyhow::ensure!(
                given(nats),
                "--transport nats needs a NATS server with JetStream: set NATS_URL or pass \
                 --nats-url (e.g. nats://127.0.0.1:4222)"
            ),
            Transport::Rabbitmq => anyhow::ensure!(
                given(amqp),
                "--transport rabbitmq needs a RabbitMQ broker: set AMQP_URL or pass --amqp-url \
                 (e.g. amqp://guest:guest@127.0.0.1:5672/%2f)"
            ),
        }
    }
    Ok(())
}

/// A name no other contender of any run uses: `bench_<run>_<tag>_<n>`.
fn unique(env: &Env, tag: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "bench_{}_{tag}_{}",
        env.run,
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A backlog drained by one contender on `transport` (NATS or RabbitMQ): the relay over the
/// store (`relays` relays in `mode`), or the minimal relay when `mode` is `None`.
pub(crate) async fn run_one(
    env: &Env,
    args: &DrainArgs,
    transport: Transport,
    relay: Option<(Mode, usize)>,
    aggregates: usize,
) -> anyhow::Result<(u64, Duration)> {
    match transport {
        Transport::Nats => {
            let url = args.nats_url.as_deref().context("no NATS_URL")?;
            let client = async_nats::connect(url)
                .await
                .with_context(|| format!("cannot connect to NATS at {url}"))?;
            let js = jetstream::new(client);
            let prefix = unique(env, "nats");
            js.create_stream(stream::Config {
                name: prefix.clone(),
                subjects: vec![format!("{prefix}.>")],
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await
            .context("create the bench's JetStream stream")?;
            let r = nats_contender(env, args, url, &js, &prefix, relay, aggregates).await;
            let deleted = js.delete_stream(&prefix).await;
            let r = r?;
            deleted.with_context(|| format!("delete stream {prefix}"))?;
            Ok(r)
        }
        Transport::Rabbitmq => {
            let url = args.amqp_url.as_deref().context("no AMQP_URL")?;
            let conn = amqp_connect(url).await?;
            let ch = conn.create_channel().await?;
            let name = unique(env, "rmq");
            ch.exchange_declare(
                &name,
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .context("declare the bench's exchange")?;
            ch.queue_declare(
                &name,
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                outbox_rabbitmq::quorum_arguments(false),
            )
            .await
            .context("declare the bench's quorum queue")?;
            ch.queue_bind(
                &name,
                &name,
                "#",
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
            let r = rabbit_contender(env, args, url, &name, relay, aggregates).await;
            let q = ch.queue_delete(&name, QueueDeleteOptions::default()).await;
            let x = ch
                .exchange_delete(&name, ExchangeDeleteOptions::default())
                .await;
            let _ = conn.close(200, "bench done").await;
            let r = r?;
            q.with_context(|| format!("delete queue {name}"))?;
            x.with_context(|| format!("delete exchange {name}"))?;
            Ok(r)
        }
        Transport::Kafka => anyhow::bail!("the Kafka contenders are drain.rs's own"),
    }
}

async fn nats_contender(
    env: &Env,
    args: &DrainArgs,
    url: &str,
    js: &jetstream::Context,
    prefix: &str,
    relay: Option<(Mode, usize)>,
    aggregates: usize,
) -> anyhow::Result<(u64, Duration)> {
    match relay {
        Some((mode, relays)) => {
            let store = env.store("nats", mode.claim_mode(), false).await?;
            env::preload(&store, args.events, aggregates).await?;
            let publisher = NatsPublisher::builder(url, prefix)
                .start()
                .await
                .map_err(|e| anyhow::anyhow!("NATS publisher: {e}"))?;
            let r = drain_relay(&store, Arc::new(publisher), args.batch, relays).await?;
            check_drained(&store, args.events, r.0).await?;
            Ok(r)
        }
        None => {
            let table = fill(env, "nats_minimal", args.events, aggregates).await?;
            let r = drain_minimal_nats(&env.pool, &table, js, prefix, args.batch).await?;
            anyhow::ensure!(
                r.0 == args.events as u64,
                "drained {} of {}",
                r.0,
                args.events
            );
            Ok(r)
        }
    }
}

async fn rabbit_contender(
    env: &Env,
    args: &DrainArgs,
    url: &str,
    exchange: &str,
    relay: Option<(Mode, usize)>,
    aggregates: usize,
) -> anyhow::Result<(u64, Duration)> {
    match relay {
        Some((mode, relays)) => {
            let store = env.store("rmq", mode.claim_mode(), false).await?;
            env::preload(&store, args.events, aggregates).await?;
            let publisher = RabbitPublisher::builder(url, exchange)
                .start()
                .await
                .map_err(|e| anyhow::anyhow!("RabbitMQ publisher: {e}"))?;
            let r = drain_relay(&store, Arc::new(publisher), args.batch, relays).await?;
            check_drained(&store, args.events, r.0).await?;
            Ok(r)
        }
        None => {
            let table = fill(env, "rmq_minimal", args.events, aggregates).await?;
            let conn = amqp_connect(url).await?;
            let r = drain_minimal_rabbit(&env.pool, &table, &conn, exchange, args.batch).await;
            let _ = conn.close(200, "bench done").await;
            let r = r?;
            anyhow::ensure!(
                r.0 == args.events as u64,
                "drained {} of {}",
                r.0,
                args.events
            );
            Ok(r)
        }
    }
}

async fn amqp_connect(url: &str) -> anyhow::Result<Connection> {
    let props = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio);
    tokio::time::timeout(Duration::from_secs(10), Connection::connect(url, props))
        .await
        .with_context(|| format!("no AMQP connection to {url} within 10 s"))?
        .with_context(|| format!("cannot connect to RabbitMQ at {url}"))
}

/// The minimal relay's table in a schema of its own, filled with the same events as the
/// relay's backlog: what it publishes, ready to send (wire headers as two arrays).
async fn fill(env: &Env, tag: &str, events: usize, aggregates: usize) -> anyhow::Result<String> {
    let schema = env.schema(tag).await?;
    let table = format!("\"{schema}\".minimal");
    sqlx::raw_sql(&format!(
        "CREATE TABLE {table} (id bigserial PRIMARY KEY, event_id text NOT NULL, \
         aggregate_type text NOT NULL, content_type text NOT NULL, created_at int8 NOT NULL, \
         payload bytea NOT NULL, header_keys text[] NOT NULL, header_values text[] NOT NULL, \
         published_at timestamptz); \
         CREATE INDEX ON {table} (id) WHERE published_at IS NULL;"
    ))
    .execute(&env.pool)
    .await?;
    let mut i = 0;
    while i < events {
        let n = 5_000.min(events - i);
        let batch: Vec<_> = (i..i + n).map(|k| env::event(k, aggregates)).collect();
        let mut ids = Vec::with_capacity(n);
        let mut types = Vec::with_capacity(n);
        let mut cts = Vec::with_capacity(n);
        let mut created = Vec::with_capacity(n);
        let mut payloads = Vec::with_capacity(n);
        let mut hk = Vec::with_capacity(n);
        let mut hv = Vec::with_capacity(n);
        for e in &batch {
            let headers = outbox_core::wire::encode_headers(e);
            ids.push(e.event_id.to_string());
            types.push(e.aggregate_type.as_str());
            cts.push(e.payload.content_type.as_str());
            created.push(e.created_at.timestamp());
            payloads.push(e.payload.bytes.as_slice());
            hk.push(serde_json::to_string(
                &headers.iter().map(|h| &h.0).collect::<Vec<_>>(),
            )?);
            hv.push(serde_json::to_string(
                &headers
                    .iter()
                    .map(|h| std::str::from_utf8(&h.1))
                    .collect::<Result<Vec<_>, _>>()?,
            )?);
        }
        sqlx::query(&format!(
            "INSERT INTO {table} (event_id, aggregate_type, content_type, created_at, payload, \
                                  header_keys, header_values) \
             SELECT i, t, c, ts, p, ARRAY(SELECT jsonb_array_elements_text(hk::jsonb)), \
                    ARRAY(SELECT jsonb_array_elements_text(hv::jsonb)) \
             FROM UNNEST($1::text[], $2::text[], $3::text[], $4::int8[], $5::bytea[], \
                         $6::text[], $7::text[]) AS u(i, t, c, ts, p, hk, hv)"
        ))
        .bind(&ids)
        .bind(&types)
        .bind(&cts)
        .bind(&created)
        .bind(&payloads)
        .bind(&hk)
        .bind(&hv)
        .execute(&env.pool)
        .await?;
        i += n;
    }
    sqlx::raw_sql(&format!("VACUUM ANALYZE {table}"))
        .execute(&env.pool)
        .await?;
    Ok(table)
}

fn claim_sql(table: &str) -> (String, String) {
    (
        format!(
            "SELECT id, event_id, aggregate_type, content_type, created_at, payload, header_keys, \
                    header_values FROM {table} \
             WHERE published_at IS NULL ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
        ),
        format!("UPDATE {table} SET published_at = now() WHERE id = ANY($1)"),
    )
}

/// The minimal JetStream relay: claim `batch`, send every message, await every `PubAck`, one
/// `UPDATE`, commit.
async fn drain_minimal_nats(
    pool: &PgPool,
    table: &str,
    js: &jetstream::Context,
    prefix: &str,
    batch: usize,
) -> anyhow::Result<(u64, Duration)> {
    let (claim, mark) = claim_sql(table);
    let started = Instant::now();
    let mut total = 0u64;
    loop {
        let mut tx = pool.begin().await?;
        let rows = sqlx::query(&claim)
            .bind(batch as i64)
            .fetch_all(&mut *tx)
            .await?;
        if rows.is_empty() {
            break;
        }
        let mut ids = Vec::with_capacity(rows.len());
        let mut pending = Vec::with_capacity(rows.len());
        for row in &rows {
            ids.push(row.get::<i64, _>("id"));
            let event_id: &str = row.get("event_id");
            let aggregate_type: &str = row.get("aggregate_type");
            let payload: &[u8] = row.get("payload");
            let hk: Vec<String> = row.get("header_keys");
            let hv: Vec<String> = row.get("header_values");
            let mut headers = HeaderMap::new();
            for (k, v) in hk.iter().zip(&hv) {
                headers.append(k.as_str(), v.as_str());
            }
            headers.insert(NATS_MESSAGE_ID, event_id);
            let message = PublishMessage::build()
                .payload(Bytes::copy_from_slice(payload))
                .headers(headers);
            pending.push(
                js.send_publish(format!("{prefix}.{aggregate_type}"), message)
                    .await?,
            );
        }
        for p in pending {
            p.await?;
        }
        sqlx::query(&mark).bind(&ids).execute(&mut *tx).await?;
        tx.commit().await?;
        total += rows.len() as u64;
    }
    Ok((total, started.elapsed()))
}

/// The minimal RabbitMQ relay: one confirm channel; claim `batch`, publish every message
/// (`mandatory`, persistent), await every confirm (a returned message fails the run), one
/// `UPDATE`, commit.
async fn drain_minimal_rabbit(
    pool: &PgPool,
    table: &str,
    conn: &Connection,
    exchange: &str,
    batch: usize,
) -> anyhow::Result<(u64, Duration)> {
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let (claim, mark) = claim_sql(table);
    let options = BasicPublishOptions {
        mandatory: true,
        immediate: false,
    };
    let started = Instant::now();
    let mut total = 0u64;
    loop {
        let mut tx = pool.begin().await?;
        let rows = sqlx::query(&claim)
            .bind(batch as i64)
            .fetch_all(&mut *tx)
            .await?;
        if rows.is_empty() {
            break;
        }
        let mut ids = Vec::with_capacity(rows.len());
        let mut pending = Vec::with_capacity(rows.len());
        for row in &rows {
            ids.push(row.get::<i64, _>("id"));
            let event_id: &str = row.get("event_id");
            let aggregate_type: &str = row.get("aggregate_type");
            let content_type: &str = row.get("content_type");
            let created_at: i64 = row.get("created_at");
            let payload: &[u8] = row.get("payload");
            let hk: Vec<String> = row.get("header_keys");
            let hv: Vec<String> = row.get("header_values");
            let mut headers = FieldTable::default();
            for (k, v) in hk.into_iter().zip(hv) {
                headers.insert(
                    ShortString::from(k),
                    AMQPValue::LongString(LongString::from(v.into_bytes())),
                );
            }
            let properties = BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(ShortString::from(event_id))
                .with_content_type(ShortString::from(content_type))
                .with_timestamp(u64::try_from(created_at).unwrap_or(0))
                .with_headers(headers);
            pending.push(
                channel
                    .basic_publish(exchange, aggregate_type, options, payload, properties)
                    .await?,
            );
        }
        for p in pending {
            match p.await? {
                Confirmation::Ack(None) => {}
                other => anyhow::bail!("not stored: {other:?}"),
            }
        }
        sqlx::query(&mark).bind(&ids).execute(&mut *tx).await?;
        tx.commit().await?;
        total += rows.len() as u64;
    }
    Ok((total, started.elapsed()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn transports_parse_and_all_names_every_one() {
        assert_eq!(selected(&names(&["kafka"])).unwrap(), [Transport::Kafka]);
        assert_eq!(
            selected(&names(&["rabbitmq", "nats", "nats"])).unwrap(),
            [Transport::Nats, Transport::Rabbitmq]
        );
        assert_eq!(selected(&names(&["all"])).unwrap(), Transport::ALL);
    }

    #[test]
    fn an_unknown_transport_is_refused_with_the_known_names() {
        let e = selected(&names(&["nats", "kafak"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"kafak\""), "{e}");
        assert!(e.contains("kafka, nats, rabbitmq or all"), "{e}");
        assert!(selected(&names(&["NATS"])).is_err());
        assert!(selected(&[]).is_err());
    }

    #[test]
    fn a_missing_server_names_its_variable() {
        let all = Transport::ALL;
        let k = Some("127.0.0.1:9092");
        let n = Some("nats://127.0.0.1:4222");
        let a = Some("amqp://guest:guest@127.0.0.1:5672/%2f");
        check_servers(&all, k, n, a).unwrap();
        let e = check_servers(&all, k, None, a).unwrap_err().to_string();
        assert!(e.contains("NATS_URL") && e.contains("--nats-url"), "{e}");
        let e = check_servers(&all, k, n, Some(" "))
            .unwrap_err()
            .to_string();
        assert!(e.contains("AMQP_URL") && e.contains("--amqp-url"), "{e}");
        let e = check_servers(&all, None, n, a).unwrap_err().to_string();
        assert!(e.contains("KAFKA_BROKERS"), "{e}");
        // Only the selected transports need a server.
        check_servers(&[Transport::Nats], None, n, None).unwrap();
        check_servers(&[Transport::Rabbitmq], None, None, a).unwrap();
    }
}
