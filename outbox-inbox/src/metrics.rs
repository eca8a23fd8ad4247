//! Consumer metrics, emitted through the [`metrics`](https://docs.rs/metrics) facade (install
//! any recorder). Every series carries the `consumer` label.
//!
//! | name | type | extra labels | meaning |
//! |---|---|---|---|
//! | `outbox_inbox_processed_total` | counter | `result` | outcomes: `applied`, `duplicate`, `stale`, `parked`, `waiting`, `already_parked`, `failed` (a [`crate::InboxProcessor::process`] call whose handler failed) |
//! | `outbox_inbox_apply_errors_total` | counter | `kind` | failed attempts: `handler_transient`, `handler_permanent`, `store`, `decode`, `unregistrable` (an event id made to collide: parked) |
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
//! | `outbox_inbox_paused_partitions` | gauge | | partitions the engine paused because their messages filled their bound (`EngineConfig::max_in_flight_per_partition`) |
//! | `outbox_inbox_partition_pauses_total` | counter | | partitions paused so far |
//! | `outbox_inbox_baselines_total` | counter | | aggregates whose first applied version was above 1 (taken as the baseline: lower versions are stale for this consumer) |
//!
//! The duplicate share is `rate(outbox_inbox_processed_total{result="duplicate"}) /
//! rate(outbox_inbox_processed_total)`; the engine's [`crate::EngineReport`] carries the same
//! counts.

use std::time::Duration;

use outbox_core::{Envelope, ParkedStats, PartitionLag};

use crate::processor::MessageOutcome;

/// Descriptions of the series, for exporters that publish them (`# HELP`).
#[cfg_attr(not(feature = "prometheus"), allow(dead_code))]
pub(crate) fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        "outbox_inbox_processed_total",
        "Consumer outcomes by result (applied, duplicate, stale, parked, waiting, already_parked, failed)"
    );
    describe_counter!(
        "outbox_inbox_apply_errors_total",
        "Failed attempts by kind (handler_transient, handler_permanent, store, decode, unregistrable)"
    );
    describe_histogram!(
        "outbox_inbox_apply_latency_seconds",
        Unit::Seconds,
        "Event creation to the commit of its effect"
    );
    describe_gauge!(
        "outbox_inbox_lag",
        "Committed offset to the end of the partition"
    );
    describe_gauge!(
        "outbox_inbox_parked",
        "Messages parked as their aggregate's head (or standalone)"
    );
    describe_gauge!(
        "outbox_inbox_waiting",
        "Messages waiting behind a parked one"
    );
    describe_gauge!(
        "outbox_inbox_oldest_parked_age_seconds",
        Unit::Seconds,
        "Age of the oldest open parked message"
    );
    describe_gauge!("outbox_inbox_held", "Messages held for a version gap");
    describe_gauge!(
        "outbox_inbox_in_flight",
        "Messages received whose outcome is not final"
    );
    describe_gauge!(
        "outbox_inbox_paused_partitions",
        "Partitions paused because their messages filled their bound"
    );
}

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

pub(crate) fn record_paused(consumer: &str, paused: usize) {
    metrics::gauge!("outbox_inbox_paused_partitions", "consumer" => consumer.to_owned())
        .set(paused as f64);
}

pub(crate) fn record_counter(name: &'static str, consumer: &str, n: u64) {
    metrics::counter!(name, "consumer" => consumer.to_owned()).increment(n);
}

#[cfg(test)]
mod tests {
    //! Each recorder function writes its series with the consumer label and the value it was
    //! given (killed surviving mutants: `record_gauges`, `record_counter` and `record_parked`
    //! replaced by `()`, which the engine tests did not read).
    use super::*;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
    use outbox_core::TopicPartition;

    /// A recorded series: name, labels, value.
    type Series = (String, Vec<(String, String)>, DebugValue);

    fn recorded(f: impl FnOnce()) -> Vec<Series> {
        let recorder = DebuggingRecorder::new();
        let snapshotter: Snapshotter = recorder.snapshotter();
        ::metrics::with_local_recorder(&recorder, f);
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(k, _, _, v)| {
                let key = k.key();
                let labels = key
                    .labels()
                    .map(|l| (l.key().to_owned(), l.value().to_owned()))
                    .collect();
                (key.name().to_owned(), labels, v)
            })
            .collect()
    }

    fn gauge(v: &DebugValue) -> f64 {
        match v {
            DebugValue::Gauge(g) => g.into_inner(),
            other => panic!("not a gauge: {other:?}"),
        }
    }

    fn label<'a>(labels: &'a [(String, String)], name: &str) -> Option<&'a str> {
        labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn gauges_carry_the_held_and_in_flight_counts() {
        let snap = recorded(|| record_gauges("c1", 3, 17));
        let value = |name: &str| {
            snap.iter()
                .find(|(n, l, _)| n == name && label(l, "consumer") == Some("c1"))
                .map(|(_, _, v)| gauge(v))
        };
        assert_eq!(value("outbox_inbox_held"), Some(3.0));
        assert_eq!(value("outbox_inbox_in_flight"), Some(17.0));
    }

    #[test]
    fn counters_add_the_given_amount_under_their_name() {
        let snap = recorded(|| {
            record_counter("outbox_inbox_rewinds_total", "c1", 2);
            record_counter("outbox_inbox_rewinds_total", "c1", 3);
            record_counter("outbox_inbox_cleaned_total", "c2", 40);
        });
        let counter = |name: &str, consumer: &str| {
            snap.iter()
                .find(|(n, l, _)| n == name && label(l, "consumer") == Some(consumer))
                .map(|(_, _, v)| v)
        };
        assert_eq!(
            counter("outbox_inbox_rewinds_total", "c1"),
            Some(&DebugValue::Counter(5))
        );
        assert_eq!(
            counter("outbox_inbox_cleaned_total", "c2"),
            Some(&DebugValue::Counter(40))
        );
    }

    #[test]
    fn parked_gauges_and_the_age_of_the_oldest() {
        let now = chrono::Utc::now();
        let stats = ParkedStats::new(2, 5, Some(now - chrono::Duration::seconds(90)));
        let snap = recorded(|| record_parked("c1", &stats, now));
        let value = |name: &str| {
            snap.iter()
                .find(|(n, _, _)| n == name)
                .map(|(_, _, v)| gauge(v))
        };
        assert_eq!(value("outbox_inbox_parked"), Some(2.0));
        assert_eq!(value("outbox_inbox_waiting"), Some(5.0));
        assert_eq!(value("outbox_inbox_oldest_parked_age_seconds"), Some(90.0));
        // Nothing parked: the age is zero, not left at an old value.
        let snap = recorded(|| record_parked("c1", &ParkedStats::default(), now));
        assert!(snap
            .iter()
            .any(|(n, _, v)| n == "outbox_inbox_oldest_parked_age_seconds" && gauge(v) == 0.0));
    }

    #[test]
    fn lag_per_partition_and_latency_from_creation() {
        let lags = [
            PartitionLag::new(TopicPartition::new("t", 0), Some(3), 0, 10),
            PartitionLag::new(TopicPartition::new("t", 1), None, 4, 6),
        ];
        let event = Envelope::builder("order", "o-1", 1, "order.paid")
            .build()
            .unwrap();
        let later = event.created_at + chrono::Duration::milliseconds(1500);
        let earlier = event.created_at - chrono::Duration::seconds(1);
        let snap = recorded(|| {
            record_lag("c1", &lags);
            record_latency("c1", &event, later);
            // A clock behind the event's creation records nothing (no negative latency).
            record_latency("c2", &event, earlier);
        });
        for l in &lags {
            let p = l.partition.partition.to_string();
            let v = snap
                .iter()
                .find(|(n, ls, _)| {
                    n == "outbox_inbox_lag"
                        && label(ls, "topic") == Some("t")
                        && label(ls, "partition") == Some(p.as_str())
                })
                .map(|(_, _, v)| gauge(v));
            assert_eq!(v, Some(l.lag() as f64), "partition {p}");
        }
        let latencies: Vec<_> = snap
            .iter()
            .filter(|(n, _, _)| n == "outbox_inbox_apply_latency_seconds")
            .collect();
        assert_eq!(latencies.len(), 1, "{latencies:?}");
        assert_eq!(label(&latencies[0].1, "consumer"), Some("c1"));
        match &latencies[0].2 {
            DebugValue::Histogram(h) => {
                assert_eq!(h.iter().map(|v| v.into_inner()).collect::<Vec<_>>(), [1.5]);
            }
            other => panic!("not a histogram: {other:?}"),
        }
    }
}
