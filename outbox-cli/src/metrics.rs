//! The Prometheus recorder of the relay daemon, and the gauges the daemon fills from the store
//! and the pool. Every metric is listed in the crate docs (`docs/metrics.md`).

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use outbox_core::OutboxStats;

use crate::error::CliError;

/// Latency buckets (seconds): 1 ms to 10 min.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];
/// Batch size buckets (events).
const BATCH_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0,
];

/// Installs the global recorder; the handle renders `/metrics`.
pub fn install() -> Result<PrometheusHandle, CliError> {
    let err = |e: metrics_exporter_prometheus::BuildError| {
        CliError::failed(format!("cannot install the metrics recorder: {e}"))
    };
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
        .map_err(err)?
        .set_buckets_for_metric(
            Matcher::Full("outbox_relay_batch_size".into()),
            BATCH_BUCKETS,
        )
        .map_err(err)?
        .install_recorder()
        .map_err(err)?;
    describe();
    zero();
    Ok(handle)
}

/// Series that alert rules read are there from the first scrape, at their true starting
/// value: a counter that appears only at its first increment hides that increment from
/// `rate()` and `increase()`, and a gauge that appears only on a failure cannot be told
/// from a relay that does not report it (`deploy/prometheus/alerts.yml`).
fn zero() {
    for counter in [
        "outbox_published_total",
        "outbox_republished_total",
        "outbox_superseded_total",
        "outbox_relay_circuit_opened_total",
        "outbox_cleanup_removed_total",
    ] {
        metrics::counter!(counter).increment(0);
    }
    metrics::gauge!("outbox_relay_store_errors").set(0.0);
    metrics::gauge!("outbox_relay_circuit_open").set(0.0);
    metrics::gauge!("outbox_relay_ready").set(0.0);
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_gauge!("outbox_unpublished", "Unpublished events (backlog)");
    describe_gauge!("outbox_oldest_claimable_age_seconds", Unit::Seconds, "Age of the oldest claimable event since its insertion (in flight and waiting for a retry included; blocked and gap-held events apart): the main signal");
    describe_gauge!(
        "outbox_blocked",
        "Unpublished events waiting behind a parked event of their aggregate"
    );
    describe_gauge!(
        "outbox_oldest_blocked_age_seconds",
        Unit::Seconds,
        "Age of the oldest event waiting behind a parked event"
    );
    describe_gauge!(
        "outbox_gap_held",
        "Unpublished events of aggregates whose head is held as a version gap"
    );
    describe_gauge!(
        "outbox_oldest_parked_age_seconds",
        Unit::Seconds,
        "Age of the oldest parked event"
    );
    describe_gauge!("outbox_parked", "Parked events");
    describe_gauge!(
        "outbox_version_gaps_held",
        "Aggregates whose head skips a version and is held"
    );
    describe_gauge!(
        "outbox_backlog_forecast_seconds",
        Unit::Seconds,
        "Time until the backlog reaches status.capacity at its current trend (slope over status.trend_window; -1: not growing)"
    );
    describe_gauge!(
        "outbox_backpressure_active",
        "1 while appends of non-critical events are refused"
    );
    describe_histogram!(
        "outbox_publish_latency_seconds",
        Unit::Seconds,
        "Created-to-acknowledged latency"
    );
    describe_counter!(
        "outbox_published_total",
        "Events acknowledged and marked published"
    );
    describe_counter!(
        "outbox_republished_total",
        "Published events that may have been sent before (a failed or uncertain attempt, or an earlier claim that ended without outcome: a crash, a lost mark, an expired lease)"
    );
    describe_counter!(
        "outbox_superseded_total",
        "Outcomes refused by lease fencing (the events were possibly sent twice)"
    );
    describe_counter!(
        "outbox_publish_failures_total",
        "Failed publication attempts by what the relay did (action: retried, deferred, parked, superseded; class: transient or permanent as the relay treated it) and the error's kind"
    );
    describe_counter!("outbox_parked_total", "Events parked by kind");
    describe_histogram!("outbox_claim_seconds", Unit::Seconds, "Duration of a claim");
    describe_histogram!(
        "outbox_complete_seconds",
        Unit::Seconds,
        "Duration of a completion (marking a batch)"
    );
    describe_gauge!(
        "outbox_db_pool_connections",
        "Database pool connections by state (in_use, idle)"
    );
    describe_gauge!(
        "outbox_store_total_bytes",
        Unit::Bytes,
        "Outbox table size with indexes and TOAST"
    );
    describe_gauge!(
        "outbox_store_dead_tuples",
        "Dead tuples of the outbox table"
    );
    describe_gauge!(
        "outbox_store_last_autovacuum_age_seconds",
        Unit::Seconds,
        "Time since the last autovacuum of the outbox table"
    );
    describe_counter!("outbox_conditional_update_conflicts_total", "Conflicts refused by the application's conditional update, by aggregate type (PostgresOutboxStore::record_conflict)");
    describe_gauge!("outbox_relay_up", "1 while the relay's workers run");
    describe_gauge!(
        "outbox_relays",
        "Relay workers in the outbox's relay registry by state (live: heartbeat within three intervals; stale: older, most likely killed), as this relay read it at its latest heartbeat"
    );
    describe_gauge!(
        "outbox_relay_ready",
        "1 while /readyz answers 200 (database and broker usable, workers running, nothing fatal)"
    );
    describe_gauge!(
        "outbox_relay_store_errors",
        "Consecutive failed cycles (store errors) of the worst worker"
    );
    describe_counter!(
        "outbox_cleanup_removed_total",
        "Finished rows removed by the relay's scheduled cleanup"
    );
}

/// Publishes a stats snapshot (core gauges plus the store's extra figures as
/// `outbox_store_<name>`).
pub fn record_stats(stats: &OutboxStats) {
    outbox_core::telemetry::record_stats(stats);
}

/// `outbox_relays{state}` from the registry's entries.
pub fn record_relays(entries: &[outbox_core::RelayEntry]) {
    let live = entries
        .iter()
        .filter(|e| e.state() == outbox_core::RelayState::Live)
        .count();
    metrics::gauge!("outbox_relays", "state" => "live").set(live as f64);
    metrics::gauge!("outbox_relays", "state" => "stale").set((entries.len() - live) as f64);
}

/// Conflicts counted by the application, per aggregate type (absolute totals from the store).
pub fn record_conflicts(counts: &[(String, u64)]) {
    for (aggregate_type, n) in counts {
        metrics::counter!("outbox_conditional_update_conflicts_total", "aggregate_type" => aggregate_type.clone())
            .absolute(*n);
    }
}

/// Pool connections in use and idle.
pub fn record_pool(pool: &sqlx::PgPool) {
    record_pool_counts(pool.size(), pool.num_idle());
}

/// Pool connections in use and idle, from the pool's size and idle count (any driver).
pub fn record_pool_counts(size: u32, idle: usize) {
    let size = f64::from(size);
    let idle = idle as f64;
    metrics::gauge!("outbox_db_pool_connections", "state" => "in_use").set((size - idle).max(0.0));
    metrics::gauge!("outbox_db_pool_connections", "state" => "idle").set(idle);
}
