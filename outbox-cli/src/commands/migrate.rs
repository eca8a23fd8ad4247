//! `outbox migrate`: the outbox schema (and, with `--inbox`, the consumers' inboxes).
//!
//! On MySQL / MariaDB (a `mysql://` or `mariadb://` URL) it applies `outbox-mysql`'s outbox
//! migrations (outbox table, per-aggregate state, audit, archive; serialized across processes
//! by a named lock) and names each one it applied; `--print-sql` prints them. `--inbox` is
//! refused there (exit 2): the consumers' inboxes are PostgreSQL's in this command.

use outbox_postgres::{inbox_schema_sql, outbox_schema_sql, PostgresInboxStore};
use serde_json::json;

use crate::config::Config;
use crate::db;
use crate::error::CliError;
use crate::opt::MigrateOpts;
use crate::output::Output;

/// Runs `outbox migrate`.
pub async fn run(config: &Config, opts: &MigrateOpts, out: &Output) -> Result<(), CliError> {
    if crate::store::backend(config)? == crate::store::Backend::MySql {
        return run_mysql(config, opts, out).await;
    }
    let o = &config.outbox;
    if opts.print_sql {
        let sql = outbox_schema_sql(&o.schema, &o.table)
            .map_err(|e| CliError::config(e.message, "fix [outbox]"))?;
        let mut inboxes = Vec::new();
        if opts.inbox {
            for c in &config.consumers {
                inboxes.push(
                    inbox_schema_sql(&c.inbox_schema, &c.inbox_table)
                        .map_err(|e| CliError::config(e.message, "fix [[consumers]]"))?,
                );
            }
        }
        if out.json {
            out.json(&json!({ "outbox_sql": sql, "inbox_sql": inboxes }));
        } else {
            println!("{sql}");
            for s in inboxes {
                println!("{s}");
            }
        }
        return Ok(());
    }
    let (pool, target) = db::connect_outbox(config, 2).await?;
    let store = db::outbox_store(config, pool.clone())?;
    let table = format!("{}.{}", o.schema, o.table);
    let applied = store
        .migrate()
        .await
        .map_err(|e| CliError::from_store(&e, &table))?;
    out.line(format!(
        "outbox {table} on {target}: {applied} migration(s) applied{}",
        if applied == 0 { " (up to date)" } else { "" }
    ));
    let mut inboxes = Vec::new();
    if opts.inbox {
        for c in &config.consumers {
            let pool = if c.database_url.is_empty() {
                pool.clone()
            } else {
                db::connect(
                    &c.database_url,
                    &crate::config::Secret::default(),
                    config.database.connect_timeout.0,
                    2,
                )
                .await?
                .0
            };
            let inbox = PostgresInboxStore::builder(pool)
                .schema(c.inbox_schema.clone())
                .table(c.inbox_table.clone())
                .build()
                .map_err(|e| CliError::config(e.message, "fix [[consumers]]"))?;
            let name = format!("{}.{}", c.inbox_schema, c.inbox_table);
            let n = inbox
                .migrate()
                .await
                .map_err(|e| CliError::from_store(&e, &name))?;
            out.line(format!(
                "inbox {name} (consumer {}): {n} migration(s) applied",
                c.name
            ));
            inboxes.push(json!({"consumer": c.name, "schema": c.inbox_schema, "table": c.inbox_table, "applied": n}));
        }
    }
    if out.json {
        out.json(&json!({
            "outbox": {"schema": o.schema, "table": o.table, "applied": applied},
            "inboxes": inboxes,
        }));
    }
    Ok(())
}

/// `outbox migrate` on MySQL / MariaDB.
async fn run_mysql(config: &Config, opts: &MigrateOpts, out: &Output) -> Result<(), CliError> {
    if opts.inbox {
        return Err(CliError::config(
            "`outbox migrate --inbox` does not support MySQL / MariaDB yet (the database URL is \
             mysql://)",
            "run `outbox migrate` without --inbox for the outbox; create a MySQL inbox with \
             outbox_mysql::MySqlInboxStore::migrate (or inbox_schema_sql) from the consumer \
             service",
        ));
    }
    let o = &config.outbox;
    let database = crate::mysql::database(config);
    if opts.print_sql {
        let sql = outbox_mysql::outbox_schema_sql(database.as_deref(), &o.table)
            .map_err(|e| CliError::config(e.message, "fix [outbox]"))?;
        if out.json {
            out.json(&json!({ "outbox_sql": sql, "inbox_sql": [] }));
        } else {
            println!("{sql}");
        }
        return Ok(());
    }
    // Names are checked before the network.
    crate::mysql::outbox_store(config, crate::mysql::lazy_pool(config)?)?;
    let (pool, target) = crate::mysql::connect(config, 2).await?;
    let store = crate::mysql::outbox_store(config, pool)?;
    let table = crate::mysql::table_label(config);
    let error = |e: outbox_core::StoreError| crate::mysql::store_error(&e, &table);
    let applied = store.migrate().await.map_err(error)?;
    let status = store.migration_status().await.map_err(error)?;
    // Migrations run in order under the lock, so this run's are the last `applied` ones up
    // to the version now in place.
    let ran: Vec<(i32, String)> = outbox_mysql::outbox_migrations()
        .iter()
        .filter(|(v, _)| *v <= status.applied && *v > status.applied - applied as i32)
        .map(|(v, what)| (*v, (*what).to_owned()))
        .collect();
    out.line(format!(
        "outbox {table} on {target}: {applied} migration(s) applied{}",
        if applied == 0 {
            format!(" (up to date at version {})", status.applied)
        } else {
            String::new()
        }
    ));
    for (v, what) in &ran {
        out.line(format!("  applied {v}: {what}"));
    }
    if out.json {
        out.json(&json!({
            "outbox": {
                "schema": database.unwrap_or_else(|| target.database.clone()),
                "table": o.table,
                "applied": applied,
                "version": status.applied,
                "migrations": ran
                    .iter()
                    .map(|(v, what)| json!({"version": v, "description": what}))
                    .collect::<Vec<_>>(),
            },
            "inboxes": [],
        }));
    }
    Ok(())
}
