//! Contiguous offset watermarks: the committed offset never passes an unfinished effect.
//!
//! With parallel handling inside a partition, messages finish out of order. The offset that may
//! be committed is the lowest offset whose outcome is not final yet (or one past the highest
//! offset seen when all are final).
//!
//! ```
//! use outbox_core::watermark::OffsetTracker;
//! use outbox_core::{CommitOffset, LogPosition};
//! let mut t = OffsetTracker::default();
//! let tickets: Vec<_> = (10..13).map(|o| t.begin(&LogPosition::new("orders", 0, o))).collect();
//! t.finish(&tickets[2]);
//! assert_eq!(t.take_commits(), vec![CommitOffset::new("orders", 0, 10)]);
//! t.finish(&tickets[0]);
//! assert_eq!(t.take_commits(), vec![CommitOffset::new("orders", 0, 11)]);
//! t.finish(&tickets[1]);
//! assert_eq!(t.take_commits(), vec![CommitOffset::new("orders", 0, 13)]);
//! assert!(t.take_commits().is_empty()); // nothing new to commit
//! ```
//!
//! # Rewinds, assignments and stale work
//!
//! Every partition entry has an *epoch*. [`OffsetTracker::begin`] hands out a [`Ticket`] that
//! names the epoch; [`OffsetTracker::finish`] ignores a ticket of an older epoch. A partition
//! gets a new epoch (all its pending offsets forgotten, nothing committed yet) when
//!
//! * an offset at or below the highest one seen arrives (a **rewind**: a topic recreated under
//!   a running consumer, an out-of-range reset after the broker lost data, a seek after
//!   truncation). The same offsets may now hold other records, so nothing finished before the
//!   rewind may count for them;
//! * the partition is assigned ([`OffsetTracker::assign`]), revoked ([`OffsetTracker::revoke`])
//!   or its assignment is lost ([`OffsetTracker::lose`]).
//!
//! Work still running for the old epoch finishes harmlessly: its effect is durable (or rolled
//! back), the redelivered copy is deduplicated by the inbox, and its ticket moves no watermark.
//!
//! The engine owns one tracker and hands a [`SharedOffsetTracker`] to its
//! [`crate::MessageSource`] ([`crate::MessageSource::attach_offsets`]), so a rebalance callback
//! commits exactly what is final.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::inbox::{CommitOffset, LogPosition, TopicPartition};

/// Proof that an offset was begun, needed to finish it. Tickets of an older epoch of the
/// partition (before a rewind, a revoke or a new assignment) are ignored.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Ticket {
    position: LogPosition,
    epoch: u64,
}

impl Ticket {
    /// The message's position.
    pub fn position(&self) -> &LogPosition {
        &self.position
    }

    /// The partition epoch this ticket belongs to.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
}

/// Watermark of one partition.
#[derive(Clone, Debug)]
pub struct PartitionWatermark {
    pending: BTreeSet<i64>,
    highest_seen: Option<i64>,
    committed: Option<i64>,
    epoch: u64,
}

impl PartitionWatermark {
    fn new(epoch: u64) -> Self {
        Self {
            pending: BTreeSet::new(),
            highest_seen: None,
            committed: None,
            epoch,
        }
    }

    /// Next offset to read that may be committed now, if any message was seen.
    pub fn committable(&self) -> Option<i64> {
        match self.pending.first() {
            Some(lowest) => Some(*lowest),
            None => self.highest_seen.map(|h| h + 1),
        }
    }

    /// Number of offsets not final.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// The epoch of this entry.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The last offset handed out for committing ([`OffsetTracker::take_commits`]).
    pub fn last_taken(&self) -> Option<i64> {
        self.committed
    }

    fn take_commit(&mut self) -> Option<i64> {
        let c = self.committable()?;
        if self.committed.is_some_and(|done| done >= c) {
            return None;
        }
        self.committed = Some(c);
        Some(c)
    }
}

/// What [`OffsetTracker::begin`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BeginKind {
    /// The next offset of the partition (possibly after a gap: compaction, control records).
    Forward,
    /// An offset at or below the highest one seen: the partition was reset to a new epoch.
    Rewind {
        /// The highest offset seen before.
        highest_seen: i64,
    },
}

/// Watermarks of every assigned partition. See the [module docs](self).
#[derive(Clone, Debug, Default)]
pub struct OffsetTracker {
    partitions: BTreeMap<TopicPartition, PartitionWatermark>,
    next_epoch: u64,
    rewinds: u64,
    /// Bumped whenever tickets of a partition stop being current.
    changes: u64,
}

impl OffsetTracker {
    fn fresh_epoch(&mut self) -> u64 {
        self.next_epoch += 1;
        self.next_epoch
    }

    /// A message at `position` was received; its outcome is not final. An offset at or below
    /// the highest one seen in the partition resets the partition first (a rewind).
    pub fn begin(&mut self, position: &LogPosition) -> Ticket {
        self.begin_checked(position).0
    }

    /// [`begin`](Self::begin), also telling whether this was a rewind.
    pub fn begin_checked(&mut self, position: &LogPosition) -> (Ticket, BeginKind) {
        let tp = position.topic_partition();
        let mut kind = BeginKind::Forward;
        let rewound = self
            .partitions
            .get(&tp)
            .and_then(|w| w.highest_seen)
            .filter(|h| position.offset <= *h);
        if let Some(highest_seen) = rewound {
            kind = BeginKind::Rewind { highest_seen };
            self.rewinds += 1;
            self.changes += 1;
            let epoch = self.fresh_epoch();
            tracing::warn!(partition = %tp, offset = position.offset, highest_seen, "offset at or below the highest seen: the log was rewound; forgetting the partition's pending offsets");
            self.partitions
                .insert(tp.clone(), PartitionWatermark::new(epoch));
        }
        if !self.partitions.contains_key(&tp) {
            let epoch = self.fresh_epoch();
            self.partitions
                .insert(tp.clone(), PartitionWatermark::new(epoch));
        }
        let w = self.partitions.get_mut(&tp).expect("inserted above");
        w.pending.insert(position.offset);
        w.highest_seen = Some(
            w.highest_seen
                .map_or(position.offset, |h| h.max(position.offset)),
        );
        (
            Ticket {
                position: position.clone(),
                epoch: w.epoch,
            },
            kind,
        )
    }

    /// The outcome of the ticket's message is final (applied, duplicate, or parked durably).
    /// Returns `false` (and changes nothing) for a ticket of an older epoch or one already
    /// finished.
    pub fn finish(&mut self, ticket: &Ticket) -> bool {
        match self.partitions.get_mut(&ticket.position.topic_partition()) {
            Some(w) if w.epoch == ticket.epoch => w.pending.remove(&ticket.position.offset),
            _ => false,
        }
    }

    /// Whether the ticket still belongs to the partition's current epoch.
    pub fn is_current(&self, ticket: &Ticket) -> bool {
        self.partitions
            .get(&ticket.position.topic_partition())
            .is_some_and(|w| w.epoch == ticket.epoch)
    }

    /// Offsets that advanced since the last call (next offsets to read).
    pub fn take_commits(&mut self) -> Vec<CommitOffset> {
        self.partitions
            .iter_mut()
            .filter_map(|(tp, w)| w.take_commit().map(|o| tp.at_next(o)))
            .collect()
    }

    /// A partition is revoked: returns its final commit (if it advanced) and forgets it.
    /// Messages still pending there are delivered again to the next owner.
    pub fn revoke(&mut self, partition: &TopicPartition) -> Option<CommitOffset> {
        let mut w = self.partitions.remove(partition)?;
        self.changes += 1;
        w.take_commit().map(|o| partition.at_next(o))
    }

    /// A partition was assigned: reading resumes at the group's committed offset, so anything
    /// tracked for it belongs to an earlier assignment and is forgotten.
    pub fn assign(&mut self, partition: &TopicPartition) {
        if self.partitions.remove(partition).is_some() {
            self.changes += 1;
            tracing::debug!(partition = %partition, "assigned again; earlier entries forgotten");
        }
    }

    /// The assignment of a partition was lost (the group gave it away without a clean revoke):
    /// forgets it without committing.
    pub fn lose(&mut self, partition: &TopicPartition) {
        if self.partitions.remove(partition).is_some() {
            self.changes += 1;
        }
    }

    /// Offsets not final across all partitions.
    pub fn in_flight(&self) -> usize {
        self.partitions
            .values()
            .map(PartitionWatermark::in_flight)
            .sum()
    }

    /// The watermark of one partition.
    pub fn partition(&self, partition: &TopicPartition) -> Option<&PartitionWatermark> {
        self.partitions.get(partition)
    }

    /// Partitions tracked right now.
    pub fn partitions(&self) -> impl Iterator<Item = (&TopicPartition, &PartitionWatermark)> {
        self.partitions.iter()
    }

    /// Rewinds seen so far.
    pub fn rewinds(&self) -> u64 {
        self.rewinds
    }

    /// A counter that moves whenever tickets stop being current (a revoke, a lost or new
    /// assignment of a tracked partition, a rewind): a holder of tickets compares it with the
    /// value it last saw to know when to look for tickets that are not
    /// [`current`](Self::is_current) any more, without checking each ticket every time.
    pub fn changes(&self) -> u64 {
        self.changes
    }
}

/// An [`OffsetTracker`] shared between the engine and its source's rebalance callbacks.
/// Cloning gives another handle to the same tracker.
#[derive(Clone, Debug, Default)]
pub struct SharedOffsetTracker(Arc<Mutex<OffsetTracker>>);

impl SharedOffsetTracker {
    /// A new, empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Locks the tracker. Hold the guard briefly: rebalance callbacks wait on it.
    pub fn lock(&self) -> MutexGuard<'_, OffsetTracker> {
        // The tracker holds plain data and no method panics half-way, so a poisoned lock still
        // guards a consistent value.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Final commits of `partitions`, which are being revoked; forgets them.
    pub fn revoke(&self, partitions: &[TopicPartition]) -> Vec<CommitOffset> {
        let mut t = self.lock();
        partitions.iter().filter_map(|p| t.revoke(p)).collect()
    }

    /// `partitions` were assigned.
    pub fn assign(&self, partitions: &[TopicPartition]) {
        let mut t = self.lock();
        partitions.iter().for_each(|p| t.assign(p));
    }

    /// The assignment of `partitions` was lost.
    pub fn lose(&self, partitions: &[TopicPartition]) {
        let mut t = self.lock();
        partitions.iter().for_each(|p| t.lose(p));
    }

    /// Whether two handles share one tracker.
    pub fn same_as(&self, other: &SharedOffsetTracker) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pos(p: i32, o: i64) -> LogPosition {
        LogPosition::new("t", p, o)
    }

    /// A ticket names the epoch of its partition entry, and a rewind moves to a new one.
    #[test]
    fn tickets_carry_their_partitions_epoch() {
        let mut t = OffsetTracker::default();
        let first = t.begin(&pos(0, 1));
        let tp = TopicPartition::new("t", 0);
        assert_eq!(first.epoch(), t.partition(&tp).unwrap().epoch());
        assert_eq!(first.position(), &pos(0, 1));
        let other = t.begin(&pos(1, 1));
        assert_ne!(
            other.epoch(),
            first.epoch(),
            "each partition entry its own epoch"
        );
        let rewound = t.begin(&pos(0, 0));
        assert_ne!(rewound.epoch(), first.epoch());
        assert_eq!(rewound.epoch(), t.partition(&tp).unwrap().epoch());
    }

    /// Rewinds are counted, the rewound partition's old tickets stop counting, and the tracker
    /// lists what it tracks.
    #[test]
    fn rewinds_are_counted_and_old_tickets_stop_counting() {
        let mut t = OffsetTracker::default();
        assert_eq!(t.rewinds(), 0);
        let old = t.begin(&pos(0, 5));
        t.begin(&pos(1, 0));
        assert!(t.is_current(&old));
        let tracked: Vec<_> = t.partitions().map(|(tp, _)| tp.partition).collect();
        assert_eq!(tracked, vec![0, 1]);
        t.begin(&pos(0, 3));
        assert!(!t.is_current(&old), "a ticket from before the rewind");
        t.begin(&pos(0, 2));
        assert_eq!(t.rewinds(), 2);
    }

    /// The shared handle's assign and lose forget a partition without committing it; revoke
    /// hands out its final commit.
    #[test]
    fn shared_assign_lose_and_revoke() {
        let shared = SharedOffsetTracker::new();
        let p0 = TopicPartition::new("t", 0);
        let p1 = TopicPartition::new("t", 1);
        let p2 = TopicPartition::new("t", 2);
        {
            let mut t = shared.lock();
            for p in 0..3 {
                let ticket = t.begin(&pos(p, 4));
                t.finish(&ticket);
            }
        }
        shared.assign(std::slice::from_ref(&p0));
        shared.lose(std::slice::from_ref(&p1));
        {
            let t = shared.lock();
            assert!(
                t.partition(&p0).is_none(),
                "assign forgets the earlier entry"
            );
            assert!(t.partition(&p1).is_none(), "lose forgets the entry");
        }
        assert_eq!(shared.revoke(&[p0, p1, p2.clone()]), vec![p2.at_next(5)]);
        assert!(shared.same_as(&shared.clone()));
        assert!(!shared.same_as(&SharedOffsetTracker::new()));
    }

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
            let mut t = OffsetTracker::default();
            let tickets: BTreeMap<i64, Ticket> =
                begun.iter().map(|o| (*o, t.begin(&pos(0, *o)))).collect();
            finished.iter().for_each(|o| assert!(t.finish(&tickets[o])));
            let tp = TopicPartition::new("t", 0);
            assert_eq!(
                t.partition(&tp).and_then(PartitionWatermark::committable),
                *expect,
                "{begun:?} {finished:?}"
            );
        }
    }

    #[test]
    fn finish_unknown_or_twice_is_false_and_revoke_commits() {
        let mut t = OffsetTracker::default();
        let a = t.begin(&pos(0, 1));
        let b = t.begin(&pos(0, 2));
        assert!(t.finish(&a));
        assert!(!t.finish(&a), "finished twice");
        let tp = TopicPartition::new("t", 0);
        assert_eq!(t.revoke(&tp), Some(CommitOffset::new("t", 0, 2)));
        assert_eq!(t.revoke(&tp), None);
        assert!(!t.finish(&b), "a ticket of a revoked partition");
        assert_eq!(t.in_flight(), 0);
    }

    /// The defect: offsets 0..10 committed, the topic recreated, offsets 0..10 come again with
    /// new records; only 2 of them applied. The old watermark (highest seen 9) must not let
    /// offset 10 be committed.
    #[test]
    fn rewind_resets_the_partition_and_old_tickets_do_not_count() {
        let mut t = OffsetTracker::default();
        let old: Vec<Ticket> = (0..10).map(|o| t.begin(&pos(0, o))).collect();
        for tk in &old[..9] {
            t.finish(tk);
        }
        assert_eq!(t.take_commits(), vec![CommitOffset::new("t", 0, 9)]);
        // The log is rewound: offset 0 again.
        let (first, kind) = t.begin_checked(&pos(0, 0));
        assert_eq!(kind, BeginKind::Rewind { highest_seen: 9 });
        let new: Vec<Ticket> = std::iter::once(first)
            .chain((1..10).map(|o| t.begin(&pos(0, o))))
            .collect();
        // Old work finishing late moves nothing.
        assert!(!t.finish(&old[9]));
        t.finish(&new[0]);
        t.finish(&new[1]);
        assert_eq!(t.take_commits(), vec![CommitOffset::new("t", 0, 2)]);
        assert_eq!(t.rewinds(), 1);
        // A repeated offset that is still pending is a rewind too.
        let again = t.begin_checked(&pos(0, 5)).1;
        assert!(matches!(again, BeginKind::Rewind { .. }));
    }

    #[test]
    fn assign_and_lose_forget_entries_without_commits() {
        let mut t = OffsetTracker::default();
        let tp = TopicPartition::new("t", 0);
        let a = t.begin(&pos(0, 4));
        t.assign(&tp);
        assert!(!t.finish(&a), "ticket of an earlier assignment");
        assert!(t.take_commits().is_empty());
        let b = t.begin(&pos(0, 4));
        assert!(t.is_current(&b));
        t.finish(&b);
        t.lose(&tp);
        assert!(
            t.take_commits().is_empty(),
            "nothing committed after a lost assignment"
        );
        let shared = SharedOffsetTracker::new();
        let c = shared.lock().begin(&pos(1, 7));
        shared.lock().finish(&c);
        assert_eq!(
            shared.revoke(&[TopicPartition::new("t", 1), tp.clone()]),
            vec![CommitOffset::new("t", 1, 8)]
        );
        assert!(shared.same_as(&shared.clone()));
        assert!(!shared.same_as(&SharedOffsetTracker::new()));
    }

    /// `changes` moves exactly when tickets stop being current: a revoke, an assignment or a
    /// loss of a tracked partition, a rewind; never for a new partition's first message, a
    /// finish, or an untracked partition.
    #[test]
    fn changes_move_when_tickets_stop_being_current() {
        let mut t = OffsetTracker::default();
        let a = t.begin(&pos(0, 1));
        let b = t.begin(&pos(1, 1));
        t.finish(&b);
        t.assign(&TopicPartition::new("t", 9));
        t.lose(&TopicPartition::new("t", 9));
        assert_eq!(t.revoke(&TopicPartition::new("t", 9)), None);
        assert_eq!(t.changes(), 0, "nothing stopped being current");
        t.begin(&pos(0, 0));
        assert_eq!(t.changes(), 1, "rewind");
        t.assign(&TopicPartition::new("t", 0));
        assert_eq!(t.changes(), 2, "assign");
        assert_eq!(
            t.revoke(&TopicPartition::new("t", 1)),
            Some(CommitOffset::new("t", 1, 2))
        );
        assert_eq!(t.changes(), 3, "revoke");
        t.begin(&pos(0, 5));
        t.lose(&TopicPartition::new("t", 0));
        assert_eq!(t.changes(), 4, "lose");
        assert!(!t.is_current(&a));
    }
}
