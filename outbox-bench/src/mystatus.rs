//! `status` on MariaDB (outbox-mysql): what `outbox status` and the relay's metrics cost on a
//! large table, the same shape and the same reads as the PostgreSQL scenario (`status.rs`,
//! whose `measure` runs the rounds and reads of both; this module holds MariaDB's store,
//! fill and `--keep`).
//!
//! For each size a table is filled in SQL: its secondary indexes are dropped, the rows are
//! inserted by `INSERT .. SELECT` from MariaDB's `SEQUENCE` engine (`seq_<a>_to_<b>`, one
//! statement per million rows, the columns the store writes), the indexes are added back as
//! they were (built by sorting, not row by row), then `ANALYZE TABLE`. Shape: mostly
//! published rows (their publications spread over the last 24 hours), `--pending-percent`
//! pending (at least 2,000, appended one per millisecond up to now), `--parked` parked heads
//! (their aggregates' later versions wait behind them), one aggregate per 100 rows, each with
//! its state row (last version = its highest published one). Then each round alternates,
//! `--reads` times: `stats()`; the reads of one `outbox status` with the default
//! configuration (the backlog, the latency over the 15-minute window, six trend points over
//! the last minute, the relay registry); one claim of 100 + completion (lease mode).

use std::time::Duration;

use outbox_mysql::MySqlOutboxStore;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::Row;

use crate::mysql::MyEnv;
use crate::report::Report;
use crate::status::{self, million_row_ranges, Shape, StatusArgs, StatusBackend, FILL_COLUMNS};

/// Runs the status scenario on MariaDB.
pub(crate) async fn run(env: &MyEnv, args: &StatusArgs, rounds: usize) -> anyhow::Result<Report> {
    let mut report = status::report("status (mysql)", args, rounds)?;
    let pool = MySqlPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect(env.url())
        .await?;
    let backend = MariaDb {
        env,
        pool,
        keep: args.keep,
    };
    let samples = status::measure(&backend, args, rounds).await?;
    if let Some(&last) = args.sizes.last() {
        status::status_reads_target(&mut report, &samples, last);
    }
    report.figures = samples.figures();
    Ok(report)
}

/// The scenario on MariaDB: a store per size in its own database on the scenario's pool,
/// dropped after its size unless `--keep`.
struct MariaDb<'a> {
    env: &'a MyEnv,
    pool: MySqlPool,
    keep: bool,
}

impl StatusBackend for MariaDb<'_> {
    type Store = MySqlOutboxStore;

    async fn store(&self) -> anyhow::Result<MySqlOutboxStore> {
        self.env
            .store_on(&self.pool, "status", status::lease())
            .await
    }

    async fn fill(&self, store: &MySqlOutboxStore, shape: &Shape) -> anyhow::Result<()> {
        fill(store, shape).await
    }

    fn filled_note(&self, store: &MySqlOutboxStore) -> String {
        format!(
            " (database {})",
            store.settings().database.as_deref().unwrap_or("?")
        )
    }

    async fn finish(&self) -> anyhow::Result<()> {
        if self.keep {
            println!(
                "kept: database {} (drop it yourself)",
                self.env.forget_last_database()
            );
            Ok(())
        } else {
            self.env.cleanup().await
        }
    }
}

/// The rows of `shape` (see the module's doc): published (the oldest, their publications over
/// the last 24 hours), then the parked heads, then the pending rows (one per millisecond up
/// to now), over the aggregates (version = the row's round over them); the state rows; the
/// secondary indexes dropped during the fill and built again after it.
async fn fill(store: &MySqlOutboxStore, shape: &Shape) -> anyhow::Result<()> {
    let &Shape {
        rows,
        pending,
        parked,
        aggregates,
    } = shape;
    let pool = store.pool();
    let db = store
        .settings()
        .database
        .clone()
        .ok_or_else(|| anyhow::anyhow!("the bench's store names its database"))?;
    let table = store.settings().table.clone();
    let t = format!("`{db}`.`{table}`");
    let state = format!("`{db}`.`{table}_aggregate`");
    let seq: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.ENGINES \
         WHERE ENGINE = 'SEQUENCE' AND SUPPORT IN ('YES', 'DEFAULT')",
    )
    .fetch_one(pool)
    .await?;
    anyhow::ensure!(seq > 0, "the fill needs MariaDB's SEQUENCE engine");
    // The secondary indexes as the migrations made them, in column order.
    let defs = sqlx::query(
        "SELECT INDEX_NAME AS name, MAX(NON_UNIQUE) AS non_unique, \
                GROUP_CONCAT(CONCAT('`', COLUMN_NAME, '`', \
                                    IF(SUB_PART IS NULL, '', CONCAT('(', SUB_PART, ')'))) \
                             ORDER BY SEQ_IN_INDEX SEPARATOR ', ') AS cols \
         FROM information_schema.STATISTICS \
         WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? AND INDEX_NAME <> 'PRIMARY' \
         GROUP BY INDEX_NAME",
    )
    .bind(&db)
    .bind(&table)
    .fetch_all(pool)
    .await?;
    let mut drops = Vec::new();
    let mut adds = Vec::new();
    for d in &defs {
        let name: String = d.try_get("name")?;
        let non_unique: i64 = d.try_get("non_unique")?;
        let cols: String = d.try_get("cols")?;
        drops.push(format!("DROP INDEX `{name}`"));
        adds.push(format!(
            "ADD {}KEY `{name}` ({cols})",
            if non_unique == 0 { "UNIQUE " } else { "" }
        ));
    }
    if !drops.is_empty() {
        sqlx::raw_sql(&format!("ALTER TABLE {t} {}", drops.join(", ")))
            .execute(pool)
            .await?;
    }
    // Rows below `done` are published; [done, done + parked) parked; the rest pending.
    let done = (rows - pending) as i64;
    let pk = done + parked as i64;
    let (all, a) = (rows as i64, aggregates as i64);
    for (from, to) in million_row_ranges(rows) {
        sqlx::raw_sql(&format!(
            "INSERT INTO {t} ({FILL_COLUMNS}) \
             SELECT UNHEX(LPAD(HEX(g), 32, '0')), 'order', CONCAT('order-', g % {a}), \
               g DIV {a} + 1, 'order.changed', 1, 'application/json', REPEAT('x', 200), '{{}}', \
               c, \
               CASE WHEN g < {done} THEN 'published' WHEN g < {pk} THEN 'parked' \
                    ELSE 'pending' END, \
               IF(g < {done}, c + INTERVAL 40000 MICROSECOND, NULL), \
               IF(g < {done}, c + INTERVAL 40000 MICROSECOND, NULL), \
               IF(g < {done}, 'kafka', NULL), IF(g < {done}, 'orders', NULL), \
               IF(g < {done}, g % 12, NULL), IF(g < {done}, g, NULL), \
               IF(g >= {done} AND g < {pk}, c + INTERVAL 1 SECOND, NULL), \
               IF(g >= {done} AND g < {pk}, 'poison', NULL), \
               IF(g >= {done} AND g < {pk}, 1, 0), c \
             FROM (SELECT seq AS g, \
                     IF(seq < {done}, \
                        UTC_TIMESTAMP(6) - INTERVAL (({done} - seq) * 86400000000 DIV {done}) \
                          MICROSECOND, \
                        UTC_TIMESTAMP(6) - INTERVAL (({all} - seq) * 1000) MICROSECOND) AS c \
                   FROM seq_{from}_to_{last}) r",
            last = to - 1,
        ))
        .execute(pool)
        .await?;
    }
    sqlx::raw_sql(&format!(
        "INSERT INTO {state} (aggregate_key, aggregate_type, aggregate_id, last_version, \
           updated_at) \
         SELECT UNHEX(SHA2(CONCAT('order', CHAR(31 USING utf8mb4), CONCAT('order-', s.seq)), \
                           256)), \
                'order', CONCAT('order-', s.seq), \
                IF(s.seq < {done}, ({done} - 1 - s.seq) DIV {a} + 1, NULL), UTC_TIMESTAMP(6) \
         FROM seq_0_to_{last} s",
        last = a - 1,
    ))
    .execute(pool)
    .await?;
    if !adds.is_empty() {
        sqlx::raw_sql(&format!("ALTER TABLE {t} {}", adds.join(", ")))
            .execute(pool)
            .await?;
    }
    for table in [&t, &state] {
        sqlx::raw_sql(&format!("ANALYZE TABLE {table}"))
            .execute(pool)
            .await?;
    }
    Ok(())
}
