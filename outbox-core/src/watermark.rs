//! Contiguous offset watermarks: the committed offset never passes an unfinished effect.
//!
//! With parallel handling inside a partition, messages finish out of order. The offset that may
//! be committed is the lowest offset whose outcome is not final yet (or one past the highest
//! offset seen when all are final).
//!
//! ```
//! use outbox_core::watermark::OffsetTracker;
//! let mut t = OffsetTracker::default();
//! for o in 10..13 { t.begin("orders", 0, o); }
//! t.finish("orders", 0, 12);
//! assert_eq!(t.take_commits(), vec![("orders".to_string(), 0, 10)]);
//! t.finish("orders", 0, 10);
//! assert_eq!(t.take_commits(), vec![("orders".to_string(), 0, 11)]);
//! t.finish("orders", 0, 11);
//! assert_eq!(t.take_commits(), vec![("orders".to_string(), 0, 13)]);
//! assert!(t.take_commits().is_empty()); // nothing new to commit
//! ```

use std::collections::{BTreeMap, BTreeSet};

/// Watermark of one partition.
#[derive(Clone, Debug, Default)]
pub struct PartitionWatermark {
    pending: BTreeSet<i64>,
    highest_seen: Option<i64>,
    committed: Option<i64>,
}

impl PartitionWatermark {
    /// A message at `offset` was received; its outcome is not final.
    pub fn begin(&mut self, offset: i64) {
        self.pending.insert(offset);
        self.highest_seen = Some(self.highest_seen.map_or(offset, |h| h.max(offset)));
    }

    /// The outcome of `offset` is final (applied, duplicate, or parked durably).
    /// Returns `false` if the offset was not pending.
    pub fn finish(&mut self, offset: i64) -> bool {
        self.pending.remove(&offset)
    }

    /// Next offset to read that may be committed now, if any message was seen.
    pub fn committable(&self) -> Option<i64> {
        match self.pending.first() {
            Some(lowest) => Some(*lowest),
            None => self.highest_seen.map(|h| h + 1),
        }
    }

    /// The committable offset if it moved past the last one taken; records it as taken.
    pub fn take_commit(&mut self) -> Option<i64> {
        let c = self.committable()?;
        if self.committed.is_some_and(|done| done >= c) {
            return None;
        }
        self.committed = Some(c);
        Some(c)
    }

    /// Number of offsets not final.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }
}

/// Watermarks of every assigned partition.
#[derive(Clone, Debug, Default)]
pub struct OffsetTracker {
    partitions: BTreeMap<(String, i32), PartitionWatermark>,
}

impl OffsetTracker {
    /// A message was received.
    pub fn begin(&mut self, topic: &str, partition: i32, offset: i64) {
        self.partitions
            .entry((topic.to_owned(), partition))
            .or_default()
            .begin(offset);
    }

    /// A message's outcome is final.
    pub fn finish(&mut self, topic: &str, partition: i32, offset: i64) -> bool {
        self.partitions
            .get_mut(&(topic.to_owned(), partition))
            .is_some_and(|w| w.finish(offset))
    }

    /// Offsets that advanced since the last call, as `(topic, partition, next_offset)`.
    pub fn take_commits(&mut self) -> Vec<(String, i32, i64)> {
        self.partitions
            .iter_mut()
            .filter_map(|((t, p), w)| w.take_commit().map(|o| (t.clone(), *p, o)))
            .collect()
    }

    /// A partition was revoked: returns its final commit (if it advanced) and forgets it.
    /// Messages still pending there will be redelivered to the next owner.
    pub fn revoke(&mut self, topic: &str, partition: i32) -> Option<(String, i32, i64)> {
        let mut w = self.partitions.remove(&(topic.to_owned(), partition))?;
        w.take_commit().map(|o| (topic.to_owned(), partition, o))
    }

    /// Offsets not final across all partitions.
    pub fn in_flight(&self) -> usize {
        self.partitions
            .values()
            .map(PartitionWatermark::in_flight)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        // (begun, finished, expected committable)
        let cases: &[(&[i64], &[i64], Option<i64>)] = &[
            (&[], &[], None),
            (&[0], &[], Some(0)),
            (&[0], &[0], Some(1)),
            (&[0, 1, 2], &[1, 2], Some(0)),
            (&[0, 1, 2], &[0, 2], Some(1)),
            (&[0, 1, 2], &[0, 1, 2], Some(3)),
            (&[5, 9], &[5], Some(9)), // gaps in offsets (compaction, control records)
            (&[5, 9], &[5, 9], Some(10)),
        ];
        for (begun, finished, expect) in cases {
            let mut w = PartitionWatermark::default();
            begun.iter().for_each(|o| w.begin(*o));
            finished.iter().for_each(|o| assert!(w.finish(*o)));
            assert_eq!(w.committable(), *expect, "{begun:?} {finished:?}");
        }
    }

    #[test]
    fn never_passes_unfinished_under_random_orders() {
        use rand::seq::SliceRandom;
        use rand::SeedableRng;
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for _ in 0..200 {
            let mut w = PartitionWatermark::default();
            let mut order: Vec<i64> = (0..30).collect();
            order.iter().for_each(|o| w.begin(*o));
            order.shuffle(&mut rng);
            let mut done = BTreeSet::new();
            for o in order {
                w.finish(o);
                done.insert(o);
                if let Some(c) = w.take_commit() {
                    assert!(
                        (0..c).all(|x| done.contains(&x)),
                        "commit {c} passes unfinished"
                    );
                }
            }
            assert_eq!(w.committable(), Some(30));
        }
    }

    #[test]
    fn finish_unknown_is_false_and_revoke_commits() {
        let mut t = OffsetTracker::default();
        assert!(!t.finish("t", 0, 1));
        t.begin("t", 0, 1);
        t.begin("t", 0, 2);
        assert!(t.finish("t", 0, 1));
        assert_eq!(t.revoke("t", 0), Some(("t".into(), 0, 2)));
        assert_eq!(t.revoke("t", 0), None);
        assert_eq!(t.in_flight(), 0);
    }
}
