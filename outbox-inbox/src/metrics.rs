//! Consumer metrics, emitted through the [`metrics`](https://docs.rs/metrics) facade (install
//! any recorder). Every series carries the `consumer` label.
//!
//! | name | type | extra labels | meaning |
//! |---|---|---|---|
//! | `outbox_inbox_processed_total` | counter | `result` | outcomes: `applied`, `duplicate`, `stale`, `parked`, `waiting`, `already_parked`, `failed` (a [`crate::InboxProcessor::process`] call whose handler failed) |
//! | `outbox_inbox_apply_errors_total` | counter | `kind` | failed attempts: `handler_transient`, `handler_permanent`, `store`, `decode` |
//! | `outbox_inbox_apply_latency_seconds` | histogram | | `created_at` of the event to its effect's commit |
//! | `outbox_inbox_lag` | gauge | `topic`, `partition` | committed offset to the end of the partition ([`outbox_core::MessageSource::lag`]) |
//! | `outbox_inbox_parked` | gauge | | messages parked as an aggregate's head (or standalone) |
//! | `outbox_inbox_waiting` | gauge | | messages waiting behind a parked one |
//! | `outbox_inbox_oldest_parked_age_seconds` | gauge | | age of the oldest open parked message |
//! | `outbox_inbox_held` | gauge | | messages held for a version gap ([`crate::VersionPolicy::Hold`]) |
//! | `outbox_inbox_in_flight` | gauge | | messages received whose outcome is not final |
//! | `outbox_inbox_rewinds_total` | counter | | log rewinds seen (offsets at or below the highest seen) |
//! | `outbox_inbox_dropped_commits_total` | counter | | offset commits dropped because the group rebalanced |
//! | `outbox_inbox_cleaned_total` | counter | | registrations removed by the scheduled cleanup |
//!
//! The duplicate share is `rate(outbox_inbox_processed_total{result="duplicate"}) /
//! rate(outbox_inbox_processed_total)`; the engine's [`crate::EngineReport`] carries the same
//! counts.

use std::time::Duration;

use outbox_core::{Envelope, ParkedStats, PartitionLag};

use crate::processor::MessageOutcome;

pub(crate) fn record_outcome(consumer: &str, outcome: &MessageOutcome) {
    metrics::counter!("outbox_inbox_processed_total", "consumer" => consumer.to_owned(), "result" => outcome.as_str())
        .increment(1);
}

pub(crate) fn record_error(consumer: &str, kind: &'static str) {
    metrics::counter!("outbox_inbox_apply_errors_total", "consumer" => consumer.to_owned(), "kind" => kind)
        .increment(1);
}

pub(crate) fn record_latency(consumer: &str, event: &Envelope, now: chrono::DateTime<chrono::Utc>) {
    if let Ok(d) = (now - event.created_at).to_std() {
        metrics::histogram!("outbox_inbox_apply_latency_seconds", "consumer" => consumer.to_owned())
            .record(d.as_secs_f64());
    }
}

pub(crate) fn record_lag(consumer: &str, lags: &[PartitionLag]) {
    for l in lags {
        metrics::gauge!(
            "outbox_inbox_lag",
            "consumer" => consumer.to_owned(),
            "topic" => l.partition.topic.clone(),
            "partition" => l.partition.partition.to_string()
        )
        .set(l.lag() as f64);
    }
}

pub(crate) fn record_parked(
    consumer: &str,
    stats: &ParkedStats,
    now: chrono::DateTime<chrono::Utc>,
) {
    metrics::gauge!("outbox_inbox_parked", "consumer" => consumer.to_owned())
        .set(stats.parked as f64);
    metrics::gauge!("outbox_inbox_waiting", "consumer" => consumer.to_owned())
        .set(stats.waiting as f64);
    let age = stats
        .oldest_parked_at
        .and_then(|at| (now - at).to_std().ok())
        .unwrap_or(Duration::ZERO);
    metrics::gauge!("outbox_inbox_oldest_parked_age_seconds", "consumer" => consumer.to_owned())
        .set(age.as_secs_f64());
}

pub(crate) fn record_gauges(consumer: &str, held: usize, in_flight: usize) {
    metrics::gauge!("outbox_inbox_held", "consumer" => consumer.to_owned()).set(held as f64);
    metrics::gauge!("outbox_inbox_in_flight", "consumer" => consumer.to_owned())
        .set(in_flight as f64);
}

pub(crate) fn record_counter(name: &'static str, consumer: &str, n: u64) {
    metrics::counter!(name, "consumer" => consumer.to_owned()).increment(n);
}
