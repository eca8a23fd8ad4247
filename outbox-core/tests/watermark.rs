//! Property test of the offset tracker: under any interleaving of receipts, completions in any
//! order, rewinds, revokes, assignments and lost assignments across several partitions, no
//! commit ever passes an offset whose outcome is not final in the partition's current epoch,
//! and once everything is final the commit reaches one past the highest offset seen.

use std::collections::{BTreeMap, BTreeSet};

use outbox_core::watermark::{BeginKind, OffsetTracker, Ticket};
use outbox_core::{CommitOffset, LogPosition, TopicPartition};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    /// Receive the next offset of a partition, skipping `gap` offsets (compaction, control
    /// records).
    Receive { partition: i32, gap: i64 },
    /// The log of a partition is rewound to `back` offsets below the highest seen.
    Rewind { partition: i32, back: i64 },
    /// The outcome of the `pick`-th outstanding ticket (of any epoch) becomes final.
    Finish { pick: usize },
    /// Commit what advanced.
    Take,
    /// The partition is revoked (its final offset committed).
    Revoke { partition: i32 },
    /// The partition is assigned again.
    Assign { partition: i32 },
    /// The partition's assignment is lost.
    Lose { partition: i32 },
}

fn op() -> impl Strategy<Value = Op> {
    let p = 0..3i32;
    prop_oneof![
        6 => (p.clone(), 0..3i64).prop_map(|(partition, gap)| Op::Receive { partition, gap }),
        1 => (p.clone(), 0..6i64).prop_map(|(partition, back)| Op::Rewind { partition, back }),
        6 => any::<usize>().prop_map(|pick| Op::Finish { pick }),
        3 => Just(Op::Take),
        1 => p.clone().prop_map(|partition| Op::Revoke { partition }),
        1 => p.clone().prop_map(|partition| Op::Assign { partition }),
        1 => p.prop_map(|partition| Op::Lose { partition }),
    ]
}

/// The reference model: per partition, the offsets received in the current epoch and whether
/// each is final.
#[derive(Default)]
struct Model {
    epochs: BTreeMap<i32, u64>,
    current: BTreeMap<i32, BTreeMap<i64, bool>>,
    next: BTreeMap<i32, i64>,
    outstanding: Vec<(Ticket, i32, u64)>,
    epoch_counter: u64,
}

impl Model {
    fn new_epoch(&mut self, p: i32) {
        self.epoch_counter += 1;
        self.epochs.insert(p, self.epoch_counter);
        self.current.insert(p, BTreeMap::new());
    }

    fn check_commit(&self, c: &CommitOffset) -> Result<(), String> {
        let p = c.partition;
        let seen = self.current.get(&p).cloned().unwrap_or_default();
        for (o, done) in &seen {
            if *o < c.next_offset && !done {
                return Err(format!(
                    "commit {c} passes unfinished offset {o} (current epoch: {seen:?})"
                ));
            }
        }
        let highest = seen.keys().next_back().copied();
        if highest.is_none_or(|h| c.next_offset > h + 1) {
            return Err(format!(
                "commit {c} beyond the highest offset seen {highest:?}"
            ));
        }
        Ok(())
    }
}

fn run(ops: Vec<Op>) -> Result<(), String> {
    let mut t = OffsetTracker::default();
    let mut m = Model::default();
    for op in ops {
        match op {
            Op::Receive { partition, gap } => {
                if !m.current.contains_key(&partition) {
                    m.new_epoch(partition);
                }
                let next = m.next.entry(partition).or_insert(0);
                *next += gap;
                let offset = *next;
                *next += 1;
                let (ticket, kind) = t.begin_checked(&LogPosition::new("t", partition, offset));
                if kind != BeginKind::Forward {
                    return Err(format!(
                        "{offset} in partition {partition} seen as {kind:?}"
                    ));
                }
                m.current
                    .get_mut(&partition)
                    .expect("epoch")
                    .insert(offset, false);
                m.outstanding
                    .push((ticket, partition, m.epochs[&partition]));
            }
            Op::Rewind { partition, back } => {
                let Some(highest) = m
                    .current
                    .get(&partition)
                    .and_then(|s| s.keys().next_back().copied())
                else {
                    continue;
                };
                let offset = (highest - back).max(0);
                let (ticket, kind) = t.begin_checked(&LogPosition::new("t", partition, offset));
                if !matches!(kind, BeginKind::Rewind { .. }) {
                    return Err(format!(
                        "rewind to {offset} (highest {highest}) not detected"
                    ));
                }
                m.new_epoch(partition);
                m.current
                    .get_mut(&partition)
                    .expect("epoch")
                    .insert(offset, false);
                m.next.insert(partition, offset + 1);
                m.outstanding
                    .push((ticket, partition, m.epochs[&partition]));
            }
            Op::Finish { pick } => {
                if m.outstanding.is_empty() {
                    continue;
                }
                let (ticket, p, epoch) = m.outstanding.remove(pick % m.outstanding.len());
                let current = m.epochs.get(&p) == Some(&epoch)
                    && m.current
                        .get(&p)
                        .is_some_and(|s| s.contains_key(&ticket.position().offset));
                let accepted = t.finish(&ticket);
                if accepted != current {
                    return Err(format!(
                        "finish of {} (epoch current: {current}) returned {accepted}",
                        ticket.position()
                    ));
                }
                if current {
                    m.current
                        .get_mut(&p)
                        .expect("epoch")
                        .insert(ticket.position().offset, true);
                }
            }
            Op::Take => {
                for c in t.take_commits() {
                    m.check_commit(&c)?;
                }
            }
            Op::Revoke { partition } => {
                if let Some(c) = t.revoke(&TopicPartition::new("t", partition)) {
                    m.check_commit(&c)?;
                }
                m.current.remove(&partition);
                m.epochs.remove(&partition);
            }
            Op::Assign { partition } => {
                t.assign(&TopicPartition::new("t", partition));
                m.current.remove(&partition);
                m.epochs.remove(&partition);
            }
            Op::Lose { partition } => {
                t.lose(&TopicPartition::new("t", partition));
                m.current.remove(&partition);
                m.epochs.remove(&partition);
            }
        }
        let pending: usize = m
            .current
            .values()
            .map(|s| s.values().filter(|d| !**d).count())
            .sum();
        if t.in_flight() != pending {
            return Err(format!(
                "in flight {} but the model has {pending}",
                t.in_flight()
            ));
        }
    }
    // Finish everything still current: the commit reaches one past the highest offset seen.
    for (ticket, p, epoch) in std::mem::take(&mut m.outstanding) {
        if m.epochs.get(&p) == Some(&epoch) {
            t.finish(&ticket);
        }
    }
    let commits: BTreeMap<i32, i64> = t
        .take_commits()
        .into_iter()
        .map(|c| (c.partition, c.next_offset))
        .collect();
    for (p, seen) in &m.current {
        let Some(h) = seen.keys().next_back() else {
            continue;
        };
        let last = t
            .partition(&TopicPartition::new("t", *p))
            .and_then(|w| w.last_taken());
        let got = commits.get(p).copied().or(last);
        if got != Some(h + 1) {
            return Err(format!(
                "partition {p}: final commit {got:?}, expected {}",
                h + 1
            ));
        }
    }
    let _: BTreeSet<()> = BTreeSet::new();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

    #[test]
    fn commits_never_pass_an_unfinished_offset(ops in prop::collection::vec(op(), 1..120)) {
        if let Err(e) = run(ops) {
            prop_assert!(false, "{}", e);
        }
    }
}

/// A mutation of the tracker that ignores epochs would commit past new records after a rewind;
/// the property catches exactly that scenario.
#[test]
fn the_rewind_scenario_of_the_issue() {
    let ops = vec![
        Op::Receive {
            partition: 0,
            gap: 0,
        },
        Op::Receive {
            partition: 0,
            gap: 0,
        },
        Op::Finish { pick: 0 },
        Op::Take,
        Op::Rewind {
            partition: 0,
            back: 1,
        },
        Op::Receive {
            partition: 0,
            gap: 0,
        },
        Op::Finish { pick: 0 }, // the old offset 1 finishing late
        Op::Take,
    ];
    run(ops).unwrap();
}
