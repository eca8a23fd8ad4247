//! `outbox cleanup`: deletes (or archives, with `outbox.archive`) published and discarded rows
//! older than the retention, in bounded batches of one short transaction each; `--dry-run`
//! counts them. Never touches pending or parked rows, nor the per-aggregate state.
//!
//! `--inbox` cleans the consumers' inboxes instead, through the library's inbox cleanup
//! (`InboxStore::cleanup`, one bounded batch per transaction): registrations older than the
//! consumer's `dedup_retention`. Each consumer removes only its own registrations, with its
//! own window, also when consumers share an inbox table. Parked messages, their audit trail
//! and the applied versions are never touched. Each consumer's inbox is on PostgreSQL or
//! MySQL / MariaDB ([`crate::consumer_inbox`]).

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::InboxStore;
use serde_json::json;

use crate::config::{Config, Dur};
use crate::consumer_inbox::on_inbox;
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
    if opts.inbox {
        if opts.retention.is_some() {
            return Err(CliError::config(
                "--retention applies to the outbox; an inbox keeps registrations for its \
                 consumer's dedup_retention",
                "set dedup_retention in the [[consumers]] entry, or leave out --inbox",
            ));
        }
        return inboxes(config, batch, opts.dry_run, out).await;
    }
    if crate::store::backend(config)? == crate::store::Backend::MySql {
        let m = crate::store::connect_mysql(config, 3).await?;
        return outbox(
            m.store,
            &m.table,
            config,
            retention,
            batch,
            opts.dry_run,
            out,
        )
        .await;
    }
    let (pool, _) = db::connect_outbox(config, 3).await?;
    db::preflight(&pool, config).await?;
    let store = db::outbox_store(config, pool)?;
    let table = format!("{}.{}", config.outbox.schema, config.outbox.table);
    outbox(store, &table, config, retention, batch, opts.dry_run, out).await
}

/// `outbox cleanup [--dry-run]` on the outbox, whatever the store: counts through the
/// reporting role, removes through the maintenance role.
async fn outbox<S>(
    store: S,
    table: &str,
    config: &Config,
    retention: Dur,
    batch: usize,
    dry_run: bool,
    out: &Output,
) -> Result<(), CliError>
where
    S: ReportingStore + MaintenanceStore + Clone + 'static,
{
    let map = |e: outbox_core::StoreError| CliError::from_store(&e, table);
    let candidates = store.cleanup_candidates(retention.0).await.map_err(map)?;
    if dry_run {
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

/// `outbox cleanup --inbox [--dry-run]`: each consumer cleans its own registrations with its
/// own dedup window.
async fn inboxes(
    config: &Config,
    batch: usize,
    dry_run: bool,
    out: &Output,
) -> Result<(), CliError> {
    if config.consumers.is_empty() {
        return Err(CliError::config(
            "--inbox cleans the inboxes of the configured consumers, and none is configured",
            "add [[consumers]] entries (name, inbox_schema, inbox_table, dedup_retention)",
        ));
    }
    let mut reports = Vec::new();
    for c in &config.consumers {
        let retention: Dur = c.dedup_retention;
        let (inbox, table) = crate::consumer_inbox::open(config, c, 2).await?;
        let map = |e: outbox_core::StoreError| db::inbox_error(&e, c, &table);
        let candidates = on_inbox!(&inbox, |store| store
            .cleanup_candidates(&c.name, retention.0)
            .await
            .map_err(map)?);
        if dry_run {
            if !out.json {
                println!(
                    "dry run: consumer {} (inbox {table}): {candidates} registration(s) older \
                     than {retention} would be deleted in batches of {batch}; nothing was changed",
                    c.name
                );
            }
            reports.push(json!({
                "consumer": c.name, "schema": c.inbox_schema, "table": c.inbox_table,
                "retention": retention.to_string(), "would_remove": candidates,
            }));
            continue;
        }
        let bar = out.progress(candidates, "inbox cleanup");
        let mut removed = 0u64;
        let mut batches = 0u64;
        loop {
            let n = on_inbox!(&inbox, |store| store
                .cleanup(&c.name, retention.0, batch)
                .await
                .map_err(map)?);
            if n > 0 {
                batches += 1;
            }
            removed += n;
            bar.set_position(removed);
            if n < batch as u64 {
                break;
            }
        }
        bar.finish_and_clear();
        if !out.json {
            println!(
                "consumer {} (inbox {table}): removed {removed} registration(s) older than \
                 {retention} in {batches} batch(es)",
                c.name
            );
        }
        reports.push(json!({
            "consumer": c.name, "schema": c.inbox_schema, "table": c.inbox_table,
            "retention": retention.to_string(), "removed": removed, "batches": batches,
        }));
    }
    if out.json {
        out.json(&json!({"dry_run": dry_run, "batch_size": batch, "inboxes": reports}));
    }
    Ok(())
}
