//! The `outbox` binary against MariaDB, as a user runs it with a `mysql://` URL: `status` reads
//! the outbox through the reporting role (`outbox_core::ReportingStore`) of `outbox-mysql`,
//! `cleanup` counts through it and removes through the maintenance role, `reconcile` compares
//! the outbox side through it,
//! `replay` pages the published events through it to Kafka (the replay test also needs
//! `KAFKA_BROKERS`); the commands that run
//! on PostgreSQL only refuse a MySQL URL (exit 2) before any driver sees it.
//!
//! Needs `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`); each test creates its own
//! database and drops it at the end.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use chrono::Utc;
use outbox_core::prelude::*;
use outbox_core::{
    AckMetadata, ClaimMode, ClaimRequest, Envelope, ErrorClass, LastError, Outcome, ParkKind,
    ParkReason,
};
use outbox_mysql::sqlx::{self, mysql::MySqlPoolOptions, MySqlPool};
use outbox_mysql::MySqlOutboxStore;

/// A fresh database on the server of `MYSQL_URL`.
struct Db {
    admin: MySqlPool,
    name: String,
    base: String,
    dir: PathBuf,
}

impl Db {
    async fn new(test: &str) -> Option<Self> {
        let base = outbox_test_support::mysql_url(test)?;
        let admin = MySqlPoolOptions::new()
            .max_connections(2)
            .connect(&base)
            .await
            .expect("MariaDB answers at MYSQL_URL");
        let name = outbox_test_support::unique("ocli");
        sqlx::query(&format!("CREATE DATABASE `{name}`"))
            .execute(&admin)
            .await
            .expect("create database");
        let dir = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(&dir).expect("temp dir");
        Some(Self {
            admin,
            name,
            base,
            dir,
        })
    }

    /// The server's URL with this database as its path.
    fn url(&self) -> String {
        let (head, tail) = self.base.split_once("://").expect("MYSQL_URL has a scheme");
        let host = tail.split(['/', '?']).next().unwrap_or(tail);
        format!("{head}://{host}/{}", self.name)
    }

    /// `outbox <args>` with `DATABASE_URL` = `url`, in an empty directory, no broker.
    fn outbox(&self, url: &str, envs: &[(&str, &str)], args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_outbox"))
            .current_dir(&self.dir)
            .env_remove("RUST_LOG")
            .env_remove("OUTBOX_CONFIG")
            .env_remove("KAFKA_BROKERS")
            .env_remove("OUTBOX_OUTBOX__SCHEMA")
            .env("DATABASE_URL", url)
            .envs(envs.iter().copied())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run outbox")
    }

    async fn drop(self) {
        let _ = sqlx::query(&format!("DROP DATABASE `{}`", self.name))
            .execute(&self.admin)
            .await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn text(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", text(out));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(out)))
}

/// One event published 30 s after its creation, one parked, one pending: `status` reports
/// each class, the latency of the published one and the parked warning, on a `mysql://` URL
/// naming the database and on the server's URL with `outbox.schema` naming it; the password
/// never shows.
#[tokio::test]
async fn status_reads_a_mariadb_outbox_through_the_reporting_role() {
    let Some(db) = Db::new("status_reads_a_mariadb_outbox_through_the_reporting_role").await else {
        return;
    };
    let pool = MySqlPoolOptions::new()
        .max_connections(2)
        .connect(&db.url())
        .await
        .expect("connect");
    let store = MySqlOutboxStore::builder(pool.clone())
        .claim_mode(ClaimMode::lease(Duration::from_secs(30)).unwrap())
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    let created = Utc::now() - chrono::Duration::seconds(30);
    let event = |agg: &str| {
        Envelope::builder("order", agg, 1, "order.created")
            .created_at(created)
            .build()
            .unwrap()
    };
    let (a, b, c) = (event("a"), event("b"), event("c"));
    let mut tx = pool.begin().await.expect("begin");
    store
        .append_many(&mut *tx, &[a.clone(), b.clone(), c.clone()])
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    let batch = store
        .claim(&ClaimRequest::new("relay-1", 10))
        .await
        .expect("claim");
    assert_eq!(batch.records.len(), 3);
    let outcomes = [
        Outcome::Published {
            event_id: a.event_id,
            ack: AckMetadata::kafka("orders", 0, 41),
        },
        Outcome::Park {
            event_id: b.event_id,
            reason: ParkReason {
                kind: ParkKind::PermanentError,
                error: LastError {
                    class: ErrorClass::Permanent,
                    kind: "invalid_record".into(),
                    message: "test".into(),
                },
            },
        },
    ];
    store
        .complete(&batch.handle, &outcomes)
        .await
        .expect("complete");

    let with_db = db.url().replace("mysql://root@", "mysql://root:@");
    let doc = json(&db.outbox(&with_db, &[], &["--json", "status"]));
    let backlog = &doc["backlog"];
    assert_eq!(backlog["unpublished"], 1, "{doc:#}");
    assert_eq!(backlog["parked"], 1, "{doc:#}");
    assert_eq!(backlog["published_retained"], 1, "{doc:#}");
    assert_eq!(backlog["in_flight"], 0, "{doc:#}");
    assert!(
        backlog["oldest_claimable_age_seconds"].as_f64().is_some(),
        "{doc:#}"
    );
    let latency = &doc["latency"];
    assert_eq!(latency["published"], 1, "{doc:#}");
    let p50 = latency["p50_seconds"].as_f64().expect("p50");
    assert!(
        (30.0..90.0).contains(&p50),
        "created 30 s before publication: {p50}"
    );
    // All three were created 30 s ago, inside the default 15 min window; a 10 s window
    // holds none of them, and the publication made just now.
    assert_eq!(doc["flow"]["created"], 3, "{doc:#}");
    let short = json(&db.outbox(&with_db, &[], &["--json", "status", "--window", "10s"]));
    assert_eq!(short["flow"]["created"], 0, "{short:#}");
    assert_eq!(short["latency"]["published"], 1, "{short:#}");
    let warnings = doc["warnings"].to_string();
    assert!(warnings.contains("1 parked event(s)"), "{doc:#}");
    assert!(
        doc["database"].as_str().unwrap().contains(&db.name),
        "{doc:#}"
    );

    // The server's URL, with the database named by outbox.schema: the same outbox.
    let via_schema = json(&db.outbox(
        &db.base,
        &[("OUTBOX_OUTBOX__SCHEMA", db.name.as_str())],
        &["--json", "status"],
    ));
    for field in ["unpublished", "parked", "published_retained", "in_flight"] {
        assert_eq!(
            via_schema["backlog"][field], doc["backlog"][field],
            "{field}"
        );
    }

    // A configured consumer is read (its inbox, not migrated here, is reported as missing in
    // its row; `mysql_ops.rs` covers a migrated one).
    let path = db.dir.join("outbox.toml");
    std::fs::write(&path, "[[consumers]]\nname = \"billing\"\n").expect("config");
    let with_consumer = json(&db.outbox(
        &db.url(),
        &[],
        &["--json", "--config", path.to_str().unwrap(), "status"],
    ));
    assert_eq!(
        with_consumer["consumers"][0]["name"], "billing",
        "{with_consumer:#}"
    );
    assert!(
        with_consumer["consumers"][0]["parked_error"]
            .as_str()
            .is_some_and(|e| e.contains("outbox migrate --inbox")),
        "{with_consumer:#}"
    );
    std::fs::remove_file(&path).expect("config");

    // The table for people.
    let out = db.outbox(&db.url(), &[], &["status"]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("unpublished (backlog)"), "{stdout}");
    assert!(stdout.contains("warning: 1 parked event(s)"), "{stdout}");
    db.drop().await;
}

/// A database without the outbox tables: `status` fails, names the table and exits non-zero;
/// an unreachable server fails as unreachable.
#[tokio::test]
async fn status_on_mariadb_without_the_outbox_fails_clearly() {
    let Some(db) = Db::new("status_on_mariadb_without_the_outbox_fails_clearly").await else {
        return;
    };
    let out = db.outbox(&db.url(), &[], &["status"]);
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("outbox schema is missing") && stderr.contains("outbox_events"),
        "{}",
        text(&out)
    );
    assert_eq!(out.status.code(), Some(4), "not ready: {}", text(&out));

    let port = outbox_test_support::free_port();
    let nowhere = format!("mysql://root@127.0.0.1:{port}/test");
    let out = db.outbox(&nowhere, &[], &["status"]);
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot connect to MySQL"), "{}", text(&out));
    db.drop().await;
}

/// A migrated outbox in `db` with four events of aggregates a..d: a and b published, c parked,
/// d pending.
async fn four_events(db: &Db) -> (MySqlPool, [Envelope; 4]) {
    let pool = MySqlPoolOptions::new()
        .max_connections(2)
        .connect(&db.url())
        .await
        .expect("connect");
    let store = MySqlOutboxStore::builder(pool.clone())
        .claim_mode(ClaimMode::lease(Duration::from_secs(30)).unwrap())
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    let event = |agg: &str| {
        Envelope::builder("order", agg, 1, "order.created")
            .build()
            .unwrap()
    };
    let events = [event("a"), event("b"), event("c"), event("d")];
    let mut tx = pool.begin().await.expect("begin");
    store.append_many(&mut *tx, &events).await.expect("append");
    tx.commit().await.expect("commit");
    let batch = store
        .claim(&ClaimRequest::new("relay-1", 10))
        .await
        .expect("claim");
    assert_eq!(batch.records.len(), 4);
    let published = |e: &Envelope, offset| Outcome::Published {
        event_id: e.event_id,
        ack: AckMetadata::kafka("orders", 0, offset),
    };
    let outcomes = [
        published(&events[0], 1),
        published(&events[1], 2),
        Outcome::Park {
            event_id: events[2].event_id,
            reason: ParkReason {
                kind: ParkKind::PermanentError,
                error: LastError {
                    class: ErrorClass::Permanent,
                    kind: "invalid_record".into(),
                    message: "test".into(),
                },
            },
        },
    ];
    store
        .complete(&batch.handle, &outcomes)
        .await
        .expect("complete");
    (pool, events)
}

/// Moves the finish time of `event` two hours back.
async fn finished_long_ago(pool: &MySqlPool, event: &Envelope) {
    let n = sqlx::query(
        "UPDATE outbox_events SET finished_at = UTC_TIMESTAMP(6) - INTERVAL 2 HOUR \
         WHERE event_id = ?",
    )
    .bind(event.event_id.as_uuid().as_bytes().to_vec())
    .execute(pool)
    .await
    .expect("backdate")
    .rows_affected();
    assert_eq!(n, 1, "one row backdated");
}

async fn count(pool: &MySqlPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

/// `cleanup --dry-run` counts only the published row finished before the retention and
/// changes nothing; `cleanup` removes exactly it (not the recent published row, the parked or
/// the pending one); with `outbox.archive` the next one is archived first.
#[tokio::test]
async fn cleanup_on_mariadb_removes_only_finished_rows_past_the_retention() {
    let Some(db) =
        Db::new("cleanup_on_mariadb_removes_only_finished_rows_past_the_retention").await
    else {
        return;
    };
    let (pool, events) = four_events(&db).await;
    finished_long_ago(&pool, &events[0]).await;
    let total = "SELECT COUNT(*) FROM outbox_events";

    let dry = json(&db.outbox(
        &db.url(),
        &[],
        &["--json", "cleanup", "--dry-run", "--retention", "1h"],
    ));
    assert_eq!(dry["dry_run"], true, "{dry:#}");
    assert_eq!(dry["would_remove"], 1, "{dry:#}");
    assert_eq!(count(&pool, total).await, 4, "a dry run changes nothing");
    let out = db.outbox(
        &db.url(),
        &[],
        &["cleanup", "--dry-run", "--retention", "1h"],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("dry run: 1 finished row(s)"),
        "{}",
        text(&out)
    );

    let done = json(&db.outbox(
        &db.url(),
        &[],
        &[
            "--json",
            "cleanup",
            "--retention",
            "1h",
            "--batch-size",
            "1",
        ],
    ));
    assert_eq!(done["dry_run"], false, "{done:#}");
    assert_eq!(done["removed"], 1, "{done:#}");
    assert_eq!(done["batches"], 1, "{done:#}");
    let left: Vec<String> =
        sqlx::query_scalar("SELECT LOWER(HEX(event_id)) FROM outbox_events ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("rows");
    let expected: Vec<String> = events[1..]
        .iter()
        .map(|e| e.event_id.as_uuid().simple().to_string())
        .collect();
    assert_eq!(left, expected, "only the old published row went");

    // With outbox.archive, the removed row is copied to <table>_archive first.
    finished_long_ago(&pool, &events[1]).await;
    let archived = json(&db.outbox(
        &db.url(),
        &[("OUTBOX_OUTBOX__ARCHIVE", "true")],
        &["--json", "cleanup", "--retention", "1h"],
    ));
    assert_eq!(archived["removed"], 1, "{archived:#}");
    assert_eq!(archived["archive"], true, "{archived:#}");
    assert_eq!(count(&pool, total).await, 2, "parked and pending stay");
    let in_archive: Vec<String> =
        sqlx::query_scalar("SELECT LOWER(HEX(event_id)) FROM outbox_events_archive")
            .fetch_all(&pool)
            .await
            .expect("archive");
    assert_eq!(
        in_archive,
        vec![events[1].event_id.as_uuid().simple().to_string()]
    );
    db.drop().await;
}

/// `outbox migrate --inbox` on a MySQL URL migrates each configured consumer's inbox there
/// (once: a second run applies nothing), prints its SQL with `--print-sql`, and the inbox then
/// reads as present in `status`. Every command runs on MySQL now; none refuses the URL.
#[tokio::test]
async fn migrate_inbox_on_mariadb_migrates_each_consumers_inbox() {
    let Some(db) = Db::new("migrate_inbox_on_mariadb_migrates_each_consumers_inbox").await else {
        return;
    };
    let (pool, _) = four_events(&db).await;
    let path = db.dir.join("outbox.toml");
    std::fs::write(&path, "[[consumers]]\nname = \"billing\"\n").expect("config");
    let config = path.to_str().unwrap();
    let tables = "SELECT COUNT(*) FROM information_schema.tables \
                  WHERE table_schema = DATABASE() AND table_name LIKE 'processed\\_events%'";
    assert_eq!(count(&pool, tables).await, 0, "no inbox before");

    let sql = db.outbox(
        &db.url(),
        &[],
        &["--config", config, "migrate", "--inbox", "--print-sql"],
    );
    assert!(sql.status.success(), "{}", text(&sql));
    assert!(
        String::from_utf8_lossy(&sql.stdout).contains("processed_events"),
        "{}",
        text(&sql)
    );
    assert_eq!(count(&pool, tables).await, 0, "--print-sql changes nothing");

    let first = json(&db.outbox(
        &db.url(),
        &[],
        &["--json", "--config", config, "migrate", "--inbox"],
    ));
    assert_eq!(
        first["outbox"]["applied"], 0,
        "the outbox was migrated already: {first:#}"
    );
    assert_eq!(first["inboxes"][0]["consumer"], "billing", "{first:#}");
    assert!(
        first["inboxes"][0]["applied"].as_u64().unwrap_or(0) >= 1,
        "{first:#}"
    );
    assert!(count(&pool, tables).await >= 1, "the inbox's tables exist");
    let again = json(&db.outbox(
        &db.url(),
        &[],
        &["--json", "--config", config, "migrate", "--inbox"],
    ));
    assert_eq!(
        again["inboxes"][0]["applied"], 0,
        "second run changes nothing: {again:#}"
    );

    let status = json(&db.outbox(&db.url(), &[], &["--json", "--config", config, "status"]));
    assert_eq!(status["consumers"][0]["name"], "billing", "{status:#}");
    assert!(
        status["consumers"][0]["parked_error"].is_null(),
        "the migrated inbox is read: {status:#}"
    );
    assert_eq!(
        count(&pool, "SELECT COUNT(*) FROM outbox_events").await,
        4,
        "the outbox was not touched"
    );
    db.drop().await;
}

/// Moves the creation time of `event` `hours` back.
async fn created_hours_ago(pool: &MySqlPool, event: &Envelope, hours: i64) {
    let n = sqlx::query(
        "UPDATE outbox_events SET created_at = UTC_TIMESTAMP(6) - INTERVAL ? HOUR \
         WHERE event_id = ?",
    )
    .bind(hours)
    .bind(event.event_id.as_uuid().as_bytes().to_vec())
    .execute(pool)
    .await
    .expect("backdate")
    .rows_affected();
    assert_eq!(n, 1, "one row backdated");
}

/// `reconcile` on a MySQL outbox: the last hour (a and b, published) reconciles (exit 0); from
/// four hours back, the interval three hours ago holds the parked c and the overdue d and is
/// a mismatch (exit 1) with both reasons; checks in the configuration are refused with exit 2
/// instead of being left out silently (consumers are compared: `mysql_ops.rs`).
#[tokio::test]
async fn reconcile_on_mariadb_compares_the_outbox_side() {
    let Some(db) = Db::new("reconcile_on_mariadb_compares_the_outbox_side").await else {
        return;
    };
    let (pool, events) = four_events(&db).await;
    created_hours_ago(&pool, &events[2], 3).await;
    created_hours_ago(&pool, &events[3], 3).await;
    let grace = [("OUTBOX_RECONCILE__GRACE", "1m")];

    let recent = json(&db.outbox(
        &db.url(),
        &grace,
        &["--json", "reconcile", "--since", "1h", "--interval", "1h"],
    ));
    assert_eq!(recent["ok"], true, "{recent:#}");
    let rows = recent["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 1, "{recent:#}");
    assert_eq!(rows[0]["event_type"], "order.created", "{recent:#}");
    assert_eq!(rows[0]["events"], 2, "{recent:#}");
    assert_eq!(rows[0]["published"], 2, "{recent:#}");

    let out = db.outbox(
        &db.url(),
        &grace,
        &["--json", "reconcile", "--since", "4h", "--interval", "1h"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(doc["ok"], false, "{doc:#}");
    assert_eq!(doc["mismatched_rows"], 1, "{doc:#}");
    let rows = doc["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2, "{doc:#}");
    let old = &rows[0];
    assert_eq!(old["events"], 2, "{doc:#}");
    assert_eq!(old["published"], 0, "{doc:#}");
    assert_eq!(old["parked"], 1, "{doc:#}");
    assert_eq!(old["overdue"], 1, "{doc:#}");
    let reasons = old["mismatches"].to_string();
    assert!(reasons.contains("1 event(s) parked"), "{doc:#}");
    assert!(
        reasons.contains("1 event(s) not published after 1m"),
        "{doc:#}"
    );
    assert_eq!(rows[1]["mismatches"].as_array().map(Vec::len), Some(0));

    // Checks run on PostgreSQL only: refused, not skipped.
    let path = db.dir.join("outbox.toml");
    std::fs::write(
        &path,
        "[[reconcile.checks]]\nevent_type = \"order.created\"\nquery = \"SELECT 1\"\n",
    )
    .expect("config");
    let out = db.outbox(
        &db.url(),
        &[],
        &[
            "--config",
            path.to_str().unwrap(),
            "reconcile",
            "--since",
            "1h",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("does not run [[reconcile.checks]] yet"),
        "{}",
        text(&out)
    );
    db.drop().await;
}

/// `replay` on a MySQL outbox: the dry run counts the two published events; the replay sends
/// exactly them (not the parked or the pending one), in publication order, to the configured
/// topic, each with its own event id and the replay's header; a selection of the parked
/// aggregate matches nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_on_mariadb_republishes_the_published_events() {
    let test = "replay_on_mariadb_republishes_the_published_events";
    let Some(brokers) = outbox_test_support::brokers(test) else {
        return;
    };
    let Some(db) = Db::new(test).await else {
        return;
    };
    let (_pool, events) = four_events(&db).await;
    let topic = outbox_test_support::unique("replay");
    common::create_topic(&brokers, &topic, 1, &[]).await;
    let kafka = [
        ("KAFKA_BROKERS", brokers.as_str()),
        ("OUTBOX_KAFKA__TOPIC", topic.as_str()),
        ("OUTBOX_KAFKA__DELIVERY_TIMEOUT", "10s"),
    ];

    let dry = json(&db.outbox(
        &db.url(),
        &kafka,
        &["--json", "replay", "--since", "1h", "--dry-run"],
    ));
    assert_eq!(dry["matched"], 2, "{dry:#}");
    assert_eq!(dry["replayed"], 0, "{dry:#}");
    let parked = json(&db.outbox(
        &db.url(),
        &kafka,
        &["--json", "replay", "--aggregate-id", "c", "--yes"],
    ));
    assert_eq!(
        parked["matched"], 0,
        "parked events are not replayed: {parked:#}"
    );

    let done = json(&db.outbox(
        &db.url(),
        &kafka,
        &[
            "--json",
            "replay",
            "--since",
            "1h",
            "--yes",
            "--batch-size",
            "1",
        ],
    ));
    assert_eq!(done["matched"], 2, "{done:#}");
    assert_eq!(done["replayed"], 2, "{done:#}");
    let replay_id = done["replay_id"].as_str().expect("replay id").to_owned();
    let records = common::read_topic(&brokers, &topic, 1, 2);
    assert_eq!(records.len(), 2, "{records:#?}");
    let ids: Vec<&str> = records.iter().map(|r| r.event_id.as_str()).collect();
    let expected: Vec<String> = events[..2].iter().map(|e| e.event_id.to_string()).collect();
    assert_eq!(ids, expected, "a then b, as published");
    assert!(
        records
            .iter()
            .all(|r| r.headers.get("outbox_replay") == Some(&replay_id)),
        "{records:#?}"
    );
    assert_eq!(records[0].aggregate_id, "a");
    db.drop().await;
}
