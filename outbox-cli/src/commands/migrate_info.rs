//! `outbox migrate info [--inbox]`: which migrations of the outbox (and, with `--inbox`, of
//! each configured consumer's inbox) are applied and which are pending, with the time each was
//! applied, read from the migration log the stores keep (`outbox_schema_migrations`, on
//! PostgreSQL in the outbox's schema, on MySQL / MariaDB in its database). Changes nothing.
//!
//! Exit code 0 when nothing is pending, 4 (the "not ready" code of
//! [`crate::error`]) when a migration is pending, so a deploy script can gate on it:
//!
//! ```sh
//! outbox migrate info --inbox || outbox migrate --inbox
//! ```
//!
//! A version in the log that this binary does not know (applied by a newer `outbox`) is shown
//! as applied, with the log's description, and does not make the command fail.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::json;

use crate::config::{Config, ConsumerConfig, Secret};
use crate::error::CliError;
use crate::output::Output;
use crate::store::Backend;

/// One migration of one object.
#[derive(Clone, Debug, Serialize)]
pub struct MigrationRow {
    /// Its version.
    pub version: i32,
    /// What it does.
    pub description: String,
    /// `applied` or `pending`.
    pub state: &'static str,
    /// When it was applied (RFC 3339), from the log.
    pub applied_at: Option<String>,
    /// Applied, but not among the migrations this binary brings (a newer `outbox` ran it).
    pub unknown_to_this_binary: bool,
}

/// The migrations of one object: the outbox or a consumer's inbox.
#[derive(Clone, Debug, Serialize)]
pub struct ObjectInfo {
    /// `outbox` or `inbox`.
    pub kind: &'static str,
    /// The consumer, for an inbox.
    pub consumer: Option<String>,
    /// Schema (PostgreSQL) or database (MySQL; the URL's when empty).
    pub schema: String,
    /// Table.
    pub table: String,
    /// Where (URL without the password).
    pub database: String,
    /// Latest version applied (0: none).
    pub applied_version: i32,
    /// Latest version this binary brings.
    pub latest_version: i32,
    /// Pending migrations.
    pub pending: usize,
    /// Every migration, applied or pending, in order.
    pub migrations: Vec<MigrationRow>,
}

/// A row of the migration log.
type Logged = (i32, String, Option<DateTime<Utc>>);

/// Runs `outbox migrate info`.
pub async fn run(config: &Config, inbox: bool, out: &Output) -> Result<(), CliError> {
    let mut objects = vec![outbox_info(config).await?];
    if inbox {
        if config.consumers.is_empty() {
            return Err(CliError::config(
                "--inbox reports the inboxes of the configured consumers, and none is configured",
                "add [[consumers]] entries (name, inbox_schema, inbox_table), or leave out \
                 --inbox",
            ));
        }
        for c in &config.consumers {
            objects.push(inbox_info(config, c).await?);
        }
    }
    render(objects, out)
}

/// Joins the log with the migrations this binary brings.
fn merge(known: &[(i32, &'static str)], logged: Vec<Logged>) -> Vec<MigrationRow> {
    let mut rows: Vec<MigrationRow> = known
        .iter()
        .map(|(v, what)| {
            let hit = logged.iter().find(|(lv, _, _)| lv == v);
            MigrationRow {
                version: *v,
                description: (*what).to_owned(),
                state: if hit.is_some() { "applied" } else { "pending" },
                applied_at: hit.and_then(|(_, _, at)| at.map(|t| t.to_rfc3339())),
                unknown_to_this_binary: false,
            }
        })
        .collect();
    for (v, what, at) in logged {
        if !known.iter().any(|(k, _)| *k == v) {
            rows.push(MigrationRow {
                version: v,
                description: what,
                state: "applied",
                applied_at: at.map(|t| t.to_rfc3339()),
                unknown_to_this_binary: true,
            });
        }
    }
    rows.sort_by_key(|r| r.version);
    rows
}

#[allow(clippy::too_many_arguments)]
fn object(
    kind: &'static str,
    consumer: Option<String>,
    schema: String,
    table: String,
    database: String,
    known: &[(i32, &'static str)],
    logged: Vec<Logged>,
) -> ObjectInfo {
    let migrations = merge(known, logged);
    ObjectInfo {
        kind,
        consumer,
        schema,
        table,
        database,
        applied_version: migrations
            .iter()
            .filter(|m| m.state == "applied")
            .map(|m| m.version)
            .max()
            .unwrap_or(0),
        latest_version: known.iter().map(|(v, _)| *v).max().unwrap_or(0),
        pending: migrations.iter().filter(|m| m.state == "pending").count(),
        migrations,
    }
}

async fn outbox_info(config: &Config) -> Result<ObjectInfo, CliError> {
    let o = &config.outbox;
    match crate::store::backend(config)? {
        Backend::Postgres => {
            // Validates the names before any SQL is written with them.
            crate::db::outbox_store(config, crate::db::lazy_outbox_pool(config)?)?;
            let (pool, target) = crate::db::connect_outbox(config, 1).await?;
            let logged = pg_log(&pool, &o.schema, &format!("outbox:{}", o.table)).await?;
            Ok(object(
                "outbox",
                None,
                o.schema.clone(),
                o.table.clone(),
                target.to_string(),
                &outbox_postgres::outbox_migrations(),
                logged,
            ))
        }
        Backend::MySql => {
            crate::mysql::outbox_store(config, crate::mysql::lazy_pool(config)?)?;
            let (pool, target) = crate::mysql::connect(config, 1).await?;
            let database = crate::mysql::database(config);
            let logged = mysql_log(
                &pool,
                database.as_deref(),
                &format!("outbox:{}", o.table),
                &crate::mysql::table_label(config),
            )
            .await?;
            Ok(object(
                "outbox",
                None,
                database.unwrap_or_else(|| target.database.clone()),
                o.table.clone(),
                target.to_string(),
                &outbox_mysql::outbox_migrations(),
                logged,
            ))
        }
    }
}

async fn inbox_info(config: &Config, c: &ConsumerConfig) -> Result<ObjectInfo, CliError> {
    let object_name = format!("inbox:{}", c.inbox_table);
    match crate::consumer_inbox::backend(config, c)? {
        Backend::Postgres => {
            let (store, _) = crate::db::inbox_store(config, c, 1).await?;
            let database = if c.database_url.is_empty() {
                config.database_url()?.redacted()
            } else {
                c.database_url.redacted()
            };
            let logged = pg_log(store.pool(), &c.inbox_schema, &object_name).await?;
            Ok(object(
                "inbox",
                Some(c.name.clone()),
                c.inbox_schema.clone(),
                c.inbox_table.clone(),
                database,
                &outbox_postgres::inbox_migrations(),
                logged,
            ))
        }
        Backend::MySql => {
            let (url, password) = if c.database_url.is_empty() {
                (config.database_url()?, &config.database.password)
            } else {
                (&c.database_url, &Secret::default())
            };
            let (pool, target) = crate::store::mysql_pool(config, url, password, 1).await?;
            // Validates the names (and the consumer's) before any SQL is written with them.
            crate::consumer_inbox::mysql_on(c, pool.clone())?;
            let database = (c.inbox_schema != outbox_postgres::DEFAULT_SCHEMA)
                .then_some(c.inbox_schema.as_str());
            let logged = mysql_log(&pool, database, &object_name, &c.inbox_table).await?;
            let schema = match database {
                Some(d) => d.to_owned(),
                None => pool
                    .connect_options()
                    .get_database()
                    .unwrap_or("")
                    .to_owned(),
            };
            Ok(object(
                "inbox",
                Some(c.name.clone()),
                schema,
                c.inbox_table.clone(),
                target,
                &outbox_mysql::inbox_migrations(),
                logged,
            ))
        }
    }
}

/// The log rows of `object` in `schema` on PostgreSQL; none when the log does not exist.
async fn pg_log(pool: &sqlx::PgPool, schema: &str, object: &str) -> Result<Vec<Logged>, CliError> {
    let log = outbox_postgres::qualified(schema, "outbox_schema_migrations");
    let map = |e: sqlx::Error| CliError::from_store(&outbox_postgres::map_sqlx_error(e), &log);
    // From the catalogs: a missing schema or log is "nothing applied", not an error.
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relname = 'outbox_schema_migrations')",
    )
    .bind(schema)
    .fetch_one(pool)
    .await
    .map_err(map)?;
    if !exists {
        return Ok(Vec::new());
    }
    sqlx::query_as::<_, (i32, String, DateTime<Utc>)>(&format!(
        "SELECT version, description, applied_at FROM {log} WHERE object = $1 ORDER BY version"
    ))
    .bind(object)
    .fetch_all(pool)
    .await
    .map(|rows| {
        rows.into_iter()
            .map(|(v, d, at)| (v, d, Some(at)))
            .collect()
    })
    .map_err(map)
}

/// The log rows of `object` on MySQL / MariaDB (in `database`, else the URL's); none when the
/// log or the database does not exist.
async fn mysql_log(
    pool: &outbox_mysql::sqlx::MySqlPool,
    database: Option<&str>,
    object: &str,
    what: &str,
) -> Result<Vec<Logged>, CliError> {
    let log = outbox_mysql::qualified(database, "outbox_schema_migrations");
    let rows = outbox_mysql::sqlx::query_as::<_, (i32, String, chrono::NaiveDateTime)>(&format!(
        // The log's text is utf8mb4_bin, which the server reports as binary: read it as text.
        "SELECT version, CAST(description AS CHAR CHARACTER SET utf8mb4), applied_at \
         FROM {log} WHERE object = ? ORDER BY version"
    ))
    .bind(object)
    .fetch_all(pool)
    .await;
    match rows {
        // DATETIME(6) holds UTC (the store writes UTC_TIMESTAMP(6)).
        Ok(rows) => Ok(rows
            .into_iter()
            .map(|(v, d, at)| (v, d, Some(at.and_utc())))
            .collect()),
        Err(e) => {
            let e = outbox_mysql::map_sqlx_error(e);
            if e.kind == outbox_core::StoreErrorKind::Schema {
                Ok(Vec::new())
            } else {
                Err(crate::mysql::store_error(&e, what))
            }
        }
    }
}

fn render(objects: Vec<ObjectInfo>, out: &Output) -> Result<(), CliError> {
    let pending: usize = objects.iter().map(|o| o.pending).sum();
    if out.json {
        out.json(&json!({
            "up_to_date": pending == 0,
            "pending": pending,
            "objects": objects,
        }));
    } else {
        for o in &objects {
            let name = match &o.consumer {
                Some(c) => format!("inbox {}.{} (consumer {c})", o.schema, o.table),
                None => format!("outbox {}.{}", o.schema, o.table),
            };
            println!(
                "{name} on {}: version {} of {}, {}",
                o.database,
                o.applied_version,
                o.latest_version,
                if o.pending == 0 {
                    "up to date".to_owned()
                } else {
                    format!("{} pending", o.pending)
                }
            );
            let rows = o
                .migrations
                .iter()
                .map(|m| {
                    vec![
                        m.version.to_string(),
                        m.description.clone(),
                        if m.unknown_to_this_binary {
                            "applied (newer outbox)".to_owned()
                        } else {
                            m.state.to_owned()
                        },
                        m.applied_at.clone().unwrap_or_else(|| "-".into()),
                    ]
                })
                .collect();
            println!(
                "{}",
                out.table(&["version", "description", "state", "applied at"], rows)
            );
        }
    }
    if pending > 0 {
        let hint = if objects.iter().any(|o| o.kind == "inbox" && o.pending > 0) {
            "run `outbox migrate --inbox`"
        } else {
            "run `outbox migrate`"
        };
        return Err(
            CliError::not_ready(format!("{pending} migration(s) pending"), hint).reported(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_and_the_known_migrations_are_joined_by_version() {
        let at = Utc::now();
        let rows = merge(
            &[(1, "one"), (2, "two")],
            vec![
                (1, "one (logged)".into(), Some(at)),
                (3, "three".into(), None),
            ],
        );
        let states: Vec<(i32, &str, bool)> = rows
            .iter()
            .map(|r| (r.version, r.state, r.unknown_to_this_binary))
            .collect();
        assert_eq!(
            states,
            [
                (1, "applied", false),
                (2, "pending", false),
                (3, "applied", true)
            ]
        );
        assert_eq!(rows[0].description, "one");
        assert_eq!(rows[2].description, "three");
        assert_eq!(rows[0].applied_at, Some(at.to_rfc3339()));
    }
}
