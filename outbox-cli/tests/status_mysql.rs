//! `outbox status` against MariaDB: the binary reads the outbox through the reporting role
//! (`outbox_core::ReportingStore`) of `outbox-mysql`, as a user runs it with a `mysql://` URL.
//!
//! Needs `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`); each test creates its own
//! database and drops it at the end.

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
            ack: AckMetadata {
                topic: "orders".into(),
                partition: 0,
                offset: 41,
            },
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
