//! A stand-in for autovacuum on servers that run without it (`autovacuum = off`), for the soak:
//! every `autovacuum_naptime` it applies the server's own autovacuum thresholds to the given
//! tables (`VACUUM` when `n_dead_tup > autovacuum_vacuum_threshold +
//! autovacuum_vacuum_scale_factor * reltuples`, `ANALYZE` when `n_mod_since_analyze >
//! autovacuum_analyze_threshold + autovacuum_analyze_scale_factor * reltuples`), as the
//! autovacuum launcher would with the server's settings, one worker, no cost delay.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::{PgPool, Row};

/// What the stand-in did.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct AutovacCounts {
    pub(crate) vacuums: u64,
    pub(crate) analyzes: u64,
}

/// Runs until `running` turns false. `tables` are `(schema, table)` pairs.
pub(crate) async fn run(
    pool: PgPool,
    tables: Vec<(String, String)>,
    running: Arc<AtomicBool>,
) -> anyhow::Result<AutovacCounts> {
    let naptime: f64 = sqlx::query_scalar(
        "SELECT setting::float8 FROM pg_settings WHERE name = 'autovacuum_naptime'",
    )
    .fetch_one(&pool)
    .await?;
    let mut counts = AutovacCounts::default();
    let mut slept = 0.0;
    while running.load(Ordering::Relaxed) {
        // Wake each second so that the end of the soak is not delayed by a nap.
        tokio::time::sleep(Duration::from_secs(1)).await;
        slept += 1.0;
        if slept < naptime {
            continue;
        }
        slept = 0.0;
        for (schema, table) in &tables {
            let r = sqlx::query(
                "SELECT st.n_dead_tup::float8 AS dead, st.n_mod_since_analyze::float8 AS modified, \
                        GREATEST(c.reltuples, 0)::float8 AS reltuples, \
                        current_setting('autovacuum_vacuum_threshold')::float8 AS vt, \
                        current_setting('autovacuum_vacuum_scale_factor')::float8 AS vs, \
                        current_setting('autovacuum_analyze_threshold')::float8 AS at, \
                        current_setting('autovacuum_analyze_scale_factor')::float8 AS asf \
                 FROM pg_stat_user_tables st JOIN pg_class c ON c.oid = st.relid \
                 WHERE st.schemaname = $1 AND st.relname = $2",
            )
            .bind(schema)
            .bind(table)
            .fetch_optional(&pool)
            .await?;
            let Some(r) = r else { continue };
            let (dead, modified, tuples) = (
                r.get::<f64, _>("dead"),
                r.get::<f64, _>("modified"),
                r.get::<f64, _>("reltuples"),
            );
            let vacuum = dead > r.get::<f64, _>("vt") + r.get::<f64, _>("vs") * tuples;
            let analyze = modified > r.get::<f64, _>("at") + r.get::<f64, _>("asf") * tuples;
            let what = match (vacuum, analyze) {
                (true, true) => "VACUUM ANALYZE",
                (true, false) => "VACUUM",
                (false, true) => "ANALYZE",
                (false, false) => continue,
            };
            sqlx::raw_sql(&format!("{what} \"{schema}\".\"{table}\""))
                .execute(&pool)
                .await?;
            counts.vacuums += u64::from(vacuum);
            counts.analyzes += u64::from(analyze);
        }
    }
    Ok(counts)
}
