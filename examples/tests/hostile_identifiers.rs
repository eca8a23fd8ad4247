//! Identifiers from configuration (schema, table and topic names) never become SQL or reach a
//! client unchecked: every builder refuses hostile values, and every program in this crate
//! refuses them while parsing its arguments, before it connects anywhere or runs any SQL.
//!
//! The program test needs `DATABASE_URL` (set by `scripts/test`): it keeps a victim table and
//! checks after every run that it still exists. It fails without it unless
//! `OUTBOX_SKIP_SERVICE_TESTS=1`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use outbox_core::StoreErrorKind;
use outbox_kafka::KafkaPublisher;
use outbox_postgres::{PostgresInboxStore, PostgresOutboxStore};
use sqlx::PgPool;

/// Hostile or malformed PostgreSQL identifiers.
fn hostile_sql_names() -> Vec<String> {
    vec![
        r#"x"; DROP TABLE victim; --"#.to_owned(),
        "public.victim".to_owned(),
        "Upper".to_owned(),
        String::new(),
        "a".repeat(64),
        "pg_catalog".to_owned(),
        "x y".to_owned(),
        "victim;".to_owned(),
    ]
}

/// Hostile or malformed Kafka topic names.
fn hostile_topics() -> Vec<String> {
    vec![
        r#"x"; DROP TABLE victim; --"#.to_owned(),
        String::new(),
        "..".to_owned(),
        "orders topic".to_owned(),
        "orders/../x".to_owned(),
        "^orders.*".to_owned(),
        "t".repeat(250),
    ]
}

#[tokio::test]
async fn every_builder_refuses_hostile_identifiers() {
    // A pool that never connects: a refused name must not need (or reach) a database.
    let pool = PgPool::connect_lazy("postgres://nobody@127.0.0.1:1/nowhere").unwrap();
    for bad in hostile_sql_names() {
        let refusals = [
            (
                "PostgresOutboxStoreBuilder::schema",
                PostgresOutboxStore::builder(pool.clone())
                    .schema(bad.clone())
                    .build()
                    .err(),
            ),
            (
                "PostgresOutboxStoreBuilder::table",
                PostgresOutboxStore::builder(pool.clone())
                    .table(bad.clone())
                    .build()
                    .err(),
            ),
            (
                "PostgresInboxStoreBuilder::schema",
                PostgresInboxStore::builder(pool.clone())
                    .schema(bad.clone())
                    .build()
                    .err(),
            ),
            (
                "PostgresInboxStoreBuilder::table",
                PostgresInboxStore::builder(pool.clone())
                    .table(bad.clone())
                    .build()
                    .err(),
            ),
        ];
        for (what, err) in refusals {
            let err = err.unwrap_or_else(|| panic!("{what} accepted {bad:?}"));
            assert_eq!(err.kind, StoreErrorKind::Configuration, "{what} {bad:?}");
            assert!(
                err.message.contains(&format!("{bad:?}")),
                "{what}: the refusal does not name {bad:?}: {err}"
            );
        }
        let arg = outbox_examples::cli::parse_schema(&bad).expect_err(&bad);
        assert!(arg.contains("invalid schema name"), "{arg}");
    }
    // Tables must leave room for derived names (`<table>_archive`, ...): 41 bytes is too long.
    assert!(PostgresOutboxStore::builder(pool.clone())
        .table("t".repeat(41))
        .build()
        .is_err());
    assert_eq!(pool.size(), 0, "nothing connected");

    for bad in hostile_topics() {
        let err = KafkaPublisher::builder("127.0.0.1:1", bad.clone())
            .build()
            .expect_err(&bad)
            .to_string();
        assert!(
            err.contains("not a valid Kafka topic name"),
            "{bad:?}: {err}"
        );
        assert!(
            KafkaPublisher::builder("127.0.0.1:1", "orders")
                .route_aggregate("order", bad.clone())
                .build()
                .is_err(),
            "route to {bad:?}"
        );
        let arg = outbox_examples::cli::parse_topic(&bad).expect_err(&bad);
        assert!(arg.contains("not a valid Kafka topic name"), "{arg}");
    }
}

/// Runs `exe` with `args` and returns (success, stderr); a program still running after 30 s
/// (it went past its arguments) is killed and reported as such.
fn run(exe: &str, args: &[&str]) -> (bool, String) {
    let mut child = Command::new(exe)
        .args(args)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let out = child.wait_with_output().expect("output");
            return (
                status.success(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            );
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{exe} {args:?} was still running after 30 s: it did not refuse its arguments");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_program_refuses_hostile_identifiers_before_any_sql() {
    let Some(url) = outbox_test_support::required_var(module_path!(), "DATABASE_URL") else {
        return;
    };
    let pool = PgPool::connect(&url).await.expect("connect");
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let vs = format!("hostile_{run_id}");
    sqlx::raw_sql(&format!(
        "CREATE SCHEMA {vs}; CREATE TABLE {vs}.victim (id int); INSERT INTO {vs}.victim VALUES (1);"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let victim_rows = || {
        let pool = pool.clone();
        let vs = vs.clone();
        async move {
            sqlx::query_scalar::<_, i64>(&format!("SELECT count(*) FROM {vs}.victim"))
                .fetch_one(&pool)
                .await
        }
    };

    let mut schemas = hostile_sql_names();
    // What reproduced the injection: with the value pasted into its CREATE TABLE, the projector
    // dropped the victim table and went on running.
    schemas.push(format!(
        "{vs}.a (i int); DROP TABLE IF EXISTS {vs}.victim; CREATE TABLE IF NOT EXISTS {vs}"
    ));
    let projector = env!("CARGO_BIN_EXE_outbox-projector");
    let demo = env!("CARGO_BIN_EXE_demo");
    let kafka = "127.0.0.1:1";
    for bad in &schemas {
        // `outbox relay` (outbox-cli) has its own hostile-identifier test.
        let cases: [(&str, Vec<&str>); 2] = [
            (
                projector,
                vec![
                    "--database-url",
                    &url,
                    "--brokers",
                    kafka,
                    "--topic",
                    "orders",
                    "--group",
                    "g",
                    "--schema",
                    bad,
                ],
            ),
            (demo, vec!["--database-url", &url, "--schema", bad]),
        ];
        for (exe, args) in cases {
            let (ok, stderr) = run(exe, &args);
            assert!(!ok, "{exe} accepted --schema {bad:?}");
            assert!(
                stderr.contains("--schema") && stderr.contains("invalid schema name"),
                "{exe} --schema {bad:?}: no clear message in {stderr:?}"
            );
            assert_eq!(
                victim_rows().await.expect("the victim table is gone"),
                1,
                "{exe} --schema {bad:?}"
            );
        }
    }
    for bad in hostile_topics() {
        let exe = projector;
        let args = [
            "--database-url",
            &url,
            "--brokers",
            kafka,
            "--group",
            "g",
            "--schema",
            &vs,
            "--topic",
            bad.as_str(),
        ];
        let (ok, stderr) = run(exe, &args);
        assert!(!ok, "{exe} accepted --topic {bad:?}");
        assert!(
            stderr.contains("--topic") && stderr.contains("not a valid Kafka topic name"),
            "{exe} --topic {bad:?}: no clear message in {stderr:?}"
        );
    }
    // A valid name of a schema that exists is not the demo's to create, nor to drop.
    let (ok, stderr) = run(demo, &["--database-url", &url, "--schema", &vs]);
    assert!(!ok, "the demo took over the existing schema {vs}");
    assert!(stderr.contains("already exists"), "{stderr:?}");
    assert_eq!(victim_rows().await.unwrap(), 1);
    sqlx::raw_sql(&format!("DROP SCHEMA {vs} CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
}
