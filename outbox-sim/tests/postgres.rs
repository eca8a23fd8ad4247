//! The same properties against a real PostgreSQL server: `outbox-postgres`'s outbox store and
//! inbox, one schema per case, real time (short leases), fewer cases.
//!
//! Needs `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`; `scripts/test`
//! provides it). `OUTBOX_SIM_PG_CASES` sets the number of cases (default 6),
//! `OUTBOX_SIM_SEED` replays a printed seed. Skipped only with `OUTBOX_SKIP_SERVICE_TESTS=1`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_sim::{describe, run_property, NoEffect, PostgresBackend, SimConfig, Simulation, Touch};
use proptest::test_runner::TestError;
use sqlx::postgres::PgPoolOptions;

const CASES_ENV: &str = "OUTBOX_SIM_PG_CASES";

fn schema_name() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("time after 1970")
        .as_secs();
    format!(
        "osim_{secs}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// Drops this test's schemas and those that interrupted runs left (older than an hour).
fn drop_schemas(url: &str, ours: &[String]) {
    let rt = outbox_sim::runtime();
    rt.block_on(async {
        let Ok(pool) = PgPoolOptions::new().max_connections(1).connect(url).await else {
            return;
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("time after 1970")
            .as_secs();
        let names: Vec<String> = sqlx::query_scalar(
            "SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'osim\\_%'",
        )
        .fetch_all(&pool)
        .await
        .unwrap_or_default();
        for name in names {
            let stale = name
                .split('_')
                .nth(1)
                .and_then(|s| s.parse::<u64>().ok())
                .is_some_and(|t| now.saturating_sub(t) > 3600);
            if stale || ours.contains(&name) {
                let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                    .execute(&pool)
                    .await;
            }
        }
    });
}

#[test]
fn simulation_holds_every_invariant_on_postgres() {
    let Some(url) =
        outbox_test_support::database_url("simulation_holds_every_invariant_on_postgres")
    else {
        return;
    };
    let cases = std::env::var(CASES_ENV)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(6);
    let config = SimConfig::default()
        .timing(
            Duration::from_secs(4),
            Duration::from_millis(500),
            (Duration::from_millis(10), Duration::from_millis(40)),
        )
        .fixed_cases(cases)
        .max_steps(40)
        .max_shrink_iters(20);
    let schemas = Arc::new(Mutex::new(Vec::new()));
    let c = config.clone();
    let result = run_property(&config, None, |modes| {
        let schema = schema_name();
        schemas.lock().expect("not poisoned").push(schema.clone());
        let url = url.clone();
        Simulation::new(
            c.clone(),
            modes,
            move |rt, mode| {
                rt.block_on(async {
                    let pool = PgPoolOptions::new()
                        .max_connections(12)
                        .acquire_timeout(Duration::from_secs(10))
                        .connect(&url)
                        .await
                        .expect("PostgreSQL reachable");
                    PostgresBackend::new(pool, &schema, mode)
                        .await
                        .expect("schema created")
                })
            },
            NoEffect,
            vec![Box::new(Touch)],
        )
    });
    drop_schemas(&url, &schemas.lock().expect("not poisoned"));
    if let Err(e) = result {
        match &e {
            TestError::Fail(reason, case) => panic!("{reason}\n{}", describe(case)),
            TestError::Abort(reason) => panic!("aborted: {reason}"),
        }
    }
}
