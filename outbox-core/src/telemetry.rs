//! Metrics emitted through the [`metrics`] facade. Install any recorder (Prometheus, StatsD, ...)
//! to collect them. Names are stable; every series is prefixed `outbox_`.
//!
//! | name | type | labels | meaning |
//! |---|---|---|---|
//! | `outbox_published_total` | counter | | events acknowledged and marked published |
//! | `outbox_republished_total` | counter | | published events that may have been sent more than once: after a failed attempt of their own, or after an earlier claim that ended without outcome or release (a crash, a lost completion, an expired lease; [`crate::ClaimedRecord::maybe_sent_before`]) |
//! | `outbox_publish_failures_total` | counter | `class`, `kind`, `action` | failed publication attempts, labelled with what the relay did: `action` is `retried` (an attempt spent, class `transient`), `deferred` (a transport failure put back without spending an attempt, class `transient`, whatever the record's own error class), `parked` (class `permanent`) or `superseded` (the claim was lost; the error's own class); `kind` is the error's kind (e.g. `unknown_topic`, `record_too_large`) |
//! | `outbox_parked_total` | counter | `kind` | events parked (by a failed publication, or by a claim for their version: `out_of_order`, `version_gap`) |
//! | `outbox_version_gaps_held` | gauge | | aggregates whose head skips a version and is held (from [`record_stats`]) |
//! | `outbox_gap_held` | gauge | | unpublished events of those aggregates (the held head and the events after it) |
//! | `outbox_relay_circuit_open` | gauge | | 1 while the circuit breaker of at least one relay of the process is open (it pauses because the transport failed as a whole); see [Circuit gauge](#circuit-gauge) |
//! | `outbox_relay_circuit_opened_total` | counter | | times a relay's circuit breaker opened (each relay of the process counts its own) |
//! | `outbox_superseded_total` | counter | | outcomes refused by lease fencing |
//! | `outbox_publish_latency_seconds` | histogram | | created-to-acknowledged latency |
//! | `outbox_relay_batch_size` | histogram | | events per claimed batch |
//! | `outbox_relay_cycle_seconds` | histogram | | duration of a relay cycle |
//! | `outbox_unpublished` | gauge | | backlog (from [`record_stats`]) |
//! | `outbox_in_flight` | gauge | | claimed right now |
//! | `outbox_parked` | gauge | | parked events |
//! | `outbox_oldest_claimable_age_seconds` | gauge | | **main health signal**: age of the oldest claimable event ([`OutboxStats::oldest_claimable_age`]: in flight and waiting for a retry included; blocked and gap-held events apart), since its insertion into the store |
//! | `outbox_blocked` | gauge | | unpublished events waiting behind a parked event of their aggregate |
//! | `outbox_oldest_blocked_age_seconds` | gauge | | age of the oldest of them |
//! | `outbox_oldest_parked_age_seconds` | gauge | | age of the oldest parked event |
//! | `outbox_backpressure_active` | gauge | | 1 while appends of non-critical events are refused ([`crate::backpressure`]) |
//! | `outbox_backlog_forecast_seconds` | gauge | | time until the backlog reaches its configured capacity at the current rate (-1: not growing) |
//! | `outbox_backpressure_refused_total` | counter | | non-critical events refused by backpressure |
//! | `outbox_inbox_processed_total` | counter | `consumer`, `result` | consumer outcomes (`applied`, `duplicate`, `failed`, `parked`) |
//!
//! # Circuit gauge
//!
//! Every relay has its own circuit breaker ([`crate::circuit`]); several relays in one process
//! (`outbox relay --workers N`) share one unlabelled `outbox_relay_circuit_open`, which counts
//! the open breakers and reads 1 while any is open, 0 when none is (no `worker` label: one
//! series per process whatever the number of workers). A relay that is dropped no longer
//! counts. A relay with nothing to send never tries the broker, so its breaker would stay open
//! after the broker returns; it closes on its next empty cycle once another relay of the
//! process had a record acknowledged since this relay last failed. A relay alone in its process
//! (or whose fellow relays have nothing to send either) learns it only from its own next
//! publication: with no events to publish, the gauge stays at 1 until one is acknowledged.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
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

/// What the relay did with a failed publication, for `outbox_publish_failures_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FailureAction {
    /// Scheduled again, an attempt spent.
    Retried,
    /// Put back after a transport failure, no attempt spent.
    Deferred,
    /// Parked.
    Parked,
    /// Not recorded: the claim was superseded.
    Superseded,
}

impl FailureAction {
    fn as_str(self) -> &'static str {
        match self {
            Self::Retried => "retried",
            Self::Deferred => "deferred",
            Self::Parked => "parked",
            Self::Superseded => "superseded",
        }
    }
}

/// Counts a failed publication with the class the relay treated it as (a deferral is
/// transient whatever the record's own error said), its kind, and the action taken.
pub(crate) fn record_failure(error: &LastError, action: FailureAction) {
    let class = match action {
        FailureAction::Retried | FailureAction::Deferred => "transient",
        FailureAction::Parked => "permanent",
        FailureAction::Superseded => error.class.as_str(),
    };
    metrics::counter!("outbox_publish_failures_total", "class" => class, "kind" => error.kind.clone(), "action" => action.as_str())
        .increment(1);
}

pub(crate) fn record_parked(reason: &ParkReason) {
    metrics::counter!("outbox_parked_total", "kind" => reason.kind.as_str()).increment(1);
}

pub(crate) fn record_parked_kind(kind: ParkKind) {
    metrics::counter!("outbox_parked_total", "kind" => kind.as_str()).increment(1);
}

/// The relays that share one `outbox_relay_circuit_open` gauge (all the relays of a process,
/// [`CircuitTally::process`], unless a test gives them their own): it reads 1 while the breaker
/// of at least one of them is open. Each relay writes it only when its own breaker changes, so
/// it is set from the count, under the lock, never from one relay's state alone.
#[derive(Clone, Debug, Default)]
pub(crate) struct CircuitTally(Arc<TallyState>);

#[derive(Debug, Default)]
struct TallyState {
    /// Relays whose breaker is open.
    open: Mutex<usize>,
    /// Cycles, of any relay sharing the tally, in which the broker acknowledged a record.
    acknowledged: AtomicU64,
}

impl CircuitTally {
    /// The tally of the process.
    pub(crate) fn process() -> Self {
        static PROCESS: OnceLock<CircuitTally> = OnceLock::new();
        PROCESS.get_or_init(Self::default).clone()
    }

    /// One more breaker opened.
    pub(crate) fn opened(&self) {
        let mut open = self.0.open.lock().unwrap_or_else(PoisonError::into_inner);
        *open += 1;
        metrics::counter!("outbox_relay_circuit_opened_total").increment(1);
        metrics::gauge!("outbox_relay_circuit_open").set(1.0);
    }

    /// A breaker counted by [`Self::opened`] closed (or its relay went away).
    pub(crate) fn closed(&self) {
        let mut open = self.0.open.lock().unwrap_or_else(PoisonError::into_inner);
        *open = open.saturating_sub(1);
        metrics::gauge!("outbox_relay_circuit_open").set(if *open > 0 { 1.0 } else { 0.0 });
    }

    /// A relay's cycle had a record acknowledged: the transport answers.
    pub(crate) fn note_acknowledged(&self) {
        self.0.acknowledged.fetch_add(1, Ordering::Relaxed);
    }

    /// How many cycles had an acknowledgement so far (compared, never interpreted).
    pub(crate) fn acknowledgements(&self) -> u64 {
        self.0.acknowledged.load(Ordering::Relaxed)
    }
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
    metrics::gauge!("outbox_gap_held").set(stats.gap_held as f64);
    metrics::gauge!("outbox_blocked").set(stats.blocked as f64);
    metrics::gauge!("outbox_oldest_claimable_age_seconds")
        .set(stats.oldest_claimable_age.map_or(0.0, |d| d.as_secs_f64()));
    metrics::gauge!("outbox_oldest_blocked_age_seconds")
        .set(stats.oldest_blocked_age.map_or(0.0, |d| d.as_secs_f64()));
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

#[cfg(test)]
mod tests {
    //! The series are a documented interface (the table above): names, labels and values.

    use super::*;
    use crate::delivery::ParkReason;
    use crate::error::ErrorClass;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use metrics_util::MetricKind;

    type Series = Vec<(MetricKind, String, Vec<String>, DebugValue)>;

    /// Runs `f` under a local recorder and returns what it recorded.
    fn recorded(f: impl FnOnce()) -> Series {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, f);
        let mut out: Series = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(k, _, _, v)| {
                let labels = k
                    .key()
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                (k.kind(), k.key().name().to_owned(), labels, v)
            })
            .collect();
        out.sort_by(|a, b| a.1.cmp(&b.1));
        out
    }

    fn counter(
        name: &str,
        labels: &[&str],
        n: u64,
    ) -> (MetricKind, String, Vec<String>, DebugValue) {
        (
            MetricKind::Counter,
            name.to_owned(),
            labels.iter().map(|l| (*l).to_owned()).collect(),
            DebugValue::Counter(n),
        )
    }

    fn gauges(series: &Series) -> Vec<(String, f64)> {
        series
            .iter()
            .filter_map(|(kind, name, _, v)| match (kind, v) {
                (MetricKind::Gauge, DebugValue::Gauge(g)) => Some((name.clone(), g.into_inner())),
                _ => None,
            })
            .collect()
    }

    fn histogram(series: &Series, name: &str) -> Vec<f64> {
        series
            .iter()
            .find(|(kind, n, _, _)| *kind == MetricKind::Histogram && n == name)
            .map(|(_, _, _, v)| match v {
                DebugValue::Histogram(h) => h.iter().map(|x| x.into_inner()).collect(),
                _ => unreachable!(),
            })
            .unwrap_or_default()
    }

    #[test]
    fn published_counts_resends_and_latency() {
        let e = Envelope::builder("o", "o-1", 1, "t").build().unwrap();
        let now = e.created_at + chrono::Duration::milliseconds(1500);
        let s = recorded(|| record_published(&e, false, now));
        assert_eq!(s.len(), 2, "{s:?}");
        assert!(
            s.contains(&counter("outbox_published_total", &[], 1)),
            "{s:?}"
        );
        assert_eq!(histogram(&s, "outbox_publish_latency_seconds"), [1.5]);
        let s = recorded(|| record_published(&e, true, now));
        assert!(
            s.contains(&counter("outbox_republished_total", &[], 1)),
            "{s:?}"
        );
        // A clock behind the event's creation records no latency.
        let s =
            recorded(|| record_published(&e, false, e.created_at - chrono::Duration::seconds(1)));
        assert_eq!(s, [counter("outbox_published_total", &[], 1)]);
    }

    #[test]
    fn failures_and_parking_carry_their_labels() {
        let error = LastError {
            class: ErrorClass::Permanent,
            kind: "record_too_large".into(),
            message: "x".into(),
        };
        let s = recorded(|| record_failure(&error, FailureAction::Parked));
        assert_eq!(
            s,
            [counter(
                "outbox_publish_failures_total",
                &["class=permanent", "kind=record_too_large", "action=parked"],
                1
            )]
        );
        // A record error the relay deferred as a transport failure is counted as what the
        // relay did, not as the record's own (permanent) class.
        let unknown_topic = LastError {
            class: ErrorClass::Permanent,
            kind: "unknown_topic".into(),
            message: "x".into(),
        };
        let s = recorded(|| record_failure(&unknown_topic, FailureAction::Deferred));
        assert_eq!(
            s,
            [counter(
                "outbox_publish_failures_total",
                &["class=transient", "kind=unknown_topic", "action=deferred"],
                1
            )]
        );
        let reason = ParkReason {
            kind: ParkKind::AttemptsExhausted,
            error,
        };
        let s = recorded(|| record_parked(&reason));
        assert_eq!(
            s,
            [counter(
                "outbox_parked_total",
                &["kind=attempts_exhausted"],
                1
            )]
        );
        let s = recorded(|| record_parked_kind(ParkKind::OutOfOrder));
        assert_eq!(
            s,
            [counter("outbox_parked_total", &["kind=out_of_order"], 1)]
        );
    }

    #[test]
    fn circuit_superseded_and_cycle() {
        let tally = CircuitTally::default();
        let s = recorded(|| tally.opened());
        assert!(
            s.contains(&counter("outbox_relay_circuit_opened_total", &[], 1)),
            "{s:?}"
        );
        assert_eq!(gauges(&s), [("outbox_relay_circuit_open".to_owned(), 1.0)]);
        // Two open, one closes: still open; the other closes: closed.
        let s = recorded(|| {
            tally.opened();
            tally.closed();
        });
        assert_eq!(gauges(&s), [("outbox_relay_circuit_open".to_owned(), 1.0)]);
        let s = recorded(|| tally.closed());
        assert_eq!(gauges(&s), [("outbox_relay_circuit_open".to_owned(), 0.0)]);
        assert_eq!(s.len(), 1, "closing counts nothing: {s:?}");
        let s = recorded(|| tally.closed());
        assert_eq!(
            gauges(&s),
            [("outbox_relay_circuit_open".to_owned(), 0.0)],
            "an extra close never goes below zero"
        );
        assert_eq!(tally.acknowledgements(), 0);
        tally.clone().note_acknowledged();
        assert_eq!(tally.acknowledgements(), 1, "clones share the tally");
        let s = recorded(|| record_superseded(3));
        assert_eq!(s, [counter("outbox_superseded_total", &[], 3)]);
        let s = recorded(|| record_cycle(7, Duration::from_millis(250)));
        assert_eq!(histogram(&s, "outbox_relay_batch_size"), [7.0]);
        assert_eq!(histogram(&s, "outbox_relay_cycle_seconds"), [0.25]);
    }

    #[test]
    fn stats_become_gauges() {
        let stats = OutboxStats {
            unpublished: 5,
            in_flight: 2,
            blocked: 2,
            gap_held: 1,
            parked: 1,
            published_retained: 9,
            oldest_claimable_age: Some(Duration::from_millis(2500)),
            oldest_blocked_age: Some(Duration::from_secs(30)),
            oldest_parked_age: Some(Duration::from_secs(60)),
            version_gaps_held: 3,
            extra: vec![("dead_tuples".into(), 42.0)],
        };
        let mut g = gauges(&recorded(|| record_stats(&stats)));
        g.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            g,
            [
                ("outbox_blocked".to_owned(), 2.0),
                ("outbox_gap_held".to_owned(), 1.0),
                ("outbox_in_flight".to_owned(), 2.0),
                ("outbox_oldest_blocked_age_seconds".to_owned(), 30.0),
                ("outbox_oldest_claimable_age_seconds".to_owned(), 2.5),
                ("outbox_oldest_parked_age_seconds".to_owned(), 60.0),
                ("outbox_parked".to_owned(), 1.0),
                ("outbox_store_dead_tuples".to_owned(), 42.0),
                ("outbox_unpublished".to_owned(), 5.0),
                ("outbox_version_gaps_held".to_owned(), 3.0),
            ]
        );
        // No backlog: the ages read zero.
        let g = gauges(&recorded(|| record_stats(&OutboxStats::default())));
        assert!(g
            .iter()
            .filter(|(n, _)| n.contains("age"))
            .all(|(_, v)| *v == 0.0));
    }

    #[test]
    fn inbox_outcomes_are_labelled_by_consumer_and_result() {
        let s = recorded(|| {
            record_inbox("billing", "applied");
            record_inbox("billing", "applied");
        });
        assert_eq!(
            s,
            [counter(
                "outbox_inbox_processed_total",
                &["consumer=billing", "result=applied"],
                2
            )]
        );
    }
}
