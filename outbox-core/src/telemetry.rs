//! Metrics emitted through the [`metrics`] facade. Install any recorder (Prometheus, StatsD, ...)
//! to collect them. Names are stable; every series is prefixed `outbox_`.
//!
//! | name | type | labels | meaning |
//! |---|---|---|---|
//! | `outbox_published_total` | counter | | events acknowledged and marked published |
//! | `outbox_republished_total` | counter | | published events that may have been sent more than once: after a failed attempt of their own, or after an earlier claim that ended without outcome or release (a crash, a lost completion, an expired lease; [`crate::ClaimedRecord::maybe_sent_before`]) |
//! | `outbox_publish_failures_total` | counter | `class`, `kind` | failed publication attempts |
//! | `outbox_parked_total` | counter | `kind` | events parked (by a failed publication, or by a claim for their version: `out_of_order`, `version_gap`) |
//! | `outbox_version_gaps_held` | gauge | | aggregates whose head skips a version and is held (from [`record_stats`]) |
//! | `outbox_relay_circuit_open` | gauge | | 1 while the relay pauses because the transport fails as a whole |
//! | `outbox_relay_circuit_opened_total` | counter | | times the circuit breaker opened |
//! | `outbox_superseded_total` | counter | | outcomes refused by lease fencing |
//! | `outbox_publish_latency_seconds` | histogram | | created-to-acknowledged latency |
//! | `outbox_relay_batch_size` | histogram | | events per claimed batch |
//! | `outbox_relay_cycle_seconds` | histogram | | duration of a relay cycle |
//! | `outbox_unpublished` | gauge | | backlog (from [`record_stats`]) |
//! | `outbox_in_flight` | gauge | | claimed right now |
//! | `outbox_parked` | gauge | | parked events |
//! | `outbox_oldest_unpublished_age_seconds` | gauge | | **main health signal** |
//! | `outbox_oldest_parked_age_seconds` | gauge | | age of the oldest parked event |
//! | `outbox_backpressure_active` | gauge | | 1 while appends of non-critical events are refused ([`crate::backpressure`]) |
//! | `outbox_backlog_forecast_seconds` | gauge | | time until the backlog reaches its configured capacity at the current rate (-1: not growing) |
//! | `outbox_backpressure_refused_total` | counter | | non-critical events refused by backpressure |
//! | `outbox_inbox_processed_total` | counter | `consumer`, `result` | consumer outcomes (`applied`, `duplicate`, `failed`, `parked`) |

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::delivery::{LastError, OutboxStats, ParkKind, ParkReason};
use crate::envelope::Envelope;

pub(crate) fn record_published(e: &Envelope, resend: bool, now: DateTime<Utc>) {
    metrics::counter!("outbox_published_total").increment(1);
    if resend {
        metrics::counter!("outbox_republished_total").increment(1);
    }
    if let Ok(latency) = (now - e.created_at).to_std() {
        metrics::histogram!("outbox_publish_latency_seconds").record(latency.as_secs_f64());
    }
}

pub(crate) fn record_failure(error: &LastError) {
    metrics::counter!("outbox_publish_failures_total", "class" => error.class.as_str(), "kind" => error.kind.clone())
        .increment(1);
}

pub(crate) fn record_parked(reason: &ParkReason) {
    metrics::counter!("outbox_parked_total", "kind" => reason.kind.as_str()).increment(1);
}

pub(crate) fn record_parked_kind(kind: ParkKind) {
    metrics::counter!("outbox_parked_total", "kind" => kind.as_str()).increment(1);
}

pub(crate) fn record_circuit(open: bool) {
    if open {
        metrics::counter!("outbox_relay_circuit_opened_total").increment(1);
    }
    metrics::gauge!("outbox_relay_circuit_open").set(if open { 1.0 } else { 0.0 });
}

pub(crate) fn record_superseded(n: usize) {
    metrics::counter!("outbox_superseded_total").increment(n as u64);
}

pub(crate) fn record_cycle(batch: usize, took: Duration) {
    metrics::histogram!("outbox_relay_batch_size").record(batch as f64);
    metrics::histogram!("outbox_relay_cycle_seconds").record(took.as_secs_f64());
}

/// Publishes an [`OutboxStats`] snapshot as gauges. Call it periodically (the tokio driver does).
pub fn record_stats(stats: &OutboxStats) {
    metrics::gauge!("outbox_unpublished").set(stats.unpublished as f64);
    metrics::gauge!("outbox_in_flight").set(stats.in_flight as f64);
    metrics::gauge!("outbox_parked").set(stats.parked as f64);
    metrics::gauge!("outbox_version_gaps_held").set(stats.version_gaps_held as f64);
    metrics::gauge!("outbox_oldest_unpublished_age_seconds").set(
        stats
            .oldest_unpublished_age
            .map_or(0.0, |d| d.as_secs_f64()),
    );
    metrics::gauge!("outbox_oldest_parked_age_seconds")
        .set(stats.oldest_parked_age.map_or(0.0, |d| d.as_secs_f64()));
    for (name, value) in &stats.extra {
        metrics::gauge!(format!("outbox_store_{name}")).set(*value);
    }
}

/// Records one consumer outcome (`applied`, `duplicate`, `failed`, `parked`).
pub fn record_inbox(consumer: &str, result: &'static str) {
    metrics::counter!("outbox_inbox_processed_total", "consumer" => consumer.to_owned(), "result" => result)
        .increment(1);
}
