//! Adversary of the SQL append (`<schema>.<table>_append(...)`, migration 7): inputs on which
//! the PL/pgSQL validation and `Envelope::validate` (default limits) could disagree.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL` built with ICU (the
//! Debian and official images are).

mod common;

use std::time::Duration;

use outbox_core::{Envelope, EnvelopeLimits};

use common::{claim, event, lease, listening_store, raw_listener, received_until_marker};

/// The SQL append of `e` with the caller's text arguments in `collation` (an SQL collation
/// name, quoted), rolled back. `Err` carries (SQLSTATE, message).
async fn sql_append_collated(
    ctx: &common::Ctx,
    e: &Envelope,
    collation: &str,
) -> Result<(), (String, String)> {
    let mut tx = ctx.pool.begin().await.unwrap();
    let r = sqlx::query(&format!(
        "SELECT \"{}\".outbox_events_append(\
           aggregate_type => $1 COLLATE {collation}, aggregate_id => $2 COLLATE {collation}, \
           aggregate_version => $3, event_type => $4 COLLATE {collation}, payload => $5, \
           content_type => $6 COLLATE {collation}, headers => $7, schema_version => $8, \
           event_id => $9, created_at => $10)",
        ctx.schema
    ))
    .bind(&e.aggregate_type)
    .bind(&e.aggregate_id)
    .bind(e.aggregate_version)
    .bind(&e.event_type)
    .bind(&e.payload.bytes)
    .bind(&e.payload.content_type)
    .bind(serde_json::to_value(&e.headers).unwrap())
    .bind(e.schema_version)
    .bind(e.event_id.as_uuid())
    .bind(e.created_at)
    .execute(&mut *tx)
    .await;
    tx.rollback().await.unwrap();
    match r {
        Ok(_) => Ok(()),
        Err(sqlx::Error::Database(d)) => Err((
            d.code().map(|c| c.into_owned()).unwrap_or_default(),
            d.message().to_owned(),
        )),
        Err(other) => panic!("unexpected error: {other}"),
    }
}

/// The reserved envelope names are refused in any case whatever the caller's collation: a
/// caller whose text is in a Turkish collation (an argument's `COLLATE`, or a database whose
/// default collation is Turkish) lowers `EVENT_ID` to `event_ıd` (dotless i), which the
/// function compared with `event_id` and let through, while Rust refuses it (and a consumer
/// would then meet a user header beside the envelope's own `event_id`). Failed before the fix
/// (`EVENT_ID` accepted by SQL).
#[tokio::test]
async fn reserved_headers_are_refused_under_a_turkish_collation() {
    let ctx = ctx!(2);
    let _store = ctx.store(lease(30.0)).await;
    let turkish: Option<String> = sqlx::query_scalar(
        "SELECT collname::text FROM pg_collation WHERE collname = 'tr-TR-x-icu'",
    )
    .fetch_optional(&ctx.pool)
    .await
    .unwrap();
    assert!(
        turkish.is_some(),
        "this test needs a PostgreSQL built with ICU (collation tr-TR-x-icu)"
    );
    let limits = EnvelopeLimits::default();
    for name in [
        "EVENT_ID",
        "AGGREGATE_ID",
        "SCHEMA_VERSION",
        "Event_Id",
        "TRACEPARENT",
    ] {
        let mut e = event("tr", 1);
        e.headers.insert(name.into(), "x".into());
        let rust = e.validate(&limits).expect_err(name);
        let sql = sql_append_collated(&ctx, &e, "\"tr-TR-x-icu\"").await;
        assert_eq!(
            sql,
            Err(("22023".to_owned(), rust.to_string())),
            "header {name} under a Turkish collation"
        );
        // The same call in the C collation, as the control: refused with the same text.
        let sql = sql_append_collated(&ctx, &e, "\"C\"").await;
        assert_eq!(
            sql,
            Err(("22023".to_owned(), rust.to_string())),
            "{name} in C"
        );
    }
    ctx.drop().await;
}

/// A refused content type or header name is quoted in the error as Rust's `{:?}` quotes it
/// (`\u{7f}`, `\u{a0}`, `\u{2028}`, ...), not as JSON (`to_json` leaves DEL, U+0085, the
/// Unicode spaces and line separators raw and writes `\u0001` for U+0001): the function
/// promises the Rust error's text. Failed before the fix (e.g. `"a<DEL>"` for `"a\u{7f}"`).
#[tokio::test]
async fn refused_names_are_quoted_as_rust_quotes_them() {
    let ctx = ctx!(2);
    let _store = ctx.store(lease(30.0)).await;
    let limits = EnvelopeLimits::default();
    let odd = [
        "a\u{7f}",
        "\u{1}x",
        "\t\u{b}\u{c}",
        "\r\n",
        "x\u{85}",
        "\u{a0}",
        "\u{2028}\u{2029}",
        "\u{1680}\u{2000}\u{200a}\u{202f}\u{205f}\u{3000}",
        "q\"b\\",
        " ",
        "",
    ];
    let mut refused = 0;
    for s in odd {
        for what in ["content type", "header name"] {
            let mut e = event("q", 1);
            if what == "content type" {
                e.payload.content_type = s.to_owned();
            } else {
                e.headers.insert(s.to_owned(), "v".to_owned());
            }
            let Err(rust) = e.validate(&limits) else {
                continue;
            };
            refused += 1;
            let sql = sql_append_collated(&ctx, &e, "\"C\"").await;
            assert_eq!(
                sql,
                Err(("22023".to_owned(), rust.to_string())),
                "{what} {s:?}"
            );
        }
    }
    assert!(refused >= 20, "the cases are refused by Rust: {refused}");
    ctx.drop().await;
}

/// `created_at => 'infinity'` (which no Rust envelope can hold) is refused as every other
/// invalid argument is, with SQLSTATE 22023 and nothing written, not with 22003 ("cannot
/// convert infinity to integer") from the year check. Failed before the fix (22003).
#[tokio::test]
async fn an_infinite_created_at_is_an_invalid_parameter() {
    let ctx = ctx!(2);
    let _store = ctx.store(lease(30.0)).await;
    for at in ["infinity", "-infinity"] {
        let err = sqlx::query(&format!(
            "SELECT \"{}\".outbox_events_append('order', 'inf', 1, 't', ''::bytea, \
                    created_at => $1::timestamptz)",
            ctx.schema
        ))
        .bind(at)
        .execute(&ctx.pool)
        .await
        .expect_err(at);
        let d = err.as_database_error().expect("a database error");
        assert_eq!(d.code().as_deref(), Some("22023"), "{at}: {d}");
        assert!(d.message().contains("created_at"), "{at}: {d}");
    }
    let n: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".outbox_events",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(n, 0);
    ctx.drop().await;
}

/// The relay arms the gate while an SQL append is inside the function, between its INSERT and
/// its gate probe: the INSERT is held (pg_stat_activity shows it waiting) on a uncommitted
/// row of the same event id written without the function, so the append holds no gate lock
/// and the relay's arm is granted; then the blocker rolls back. The append's probe then fails
/// (the gate is held), so it notifies at its commit: the idle relay is woken, and the event
/// is claimed. No timing: each step waits for the state it needs.
#[tokio::test]
async fn a_relay_arming_inside_an_sql_append_is_woken_by_it() {
    let ctx = ctx!(6);
    let (store, notify, handle) = listening_store(&ctx, lease(30.0), Duration::from_secs(5)).await;
    let mut raw = raw_listener(&ctx, &store).await;
    let e = event("inside", 1);
    let mut blocker = ctx.pool.begin().await.unwrap();
    sqlx::query(&format!(
        "INSERT INTO \"{}\".outbox_events (event_id, aggregate_type, aggregate_id, \
           aggregate_version, event_type, schema_version, content_type, payload, created_at) \
         VALUES ($1, 'order', 'blocker', 1, 't', 1, 'application/json', ''::bytea, now())",
        ctx.schema
    ))
    .bind(e.event_id.as_uuid())
    .execute(&mut *blocker)
    .await
    .unwrap();
    let appender = {
        let pool = ctx.pool.clone();
        let schema = ctx.schema.clone();
        let id = e.event_id.as_uuid();
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            sqlx::query(&format!(
                "SELECT \"{schema}\".outbox_events_append('order', 'inside', 1, 't', \
                        ''::bytea, event_id => $1)"
            ))
            .bind(id)
            .execute(&mut *tx)
            .await
            .unwrap();
            tx.commit().await.unwrap();
        })
    };
    // The append waits inside the function, on the blocker's row.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND datname = current_database() AND query LIKE '%' || $1 || '%outbox_events_append%'",
        )
        .bind(&ctx.schema)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the append never waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(claim(&store, "r", 10).await.is_empty());
    assert!(
        store.wake_gate_armed(),
        "armed beside the append, which holds no gate lock yet"
    );
    blocker.rollback().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), appender)
        .await
        .expect("the append ends")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(2), notify.notified())
        .await
        .expect("the idle relay is woken by the append that met the armed gate");
    assert_eq!(
        received_until_marker(&ctx, &store, &mut raw).await,
        ["", "marker"]
    );
    let b = claim(&store, "r", 10).await;
    assert_eq!(b.records.len(), 1);
    assert_eq!(b.records[0].envelope.event_id, e.event_id);
    handle.abort();
    ctx.drop().await;
}

/// The rights a service's role needs, as the docs state them: `USAGE` on the schema and
/// `INSERT` on the outbox table (plus `EXECUTE`, granted to `PUBLIC`). With them it appends
/// (no sequence, audit or state table is touched; the gate lock and `NOTIFY` need no grant);
/// without `INSERT` the call is refused with 42501 and nothing is written; without `USAGE` on
/// the schema the function cannot be reached at all.
#[tokio::test]
async fn a_role_with_only_insert_on_the_table_appends() {
    let ctx = ctx!(2);
    let _store = ctx.store(lease(30.0)).await;
    let role = format!("{}_svc", ctx.schema);
    let s = &ctx.schema;
    sqlx::query(&format!("CREATE ROLE \"{role}\" LOGIN"))
        .execute(&ctx.pool)
        .await
        .unwrap();
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| common::DEFAULT_URL.to_owned());
    let mut as_role = url.parse::<sqlx::postgres::PgConnectOptions>().unwrap();
    as_role = as_role.username(&role).password("");
    let call = format!("SELECT \"{s}\".outbox_events_append('order', 'priv', 1, 't', ''::bytea)");
    let attempt = |opts: sqlx::postgres::PgConnectOptions, call: String| async move {
        use sqlx::Connection;
        let mut c = sqlx::PgConnection::connect_with(&opts).await.unwrap();
        let r = sqlx::query(&call).execute(&mut c).await;
        let _ = c.close().await;
        r.err().and_then(|e| {
            e.as_database_error()
                .and_then(|d| d.code().map(|c| c.into_owned()))
        })
    };
    let no_usage = attempt(as_role.clone(), call.clone()).await;
    sqlx::query(&format!("GRANT USAGE ON SCHEMA \"{s}\" TO \"{role}\""))
        .execute(&ctx.pool)
        .await
        .unwrap();
    let no_insert = attempt(as_role.clone(), call.clone()).await;
    sqlx::query(&format!(
        "GRANT INSERT ON \"{s}\".outbox_events TO \"{role}\""
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let granted = attempt(as_role.clone(), call.clone()).await;
    let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM \"{s}\".outbox_events"))
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
    // Dropped before any assertion, so that a failure leaves no role behind.
    for sql in [
        format!("DROP OWNED BY \"{role}\""),
        format!("DROP ROLE \"{role}\""),
    ] {
        sqlx::query(&sql).execute(&ctx.pool).await.unwrap();
    }
    assert_eq!(no_usage.as_deref(), Some("42501"), "without USAGE");
    assert_eq!(no_insert.as_deref(), Some("42501"), "without INSERT");
    assert_eq!(granted, None, "USAGE + INSERT suffice");
    assert_eq!(n, 1);
    ctx.drop().await;
}

/// A service whose ids live in a case-insensitive column (a nondeterministic ICU collation,
/// PostgreSQL's replacement for citext) passes them to the function as they are: the
/// function's regular expressions then ran in that collation, which PostgreSQL refuses
/// ("nondeterministic collations are not supported for regular expressions", 0A000), so a
/// valid envelope was refused. The function now validates in the C collation whatever the
/// caller's, and accepts and refuses as Rust does. Failed before the fix (0A000 on a valid
/// envelope).
#[tokio::test]
async fn a_callers_nondeterministic_collation_changes_nothing() {
    let ctx = ctx!(2);
    let _store = ctx.store(lease(30.0)).await;
    sqlx::query(&format!(
        "CREATE COLLATION \"{}\".ci (provider = icu, locale = 'und-u-ks-level2', \
         deterministic = false)",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let ci = format!("\"{}\".ci", ctx.schema);
    let limits = EnvelopeLimits::default();
    let mut cases = Vec::new();
    let mut e = event("Order-42", 1);
    e.headers.insert(
        "traceparent".into(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
    );
    cases.push(e);
    let mut e = event("ci", 1);
    e.headers.insert("Event_ID".into(), "x".into());
    cases.push(e);
    let mut e = event("ci", 1);
    e.payload.content_type = "\u{a0}".into();
    cases.push(e);
    let mut e = event("ci", 1);
    e.aggregate_id = "a\u{85}".into();
    cases.push(e);
    for (i, e) in cases.iter().enumerate() {
        let rust = e
            .validate(&limits)
            .map_err(|r| ("22023".to_owned(), r.to_string()));
        let sql = sql_append_collated(&ctx, e, &ci).await;
        assert_eq!(sql, rust, "case {i}");
    }
    ctx.drop().await;
}
