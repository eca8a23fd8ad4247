//! The delivery rules every history checker judges by, one copy: the randomized concurrency
//! runs (`randomized::history`) and the crash-point simulation (`outbox-sim`) both call these
//! instead of keeping their own.

use std::collections::{HashMap, HashSet};

use outbox_core::EventId;

/// One delivery of a record to the broker, as a checker saw it.
#[derive(Clone, Copy, Debug)]
pub struct Delivery<'a> {
    /// The event's dedup id (a re-issued copy counts as its original).
    pub dedup: EventId,
    /// Its aggregate.
    pub aggregate: &'a str,
    /// Its version.
    pub version: i64,
    /// A deliberate duplicate (a test's injected copy): it may repeat a version.
    pub injected_duplicate: bool,
}

/// A first delivery that broke the order rule: indices into the deliveries given to
/// [`first_delivery_disorder`] (this one, and the first delivery of the highest version before
/// it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Disorder {
    /// The delivery out of order.
    pub at: usize,
    /// The earlier first delivery of a version at or above it.
    pub after: usize,
}

/// Per aggregate, the first deliveries (by dedup id) strictly increase in version: never a
/// version again, never a lower one (equal only between an injected duplicate and another
/// event). Returns every delivery that breaks it.
pub fn first_delivery_disorder<'a>(
    deliveries: impl IntoIterator<Item = Delivery<'a>>,
) -> Vec<Disorder> {
    let mut first_seen: HashSet<EventId> = HashSet::new();
    let mut highest: HashMap<&str, (i64, usize, bool)> = HashMap::new();
    let mut found = Vec::new();
    for (i, d) in deliveries.into_iter().enumerate() {
        if !first_seen.insert(d.dedup) {
            continue;
        }
        if let Some(&(v, prev, prev_injected)) = highest.get(d.aggregate) {
            let equal_allowed = d.version == v && (d.injected_duplicate || prev_injected);
            if d.version < v || (d.version == v && !equal_allowed) {
                found.push(Disorder { at: i, after: prev });
            }
        }
        if highest
            .get(d.aggregate)
            .is_none_or(|&(v, ..)| d.version > v)
        {
            highest.insert(d.aggregate, (d.version, i, d.injected_duplicate));
        }
    }
    found
}

/// Attempts are spent by a record's own failures only (a broker that is down defers a record
/// without spending one): a row may show at most as many attempts as record-scoped failures
/// were answered for it since its last operator retry.
pub fn attempts_within(attempts: u32, record_scoped_failures: u32) -> bool {
    attempts <= record_scoped_failures
}

/// The version rule of a claim: an aggregate's head goes out only as the next version after the
/// last one published or discarded (or accepted by an operator): never past a gap, never at or
/// below a version already done.
pub fn is_next_version(last_done: i64, version: i64) -> bool {
    version == last_done + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(n: u128, agg: &str, version: i64) -> Delivery<'_> {
        Delivery {
            dedup: EventId::from_parts(crate::ManualClock::epoch(), n << 16),
            aggregate: agg,
            version,
            injected_duplicate: false,
        }
    }

    #[test]
    fn first_deliveries_must_strictly_increase_per_aggregate() {
        assert!(first_delivery_disorder([d(1, "a", 1), d(2, "b", 1), d(3, "a", 2)]).is_empty());
        // A redelivery of the same event is no first delivery.
        assert!(first_delivery_disorder([d(1, "a", 1), d(2, "a", 2), d(1, "a", 1)]).is_empty());
        assert_eq!(
            first_delivery_disorder([d(1, "a", 2), d(2, "a", 1)]),
            vec![Disorder { at: 1, after: 0 }]
        );
        // Two events of one version.
        assert_eq!(
            first_delivery_disorder([d(1, "a", 1), d(2, "a", 1)]),
            vec![Disorder { at: 1, after: 0 }]
        );
        let mut dup = d(2, "a", 1);
        dup.injected_duplicate = true;
        assert!(first_delivery_disorder([d(1, "a", 1), dup]).is_empty());
    }

    #[test]
    fn attempts_and_the_next_version() {
        assert!(attempts_within(0, 0) && attempts_within(2, 3));
        assert!(!attempts_within(1, 0));
        assert!(is_next_version(0, 1) && is_next_version(4, 5));
        assert!(!is_next_version(1, 3), "past a gap");
        assert!(!is_next_version(3, 3), "at the last version");
    }
}
