//! Appending from SQL (`<schema>.<table>_append(...)`, migration 7), for services not written
//! in Rust: the same row as the Rust append, the same validation, the caller's transaction,
//! the same wake-up; driven from sqlx, from `psql` and from the Python example
//! (`examples/python/append_event.py`, psycopg 3).
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; the `psql` and Python
//! tests need `psql` and `python3` with psycopg 3 (`scripts/test` installs psycopg).

mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use outbox_core::{ClaimMode, Envelope, EnvelopeLimits, EventId};
use rand::{Rng, SeedableRng};
use sqlx::{PgPool, Row};

use common::{claim, event, lease, listening_store, raw_listener, received_until_marker, Ctx};

/// Calls the SQL function with every field of `e`, in a transaction of its own that commits
/// when `commit` is true and rolls back otherwise. `Err` carries (SQLSTATE, message).
async fn sql_append(
    pool: &PgPool,
    schema: &str,
    e: &Envelope,
    commit: bool,
) -> Result<uuid::Uuid, (String, String)> {
    let mut tx = pool.begin().await.unwrap();
    let headers = serde_json::to_value(&e.headers).unwrap();
    let r = sqlx::query_scalar::<_, uuid::Uuid>(&format!(
        "SELECT \"{schema}\".outbox_events_append(\
           aggregate_type => $1, aggregate_id => $2, aggregate_version => $3, \
           event_type => $4, payload => $5, content_type => $6, headers => $7, \
           schema_version => $8, event_id => $9, created_at => $10)"
    ))
    .bind(&e.aggregate_type)
    .bind(&e.aggregate_id)
    .bind(e.aggregate_version)
    .bind(&e.event_type)
    .bind(&e.payload.bytes)
    .bind(&e.payload.content_type)
    .bind(headers)
    .bind(e.schema_version)
    .bind(e.event_id.as_uuid())
    .bind(e.created_at)
    .fetch_one(&mut *tx)
    .await;
    match r {
        Ok(id) => {
            if commit {
                tx.commit().await.unwrap();
            } else {
                tx.rollback().await.unwrap();
            }
            Ok(id)
        }
        Err(sqlx::Error::Database(d)) => Err((
            d.code().map(|c| c.into_owned()).unwrap_or_default(),
            d.message().to_owned(),
        )),
        Err(other) => panic!("unexpected error: {other}"),
    }
}

async fn count(pool: &PgPool, schema: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM \"{schema}\".outbox_events"))
        .fetch_one(pool)
        .await
        .unwrap()
}

fn rich_event(agg: &str, version: i64) -> Envelope {
    let mut e = event(agg, version);
    e.headers.insert("tenant".into(), "acme".into());
    e.headers.insert(
        "traceparent".into(),
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
    );
    e.payload.bytes = "{\"total\":\"12.50\",\"note\":\"caf\u{e9} \u{1f600}\"}".into();
    e.payload.content_type = "application/json".into();
    e.schema_version = 3;
    e.created_at = Utc.with_ymd_and_hms(2026, 12, 5, 1, 2, 3).unwrap()
        + chrono::Duration::microseconds(456_789);
    e
}

/// The SQL append writes what the Rust append writes: the relay claims the same envelope.
#[tokio::test]
async fn the_sql_append_writes_the_envelope_the_rust_append_writes() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let rust = rich_event("by-rust", 1);
    let mut from_sql = rich_event("by-sql", 1);
    from_sql.event_id = EventId::now_v7();
    store.append(&ctx.pool, &rust).await.unwrap();
    let id = sql_append(&ctx.pool, &ctx.schema, &from_sql, true)
        .await
        .unwrap();
    assert_eq!(id, from_sql.event_id.as_uuid());

    let batch = claim(&store, "r", 10).await;
    let mut got: BTreeMap<String, Envelope> = batch
        .records
        .iter()
        .map(|r| (r.envelope.aggregate_id.clone(), r.envelope.clone()))
        .collect();
    assert_eq!(got.len(), 2, "both events are claimable");
    assert_eq!(got.remove("by-rust").unwrap(), rust);
    assert_eq!(got.remove("by-sql").unwrap(), from_sql);

    // The columns the relay does not read (insertion time, status, counters) match too.
    let rows = sqlx::query(&format!(
        "SELECT aggregate_id, status, attempts, blocked, inserted_at IS NOT NULL AS has_ins, \
                headers::text AS h \
         FROM \"{}\".outbox_events ORDER BY aggregate_id",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    let view = |i: usize| {
        let r = &rows[i];
        (
            r.get::<String, _>("status"),
            r.get::<i32, _>("attempts"),
            r.get::<bool, _>("blocked"),
            r.get::<bool, _>("has_ins"),
            r.get::<String, _>("h"),
        )
    };
    assert_eq!(view(0), view(1));

    // Defaults: content type JSON, no headers, schema version 1, a fresh id, now().
    let id: uuid::Uuid = sqlx::query_scalar(&format!(
        "SELECT \"{}\".outbox_events_append('order', 'defaults', 1, 'order.created', \
                convert_to('{{}}', 'UTF8'))",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    let batch = claim(&store, "r2", 10).await;
    let e = &batch
        .records
        .iter()
        .find(|r| r.envelope.aggregate_id == "defaults")
        .expect("the default-argument event is claimable")
        .envelope;
    assert_eq!(e.event_id.as_uuid(), id);
    assert_eq!(e.payload.content_type, "application/json");
    assert_eq!(e.schema_version, 1);
    assert!(e.headers.is_empty());
    assert!((Utc::now() - e.created_at).num_seconds().abs() < 60);
    ctx.drop().await;
}

/// The append is part of the caller's transaction: rolled back, nothing is written; a
/// duplicate event id fails like the Rust append's (a unique violation).
#[tokio::test]
async fn the_sql_append_commits_and_rolls_back_with_the_caller() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let e = rich_event("tx", 1);
    sql_append(&ctx.pool, &ctx.schema, &e, false).await.unwrap();
    assert_eq!(count(&ctx.pool, &ctx.schema).await, 0, "rolled back");
    assert!(claim(&store, "r", 10).await.is_empty());
    sql_append(&ctx.pool, &ctx.schema, &e, true).await.unwrap();
    assert_eq!(count(&ctx.pool, &ctx.schema).await, 1, "committed");
    let dup = sql_append(&ctx.pool, &ctx.schema, &e, true)
        .await
        .expect_err("the same event id twice");
    assert_eq!(dup.0, "23505", "unique violation: {dup:?}");
    assert_eq!(count(&ctx.pool, &ctx.schema).await, 1);
    ctx.drop().await;
}

fn at_year(year: i32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(year, 6, 1, 0, 0, 0).unwrap()
}

/// One change to a valid envelope, named for the failure message.
type Mutation = (&'static str, fn(&mut Envelope));

/// Edge cases of every rule of `Envelope::validate` (default limits), on both sides of each
/// bound.
fn mutations() -> Vec<Mutation> {
    fn hdr(e: &mut Envelope, k: &str, v: &str) {
        e.headers.insert(k.into(), v.into());
    }
    vec![
        ("valid", |_| {}),
        ("empty type", |e| e.aggregate_type = String::new()),
        ("blank type (ideographic space)", |e| {
            e.aggregate_type = "\u{3000} ".into()
        }),
        ("blank id (nbsp, tab)", |e| {
            e.aggregate_id = "\u{a0}\t".into()
        }),
        ("id with a visible char after blanks", |e| {
            e.aggregate_id = "\u{3000}x".into()
        }),
        ("blank event type (next line)", |e| {
            e.event_type = "\u{85}".into()
        }),
        ("zero-width space is not blank", |e| {
            e.event_type = "\u{200b}".into()
        }),
        ("type 255 bytes multibyte", |e| {
            e.aggregate_type = "\u{e9}".repeat(127) + "a"
        }),
        ("type 256 bytes multibyte", |e| {
            e.aggregate_type = "\u{e9}".repeat(128)
        }),
        ("id 255 ascii", |e| e.aggregate_id = "i".repeat(255)),
        ("id 256 ascii", |e| e.aggregate_id = "i".repeat(256)),
        ("event type 256", |e| e.event_type = "t".repeat(256)),
        ("control in id (DEL)", |e| {
            e.aggregate_id = "a\u{7f}b".into()
        }),
        ("control in type (C1)", |e| {
            e.aggregate_type = "a\u{9f}".into()
        }),
        ("control in event type (newline)", |e| {
            e.event_type = "a\nb".into()
        }),
        ("U+00A0 in a name is fine", |e| {
            e.aggregate_id = "a\u{a0}b".into()
        }),
        ("version 0", |e| e.aggregate_version = 0),
        ("version -5", |e| e.aggregate_version = -5),
        ("version max", |e| e.aggregate_version = i64::MAX),
        ("schema version 0", |e| e.schema_version = 0),
        ("schema version max", |e| e.schema_version = i32::MAX),
        ("content type blank", |e| {
            e.payload.content_type = " ".into()
        }),
        ("content type empty", |e| {
            e.payload.content_type = String::new()
        }),
        ("content type 255", |e| {
            e.payload.content_type = "c".repeat(255)
        }),
        ("content type 256", |e| {
            e.payload.content_type = "c".repeat(256)
        }),
        ("content type with control", |e| {
            e.payload.content_type = "text/plain\r".into()
        }),
        ("content type odd but fine", |e| {
            e.payload.content_type = "application/x-\u{e9}; v=1".into()
        }),
        ("year 0 (1 BC)", |e| e.created_at = at_year(0)),
        ("year -1 (2 BC)", |e| e.created_at = at_year(-1)),
        ("year 9999", |e| e.created_at = at_year(9999)),
        ("year 10000", |e| e.created_at = at_year(10000)),
        ("year 9999 last microsecond", |e| {
            e.created_at = Utc.with_ymd_and_hms(9999, 12, 31, 23, 59, 59).unwrap()
                + chrono::Duration::microseconds(999_999)
        }),
        ("payload at the limit", |e| {
            e.payload.bytes = vec![b'x'; 921_600]
        }),
        ("payload over the limit", |e| {
            e.payload.bytes = vec![b'x'; 921_601]
        }),
        ("empty payload", |e| e.payload.bytes = Vec::new()),
        ("binary payload", |e| e.payload.bytes = vec![0, 255, 10, 13]),
        ("32 headers", |e| {
            for i in 0..32 {
                hdr(e, &format!("h{i:02}"), "v");
            }
        }),
        ("33 headers", |e| {
            for i in 0..33 {
                hdr(e, &format!("h{i:02}"), "v");
            }
        }),
        ("header bytes at the limit", |e| {
            hdr(e, "big", &"v".repeat(16_384 - 3))
        }),
        ("header bytes over the limit", |e| {
            hdr(e, "big", &"v".repeat(16_384 - 2))
        }),
        ("header bytes over in sum", |e| {
            hdr(e, "a", &"v".repeat(9_000));
            hdr(e, "b", &"v".repeat(9_000));
        }),
        ("empty header name", |e| hdr(e, "", "v")),
        ("header name with space", |e| hdr(e, "a b", "v")),
        ("header name non-ASCII", |e| hdr(e, "caf\u{e9}", "v")),
        ("header name 255", |e| hdr(e, &"n".repeat(255), "v")),
        ("header name 256", |e| hdr(e, &"n".repeat(256), "v")),
        ("reserved header", |e| hdr(e, "event_id", "x")),
        ("reserved header upper case", |e| {
            hdr(e, "Aggregate_Version", "x")
        }),
        ("near-reserved header", |e| hdr(e, "event_ids", "x")),
        ("header value with control", |e| hdr(e, "k", "a\u{1b}b")),
        ("header value with C1", |e| hdr(e, "k", "\u{80}")),
        ("header value empty", |e| hdr(e, "k", "")),
        ("header value unicode", |e| {
            hdr(e, "k", "\u{1f600} \u{3000}")
        }),
        ("traceparent valid", |e| {
            hdr(
                e,
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )
        }),
        ("traceparent upper-case name", |e| {
            hdr(
                e,
                "TraceParent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )
        }),
        ("traceparent upper-case hex", |e| {
            hdr(
                e,
                "traceparent",
                "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            )
        }),
        ("traceparent zero trace id", |e| {
            hdr(
                e,
                "traceparent",
                "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            )
        }),
        ("traceparent zero parent id", |e| {
            hdr(
                e,
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            )
        }),
        ("traceparent version ff", |e| {
            hdr(
                e,
                "traceparent",
                "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )
        }),
        ("traceparent v00 with a fifth part", |e| {
            hdr(
                e,
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
            )
        }),
        ("traceparent v01 with a fifth part", |e| {
            hdr(
                e,
                "traceparent",
                "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
            )
        }),
        ("traceparent v00 trailing dash", |e| {
            hdr(
                e,
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-",
            )
        }),
        ("traceparent three parts", |e| {
            hdr(
                e,
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            )
        }),
        ("traceparent empty", |e| hdr(e, "traceparent", "")),
        ("traceparent short flags", |e| {
            hdr(
                e,
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
            )
        }),
    ]
}

/// Accepts and rejects exactly what `Envelope::validate` (default limits) does, with the
/// Rust error's text and SQLSTATE 22023, and writes nothing when it rejects: every edge case
/// alone, then seeded random combinations of them.
#[tokio::test]
async fn the_sql_append_accepts_and_rejects_what_the_envelope_does() {
    let ctx = ctx!(4);
    let _store = ctx.store(lease(30.0)).await;
    let limits = EnvelopeLimits::default();
    let muts = mutations();
    let check = |name: String, e: Envelope| {
        let pool = ctx.pool.clone();
        let schema = ctx.schema.clone();
        let limits = limits.clone();
        async move {
            let rust = e.validate(&limits);
            let sql = sql_append(&pool, &schema, &e, false).await;
            match (&rust, &sql) {
                (Ok(()), Ok(_)) => {}
                (Err(r), Err((code, msg))) => {
                    assert_eq!(code, "22023", "{name}: SQLSTATE of {msg:?}");
                    assert_eq!(msg, &r.to_string(), "{name}: message");
                }
                _ => panic!("{name}: Rust says {rust:?}, SQL says {sql:?}"),
            }
            rust.is_ok()
        }
    };
    let mut accepted = 0;
    for (name, m) in &muts {
        let mut e = event("v", 1);
        m(&mut e);
        accepted += usize::from(check((*name).to_owned(), e).await);
    }
    // Both outcomes are exercised (a check that cannot fail would not see both).
    assert!(
        accepted > 10 && accepted < muts.len() - 10,
        "accepted {accepted}"
    );

    let seed = common::env_seed("OUTBOX_SQL_APPEND_SEED").unwrap_or_else(common::clock_seed);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for case in 0..150 {
        let mut e = event("v", 1);
        let mut names = Vec::new();
        for _ in 0..rng.random_range(1..=3) {
            let (name, m) = &muts[rng.random_range(0..muts.len())];
            m(&mut e);
            names.push(*name);
        }
        check(
            format!("seed {seed} (OUTBOX_SQL_APPEND_SEED) case {case}: {names:?}"),
            e,
        )
        .await;
    }
    assert_eq!(count(&ctx.pool, &ctx.schema).await, 0, "all rolled back");

    // What Rust's types rule out, SQL must refuse too: NULLs, non-string header values.
    for (what, call) in [
        ("NULL id", "NULL, 1, 't', ''::bytea"),
        ("NULL version", "'a', NULL, 't', ''::bytea"),
        ("NULL payload", "'a', 1, 't', NULL"),
    ] {
        let err = sqlx::query(&format!(
            "SELECT \"{}\".outbox_events_append('order', {call})",
            ctx.schema
        ))
        .execute(&ctx.pool)
        .await
        .expect_err(what);
        let code = err
            .as_database_error()
            .unwrap()
            .code()
            .unwrap()
            .into_owned();
        assert_eq!(code, "22004", "{what}: {err}");
    }
    for headers in ["{\"n\": 1}", "[\"a\"]", "\"s\"", "{\"k\": null}"] {
        let err = sqlx::query(&format!(
            "SELECT \"{}\".outbox_events_append('order', 'a', 1, 't', ''::bytea, \
                    headers => $1::jsonb)",
            ctx.schema
        ))
        .bind(headers)
        .execute(&ctx.pool)
        .await
        .expect_err(headers);
        let code = err
            .as_database_error()
            .unwrap()
            .code()
            .unwrap()
            .into_owned();
        assert_eq!(code, "22023", "{headers}: {err}");
    }
    assert_eq!(count(&ctx.pool, &ctx.schema).await, 0);
    ctx.drop().await;
}

/// The SQL append takes part in the wake-up exactly as the Rust append: an idle relay (gate
/// armed) is notified at the commit, a busy one is not.
#[tokio::test]
async fn the_sql_append_wakes_an_idle_relay_and_not_a_busy_one() {
    let ctx = ctx!(6);
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let (store, notify, handle) = listening_store(&ctx, mode, Duration::from_secs(5)).await;
        let mut raw = raw_listener(&ctx, &store).await;
        assert!(claim(&store, "r", 10).await.is_empty());
        assert!(store.wake_gate_armed(), "an empty claim arms the gate");
        sql_append(&ctx.pool, &ctx.schema, &rich_event("idle", 1), true)
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(2), notify.notified())
            .await
            .expect("the idle relay is woken by the SQL append's commit");
        assert_eq!(
            received_until_marker(&ctx, &store, &mut raw).await,
            ["", "marker"]
        );
        let b = claim(&store, "r", 10).await;
        assert_eq!(b.records.len(), 1);
        assert!(!store.wake_gate_armed(), "a claim that finds work disarms");
        sql_append(&ctx.pool, &ctx.schema, &rich_event("busy", 1), true)
            .await
            .unwrap();
        assert_eq!(
            received_until_marker(&ctx, &store, &mut raw).await,
            ["marker"],
            "a busy relay is not notified"
        );
        common::publish_all(&store, &b).await;
        let b = claim(&store, "r", 10).await;
        assert_eq!(
            b.records.len(),
            1,
            "the busy append is claimed by the next claim"
        );
        common::publish_all(&store, &b).await;

        // An append whose transaction is still open when the relay goes idle: arming waits
        // for it to end (its shared gate lock), then claims what it committed.
        let mut open = ctx.pool.begin().await.unwrap();
        sqlx::query(&format!(
            "SELECT \"{}\".outbox_events_append('order', 'straddle', 1, 't', ''::bytea)",
            ctx.schema
        ))
        .execute(&mut *open)
        .await
        .unwrap();
        let relay = {
            let store = store.clone();
            tokio::spawn(async move { claim(&store, "r", 10).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        open.commit().await.unwrap();
        let b = tokio::time::timeout(Duration::from_secs(10), relay)
            .await
            .expect("the claim ends")
            .unwrap();
        assert_eq!(
            b.records.len(),
            1,
            "the append that straddled the arming is claimed, not left for a lost wake-up"
        );
        common::publish_all(&store, &b).await;
        handle.abort();
        sqlx::query(&format!("TRUNCATE \"{}\".outbox_events", ctx.schema))
            .execute(&ctx.pool)
            .await
            .unwrap();
        sqlx::query(&format!(
            "TRUNCATE \"{}\".outbox_events_aggregate",
            ctx.schema
        ))
        .execute(&ctx.pool)
        .await
        .unwrap();
    }
    ctx.drop().await;
}

fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| common::DEFAULT_URL.to_owned())
}

async fn orders_table(ctx: &Ctx) {
    sqlx::query(&format!(
        "CREATE TABLE \"{}\".orders (id text PRIMARY KEY, status text NOT NULL, \
                                     version bigint NOT NULL)",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    sqlx::query(&format!(
        "INSERT INTO \"{}\".orders VALUES ('o-1', 'paid', 0)",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
}

/// From `psql`, as a shell script or another language's driver would: the business update
/// and the append in one transaction; a bad call fails the script with the validation text.
#[tokio::test]
async fn psql_appends_in_the_business_transaction() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    orders_table(&ctx).await;
    let s = &ctx.schema;
    let script = format!(
        "BEGIN;\n\
         UPDATE \"{s}\".orders SET status = 'shipped', version = version + 1 \
           WHERE id = 'o-1' AND version = 0;\n\
         SELECT \"{s}\".outbox_events_append(\
           aggregate_type => 'order', aggregate_id => 'o-1', aggregate_version => 1, \
           event_type => 'order.shipped', \
           payload => convert_to('{{\"status\":\"shipped\"}}', 'UTF8'), \
           headers => '{{\"source\":\"psql\"}}');\n\
         COMMIT;\n"
    );
    let out = Command::new("psql")
        .args([
            &database_url(),
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            &script,
        ])
        .output()
        .expect("psql must be installed (it comes with PostgreSQL's client package)");
    assert!(
        out.status.success(),
        "psql failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let b = claim(&store, "r", 10).await;
    assert_eq!(b.records.len(), 1);
    let e = &b.records[0].envelope;
    assert_eq!((e.aggregate_id.as_str(), e.aggregate_version), ("o-1", 1));
    assert_eq!(e.payload.bytes, b"{\"status\":\"shipped\"}");
    assert_eq!(e.headers.get("source").map(String::as_str), Some("psql"));

    // A rejected envelope fails the script, with the reason, and the transaction with it.
    let bad = format!(
        "BEGIN;\n\
         UPDATE \"{s}\".orders SET version = version + 1 WHERE id = 'o-1';\n\
         SELECT \"{s}\".outbox_events_append('order', 'o-1', 2, 'order.shipped', ''::bytea, \
                headers => '{{\"event_id\":\"x\"}}');\n\
         COMMIT;\n"
    );
    let out = Command::new("psql")
        .args([
            &database_url(),
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            &bad,
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("invalid header \"event_id\": the name is reserved for envelope fields"),
        "{stderr}"
    );
    let version: i64 = sqlx::query_scalar(&format!(
        "SELECT version FROM \"{s}\".orders WHERE id = 'o-1'"
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(
        version, 1,
        "the business update rolled back with the append"
    );
    assert_eq!(count(&ctx.pool, s).await, 1);
    ctx.drop().await;
}

/// The README's Python example, run as is: appends with the conditional update, and writes
/// nothing on a version conflict.
#[tokio::test]
async fn the_python_example_appends_in_the_business_transaction() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    orders_table(&ctx).await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/python/append_event.py"
    );
    let run = |expected: &str| {
        Command::new("python3")
            .arg(script)
            .args(["o-1", expected])
            .env("DATABASE_URL", database_url())
            .env("OUTBOX_SCHEMA", &ctx.schema)
            .output()
            .expect("python3 must be installed")
    };
    let out = run("0");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'psycopg'"),
        "psycopg 3 is missing: pip install 'psycopg[binary]' (scripts/test installs it)"
    );
    assert!(out.status.success(), "python failed: {stderr}");
    let printed = String::from_utf8_lossy(&out.stdout).trim().to_owned();

    // Version 0 is gone: a second run with the same expectation conflicts, writes nothing.
    let out = run("0");
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(count(&ctx.pool, &ctx.schema).await, 1);

    let b = claim(&store, "r", 10).await;
    assert_eq!(b.records.len(), 1);
    let e = &b.records[0].envelope;
    assert_eq!(e.event_id.to_string(), printed);
    assert_eq!(
        (e.aggregate_type.as_str(), e.aggregate_id.as_str()),
        ("order", "o-1")
    );
    assert_eq!(e.aggregate_version, 1);
    assert_eq!(e.event_type, "order.shipped");
    let body: serde_json::Value = serde_json::from_slice(&e.payload.bytes).unwrap();
    assert_eq!(body["status"], "shipped");
    assert_eq!(
        e.headers.get("source").map(String::as_str),
        Some("python-shop")
    );
    ctx.drop().await;
}
