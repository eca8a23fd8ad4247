//! `outbox cleanup`: deletes (or archives, with `outbox.archive`) published and discarded rows
//! older than the retention, in bounded batches of one short transaction each; `--dry-run`
//! counts them. Never touches pending or parked rows, nor the per-aggregate state.

use std::time::Duration;

use outbox_core::OutboxStore;
use serde_json::json;

use crate::config::Config;
use crate::db;
use crate::error::CliError;
use crate::opt::CleanupOpts;
use crate::output::Output;

/// Runs `outbox cleanup`.
pub async fn run(config: &Config, opts: &CleanupOpts, out: &Output) -> Result<(), CliError> {
    let retention = match &opts.retention {
        Some(r) => super::parse_duration("--retention", r)?,
        None => config.cleanup.retention,
    };
    let batch = opts.batch_size.unwrap_or(config.cleanup.batch_size).max(1);
    let (pool, _) = db::connect_outbox(config, 3).await?;
    db::preflight(&pool, config).await?;
    let store = db::outbox_store(config, pool)?;
    let table = format!("{}.{}", config.outbox.schema, config.outbox.table);
    let map = |e: outbox_core::StoreError| CliError::from_store(&e, &table);
    let candidates = store.cleanup_candidates(retention.0).await.map_err(map)?;
    if opts.dry_run {
        if out.json {
            out.json(&json!({
                "dry_run": true, "would_remove": candidates, "retention": retention.to_string(),
                "batch_size": batch, "archive": config.outbox.archive,
            }));
        } else {
            println!(
                "dry run: {candidates} finished row(s) older than {retention} would be {} in \
                 batches of {batch}; nothing was changed",
                if config.outbox.archive {
                    "archived and deleted"
                } else {
                    "deleted"
                }
            );
        }
        return Ok(());
    }
    let bar = out.progress(candidates, "cleanup");
    // The store deletes batch after batch; the bar follows the count of what is left.
    let watcher = {
        let store = store.clone();
        let bar = bar.clone();
        let retention = retention.0;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(300)).await;
                if let Ok(left) = store.cleanup_candidates(retention).await {
                    bar.set_position(candidates.saturating_sub(left));
                }
            }
        })
    };
    let report = store.cleanup(retention.0, batch).await;
    watcher.abort();
    let report = report.map_err(map)?;
    bar.set_position(report.removed.min(candidates.max(report.removed)));
    bar.finish_and_clear();
    if out.json {
        out.json(&json!({
            "dry_run": false, "removed": report.removed, "batches": report.batches,
            "retention": retention.to_string(), "batch_size": batch,
            "archive": config.outbox.archive,
        }));
    } else {
        println!(
            "removed {} finished row(s) older than {retention} in {} batch(es){}",
            report.removed,
            report.batches,
            if config.outbox.archive {
                " (archived first)"
            } else {
                ""
            }
        );
    }
    Ok(())
}
