//! `outbox migrate`: the outbox schema (and, with `--inbox`, the consumers' inboxes).
//!
//! On MySQL / MariaDB (a `mysql://` or `mariadb://` URL) it applies `outbox-mysql`'s outbox
//! migrations (outbox table, per-aggregate state, audit, archive; serialized across processes
//! by a named lock) and names each one it applied; `--print-sql` prints them. With `--inbox`,
//! each consumer's inbox is migrated on the store its own URL (else the outbox's) names, so an
//! outbox on one store and an inbox on the other are migrated alike.

use outbox_postgres::{inbox_schema_sql, outbox_schema_sql};
use serde_json::json;

use crate::config::Config;
use crate::db;
use crate::error::CliError;
use crate::opt::MigrateOpts;
use crate::output::Output;

/// Runs `outbox migrate`.
pub async fn run(config: &Config, opts: &MigrateOpts, out: &Output) -> Result<(), CliError> {
    if let Some(crate::opt::MigrateAction::Info(info)) = &opts.action {
        return super::migrate_info::run(config, info.inbox, out).await;
    }
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
    let inboxes = if opts.inbox {
        migrate_inboxes(config, out).await?
    } else {
        Vec::new()
    };
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
    let o = &config.outbox;
    let database = crate::mysql::database(config);
    if opts.print_sql {
        let sql = outbox_mysql::outbox_schema_sql(database.as_deref(), &o.table)
            .map_err(|e| CliError::config(e.message, "fix [outbox]"))?;
        let mut inboxes = Vec::new();
        if opts.inbox {
            for c in &config.consumers {
                let db = (c.inbox_schema != outbox_postgres::DEFAULT_SCHEMA)
                    .then_some(c.inbox_schema.as_str());
                inboxes.push(
                    outbox_mysql::inbox_schema_sql(db, &c.inbox_table)
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
    // Names are checked before the network.
    crate::mysql::outbox_store(config, crate::mysql::lazy_pool(config)?)?;
    let (pool, target) = crate::mysql::connect(config, 2).await?;
    let store = crate::mysql::outbox_store(config, pool)?;
    let table = crate::mysql::table_label(config);
    let error = |e: outbox_core::StoreError| crate::mysql::store_error(&e, &table);
    let applied = store.migrate().await.map_err(error)?;
    let status = store.migration_status().await.map_err(error)?;
    // Migrations run in order under the lock, so this run's are the last `applied` ones up
    // to the version now in place (counted in migrations: the versions need not be
    // consecutive).
    let upto: Vec<(i32, &str)> = outbox_mysql::outbox_migrations()
        .into_iter()
        .filter(|(v, _)| *v <= status.applied)
        .collect();
    let ran: Vec<(i32, String)> = upto[upto.len().saturating_sub(applied)..]
        .iter()
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
    let inboxes = if opts.inbox {
        migrate_inboxes(config, out).await?
    } else {
        Vec::new()
    };
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
            "inboxes": inboxes,
        }));
    }
    Ok(())
}

/// Migrates each configured consumer's inbox on its own store (its `database_url`, else the
/// outbox's; see [`crate::consumer_inbox`]) and reports it. Returns the JSON rows.
async fn migrate_inboxes(
    config: &Config,
    out: &Output,
) -> Result<Vec<serde_json::Value>, CliError> {
    use crate::consumer_inbox::{open, ConsumerInbox};
    let mut rows = Vec::new();
    for c in &config.consumers {
        let (inbox, name) = open(config, c, 2).await?;
        let n = match &inbox {
            ConsumerInbox::Postgres(store) => store
                .migrate()
                .await
                .map_err(|e| CliError::from_store(&e, &name))?,
            ConsumerInbox::MySql(store) => store
                .migrate()
                .await
                .map_err(|e| crate::mysql::store_error(&e, &name))?,
        };
        out.line(format!(
            "inbox {name} (consumer {}): {n} migration(s) applied",
            c.name
        ));
        rows.push(json!({
            "consumer": c.name,
            "schema": c.inbox_schema,
            "table": c.inbox_table,
            "applied": n,
        }));
    }
    Ok(rows)
}
