//! `outbox reconcile --since ...`: per interval and event type, compares
//!
//! 1. state transitions: the count query of `[[reconcile.checks]]` for that event type, run
//!    per interval in a read-only transaction with `$1`/`$2` = the interval's bounds;
//! 2. outbox events created in the interval;
//! 3. events published with the broker's offset recorded (and those still pending past
//!    `reconcile.grace`, parked or discarded);
//! 4. per configured consumer, effects applied: inbox registrations of the events published
//!    to the consumer's topics (by event id, or the original id for a re-issued copy), and
//!    beside them the events the consumer parked (parked or waiting behind a parked message,
//!    read through the library's parking API): a parked message is not applied yet, waits for
//!    an operator, and is shown, not counted as a mismatch.
//!
//! Any difference is a mismatch, reported per row with its reason; the command then exits 1.
//! Intervals older than `cleanup.retention` (outbox rows gone) or a consumer's
//! `dedup_retention` (registrations gone) are marked incomplete instead of compared.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use outbox_core::{InboxParking, IntervalCount, ParkedFilter, ReportingStore};
use serde::Serialize;
use serde_json::json;
use uuid::Uuid;

use crate::config::{Config, ConsumerConfig};
use crate::consumer_inbox::{on_inbox, ConsumerInbox};
use crate::db;
use crate::error::CliError;
use crate::opt::ReconcileOpts;
use crate::output::Output;
use crate::store::Backend;

/// One consumer's effects in a row.
#[derive(Clone, Debug, Serialize)]
pub struct Effects {
    /// Consumer name.
    pub consumer: String,
    /// Events it should have applied (published to its topics at least `grace` ago).
    pub expected: u64,
    /// Of those, registered in its inbox.
    pub applied: u64,
    /// Of those, parked by the consumer (parked or waiting behind a parked message): not
    /// applied, waiting for an operator; shown, not a mismatch.
    pub parked: u64,
    /// Published to its topics less than `reconcile.grace` ago: not expected yet, so not
    /// compared, but shown (with how many of them it applied already), so a consumer is never
    /// missing from the row.
    pub within_grace: u64,
    /// Of those, registered in its inbox already.
    pub within_grace_applied: u64,
}

/// One interval and event type.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Interval start.
    pub start: DateTime<Utc>,
    /// Event type.
    pub event_type: String,
    /// Transitions counted by the user's query (`None`: no check configured).
    pub transitions: Option<u64>,
    /// Outbox events created.
    pub events: u64,
    /// Published with a broker offset.
    pub published: u64,
    /// Pending past the grace.
    pub overdue: u64,
    /// Parked.
    pub parked: u64,
    /// Discarded.
    pub discarded: u64,
    /// Per consumer.
    pub effects: Vec<Effects>,
    /// Why this row does not add up (empty: it does).
    pub mismatches: Vec<String>,
    /// Data of this interval is partly cleaned up; not compared.
    pub incomplete: Option<String>,
}

/// Runs `outbox reconcile`.
pub async fn run(config: &Config, opts: &ReconcileOpts, out: &Output) -> Result<(), CliError> {
    // Whole seconds (interval starts are compared as the database computes them), rounded up
    // so that `--since 1d --interval 1d` is one interval that ends after now.
    let now = chrono::SubsecRound::trunc_subsecs(Utc::now(), 0) + chrono::Duration::seconds(1);
    let since =
        chrono::SubsecRound::trunc_subsecs(super::parse_time("--since", &opts.since, now)?, 0);
    let interval = match &opts.interval {
        Some(i) => super::parse_duration("--interval", i)?,
        None => config.reconcile.interval,
    };
    if interval.0.is_zero() {
        return Err(CliError::config(
            "--interval must be greater than zero",
            "e.g. --interval 1h",
        ));
    }
    let step = chrono::Duration::from_std(interval.0)
        .map_err(|_| CliError::config("--interval is too long", "e.g. --interval 1h"))?;
    if (now - since).num_seconds() / step.num_seconds().max(1) > 10_000 {
        return Err(CliError::config(
            "more than 10000 intervals requested",
            "use a later --since or a longer --interval",
        ));
    }
    let grace = config.reconcile.grace.0;
    let window = Window {
        since,
        now,
        step,
        grace,
    };
    if crate::store::backend(config)? == crate::store::Backend::MySql {
        mysql_limits(config)?;
        let m = crate::store::connect_mysql(config, 3).await?;
        let consumers = consumers(config, None).await?;
        let rows = compare(&m.store, &m.table, config, None, &consumers, &window).await?;
        return render(rows, since, interval, out);
    }
    let (pool, _) = db::connect_outbox(config, 3).await?;
    db::preflight(&pool, config).await?;
    let store = db::outbox_store(config, pool.clone())?;
    let table = format!("{}.{}", config.outbox.schema, config.outbox.table);
    let consumers = consumers(config, Some(&pool)).await?;
    let rows = compare(&store, &table, config, Some(&pool), &consumers, &window).await?;
    render(rows, since, interval, out)
}

/// The configured consumers with their inboxes (PostgreSQL or MySQL; one in the PostgreSQL
/// outbox's database shares `outbox_pool`) and their open parked ids.
async fn consumers<'a>(
    config: &'a Config,
    outbox_pool: Option<&sqlx::PgPool>,
) -> Result<Vec<Consumer<'a>>, CliError> {
    let mut consumers = Vec::new();
    for c in &config.consumers {
        let (inbox, inbox_table) = match outbox_pool {
            Some(pool)
                if c.database_url.is_empty()
                    && crate::consumer_inbox::backend(config, c)? == Backend::Postgres =>
            {
                let (store, table) = db::inbox_store_on(c, pool.clone())?;
                (ConsumerInbox::Postgres(store), table)
            }
            _ => crate::consumer_inbox::open(config, c, 2).await?,
        };
        // The consumer's open parked messages, by the ids its inbox deduplicates by, through
        // the library's parking API.
        let parked: BTreeSet<Uuid> = on_inbox!(&inbox, |store| store
            .list_parked(&c.name, &ParkedFilter::open().limit(1_000_000))
            .await)
        .map_err(|e| db::inbox_error(&e, c, &inbox_table))?
        .iter()
        .flat_map(|m| [m.record.dedup_id, m.record.event_id])
        .flatten()
        .map(|id| id.as_uuid())
        .collect();
        consumers.push((c, inbox, inbox_table, parked));
    }
    Ok(consumers)
}

/// What `reconcile` covers: intervals of `step` from `since` to `now`.
#[derive(Clone, Copy)]
struct Window {
    since: DateTime<Utc>,
    now: DateTime<Utc>,
    step: chrono::Duration,
    grace: std::time::Duration,
}

/// A consumer, its inbox (and its table, for messages) and its open parked ids.
type Consumer<'a> = (&'a ConsumerConfig, ConsumerInbox, String, BTreeSet<Uuid>);

/// On MySQL the outbox and the consumers' inboxes are compared; the transition queries of
/// `[[reconcile.checks]]` (written for PostgreSQL) are not run yet: a configuration with them
/// is refused rather than reported as reconciled without them.
fn mysql_limits(config: &Config) -> Result<(), CliError> {
    if !config.reconcile.checks.is_empty() {
        return Err(CliError::config(
            "`outbox reconcile` on MySQL / MariaDB does not run [[reconcile.checks]] yet \
             (their transition queries run on PostgreSQL only)",
            "remove [[reconcile.checks]] to compare the outbox alone on MySQL, or run against \
             a PostgreSQL outbox",
        ));
    }
    Ok(())
}

/// The rows, read through the reporting role of `store` (the transitions and inboxes on
/// PostgreSQL through `pool` and `consumers`).
async fn compare<S: ReportingStore>(
    store: &S,
    table: &str,
    config: &Config,
    pool: Option<&sqlx::PgPool>,
    consumers: &[Consumer<'_>],
    window: &Window,
) -> Result<Vec<Row>, CliError> {
    let Window {
        since,
        now,
        step,
        grace,
    } = *window;
    let interval = step.to_std().unwrap_or_default();
    let map = |e: outbox_core::StoreError| CliError::from_store(&e, table);
    // Bucket starts aligned on `since`, as date_bin aligns them.
    let counts = store
        .interval_counts(since, interval, grace)
        .await
        .map_err(map)?;
    let mut by_key: BTreeMap<(DateTime<Utc>, String), IntervalCount> = counts
        .into_iter()
        .map(|c| ((c.start, c.event_type.clone()), c))
        .collect();
    let checked: BTreeSet<String> = config
        .reconcile
        .checks
        .iter()
        .map(|c| c.event_type.clone())
        .collect();
    let mut starts = Vec::new();
    let mut t = since;
    while t < now {
        starts.push(t);
        t += step;
    }
    for s in &starts {
        for et in &checked {
            by_key
                .entry((*s, et.clone()))
                .or_insert_with(|| IntervalCount::zero(*s, et));
        }
    }
    let outbox_cutoff =
        now - chrono::Duration::from_std(config.cleanup.retention.0).unwrap_or_default();
    let mut rows = Vec::new();
    for ((start, event_type), c) in by_key {
        let end = start + step;
        let mut row = Row {
            start,
            event_type: event_type.clone(),
            transitions: None,
            events: c.events,
            published: c.published,
            overdue: c.overdue,
            parked: c.parked,
            discarded: c.discarded,
            effects: Vec::new(),
            mismatches: Vec::new(),
            incomplete: None,
        };
        if start < outbox_cutoff {
            row.incomplete = Some(format!(
                "outbox rows older than cleanup.retention ({}) are cleaned up",
                config.cleanup.retention
            ));
        }
        for check in config
            .reconcile
            .checks
            .iter()
            .filter(|k| k.event_type == event_type)
        {
            let pool = pool.ok_or_else(|| {
                CliError::config(
                    "[[reconcile.checks]] run on PostgreSQL only",
                    "remove [[reconcile.checks]]",
                )
            })?;
            let n = transitions(pool, &check.query, start, end).await?;
            row.transitions = Some(row.transitions.unwrap_or(0) + n);
        }
        if row.incomplete.is_none() {
            if let Some(n) = row.transitions {
                if n != row.events {
                    row.mismatches.push(format!(
                        "{n} state transition(s) but {} outbox event(s)",
                        row.events
                    ));
                }
            }
        }
        if row.overdue > 0 {
            row.mismatches.push(format!(
                "{} event(s) not published after {}",
                row.overdue, config.reconcile.grace
            ));
        }
        if row.parked > 0 {
            row.mismatches
                .push(format!("{} event(s) parked", row.parked));
        }
        for (consumer, inbox, inbox_table, parked_ids) in consumers {
            let topics = if consumer.topics.is_empty() {
                Vec::new()
            } else {
                consumer.topics.clone()
            };
            let as_uuids = |rows: Vec<outbox_core::PublishedId>| -> Vec<(Uuid, Option<Uuid>)> {
                rows.into_iter()
                    .map(|p| (p.event_id.as_uuid(), p.original.map(|o| o.as_uuid())))
                    .collect()
            };
            let ids = as_uuids(
                store
                    .published_ids(&event_type, start, end, &topics, grace)
                    .await
                    .map_err(map)?,
            );
            // Published, but less than the grace ago: not judged yet. Without them a consumer
            // that applied everything seconds ago had no entry in the row at all.
            let expected: BTreeSet<Uuid> = ids.iter().map(|(id, _)| *id).collect();
            let recent: Vec<(Uuid, Option<Uuid>)> = if grace.is_zero() {
                Vec::new()
            } else {
                as_uuids(
                    store
                        .published_ids(&event_type, start, end, &topics, std::time::Duration::ZERO)
                        .await
                        .map_err(map)?,
                )
                .into_iter()
                .filter(|(id, _)| !expected.contains(id))
                .collect()
            };
            let inbox_failed = |e: outbox_core::StoreError| {
                let err = db::inbox_error(&e, consumer, inbox_table);
                if e.kind == outbox_core::StoreErrorKind::Schema {
                    return err;
                }
                err.with_hint(format!(
                    "check the inbox of consumer {} ([[consumers]] inbox_schema, inbox_table, \
                     database_url)",
                    consumer.name
                ))
            };
            let applied = if ids.is_empty() {
                0
            } else {
                inbox
                    .applied_of(consumer, &ids)
                    .await
                    .map_err(inbox_failed)?
            };
            let within_grace_applied = if recent.is_empty() {
                0
            } else {
                inbox
                    .applied_of(consumer, &recent)
                    .await
                    .map_err(inbox_failed)?
            };
            let parked = ids
                .iter()
                .filter(|(own, original)| {
                    parked_ids.contains(own) || original.is_some_and(|o| parked_ids.contains(&o))
                })
                .count() as u64;
            let dedup_cutoff =
                now - chrono::Duration::from_std(consumer.dedup_retention.0).unwrap_or_default();
            if start < dedup_cutoff {
                row.incomplete.get_or_insert_with(|| {
                    format!(
                        "consumer {}'s registrations older than its dedup_retention are cleaned up",
                        consumer.name
                    )
                });
            } else if applied + parked < ids.len() as u64 {
                row.mismatches.push(format!(
                    "consumer {} applied {applied} of {} published event(s){}",
                    consumer.name,
                    ids.len(),
                    if parked > 0 {
                        format!(" ({parked} parked)")
                    } else {
                        String::new()
                    }
                ));
            }
            row.effects.push(Effects {
                consumer: consumer.name.clone(),
                expected: ids.len() as u64,
                applied,
                parked,
                within_grace: recent.len() as u64,
                within_grace_applied,
            });
        }
        rows.push(row);
    }
    Ok(rows)
}

/// One consumer's effects in the human table: `name: applied/expected`, then what is parked
/// and what was published within the grace (not compared yet).
fn effects_text(e: &Effects) -> String {
    let mut text = format!("{}: {}/{}", e.consumer, e.applied, e.expected);
    if e.parked > 0 {
        text.push_str(&format!(" ({} parked)", e.parked));
    }
    if e.within_grace > 0 {
        text.push_str(&format!(
            " +{} recent ({} applied)",
            e.within_grace, e.within_grace_applied
        ));
    }
    text
}

fn render(
    rows: Vec<Row>,
    since: DateTime<Utc>,
    interval: crate::config::Dur,
    out: &Output,
) -> Result<(), CliError> {
    let mismatched = rows.iter().filter(|r| !r.mismatches.is_empty()).count();
    if out.json {
        out.json(&json!({
            "since": since.to_rfc3339(),
            "interval": interval.to_string(),
            "ok": mismatched == 0,
            "mismatched_rows": mismatched,
            "rows": rows,
        }));
    } else {
        let table_rows = rows
            .iter()
            .map(|r| {
                vec![
                    r.start.format("%Y-%m-%d %H:%M").to_string(),
                    r.event_type.clone(),
                    r.transitions.map_or("-".into(), |n| n.to_string()),
                    r.events.to_string(),
                    r.published.to_string(),
                    r.effects
                        .iter()
                        .map(effects_text)
                        .collect::<Vec<_>>()
                        .join(", "),
                    if !r.mismatches.is_empty() {
                        format!("MISMATCH: {}", r.mismatches.join("; "))
                    } else if let Some(i) = &r.incomplete {
                        format!("incomplete: {i}")
                    } else {
                        "ok".into()
                    },
                ]
            })
            .collect();
        println!(
            "{}",
            out.table(
                &[
                    "interval",
                    "event type",
                    "transitions",
                    "events",
                    "published",
                    "effects",
                    "result"
                ],
                table_rows
            )
        );
        println!(
            "{} row(s), {mismatched} with a mismatch (since {}, interval {interval})",
            rows.len(),
            since.to_rfc3339()
        );
    }
    if mismatched > 0 {
        Err(CliError::failed(format!("{mismatched} interval(s) do not reconcile")).reported())
    } else {
        Ok(())
    }
}

async fn transitions(
    pool: &sqlx::PgPool,
    query: &str,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
) -> Result<u64, CliError> {
    let fail = |e: sqlx::Error| {
        CliError::config(
            format!(
                "reconcile query failed: {}",
                outbox_postgres::map_sqlx_error(e).message
            ),
            "each [[reconcile.checks]] query returns one count for the interval [$1, $2) \
             (two timestamptz), e.g. SELECT count(*) FROM orders WHERE placed_at >= $1 AND \
             placed_at < $2",
        )
    };
    let mut tx = pool.begin().await.map_err(fail)?;
    sqlx::query("SET TRANSACTION READ ONLY")
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    let n: i64 = sqlx::query_scalar(query)
        .bind(start)
        .bind(end)
        .fetch_one(&mut *tx)
        .await
        .map_err(fail)?;
    let _ = tx.rollback().await;
    Ok(n.max(0) as u64)
}
