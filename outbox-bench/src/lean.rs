//! The lean reference of the Kafka broker group (issue 25), and one variant per factor that
//! made the old minimal relay slower than a hand-written one.
//!
//! The lean relay does the relay's work minus ordering and the per-record guarantees: claim
//! `--batch` rows (`ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED` on a partial index of the
//! unpublished rows), enqueue every record, await every delivery report together, one
//! `UPDATE`, commit. It sends what the relay sends (same key per aggregate, same payload bytes,
//! the same eight wire headers) with the relay's producer settings: the forced safe ones
//! (`enable.idempotence`, `acks=all`, 5 in flight, the same partitioner) and the publisher's
//! `linger.ms` 0. Columns are read by position and borrowed from the row; the wire headers are
//! kept pre-encoded in one `bytea` per row and handed to librdkafka as borrowed slices.
//!
//! Each variant changes one of these, to price it beside the reference in the same run:
//! `lean-linger5` (librdkafka's default `linger.ms`, which the old minimal relay used),
//! `lean-arrays` (the old minimal's table: headers as `text[]` / `bytea[]`, decoded into owned
//! vectors per row), `lean-pk-only` (no partial index: the claim walks the primary key past
//! the published rows), `lean-no-headers` (no headers sent: less than the relay sends, so
//! never a reference) and `lean-cold` (the producer not warmed up before the clock starts, as
//! the old minimal relay's).

use std::time::{Duration, Instant};

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};

use crate::drain::{self, RefRecord};
use crate::env::Env;

/// The lean reference and its one-factor variants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lean {
    /// The reference of the broker group.
    Reference,
    /// `linger.ms` 5 (librdkafka's default, what the old minimal relay's producer used).
    Linger5,
    /// Headers as `text[]` / `bytea[]` decoded into owned vectors (the old minimal's table).
    HeaderArrays,
    /// Primary key only, no partial index of the unpublished rows.
    PkOnly,
    /// No headers read or sent (sends less than the relay).
    NoHeaders,
    /// The producer created just before the clock starts, not warmed up (as the old minimal
    /// relay's): the first batch may wait for the connection and the producer id.
    Cold,
}

/// How a variant keeps and sends the wire headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Headers {
    Blob,
    Arrays,
    None,
}

impl Lean {
    pub(crate) fn id(self) -> &'static str {
        match self {
            Lean::Reference => "lean",
            Lean::Linger5 => "lean-linger5",
            Lean::HeaderArrays => "lean-arrays",
            Lean::PkOnly => "lean-pk-only",
            Lean::NoHeaders => "lean-no-headers",
            Lean::Cold => "lean-cold",
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Lean::Reference => "broker: lean unordered relay (reference)",
            Lean::Linger5 => "broker: lean relay, linger.ms=5",
            Lean::HeaderArrays => "broker: lean relay, headers as text[]/bytea[]",
            Lean::PkOnly => "broker: lean relay, no partial index",
            Lean::NoHeaders => "broker: lean relay WITHOUT headers (sends less)",
            Lean::Cold => "broker: lean relay, producer not warmed up",
        }
    }

    fn headers(self) -> Headers {
        match self {
            Lean::HeaderArrays => Headers::Arrays,
            Lean::NoHeaders => Headers::None,
            _ => Headers::Blob,
        }
    }

    /// The producer's `linger.ms`: the relay's publisher default unless the variant prices it.
    fn linger_ms(self) -> String {
        match self {
            Lean::Linger5 => "5".into(),
            _ => outbox_kafka::DEFAULT_LINGER_MS.to_string(),
        }
    }
}

/// Fills a table for `lean`, drains it into a new topic and checks that every row was
/// published.
pub(crate) async fn run_one(
    env: &Env,
    lean: Lean,
    records: &[RefRecord],
    batch: usize,
    partitions: i32,
) -> anyhow::Result<(u64, Duration)> {
    let schema = env.schema("lean").await?;
    let table = format!("\"{schema}\".lean");
    match lean.headers() {
        // The old minimal relay's table, with its partial index.
        Headers::Arrays => drain::fill_minimal(&env.pool, &table, records).await?,
        _ => fill_blob(&env.pool, &table, records, lean != Lean::PkOnly).await?,
    }
    let topic = env.topic("lean", partitions).await?;
    let producer: FutureProducer = drain::reference_config(env.brokers()?)
        .set("linger.ms", lean.linger_ms())
        .create()?;
    if lean != Lean::Cold {
        // Connected, with the topic's metadata and a producer id, before the clock starts: one
        // warm-up record (never read) delivered. A producer created just before its first
        // batch can stall it by about half a second on a fresh connection.
        producer
            .client()
            .fetch_metadata(Some(&topic), Duration::from_secs(10))?;
        producer
            .send_result(FutureRecord::<str, [u8]>::to(&topic).key("warm-up"))
            .map_err(|(e, _)| e)?
            .await?
            .map_err(|(e, _)| e)?;
    }
    let r = drain_lean(&env.pool, &table, &producer, &topic, batch, lean.headers()).await?;
    let left: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {table} WHERE published_at IS NULL"
    ))
    .fetch_one(&env.pool)
    .await?;
    anyhow::ensure!(
        r.0 == records.len() as u64 && left == 0,
        "drained {} of {}, {left} left unpublished",
        r.0,
        records.len()
    );
    Ok(r)
}

/// The wire headers of one record as one `bytea`: per header the name's length (u16, big
/// endian), the name, the value's length (u32, big endian), the value.
pub(crate) fn encode_blob(headers: &[(String, Vec<u8>)]) -> Vec<u8> {
    let len: usize = headers.iter().map(|(k, v)| 6 + k.len() + v.len()).sum();
    let mut out = Vec::with_capacity(len);
    for (k, v) in headers {
        out.extend_from_slice(&(k.len() as u16).to_be_bytes());
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(&(v.len() as u32).to_be_bytes());
        out.extend_from_slice(v);
    }
    out
}

/// Calls `f` with each header of a blob of [`encode_blob`], borrowed from it.
pub(crate) fn each_header<'a>(
    mut blob: &'a [u8],
    mut f: impl FnMut(&'a str, &'a [u8]),
) -> anyhow::Result<()> {
    fn take<'a>(blob: &mut &'a [u8], n: usize) -> anyhow::Result<&'a [u8]> {
        anyhow::ensure!(blob.len() >= n, "truncated header blob");
        let (head, rest) = blob.split_at(n);
        *blob = rest;
        Ok(head)
    }
    while !blob.is_empty() {
        let n = u16::from_be_bytes(take(&mut blob, 2)?.try_into()?) as usize;
        let name = std::str::from_utf8(take(&mut blob, n)?)?;
        let n = u32::from_be_bytes(take(&mut blob, 4)?.try_into()?) as usize;
        f(name, take(&mut blob, n)?);
    }
    Ok(())
}

async fn fill_blob(
    pool: &PgPool,
    table: &str,
    records: &[RefRecord],
    partial_index: bool,
) -> anyhow::Result<()> {
    let index = if partial_index {
        format!("CREATE INDEX ON {table} (id) WHERE published_at IS NULL;")
    } else {
        String::new()
    };
    sqlx::raw_sql(&format!(
        "CREATE TABLE {table} (id bigserial PRIMARY KEY, key text NOT NULL, payload bytea NOT NULL, \
         headers bytea NOT NULL, published_at timestamptz); {index}"
    ))
    .execute(pool)
    .await?;
    for chunk in records.chunks(5_000) {
        let keys: Vec<&str> = chunk.iter().map(|r| r.key.as_str()).collect();
        let payloads: Vec<&[u8]> = chunk.iter().map(|r| r.payload.as_slice()).collect();
        let blobs: Vec<Vec<u8>> = chunk.iter().map(|r| encode_blob(&r.headers)).collect();
        sqlx::query(&format!(
            "INSERT INTO {table} (key, payload, headers) \
             SELECT * FROM UNNEST($1::text[], $2::bytea[], $3::bytea[])"
        ))
        .bind(&keys)
        .bind(&payloads)
        .bind(&blobs)
        .execute(pool)
        .await?;
    }
    sqlx::raw_sql(&format!("VACUUM ANALYZE {table}"))
        .execute(pool)
        .await?;
    Ok(())
}

/// The record of one claimed row, its headers built as `headers` says.
pub(crate) fn record<'a>(
    row: &'a PgRow,
    topic: &'a str,
    headers: Headers,
) -> anyhow::Result<FutureRecord<'a, str, [u8]>> {
    let key: &str = row.try_get(1)?;
    let payload: &[u8] = row.try_get(2)?;
    let rec = FutureRecord::to(topic).key(key).payload(payload);
    let headers = match headers {
        Headers::None => return Ok(rec),
        Headers::Blob => {
            let blob: &[u8] = row.try_get(3)?;
            // `insert` takes the list by value; the Option moves it through the closure.
            let mut h = Some(OwnedHeaders::new_with_capacity(8));
            each_header(blob, |k, v| {
                h = h.take().map(|h| {
                    h.insert(Header {
                        key: k,
                        value: Some(v),
                    })
                });
            })?;
            h.expect("put back after every insert")
        }
        Headers::Arrays => {
            // What the minimal relay does: one owned vector per array, per row.
            let hk: Vec<String> = row.try_get(3)?;
            let hv: Vec<Vec<u8>> = row.try_get(4)?;
            let mut out = OwnedHeaders::new_with_capacity(hk.len());
            for (k, v) in hk.iter().zip(&hv) {
                out = out.insert(Header {
                    key: k.as_str(),
                    value: Some(v.as_slice()),
                });
            }
            out
        }
    };
    Ok(rec.headers(headers))
}

/// The lean relay: claim `batch` with `SKIP LOCKED`, enqueue all, await all together, one
/// `UPDATE`, commit; until a claim finds nothing.
async fn drain_lean(
    pool: &PgPool,
    table: &str,
    producer: &FutureProducer,
    topic: &str,
    batch: usize,
    headers: Headers,
) -> anyhow::Result<(u64, Duration)> {
    let columns = match headers {
        Headers::Blob => "id, key, payload, headers",
        Headers::Arrays => "id, key, payload, header_keys, header_values",
        Headers::None => "id, key, payload",
    };
    let claim = format!(
        "SELECT {columns} FROM {table} WHERE published_at IS NULL \
         ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
    );
    let mark = format!("UPDATE {table} SET published_at = now() WHERE id = ANY($1)");
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
            ids.push(row.try_get::<i64, _>(0)?);
            let rec = record(row, topic, headers)?;
            pending.push(producer.send_result(rec).map_err(|(e, _)| e)?);
        }
        for report in futures::future::join_all(pending).await {
            report?.map_err(|(e, _)| e)?;
        }
        sqlx::query(&mark).bind(&ids).execute(&mut *tx).await?;
        tx.commit().await?;
        total += ids.len() as u64;
    }
    Ok((total, started.elapsed()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_blob_gives_back_every_header_in_order() {
        let e = crate::env::event(7, 3);
        let headers = outbox_core::wire::encode_headers(&e);
        let blob = encode_blob(&headers);
        let mut back = Vec::new();
        each_header(&blob, |k, v| back.push((k.to_owned(), v.to_vec()))).unwrap();
        assert_eq!(back, headers);
        assert!(each_header(&blob[..blob.len() - 1], |_, _| {}).is_err());
    }
}
