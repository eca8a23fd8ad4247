//! `outbox migrate`, `outbox relay` and `outbox check` on a `mysql://` URL, driven as a user
//! runs them against MariaDB: migrations applied once and named, the relay daemon draining the
//! outbox to a Kafka-protocol broker with `/readyz`, `/metrics` and SIGTERM as on PostgreSQL,
//! and the failures with their exit codes and fixes (unreachable server, missing tables,
//! missing grants with the exact `GRANT` statements, checked by running them).
//!
//! Needs `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`; each test creates its own
//! database, and a test user where it needs one, and drops them) and, for the relay tests,
//! `KAFKA_BROKERS` (`scripts/test`; `source scripts/services.sh; ensure_kafka`).

mod common;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{text, Daemon};
use outbox_core::{ClaimMode, Envelope};
use outbox_mysql::sqlx::{self, mysql::MySqlPoolOptions, MySqlPool};
use outbox_mysql::MySqlOutboxStore;

/// A fresh database on the server of `MYSQL_URL`, and the users a test created.
struct Db {
    admin: MySqlPool,
    name: String,
    base: String,
    dir: PathBuf,
    users: Vec<String>,
    databases: Vec<String>,
}

impl Db {
    async fn new(test: &str) -> Option<Self> {
        let base = outbox_test_support::mysql_url(test)?;
        let admin = MySqlPoolOptions::new()
            .max_connections(2)
            .connect(&base)
            .await
            .expect("MariaDB answers at MYSQL_URL");
        let name = outbox_test_support::unique("orelay");
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
            users: Vec::new(),
            databases: Vec::new(),
        })
    }

    /// The server's `host:port`.
    fn host(&self) -> String {
        let tail = self.base.split_once("://").expect("scheme").1;
        let host = tail.split(['/', '?']).next().unwrap_or(tail);
        host.rsplit_once('@').map_or(host, |(_, h)| h).to_owned()
    }

    /// The server's URL with this database as its path.
    fn url(&self) -> String {
        let (head, tail) = self.base.split_once("://").expect("MYSQL_URL has a scheme");
        let host = tail.split(['/', '?']).next().unwrap_or(tail);
        format!("{head}://{host}/{}", self.name)
    }

    /// A user with `password` that holds only what `grants` give it (statements with `{db}`
    /// for this database and `{user}` for the account); dropped by [`Db::drop`].
    async fn user(&mut self, grants: &[&str]) -> (String, String) {
        let user = format!("u{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let password = "relay-test-pw";
        sqlx::query(&format!(
            "CREATE USER '{user}'@'%' IDENTIFIED BY '{password}'"
        ))
        .execute(&self.admin)
        .await
        .expect("create user");
        self.users.push(user.clone());
        for g in grants {
            let sql = g
                .replace("{db}", &self.name)
                .replace("{user}", &format!("'{user}'@'%'"));
            sqlx::query(&sql).execute(&self.admin).await.expect(g);
        }
        let url = format!("mysql://{user}:{password}@{}/{}", self.host(), self.name);
        (user, url)
    }

    /// `outbox <args>` with `DATABASE_URL` = `url`, in an empty directory.
    fn outbox(&self, url: &str, envs: &[(&str, &str)], args: &[&str]) -> Output {
        self.cmd(url, envs, args)
            .stdin(Stdio::null())
            .output()
            .expect("run outbox")
    }

    fn cmd(&self, url: &str, envs: &[(&str, &str)], args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_outbox"));
        c.current_dir(&self.dir)
            .env_remove("RUST_LOG")
            .env_remove("OUTBOX_CONFIG")
            .env_remove("KAFKA_BROKERS")
            .env_remove("OUTBOX_OUTBOX__SCHEMA")
            .env("DATABASE_URL", url)
            .envs(envs.iter().copied())
            .args(args);
        c
    }

    async fn pool(&self) -> MySqlPool {
        MySqlPoolOptions::new()
            .max_connections(2)
            .connect(&self.url())
            .await
            .expect("connect")
    }

    async fn tables(&self, database: &str) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = ? \
             ORDER BY TABLE_NAME",
        )
        .bind(database)
        .fetch_all(&self.admin)
        .await
        .expect("tables")
    }

    async fn drop(self) {
        for u in &self.users {
            let _ = sqlx::query(&format!("DROP USER '{u}'@'%'"))
                .execute(&self.admin)
                .await;
        }
        for d in self.databases.iter().chain([&self.name]) {
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS `{d}`"))
                .execute(&self.admin)
                .await;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(out)))
}

/// The `GRANT` statements in a message, one per line as the CLI prints them.
fn grants(s: &str) -> Vec<String> {
    s.lines()
        .map(str::trim)
        .filter(|l| l.starts_with("GRANT "))
        .map(|l| l.trim_end_matches(';').to_owned())
        .collect()
}

/// `migrate` applies outbox-mysql's migration once and names it; a second run applies none;
/// `outbox.schema` naming another database creates it there; `--print-sql` prints the DDL and
/// creates nothing; `--inbox` is refused (exit 2); an unreachable server exits 3, a missing
/// database or a refused user exits 2, each naming the cause.
#[tokio::test]
async fn migrate_on_mariadb_applies_each_migration_once_and_names_it() {
    let Some(mut db) = Db::new("migrate_on_mariadb_applies_each_migration_once_and_names_it").await
    else {
        return;
    };
    let printed = db.outbox(&db.url(), &[], &["migrate", "--print-sql"]);
    assert!(printed.status.success(), "{}", text(&printed));
    let sql = String::from_utf8_lossy(&printed.stdout);
    assert!(
        sql.contains("CREATE TABLE IF NOT EXISTS `outbox_events` ("),
        "{sql}"
    );
    assert!(
        db.tables(&db.name).await.is_empty(),
        "--print-sql applies nothing"
    );

    let first = db.outbox(&db.url(), &[], &["--json", "migrate"]);
    assert!(first.status.success(), "{}", text(&first));
    let doc = json(&first);
    let known = outbox_mysql::outbox_migrations();
    assert_eq!(doc["outbox"]["applied"], known.len(), "{doc:#}");
    assert_eq!(doc["outbox"]["version"], known.last().unwrap().0, "{doc:#}");
    assert_eq!(doc["outbox"]["schema"], db.name.as_str(), "{doc:#}");
    assert_eq!(doc["outbox"]["migrations"][0]["version"], 1, "{doc:#}");
    assert_eq!(doc["outbox"]["migrations"][1]["version"], 2, "{doc:#}");
    assert_eq!(doc["outbox"]["migrations"][2]["version"], 3, "{doc:#}");
    assert_eq!(
        db.tables(&db.name).await,
        [
            "outbox_events",
            "outbox_events_aggregate",
            "outbox_events_archive",
            "outbox_events_audit",
            "outbox_events_lease",
            "outbox_events_relays",
            "outbox_schema_migrations"
        ]
    );
    let again = db.outbox(&db.url(), &[], &["migrate"]);
    assert!(again.status.success(), "{}", text(&again));
    assert!(
        String::from_utf8_lossy(&again.stdout)
            .contains("0 migration(s) applied (up to date at version 4)"),
        "{}",
        text(&again)
    );

    // outbox.schema names the database on MySQL: created, and the migration named.
    let other = format!("{}_x", db.name);
    db.databases.push(other.clone());
    let out = db.outbox(
        &db.url(),
        &[("OUTBOX_OUTBOX__SCHEMA", other.as_str())],
        &["migrate"],
    );
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("outbox {other}.outbox_events on "))
            && stdout.contains(&format!(
                "{} migration(s) applied",
                outbox_mysql::outbox_migrations().len()
            ))
            && stdout.contains("applied 1: outbox table, per-aggregate state, audit, archive")
            && stdout.contains("applied 2: transport-neutral acknowledgement columns"),
        "{stdout}"
    );
    assert_eq!(
        db.tables(&other).await.len(),
        7,
        "with <table>_lease and <table>_relays"
    );

    // `--inbox` without consumers migrates the outbox only (tests/mysql.rs migrates one).
    let inbox = db.outbox(&db.url(), &[], &["migrate", "--inbox"]);
    assert!(inbox.status.success(), "{}", text(&inbox));
    assert!(
        String::from_utf8_lossy(&inbox.stdout).contains("(up to date"),
        "{}",
        text(&inbox)
    );

    let port = outbox_test_support::free_port();
    let nowhere = db.outbox(
        &format!("mysql://root@127.0.0.1:{port}/x"),
        &[],
        &["migrate"],
    );
    assert_eq!(nowhere.status.code(), Some(3), "{}", text(&nowhere));
    assert!(
        String::from_utf8_lossy(&nowhere.stderr)
            .contains(&format!("cannot connect to MySQL at 127.0.0.1:{port}")),
        "{}",
        text(&nowhere)
    );
    let missing_db = db.url().replace(&db.name, &format!("{}_none", db.name));
    let out = db.outbox(&missing_db, &[], &["migrate"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("has no database"),
        "{}",
        text(&out)
    );
    let stranger = format!(
        "mysql://nobody_{}:x@{}/{}",
        std::process::id(),
        db.host(),
        db.name
    );
    let out = db.outbox(&stranger, &[], &["migrate"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("refused user"),
        "{}",
        text(&out)
    );
    db.drop().await;
}

/// `check --no-broker` on MariaDB: without the tables a violation names the pending migration
/// and `outbox migrate` (exit 1); migrated, the schema version, the privileges and the
/// server's durability settings are reported ok (exit 0); a user that lacks grants gets the
/// exact `GRANT` statements, and once they are run as root the same user passes; an
/// unreachable server is a violation.
#[tokio::test]
async fn check_on_mariadb_reports_schema_grants_and_durability() {
    let Some(mut db) = Db::new("check_on_mariadb_reports_schema_grants_and_durability").await
    else {
        return;
    };
    let finding = |doc: &serde_json::Value, check: &str, severity: &str| -> Vec<String> {
        doc["findings"]
            .as_array()
            .expect("findings")
            .iter()
            .filter(|f| f["check"] == check && f["severity"] == severity)
            .map(|f| format!("{} | {}", f["message"], f["fix"]))
            .collect()
    };
    let bare = db.outbox(&db.url(), &[], &["--json", "check", "--no-broker"]);
    assert_eq!(bare.status.code(), Some(1), "{}", text(&bare));
    let doc = json(&bare);
    assert_eq!(doc["ok"], false);
    let missing = finding(&doc, "database", "error");
    assert_eq!(missing.len(), 1, "{doc:#}");
    assert!(
        missing[0].contains("does not exist")
            && missing[0]
                .contains("pending: 1 (outbox table, per-aggregate state, audit, archive)")
            && missing[0].contains("outbox migrate"),
        "{missing:?}"
    );

    assert!(db.outbox(&db.url(), &[], &["migrate"]).status.success());
    let ok = db.outbox(&db.url(), &[], &["--json", "check", "--no-broker"]);
    assert_eq!(ok.status.code(), Some(0), "{}", text(&ok));
    let doc = json(&ok);
    assert_eq!(doc["ok"], true, "{doc:#}");
    let database = finding(&doc, "database", "ok");
    assert!(
        database[0].contains("at schema version 4 of 4, privileges in place"),
        "{database:?}"
    );
    // This server flushes at each commit (read, never changed by the tests): ok; the unsafe
    // values are covered by the unit test of the decision (`outbox_cli::mysql`).
    let durability = finding(&doc, "durability", "ok").join("\n");
    for says in [
        "innodb_flush_log_at_trx_commit: innodb_flush_log_at_trx_commit = 1",
        "server_version:",
        "isolation: server default isolation",
    ] {
        assert!(durability.contains(says), "{says}: {doc:#}");
    }
    assert!(finding(&doc, "durability", "error").is_empty(), "{doc:#}");

    // A user that may read the migration log only.
    let (_user, limited) = db
        .user(&["GRANT SELECT ON `{db}`.`outbox_schema_migrations` TO {user}"])
        .await;
    let denied = db.outbox(&limited, &[], &["--json", "check", "--no-broker"]);
    assert_eq!(denied.status.code(), Some(1), "{}", text(&denied));
    let doc = json(&denied);
    let lacking = finding(&doc, "database", "error");
    assert_eq!(lacking.len(), 1, "{doc:#}");
    assert!(
        lacking[0].contains("lacks privileges on the outbox"),
        "{lacking:?}"
    );
    let fix = doc["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["check"] == "database")
        .and_then(|f| f["fix"].as_str())
        .expect("fix")
        .to_owned();
    let statements = grants(&fix);
    assert_eq!(statements.len(), 5, "{fix}");
    assert!(
        statements[0].starts_with(&format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON `{}`.`outbox_events` TO '",
            db.name
        )),
        "{statements:?}"
    );
    // The statements, run as printed, are exactly what was missing.
    for g in &statements {
        sqlx::query(g).execute(&db.admin).await.expect(g);
    }
    let granted = db.outbox(&limited, &[], &["--json", "check", "--no-broker"]);
    assert_eq!(granted.status.code(), Some(0), "{}", text(&granted));

    // Privileges through a role, which information_schema does not show: not refused, the
    // statements are a warning.
    let role = format!("r{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    sqlx::query(&format!("CREATE ROLE {role}"))
        .execute(&db.admin)
        .await
        .expect("role");
    for g in &statements {
        let to_role = g.replace(&g[g.find(" TO ").unwrap()..], &format!(" TO {role}"));
        sqlx::query(&to_role)
            .execute(&db.admin)
            .await
            .expect(&to_role);
    }
    let (through_role, via_role) = db
        .user(&[
            "GRANT SELECT ON `{db}`.`outbox_schema_migrations` TO {user}",
            &format!("GRANT {role} TO {{user}}"),
        ])
        .await;
    sqlx::query(&format!("SET DEFAULT ROLE {role} FOR '{through_role}'@'%'"))
        .execute(&db.admin)
        .await
        .expect("default role");
    let with_role = db.outbox(&via_role, &[], &["--json", "check", "--no-broker"]);
    let _ = sqlx::query(&format!("DROP ROLE {role}"))
        .execute(&db.admin)
        .await;
    assert_eq!(with_role.status.code(), Some(0), "{}", text(&with_role));
    let stderr = String::from_utf8_lossy(&with_role.stderr);
    assert!(
        stderr.contains(&format!("has role \"{role}\" active")) && grants(&stderr).len() == 5,
        "{}",
        text(&with_role)
    );

    let port = outbox_test_support::free_port();
    let nowhere = db.outbox(
        &format!("mysql://root@127.0.0.1:{port}/x"),
        &[],
        &["--json", "check", "--no-broker"],
    );
    assert_eq!(nowhere.status.code(), Some(1), "{}", text(&nowhere));
    let doc = json(&nowhere);
    assert!(
        finding(&doc, "database", "error")[0].contains("cannot connect to MySQL"),
        "{doc:#}"
    );
    db.drop().await;
}

/// Start-up failures of `outbox relay` on a `mysql://` URL, with the exit codes of
/// PostgreSQL: a configuration error exits 2 before the network (the server is unreachable
/// too); an unreachable server exits 3; missing tables exit 4 naming `outbox migrate`; a user
/// without grants exits 4 with the exact statements. No broker needed: each fails before one.
#[tokio::test]
async fn relay_on_mariadb_fails_fast_with_the_fix() {
    let Some(mut db) = Db::new("relay_on_mariadb_fails_fast_with_the_fix").await else {
        return;
    };
    let broker = [("KAFKA_BROKERS", "127.0.0.1:9")];
    let port = outbox_test_support::free_port();
    let nowhere = format!("mysql://root@127.0.0.1:{port}/x");
    let out = db.outbox(
        &nowhere,
        &broker,
        &[
            "relay",
            "--no-http",
            "--lease",
            "5s",
            "--delivery-timeout",
            "30s",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("relay configuration refused"),
        "{}",
        text(&out)
    );
    let out = db.outbox(&nowhere, &broker, &["relay", "--no-http"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains(&format!("cannot connect to MySQL at 127.0.0.1:{port}")),
        "{}",
        text(&out)
    );

    let out = db.outbox(&db.url(), &broker, &["relay", "--no-http"]);
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("outbox_events does not exist") && stderr.contains("run `outbox migrate`"),
        "{}",
        text(&out)
    );

    assert!(db.outbox(&db.url(), &[], &["migrate"]).status.success());
    let (user, limited) = db
        .user(&[
            "GRANT SELECT ON `{db}`.`outbox_schema_migrations` TO {user}",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON `{db}`.`outbox_events` TO {user}",
        ])
        .await;
    let out = db.outbox(&limited, &broker, &["relay", "--no-http"]);
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        grants(&stderr),
        [
            format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON `{}`.`outbox_events_aggregate` TO '{user}'@'%'",
                db.name
            ),
            format!(
                "GRANT SELECT, INSERT ON `{}`.`outbox_events_audit` TO '{user}'@'%'",
                db.name
            ),
            format!(
                "GRANT SELECT, INSERT, DELETE ON `{}`.`outbox_events_lease` TO '{user}'@'%'",
                db.name
            ),
            format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON `{}`.`outbox_events_relays` TO '{user}'@'%'",
                db.name
            ),
        ],
        "{}",
        text(&out)
    );
    // A user that may not even read the migration log: denied there (not "missing"), and
    // given every statement, the log's first.
    let (other, no_log) = db
        .user(&["GRANT SELECT ON `{db}`.`outbox_events` TO {user}"])
        .await;
    let out = db.outbox(&no_log, &broker, &["relay", "--no-http"]);
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    let stated = grants(&String::from_utf8_lossy(&out.stderr));
    assert_eq!(stated.len(), 6, "{}", text(&out));
    assert_eq!(
        stated[0],
        format!(
            "GRANT SELECT ON `{}`.`outbox_schema_migrations` TO '{other}'@'%'",
            db.name
        )
    );
    assert!(
        stated[1].starts_with("GRANT INSERT, UPDATE, DELETE ON "),
        "{stated:?}"
    );
    db.drop().await;
}

/// The daemon of a `mysql://` URL, relaying to the broker of `KAFKA_BROKERS`.
fn spawn_relay(db: &Db, url: &str, brokers: &str, topic: &str, args: &[&str]) -> Daemon {
    spawn_relay_env(db, url, brokers, topic, &[], args)
}

/// [`spawn_relay`] with extra environment variables.
fn spawn_relay_env(
    db: &Db,
    url: &str,
    brokers: &str,
    topic: &str,
    envs: &[(&str, &str)],
    args: &[&str],
) -> Daemon {
    let port = outbox_test_support::free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut all = vec![
        ("KAFKA_BROKERS", brokers),
        ("OUTBOX_KAFKA__TOPIC", topic),
        ("OUTBOX_RELAY__STATS_INTERVAL", "500ms"),
    ];
    all.extend_from_slice(envs);
    let child = db
        .cmd(url, &all, &["relay", "--listen", &listen])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn outbox relay");
    Daemon { child, port }
}

async fn count(pool: &MySqlPool, status: &str) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM outbox_events WHERE status = ?")
        .bind(status)
        .fetch_one(pool)
        .await
        .expect("count")
}

/// `events` appended (three versions of `aggregates` aggregates) through the library.
async fn append(pool: &MySqlPool, aggregates: usize, versions: i64) -> Vec<Envelope> {
    let store = MySqlOutboxStore::builder(pool.clone())
        .claim_mode(ClaimMode::lease(Duration::from_secs(30)).unwrap())
        .build()
        .expect("store");
    let mut all = Vec::new();
    for v in 1..=versions {
        let events: Vec<Envelope> = (0..aggregates)
            .map(|a| {
                Envelope::builder("order", format!("order-{a}"), v, "order.changed")
                    .build()
                    .unwrap()
            })
            .collect();
        store.append_many(pool, &events).await.expect("append");
        all.extend(events);
    }
    all
}

/// The relay daemon on MariaDB, started by changing only the URL: ready, drains every event
/// to the topic (first deliveries in version order per aggregate), fills the metrics from the
/// MySQL store, says once that it polls (no LISTEN/NOTIFY), and stops on SIGTERM with exit 0
/// and its report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_on_mariadb_drains_serves_health_and_metrics_and_stops_on_sigterm() {
    let test = "relay_on_mariadb_drains_serves_health_and_metrics_and_stops_on_sigterm";
    let Some(brokers) = outbox_test_support::brokers(test) else {
        return;
    };
    let Some(db) = Db::new(test).await else {
        return;
    };
    let topic = db.name.replace('_', "-");
    common::create_topic(&brokers, &topic, 3, &[]).await;
    assert!(db.outbox(&db.url(), &[], &["migrate"]).status.success());
    // The whole check, the broker's side included (no topic facts recorded on MySQL).
    let checked = db.outbox(
        &db.url(),
        &[
            ("KAFKA_BROKERS", brokers.as_str()),
            ("OUTBOX_KAFKA__TOPIC", topic.as_str()),
        ],
        &["--json", "check"],
    );
    assert_eq!(checked.status.code(), Some(0), "{}", text(&checked));
    let doc = json(&checked);
    assert!(
        doc["findings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["check"] == "topic"
                && f["severity"] == "ok"
                && f["message"]
                    .as_str()
                    .unwrap()
                    .starts_with(&format!("{topic}: 3 partition(s)"))),
        "{doc:#}"
    );
    let pool = db.pool().await;
    let events = append(&pool, 20, 3).await;
    let mut relay = spawn_relay(
        &db,
        &db.url(),
        &brokers,
        &topic,
        &["--workers", "2", "--batch-size", "16"],
    );
    relay.wait_ready(Duration::from_secs(30));
    assert_eq!(relay.get("/healthz").map(|r| r.0), Some(200));
    let deadline = Instant::now() + Duration::from_secs(60);
    while count(&pool, "published").await < events.len() as i64 {
        assert!(Instant::now() < deadline, "not drained");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let n = events.len() as f64;
    let wait = Duration::from_secs(10);
    relay.wait_metric("outbox_published_total", "", |v| v >= n, wait);
    relay.wait_metric("outbox_publish_latency_seconds_count", "", |v| v >= n, wait);
    relay.wait_metric("outbox_claim_seconds_count", "", |v| v > 0.0, wait);
    relay.wait_metric("outbox_complete_seconds_count", "", |v| v > 0.0, wait);
    relay.wait_metric("outbox_unpublished", "", |v| v == 0.0, wait);
    relay.wait_metric(
        "outbox_db_pool_connections",
        "state=\"idle\"",
        |v| v >= 1.0,
        wait,
    );
    relay.wait_metric("outbox_relay_up", "", |v| v == 1.0, wait);
    let (code, stdout, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert!(stderr.contains("relay stopped (signal)"), "{stderr}");
    assert!(
        stderr.contains(&format!("{} published", events.len())),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("has no LISTEN/NOTIFY").count(),
        1,
        "said once, as information: {stderr}"
    );
    assert!(!stderr.contains("ERROR"), "{stderr}");
    let records = common::read_topic(&brokers, &topic, 3, events.len());
    let mut firsts: std::collections::BTreeMap<String, Vec<i64>> = Default::default();
    let mut seen = std::collections::HashSet::new();
    for r in &records {
        if seen.insert(r.event_id.clone()) {
            firsts
                .entry(r.aggregate_id.clone())
                .or_default()
                .push(r.version);
        }
    }
    assert_eq!(seen.len(), events.len());
    for (agg, vs) in firsts {
        assert_eq!(vs, vec![1, 2, 3], "{agg}");
    }
    db.drop().await;
}

/// A table dropped under the running relay on MariaDB: it stops with exit 4 naming
/// `outbox migrate`, as on PostgreSQL; `/readyz` says why until it exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_dropped_under_the_relay_on_mariadb_stops_it_with_the_fix() {
    let test = "a_table_dropped_under_the_relay_on_mariadb_stops_it_with_the_fix";
    let Some(brokers) = outbox_test_support::brokers(test) else {
        return;
    };
    let Some(db) = Db::new(test).await else {
        return;
    };
    let topic = db.name.replace('_', "-");
    common::create_topic(&brokers, &topic, 1, &[]).await;
    assert!(db.outbox(&db.url(), &[], &["migrate"]).status.success());
    let pool = db.pool().await;
    let mut relay = spawn_relay(&db, &db.url(), &brokers, &topic, &[]);
    relay.wait_ready(Duration::from_secs(30));
    sqlx::query("DROP TABLE outbox_events_aggregate")
        .execute(&pool)
        .await
        .expect("drop");
    append(&pool, 1, 1).await;
    let (code, _, stderr) = relay.wait(Duration::from_secs(30));
    assert_eq!(code, 4, "{stderr}");
    assert!(
        stderr.contains("outbox schema is missing or out of date")
            && stderr.contains("run `outbox migrate`"),
        "{stderr}"
    );
    db.drop().await;
}

/// The locked-transaction claim of `outbox-mysql` and the scheduled cleanup with archiving,
/// through the daemon on MariaDB: every event published, then archived and removed by the
/// relay's own cleanup in batches; the exit report counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_on_mariadb_in_locked_mode_publishes_then_archives_and_cleans_up() {
    let test = "relay_on_mariadb_in_locked_mode_publishes_then_archives_and_cleans_up";
    let Some(brokers) = outbox_test_support::brokers(test) else {
        return;
    };
    let Some(db) = Db::new(test).await else {
        return;
    };
    let topic = db.name.replace('_', "-");
    common::create_topic(&brokers, &topic, 2, &[]).await;
    assert!(db.outbox(&db.url(), &[], &["migrate"]).status.success());
    let pool = db.pool().await;
    let events = append(&pool, 5, 2).await;
    let mut relay = spawn_relay_env(
        &db,
        &db.url(),
        &brokers,
        &topic,
        &[
            ("OUTBOX_OUTBOX__ARCHIVE", "true"),
            ("OUTBOX_CLEANUP__INTERVAL", "300ms"),
            ("OUTBOX_CLEANUP__RETENTION", "0s"),
            ("OUTBOX_CLEANUP__BATCH_SIZE", "3"),
        ],
        &["--claim-mode", "locked", "--delivery-timeout", "5s"],
    );
    relay.wait_ready(Duration::from_secs(30));
    let n = events.len() as f64;
    relay.wait_metric(
        "outbox_published_total",
        "",
        |v| v >= n,
        Duration::from_secs(30),
    );
    relay.wait_metric(
        "outbox_cleanup_removed_total",
        "",
        |v| v >= n,
        Duration::from_secs(30),
    );
    let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM outbox_events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
    let archived: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM outbox_events_archive WHERE status = 'published'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(archived as usize, events.len());
    let (code, _, stderr) = relay.terminate(Duration::from_secs(30));
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains(&format!("{} published", events.len()))
            && stderr.contains(&format!("{} rows cleaned up", events.len())),
        "{stderr}"
    );
    db.drop().await;
}

/// A privilege revoked under the running relay on MariaDB: it stops with exit 4 and the exact
/// `GRANT` statement for what the user lacks now (read when it stops), as on PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_privilege_revoked_under_the_relay_on_mariadb_is_named_with_its_grant() {
    let test = "a_privilege_revoked_under_the_relay_on_mariadb_is_named_with_its_grant";
    let Some(brokers) = outbox_test_support::brokers(test) else {
        return;
    };
    let Some(mut db) = Db::new(test).await else {
        return;
    };
    let topic = db.name.replace('_', "-");
    common::create_topic(&brokers, &topic, 1, &[]).await;
    assert!(db.outbox(&db.url(), &[], &["migrate"]).status.success());
    let (user, url) = db
        .user(&[
            "GRANT SELECT ON `{db}`.`outbox_schema_migrations` TO {user}",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON `{db}`.`outbox_events` TO {user}",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON `{db}`.`outbox_events_aggregate` TO {user}",
            "GRANT SELECT, INSERT ON `{db}`.`outbox_events_audit` TO {user}",
            "GRANT SELECT, INSERT, DELETE ON `{db}`.`outbox_events_lease` TO {user}",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON `{db}`.`outbox_events_relays` TO {user}",
        ])
        .await;
    let mut relay = spawn_relay(&db, &url, &brokers, &topic, &[]);
    relay.wait_ready(Duration::from_secs(30));
    sqlx::query(&format!(
        "REVOKE INSERT, UPDATE ON `{}`.`outbox_events_aggregate` FROM '{user}'@'%'",
        db.name
    ))
    .execute(&db.admin)
    .await
    .expect("revoke");
    let pool = db.pool().await;
    append(&pool, 1, 1).await;
    let (code, _, stderr) = relay.wait(Duration::from_secs(30));
    assert_eq!(code, 4, "{stderr}");
    assert_eq!(
        grants(&stderr),
        [format!(
            "GRANT INSERT, UPDATE ON `{}`.`outbox_events_aggregate` TO '{user}'@'%'",
            db.name
        )],
        "{stderr}"
    );
    db.drop().await;
}
