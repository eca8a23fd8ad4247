//! `outbox migrate`: the outbox schema (and, with `--inbox`, the consumers' inboxes).

use outbox_postgres::{inbox_schema_sql, outbox_schema_sql, PostgresInboxStore};
use serde_json::json;

use crate::config::Config;
use crate::db;
use crate::error::CliError;
use crate::opt::MigrateOpts;
use crate::output::Output;

/// Runs `outbox migrate`.
pub async fn run(config: &Config, opts: &MigrateOpts, out: &Output) -> Result<(), CliError> {
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
