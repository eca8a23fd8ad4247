//! The reference model and the invariants, checked against the real state (the store's rows,
//! the log, the inbox's registrations and parked messages, the committed effects and offsets)
//! after every step.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};

use outbox_core::{DeliveryStatus, Envelope, EventId, LogPosition};
use outbox_testkit::{LogRecord, MemoryLog};

use crate::backend::{EffectsView, RowView};

/// Violations found by the doubles and wrappers while a step ran (they cannot return them).
#[derive(Clone, Debug, Default)]
pub struct Violations(Arc<Mutex<Vec<String>>>);

impl Violations {
    /// Records a violation.
    pub fn push(&self, message: String) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(message);
    }

    /// The first violation recorded, if any.
    pub fn first(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .first()
            .cloned()
    }
}

pub(crate) type Check = Result<(), String>;

pub(crate) fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Check {
    if cond {
        Ok(())
    } else {
        Err(msg())
    }
}

/// What the simulation knows independently of the system under test.
#[derive(Debug, Default)]
pub(crate) struct Model {
    pub(crate) committed: BTreeMap<EventId, Envelope>,
    pub(crate) rolled_back: BTreeSet<EventId>,
    /// Re-issued copy -> the event it replaces.
    pub(crate) reissued: BTreeMap<EventId, EventId>,
    pub(crate) discarded: BTreeSet<EventId>,
    pub(crate) retried: BTreeSet<EventId>,
    pub(crate) parked_seen: BTreeSet<EventId>,
    pub(crate) published_ever: BTreeSet<EventId>,
}

impl Model {
    fn known(&self, id: &EventId) -> bool {
        self.committed.contains_key(id) || self.reissued.contains_key(id)
    }

    /// The dedup id of `id` (a re-issued copy counts as the event it replaces).
    pub(crate) fn dedup(&self, id: EventId) -> EventId {
        let mut d = id;
        while let Some(original) = self.reissued.get(&d) {
            d = *original;
        }
        d
    }

    /// Every event that must end up published and applied: committed or re-issued, not
    /// discarded.
    pub(crate) fn expected(&self) -> Vec<EventId> {
        self.committed
            .keys()
            .chain(self.reissued.keys())
            .filter(|id| !self.discarded.contains(id))
            .copied()
            .collect()
    }
}

/// The real state after a step.
pub(crate) struct Observed {
    pub(crate) rows: Vec<RowView>,
    pub(crate) records: Vec<LogRecord>,
    pub(crate) effects: EffectsView,
    pub(crate) registered: BTreeSet<EventId>,
    /// Positions of messages parked on the consumer side (any status).
    pub(crate) consumer_parked: BTreeSet<LogPosition>,
    /// Committed offset per partition.
    pub(crate) offsets: Vec<(i32, i64)>,
}

fn decode(records: &[LogRecord]) -> Vec<(&LogRecord, Envelope)> {
    records
        .iter()
        .filter_map(|r| r.decode().ok().map(|e| (r, e)))
        .collect()
}

/// The invariants that hold after every step.
pub(crate) fn check(model: &mut Model, log: &MemoryLog, seen: &Observed) -> Check {
    let logged = decode(&seen.records);
    let logged_ids: BTreeSet<EventId> = logged.iter().map(|(_, e)| e.event_id).collect();
    // Nothing from a rolled-back transaction anywhere; nothing unknown.
    for row in &seen.rows {
        ensure(model.known(&row.event_id), || {
            format!("row {} was never committed", row.event_id)
        })?;
    }
    for id in &logged_ids {
        ensure(!model.rolled_back.contains(id), || {
            format!("event {id} of a rolled-back transaction was published")
        })?;
        ensure(model.known(id), || format!("unknown event {id} in the log"))?;
    }
    // No committed event lost: cleanup may delete published and discarded rows only.
    let in_store: BTreeSet<EventId> = seen.rows.iter().map(|r| r.event_id).collect();
    for id in model.committed.keys().chain(model.reissued.keys()) {
        ensure(
            in_store.contains(id)
                || model.published_ever.contains(id)
                || model.discarded.contains(id),
            || format!("committed event {id} vanished from the outbox"),
        )?;
    }
    for row in &seen.rows {
        let id = row.event_id;
        match row.status {
            DeliveryStatus::Published => {
                model.published_ever.insert(id);
                // The acknowledgement metadata stored points at this very record.
                let ack = row.ack.as_ref().ok_or_else(|| {
                    format!("event {id} is marked published without acknowledgement metadata")
                })?;
                let at = log
                    .records(&ack.topic, ack.partition)
                    .into_iter()
                    .find(|r| r.offset == ack.offset);
                let there = at
                    .as_ref()
                    .and_then(|r| r.decode().ok())
                    .map(|e| e.event_id);
                ensure(there == Some(id), || {
                    format!(
                        "event {id} is marked published at {}/{}@{} but the log holds {} there",
                        ack.topic,
                        ack.partition,
                        ack.offset,
                        there.map_or_else(|| "nothing".to_owned(), |t| t.to_string())
                    )
                })?;
                ensure(
                    !model.parked_seen.contains(&id) || model.retried.contains(&id),
                    || format!("parked event {id} was published without an operator action"),
                )?;
            }
            DeliveryStatus::Parked => {
                model.parked_seen.insert(id);
            }
            _ => {}
        }
    }
    // First deliveries per aggregate in version order.
    let mut first_seen: BTreeSet<EventId> = BTreeSet::new();
    let mut last_version: BTreeMap<&str, i64> = BTreeMap::new();
    for (_, e) in &logged {
        if !first_seen.insert(e.event_id) {
            continue;
        }
        let last = last_version.entry(&e.aggregate_id).or_insert(0);
        ensure(e.aggregate_version >= *last, || {
            format!(
                "first delivery of {} v{} after v{}",
                e.aggregate_id, e.aggregate_version, last
            )
        })?;
        *last = e.aggregate_version;
    }
    // Each effect at most once, and in version order per aggregate.
    for (id, n) in &seen.effects.counts {
        ensure(*n == 1, || format!("effect of {id} applied {n} times"))?;
    }
    if let Some(v) = seen.effects.out_of_order.first() {
        return Err(format!("effects out of version order: {v}"));
    }
    // The committed offset never passes a message whose outcome is not final: registered
    // (with its effect, or as a duplicate or stale version), or parked on the consumer side
    // (itself, or another copy of its event, which a copy is recognised as).
    let parked_events: BTreeSet<EventId> = logged
        .iter()
        .filter(|(r, _)| seen.consumer_parked.contains(&r.position()))
        .map(|(_, e)| e.dedup_id())
        .collect();
    for (p, committed) in &seen.offsets {
        for (r, e) in &logged {
            if r.partition != *p || r.offset >= *committed {
                continue;
            }
            ensure(
                seen.registered.contains(&e.dedup_id())
                    || seen.consumer_parked.contains(&r.position())
                    || parked_events.contains(&e.dedup_id()),
                || {
                    format!(
                        "offset {committed} committed in partition {p} but the message at offset {} ({}) is not final",
                        r.offset, e.event_id
                    )
                },
            )?;
        }
    }
    Ok(())
}

/// A sent batch: each record is the head of its aggregate (every earlier version published or
/// discarded) and not parked.
pub(crate) fn check_send_order(rows: &[RowView], sending: &[Envelope]) -> Check {
    for e in sending {
        for row in rows {
            if row.aggregate_id != e.aggregate_id {
                continue;
            }
            if row.event_id == e.event_id {
                ensure(row.status != DeliveryStatus::Parked, || {
                    format!("parked event {} sent", e.event_id)
                })?;
            }
            if row.version < e.aggregate_version {
                ensure(
                    matches!(
                        row.status,
                        DeliveryStatus::Published | DeliveryStatus::Discarded
                    ),
                    || {
                        format!(
                            "{} v{} sent while v{} is {:?}",
                            e.aggregate_id, e.aggregate_version, row.version, row.status
                        )
                    },
                )?;
            }
        }
    }
    Ok(())
}
