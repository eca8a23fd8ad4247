//! `outbox replay`: re-publishes already published events, selected by aggregate, event type
//! or creation time, in the order they were published (each aggregate's versions in the order
//! its consumers first received them, also where a lower version committed after a higher one
//! and went out first), to the topic their route gives, with their own event ids and the
//! header [`REPLAY_HEADER`] set to the replay's id. Inboxes deduplicate by event id, so a
//! consumer that already applied an event ignores its replay; a replay serves consumers that
//! lost their state or start fresh. A replay runs beside the relay and does not change delivery
//! state; replayed records may interleave with live ones, so a consumer sees an old version
//! after a newer one (its version check treats it as stale). Events the relay publishes while
//! the replay runs are replayed too when they match and their publication has committed before
//! the replay reaches its time (one whose completion commits later lies behind the replay's
//! position and is not; it went out live anyway), so a replay beside a busy relay can replay
//! more than it counted at the start. Events older than `cleanup.retention` were cleaned up
//! and cannot be replayed.

use chrono::Utc;
use outbox_core::Publisher;
use outbox_core::{PublishedFilter, ReportingStore};
use outbox_postgres::RecordedTopic;
use serde_json::json;

use crate::config::Config;
use crate::db;
use crate::error::CliError;
use crate::opt::ReplayOpts;
use crate::output::Output;

/// Header carried by every replayed record: the id of the replay run (a UUID).
pub use outbox_core::wire::REPLAY_HEADER;

/// Runs `outbox replay`.
pub async fn run(config: &Config, opts: &ReplayOpts, out: &Output) -> Result<(), CliError> {
    let now = Utc::now();
    let mut filter = PublishedFilter::default();
    filter.aggregate_type = opts.aggregate_type.clone();
    filter.aggregate_id = opts.aggregate_id.clone();
    filter.event_type = opts.event_type.clone();
    filter.since = opts
        .since
        .as_deref()
        .map(|s| super::parse_time("--since", s, now))
        .transpose()?;
    filter.until = opts
        .until
        .as_deref()
        .map(|s| super::parse_time("--until", s, now))
        .transpose()?;
    if filter.aggregate_type.is_none()
        && filter.aggregate_id.is_none()
        && filter.event_type.is_none()
        && filter.since.is_none()
    {
        return Err(CliError::config(
            "replay needs a selection",
            "pass --aggregate-type, --aggregate-id, --event-type or --since (and --until)",
        ));
    }
    if let Some(since) = filter.since {
        let window =
            chrono::Duration::from_std(config.retention.replay_window.0).unwrap_or_default();
        if since < now - window {
            tracing::warn!(replay_window = %config.retention.replay_window, "--since is older than retention.replay_window: consumers' dedup windows may not cover it, so effects can repeat");
        }
    }
    if crate::store::backend(config)? == crate::store::Backend::MySql {
        // MySQL keeps no record of the topics' partition counts and partitioner (the relay
        // that records them runs on PostgreSQL only): nothing to compare the broker with.
        let m = crate::store::connect_mysql(config, 3).await?;
        return replay(
            &m.store,
            &m.table,
            async { Ok(Vec::new()) },
            config,
            opts,
            &filter,
            out,
        )
        .await;
    }
    let (pool, _) = db::connect_outbox(config, 3).await?;
    db::preflight(&pool, config).await?;
    let store = db::outbox_store(config, pool)?;
    let table = format!("{}.{}", config.outbox.schema, config.outbox.table);
    let recorded = async {
        store
            .recorded_topics()
            .await
            .map_err(|e| CliError::from_store(&e, &table))
    };
    replay(&store, &table, recorded, config, opts, &filter, out).await
}

/// Counts and pages the events through the reporting role of `store`; `recorded` (the
/// topics' recorded partition counts and partitioner, read once something is to be replayed)
/// is what the publisher checks the broker against.
async fn replay<S: ReportingStore>(
    store: &S,
    table: &str,
    recorded: impl std::future::Future<Output = Result<Vec<RecordedTopic>, CliError>>,
    config: &Config,
    opts: &ReplayOpts,
    filter: &PublishedFilter,
    out: &Output,
) -> Result<(), CliError> {
    let map = |e: outbox_core::StoreError| CliError::from_store(&e, table);
    let matched = store.count_published(filter).await.map_err(map)?;
    if opts.dry_run || matched == 0 {
        if out.json {
            out.json(&json!({"dry_run": opts.dry_run, "matched": matched, "replayed": 0}));
        } else {
            println!(
                "{matched} published event(s) match{}",
                if opts.dry_run {
                    "; dry run, nothing published"
                } else {
                    ""
                }
            );
        }
        return Ok(());
    }
    out.confirm(
        &format!("Re-publish {matched} event(s), marked with header {REPLAY_HEADER}?"),
        opts.yes,
    )?;
    let recorded = recorded.await?;
    // Through the configured transport. On NATS the replay header makes the `Nats-Msg-Id`
    // the replay's own, so the stream's duplicate window does not drop it.
    let publisher = crate::transport::start(config, &recorded)
        .await?
        .worker_publisher(0)?;
    let replay_id = uuid::Uuid::new_v4().to_string();
    let bar = out.progress(matched, "replay");
    let (mut replayed, mut after) = (0u64, None);
    loop {
        let rows = store
            .published_events(filter, after, opts.batch_size.max(1))
            .await
            .map_err(map)?;
        let Some(last) = rows.last() else { break };
        after = Some(last.position);
        // Where each was first stored, in its transport's own form (`orders/3@41`,
        // `ORDERS#41`, `outbox -> order.created`): named when its replay fails.
        let (events, first_stored): (Vec<_>, Vec<_>) = rows
            .into_iter()
            .map(|r| {
                let mut e = r.envelope;
                e.headers
                    .insert(REPLAY_HEADER.to_owned(), replay_id.clone());
                (e, r.ack)
            })
            .unzip();
        let results = publisher.publish(&events.iter().collect::<Vec<_>>()).await;
        let failed: Vec<String> = events
            .iter()
            .zip(&first_stored)
            .zip(&results)
            .filter_map(|((e, ack), r)| {
                r.as_ref()
                    .err()
                    .map(|err| format!("{} (first stored at {ack}): {err}", e.event_id))
            })
            .collect();
        replayed += (events.len() - failed.len()) as u64;
        bar.set_position(replayed);
        if !failed.is_empty() {
            bar.abandon();
            return Err(CliError::failed(format!(
                "replay {replay_id} stopped: {} of {matched} re-published, {} failed (first: {})",
                replayed,
                failed.len(),
                failed[0]
            ))
            .with_hint("fix the broker problem and run the replay again (consumers dedupe what was already replayed)"));
        }
    }
    bar.finish_and_clear();
    if out.json {
        out.json(&json!({
            "dry_run": false, "matched": matched, "replayed": replayed,
            "replay_id": replay_id, "header": REPLAY_HEADER,
        }));
    } else {
        println!(
            "replayed {replayed} of {matched} event(s); records carry {REPLAY_HEADER}={replay_id}"
        );
    }
    Ok(())
}
