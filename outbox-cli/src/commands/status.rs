//! `outbox status`: the backlog and its ages, parked events, version gaps held, publish latency
//! percentiles over a window, the backlog's trend and forecast to capacity (by the relay's
//! rule and window, [`crate::trend`]), backpressure, table health, the relays in the registry
//! (live or stale, what they hold; see [`crate::relays`]), and per consumer its lag and inbox.

use std::time::Duration;

use chrono::Utc;
use outbox_core::backpressure::{forecast, BacklogSnapshot, Backpressure};
use outbox_core::prelude::*;
use outbox_core::{InboxParking, LatencySummary, OutboxStats};
use serde_json::{json, Value};
use tokio::signal::unix::{signal, SignalKind};

use crate::config::{Config, ConsumerConfig};
use crate::consumer_inbox::{on_inbox, ConsumerInbox};
use crate::db;
use crate::error::CliError;
use crate::opt::StatusOpts;
use crate::output::{age, secs, Output};
use crate::relays::Relays;

fn extra(stats: &outbox_core::OutboxStats, name: &str) -> Option<f64> {
    stats.extra.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
}

/// The shortest `--watch` interval.
const MIN_WATCH: Duration = Duration::from_millis(200);

/// Runs `outbox status`, once or, with `--watch`, every interval until SIGINT or SIGTERM
/// (exit 0). On a terminal each refresh clears the screen; otherwise (a pipe, a log) the
/// refreshes follow one another, each headed by its time. A failure of the first refresh
/// ends the command with its exit code (nothing to watch: bad configuration, no schema); a
/// later one (the database gone for a while) is shown in place of the report, and the next
/// refresh tries again.
pub async fn run(config: &Config, opts: &StatusOpts, out: &Output) -> Result<(), CliError> {
    let Some(every) = &opts.watch else {
        return run_once(config, opts, out).await;
    };
    let every = super::parse_duration("--watch", every)?;
    if every.0 < MIN_WATCH {
        return Err(CliError::config(
            format!("--watch {every} is too short"),
            format!(
                "use at least {} (each refresh queries the database)",
                humantime::format_duration(MIN_WATCH)
            ),
        ));
    }
    let terminal = !out.json && std::io::IsTerminal::is_terminal(&std::io::stdout());
    // Registered now, before the first refresh, so that a signal at any time ends the watch
    // with exit 0 rather than by the signal's default action.
    let listen = |kind: SignalKind| {
        signal(kind)
            .map_err(|e| CliError::failed(format!("cannot listen for signals ({kind:?}): {e}")))
    };
    let (mut term, mut int) = (
        listen(SignalKind::terminate())?,
        listen(SignalKind::interrupt())?,
    );
    let mut stop = std::pin::pin!(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    });
    let mut first = true;
    loop {
        if terminal {
            // Home and clear: the report is drawn in place.
            print!("\x1b[H\x1b[2J");
        } else if !first {
            out.line("");
        }
        out.line(format!(
            "{} every {every} (Ctrl-C to stop)",
            Utc::now().format("%Y-%m-%d %H:%M:%S UTC")
        ));
        let result = tokio::select! {
            r = run_once(config, opts, out) => r,
            () = &mut stop => return Ok(()),
        };
        match result {
            Ok(()) => {}
            Err(e) if first => return Err(e),
            Err(e) => {
                if out.json {
                    out.json(&e.to_json());
                } else {
                    println!("{e}");
                }
            }
        }
        first = false;
        let _ = std::io::Write::flush(&mut std::io::stdout());
        tokio::select! {
            () = tokio::time::sleep(every.0) => {}
            () = &mut stop => return Ok(()),
        }
    }
}

/// One `outbox status` report.
async fn run_once(config: &Config, opts: &StatusOpts, out: &Output) -> Result<(), CliError> {
    let window = match &opts.window {
        Some(w) => super::parse_duration("--window", w)?,
        None => config.status.window,
    };
    if crate::store::backend(config)? == crate::store::Backend::MySql {
        return run_mysql(config, opts, out, window).await;
    }
    let (pool, target) = db::connect_outbox(config, 3).await?;
    db::preflight(&pool, config).await?;
    let store = db::outbox_store(config, pool.clone())?;
    let table = format!("{}.{}", config.outbox.schema, config.outbox.table);
    let (stats, latency) = read(&store, window.0, &table).await?;
    let trend = backlog_trend(&store, config, stats.unpublished, &table).await?;
    let relays = Relays::read(&store).await;
    let mut warnings: Vec<String> = Vec::new();
    let mut consumers = Vec::new();
    for c in &config.consumers {
        consumers
            .push(consumer_status(config, c, Some(&pool), opts.no_consumers, &mut warnings).await);
    }
    render(
        config,
        out,
        Report {
            window,
            target: target.to_string(),
            table,
            stats,
            latency,
            trend,
            relays,
            consumers,
            warnings,
        },
    )
}

/// What `status` reads through the reporting role, whatever the store.
async fn read<R: ReportingStore>(
    store: &R,
    window: Duration,
    table: &str,
) -> Result<(OutboxStats, LatencySummary), CliError> {
    let map = |e: outbox_core::StoreError| CliError::from_store(&e, table);
    let stats = store.backlog().await.map_err(map)?;
    let latency = store.publish_latency(window).await.map_err(map)?;
    Ok((stats, latency))
}

/// Most points of the reconstructed trend: with a long `status.trend_window` the samples are
/// spaced wider than `relay.stats_interval` (one query per point).
const MAX_TREND_POINTS: u32 = 60;

/// The backlog's trend as `status` shows it.
#[derive(Clone, Debug)]
struct Trend {
    /// Growth in events per second (negative: draining); `None` when not computable.
    rate: Option<f64>,
    /// The window the slope is taken over (`status.trend_window`).
    window: Duration,
    /// The backlog points it is taken through.
    points: usize,
}

/// The backlog's current trend, by the relay daemon's rule for
/// `outbox_backlog_forecast_seconds` ([`crate::trend`]): the least-squares slope of the
/// backlog sampled every `relay.stats_interval` over the last `status.trend_window`. A
/// one-shot command has no samples of its own, so it reconstructs them from the store: the
/// backlog `w` ago is the backlog now, less the events created within `w`, plus the events
/// published within `w` (the reporting role's counts over a window ending now,
/// [`ReportingStore::flows`], all points in one call; PostgreSQL counts the discarded ones too, which also left the
/// backlog). Events parked within `w` are not added back (they leave the backlog without a
/// publication); a relay that parks many at once makes the reconstruction read a little
/// steeper than the daemon's samples did.
async fn backlog_trend<R: ReportingStore>(
    store: &R,
    config: &Config,
    unpublished: u64,
    table: &str,
) -> Result<Trend, CliError> {
    let window = config.status.trend_window.0.max(Duration::from_secs(1));
    let step = config
        .relay
        .stats_interval
        .0
        .max(Duration::from_millis(100))
        .max(window / MAX_TREND_POINTS);
    let map = |e: outbox_core::StoreError| CliError::from_store(&e, table);
    // Offsets back from now, oldest first: window, ..., 2 step, step, 0.
    let mut back = Vec::new();
    let mut w = Duration::ZERO;
    while w <= window {
        back.push(w);
        w += step;
    }
    back.reverse();
    // One read for every point (the store's `flows`: PostgreSQL reads the widest window
    // once), not one per point.
    let past: Vec<Duration> = back.iter().copied().filter(|w| !w.is_zero()).collect();
    let flows = store.flows(&past).await.map_err(map)?;
    let mut flows = flows.into_iter();
    let start = std::time::Instant::now();
    let mut samples = crate::trend::BacklogTrend::new(window);
    for w in &back {
        let backlog = if w.is_zero() {
            unpublished
        } else {
            let flow = flows.next().ok_or_else(|| {
                CliError::from_store(
                    &outbox_core::StoreError::new(
                        outbox_core::StoreErrorKind::Other,
                        "the store returned fewer flows than windows",
                    ),
                    table,
                )
            })?;
            (unpublished as i128 - flow.created as i128 + flow.finished as i128).max(0) as u64
        };
        samples.observe(start + (window - *w), backlog);
    }
    Ok(Trend {
        rate: samples.rate_per_sec(),
        window,
        points: samples.len(),
    })
}

/// `outbox status` on MySQL / MariaDB: the outbox through [`ReportingStore`]; `outbox.schema`
/// names the database when it is set (else the URL's). The consumers as on PostgreSQL: the
/// lag from the broker, the inbox (MySQL, or PostgreSQL by the consumer's `database_url`)
/// through the inbox roles.
async fn run_mysql(
    config: &Config,
    opts: &StatusOpts,
    out: &Output,
    window: crate::config::Dur,
) -> Result<(), CliError> {
    let crate::store::MySqlOutbox {
        store,
        target,
        table,
    } = crate::store::connect_mysql(config, 2).await?;
    let (stats, latency) = read(&store, window.0, &table).await?;
    let trend = backlog_trend(&store, config, stats.unpublished, &table).await?;
    let relays = Relays::read(&store).await;
    let mut warnings = Vec::new();
    let mut consumers = Vec::new();
    for c in &config.consumers {
        consumers.push(consumer_status(config, c, None, opts.no_consumers, &mut warnings).await);
    }
    render(
        config,
        out,
        Report {
            window,
            target,
            table,
            stats,
            latency,
            trend,
            relays,
            consumers,
            warnings,
        },
    )
}

/// What `status` shows.
struct Report {
    window: crate::config::Dur,
    target: String,
    table: String,
    stats: OutboxStats,
    latency: LatencySummary,
    trend: Trend,
    relays: Relays,
    consumers: Vec<Value>,
    warnings: Vec<String>,
}

fn render(config: &Config, out: &Output, report: Report) -> Result<(), CliError> {
    let Report {
        window,
        target,
        table,
        stats,
        latency,
        trend,
        relays,
        consumers,
        mut warnings,
    } = report;
    // The relay's rule (the current trend), not created minus published over `window`: a
    // drain of older events within a long window must not cancel a backlog that grows now.
    let rate = trend.rate;
    let capacity = config.status.capacity;
    let until_full = forecast(capacity, stats.unpublished, rate);
    let gate = Backpressure::new(super::relay::backpressure_policy(config));
    gate.observe(BacklogSnapshot::from_stats(&stats, rate), Utc::now());
    let bp = gate.state(Utc::now());
    if stats.parked > 0 {
        warnings.push(format!(
            "{} parked event(s) block their aggregates ({} event(s) wait behind them): see \
             `outbox parked list`",
            stats.parked, stats.blocked
        ));
    }
    if stats.version_gaps_held > 0 {
        warnings.push(format!(
            "{} aggregate(s) wait for a missing version ({} event(s) held; parked as version \
             gaps after outbox.gap_timeout)",
            stats.version_gaps_held, stats.gap_held
        ));
    }
    for (e, n) in relays.dead_with_claims() {
        warnings.push(format!(
            "relay {} is stale (last heartbeat {} ago) and still holds {n} claim(s): if it is \
             gone, `{}`",
            e.registration.owner,
            age(Some(e.heartbeat_age)),
            crate::relays::release_command(&e.registration.owner)
        ));
    }
    let doc = json!({
        "database": target,
        "transport": crate::transport::describe_json(config),
        "outbox": {"schema": config.outbox.schema, "table": config.outbox.table},
        "backlog": {
            "unpublished": stats.unpublished,
            "in_flight": stats.in_flight,
            "parked": stats.parked,
            "blocked": stats.blocked,
            "gap_held": stats.gap_held,
            "version_gaps_held": stats.version_gaps_held,
            "oldest_claimable_age_seconds": secs(stats.oldest_claimable_age),
            "oldest_blocked_age_seconds": secs(stats.oldest_blocked_age),
            "oldest_parked_age_seconds": secs(stats.oldest_parked_age),
            "published_retained": stats.published_retained,
            "published_retained_estimated":
                extra(&stats, "published_retained_estimated").is_some_and(|v| v > 0.0),
        },
        "latency": {
            "window_seconds": window.0.as_secs_f64(),
            "published": latency.count,
            "p50_seconds": latency.p50,
            "p90_seconds": latency.p90,
            "p99_seconds": latency.p99,
            "max_seconds": latency.max,
            "estimated": latency.sample.is_some(),
            "sample_size": latency.sample,
        },
        "flow": {
            "window_seconds": window.0.as_secs_f64(),
            "created": latency.created,
            "created_estimated": latency.created_estimated,
            "published": latency.count,
            "published_estimated": latency.sample.is_some(),
            "rate_per_second": rate,
            "trend_window_seconds": trend.window.as_secs_f64(),
            "trend_points": trend.points,
            "capacity": capacity,
            "forecast_seconds": secs(until_full),
        },
        "backpressure": {
            "enabled": gate.policy().is_enabled(),
            "active": bp.active,
            "reason": bp.reason,
        },
        "table": {
            "total_bytes": extra(&stats, "total_bytes"),
            "dead_tuples": extra(&stats, "dead_tuples"),
            "last_autovacuum_age_seconds": extra(&stats, "last_autovacuum_age_seconds"),
            "conditional_update_conflicts": extra(&stats, "conditional_update_conflicts"),
        },
        "relays": relays.json(),
        "consumers": consumers,
        "warnings": warnings,
    });
    if out.json {
        out.json(&doc);
        return Ok(());
    }
    let fmt_s = |v: Option<f64>| v.map_or("-".to_owned(), |s| format!("{s:.3} s"));
    let rows = vec![
        vec![
            "unpublished (backlog)".into(),
            stats.unpublished.to_string(),
        ],
        vec!["  in flight".into(), stats.in_flight.to_string()],
        vec![
            "  oldest claimable (main signal)".into(),
            age(stats.oldest_claimable_age),
        ],
        vec![
            "  blocked behind parked events".into(),
            stats.blocked.to_string(),
        ],
        vec!["    oldest blocked".into(), age(stats.oldest_blocked_age)],
        vec![
            "  held behind version gaps".into(),
            format!(
                "{} ({} aggregate(s))",
                stats.gap_held, stats.version_gaps_held
            ),
        ],
        vec!["parked".into(), stats.parked.to_string()],
        vec!["  oldest parked".into(), age(stats.oldest_parked_age)],
        vec![
            format!("published in the last {window}"),
            match latency.sample {
                None => latency.count.to_string(),
                Some(_) => format!("{} (estimated)", latency.count),
            },
        ],
        vec![
            "  latency p50 / p90 / p99 / max".into(),
            format!(
                "{} / {} / {} / {}{}",
                fmt_s(latency.p50),
                fmt_s(latency.p90),
                fmt_s(latency.p99),
                fmt_s(latency.max),
                match latency.sample {
                    None => String::new(),
                    Some(n) => format!(" (estimated over the latest {n} publications)"),
                }
            ),
        ],
        vec![
            format!("created in the last {window}"),
            if latency.created_estimated {
                format!("{} (estimated)", latency.created)
            } else {
                latency.created.to_string()
            },
        ],
        vec![
            format!(
                "backlog trend (last {})",
                humantime::format_duration(trend.window)
            ),
            rate.map_or("-".to_owned(), |r| format!("{r:+.3} events/s")),
        ],
        vec![
            format!("forecast to capacity ({capacity})"),
            match until_full {
                None => "not growing".into(),
                Some(d) => age(Some(d)),
            },
        ],
        vec![
            "backpressure".into(),
            if !gate.policy().is_enabled() {
                "not configured".into()
            } else if bp.active {
                format!("ON: {}", bp.reason.clone().unwrap_or_default())
            } else {
                "off".into()
            },
        ],
        vec![
            "table size / dead tuples".into(),
            format!(
                "{} bytes / {}",
                extra(&stats, "total_bytes").map_or("-".into(), |v| format!("{v:.0}")),
                extra(&stats, "dead_tuples").map_or("-".into(), |v| format!("{v:.0}"))
            ),
        ],
    ];
    println!("outbox {table} on {target}");
    println!("transport: {}", crate::transport::describe(config));
    println!("{}", out.table(&["", "value"], rows));
    relays.render(out);
    if !consumers.is_empty() {
        let rows = consumers
            .iter()
            .map(|c| {
                vec![
                    c["name"].as_str().unwrap_or("").to_owned(),
                    c["group"].as_str().unwrap_or("").to_owned(),
                    match &c["lag"] {
                        Value::Null => c["lag_error"].as_str().unwrap_or("-").to_owned(),
                        v => v.to_string(),
                    },
                    match &c["inbox_registrations"] {
                        Value::Null => c["inbox_error"].as_str().unwrap_or("-").to_owned(),
                        v => v.to_string(),
                    },
                    match (&c["parked"], &c["waiting"]) {
                        (Value::Null, _) | (_, Value::Null) => {
                            c["parked_error"].as_str().unwrap_or("-").to_owned()
                        }
                        (p, w) => match c["retry_requested"].as_u64() {
                            Some(r) if r > 0 => {
                                format!("{p} (+{w} waiting; {r} retry requested)")
                            }
                            _ => format!("{p} (+{w} waiting)"),
                        },
                    },
                    age(c["oldest_parked_age_seconds"]
                        .as_f64()
                        .map(Duration::from_secs_f64)),
                ]
            })
            .collect();
        println!(
            "{}",
            out.table(
                &[
                    "consumer",
                    "group",
                    "lag",
                    "inbox registrations",
                    "parked",
                    "oldest parked"
                ],
                rows
            )
        );
    }
    for w in &warnings {
        println!("warning: {w}");
    }
    Ok(())
}

/// One consumer's lag and inbox; `outbox_pool` is the PostgreSQL outbox's pool, which an
/// inbox in the outbox's database shares. The web console shows the same document.
pub(crate) async fn consumer_status(
    config: &Config,
    c: &ConsumerConfig,
    outbox_pool: Option<&sqlx::PgPool>,
    no_broker: bool,
    warnings: &mut Vec<String>,
) -> Value {
    let topics = if c.topics.is_empty() {
        config.topics()
    } else {
        c.topics.clone()
    };
    let (lag, partitions, lag_error) = if no_broker {
        (None, Vec::new(), Some("not read (no broker)".to_owned()))
    } else {
        match crate::transport::consumer_lag(config, c, &topics).await {
            Ok(read) => {
                warnings.extend(read.warnings);
                (Some(read.total), read.parts, None)
            }
            Err(e) => (None, Vec::new(), Some(e.message)),
        }
    };
    let inbox = inbox_status(config, c, outbox_pool).await;
    if inbox.parked.unwrap_or(0) + inbox.waiting.unwrap_or(0) > 0 {
        warnings.push(format!(
            "consumer {}: {} parked message(s) block their aggregates, {} wait behind them: see \
             `outbox parked list --consumer {}`",
            c.name,
            inbox.parked.unwrap_or(0),
            inbox.waiting.unwrap_or(0),
            c.name
        ));
    }
    json!({
        "name": c.name,
        "group": c.group(),
        "topics": topics,
        "lag": lag,
        "lag_error": lag_error,
        "partitions": partitions,
        "inbox_registrations": inbox.registrations,
        "last_applied_at": inbox.last_applied,
        "inbox_error": inbox.error,
        "parked": inbox.parked,
        "waiting": inbox.waiting,
        "oldest_parked_age_seconds": secs(inbox.oldest_parked_age),
        "parked_error": inbox.parked_error,
        "retry_requested": inbox.retry_requested,
    })
}

/// What `status` reads from a consumer's inbox.
#[derive(Default)]
struct InboxStatus {
    registrations: Option<i64>,
    last_applied: Option<String>,
    error: Option<String>,
    parked: Option<u64>,
    waiting: Option<u64>,
    oldest_parked_age: Option<Duration>,
    parked_error: Option<String>,
    /// Retries requested and not yet performed by the consumer service.
    retry_requested: Option<usize>,
}

async fn inbox_status(
    config: &Config,
    c: &ConsumerConfig,
    outbox_pool: Option<&sqlx::PgPool>,
) -> InboxStatus {
    let opened = match (outbox_pool, c.database_url.is_empty()) {
        (Some(pool), true) => db::inbox_store_on(c, pool.clone())
            .map(|(store, table)| (ConsumerInbox::Postgres(store), table)),
        _ => crate::consumer_inbox::open(config, c, 1).await,
    };
    let (inbox, table) = match opened {
        Ok(o) => o,
        Err(e) => {
            return InboxStatus {
                error: Some(e.message.clone()),
                parked_error: Some(e.message),
                ..InboxStatus::default()
            }
        }
    };
    let mut status = InboxStatus::default();
    match inbox.registrations(c).await {
        Ok((n, last)) => {
            status.registrations = Some(n);
            status.last_applied = last.map(|t| t.to_rfc3339());
        }
        Err(e) => status.error = Some(format!("cannot read inbox {table}: {}", e.message)),
    }
    // The parked counts through the library's parking API.
    on_inbox!(&inbox, |store| match store.parked_stats(&c.name).await {
        Ok(p) => {
            status.retry_requested = store.requested_retries(&c.name).await.ok().map(|r| r.len());
            status.parked = Some(p.parked);
            status.waiting = Some(p.waiting);
            status.oldest_parked_age = p
                .oldest_parked_at
                .and_then(|t| (Utc::now() - t).to_std().ok());
        }
        Err(e) => {
            status.parked_error = Some(format!(
                "cannot read the parked messages of {table}: {} (run `outbox migrate --inbox`)",
                e.message
            ))
        }
    });
    status
}
