//! The reference model and the invariants, checked against the real state (the store's rows,
//! the log, the inbox's registrations and parked messages, the committed effects and offsets)
//! after every step.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};

use chrono::{DateTime, Utc};
use outbox_core::{DeliveryStatus, Envelope, EventId, LogPosition, ParkKind};
use outbox_testkit::{rules, LogRecord, MemoryLog};

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
    /// When each committed event committed (the store's clock).
    pub(crate) committed_at: BTreeMap<EventId, DateTime<Utc>>,
    /// Record-scoped failures (the record's own transient or permanent failure) answered for
    /// each event since its last operator retry: the most attempts it may have spent.
    pub(crate) record_failures: BTreeMap<EventId, u32>,
    /// Parks seen, by kind.
    pub(crate) gap_parked: usize,
    pub(crate) out_of_order_parked: usize,
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

    /// An operator retry of `id` succeeded: its attempts start again.
    pub(crate) fn retry(&mut self, id: EventId) {
        self.retried.insert(id);
        self.record_failures.remove(&id);
    }

    /// Aggregate and version of a committed event or a re-issued copy.
    fn version_of(&self, id: EventId) -> Option<(&str, i64)> {
        self.committed
            .get(&self.dedup(id))
            .map(|e| (e.aggregate_id.as_str(), e.aggregate_version))
    }

    /// The lowest version of `aggregate` that no committed event has, below its highest.
    pub(crate) fn lowest_hole(&self, aggregate: &str) -> Option<i64> {
        let have: BTreeSet<i64> = self
            .committed
            .values()
            .filter(|e| e.aggregate_id == aggregate)
            .map(|e| e.aggregate_version)
            .collect();
        let top = *have.iter().next_back()?;
        (1..top).find(|v| !have.contains(v))
    }

    /// The last version of `aggregate` that the store may count as done, as the model knows
    /// it: the highest published or discarded, or one below an operator's retry or re-issue
    /// (which accepts a gap). The store must claim `floor + 1` and nothing else.
    pub(crate) fn floor(&self, rows: &[RowView], aggregate: &str) -> i64 {
        let reissued: BTreeSet<EventId> = self.reissued.values().copied().collect();
        let done = |id: EventId| -> i64 {
            match self.version_of(id) {
                Some((a, v)) if a == aggregate => {
                    if reissued.contains(&id) {
                        v - 1
                    } else {
                        v
                    }
                }
                _ => 0,
            }
        };
        let mut floor = 0;
        for row in rows {
            if row.aggregate_id == aggregate
                && matches!(
                    row.status,
                    DeliveryStatus::Published | DeliveryStatus::Discarded
                )
            {
                floor = floor.max(done(row.event_id));
            }
        }
        for id in self.published_ever.iter().chain(self.discarded.iter()) {
            floor = floor.max(done(*id));
        }
        for id in self.retried.iter().chain(reissued.iter()) {
            if let Some((a, v)) = self.version_of(*id) {
                if a == aggregate {
                    floor = floor.max(v - 1);
                }
            }
        }
        floor
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
    /// Open consumer-side parking (head or waiting): aggregate, version, event.
    pub(crate) consumer_open: Vec<(String, i64, Option<EventId>)>,
    /// Committed offset per partition (Kafka).
    pub(crate) offsets: Vec<(i32, i64)>,
    /// The stored messages the broker holds acknowledged (JetStream, RabbitMQ).
    pub(crate) acked: Vec<LogRecord>,
    /// Events of messages parked on the consumer side (any status).
    pub(crate) parked_events: BTreeSet<EventId>,
    /// Whether the consumer promises its effects in version order per aggregate (not
    /// `Unchecked` over JetStream's redeliveries).
    pub(crate) order_promised: bool,
    /// The store's clock.
    pub(crate) now: DateTime<Utc>,
    /// How long the store holds a version gap.
    pub(crate) gap_timeout: std::time::Duration,
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
        // Attempts are spent by the record's own failures only: a broker that is down (a
        // transport failure, a lost acknowledgement) defers the record without spending one.
        let failures = model.record_failures.get(&id).copied().unwrap_or(0);
        ensure(rules::attempts_within(row.attempts, failures), || {
            format!(
                "event {id} ({} v{}) has spent {} attempts but had {failures} record-scoped \
                 failures since its last retry: a deferral spent an attempt",
                row.aggregate_id, row.version, row.attempts
            )
        })?;
        match row.status {
            DeliveryStatus::Published => {
                model.published_ever.insert(id);
                // The acknowledgement metadata stored points at this very record (in the
                // transport's own coordinates).
                let ack = row.ack.as_ref().ok_or_else(|| {
                    format!("event {id} is marked published without acknowledgement metadata")
                })?;
                crate::transport::check_ack(ack, log, id, &row.aggregate_id)?;
                ensure(
                    !model.parked_seen.contains(&id) || model.retried.contains(&id),
                    || format!("parked event {id} was published without an operator action"),
                )?;
            }
            DeliveryStatus::Parked if model.parked_seen.insert(id) => {
                check_park(model, seen, row)?;
            }
            _ => {}
        }
    }
    // First deliveries per aggregate in strictly increasing version order (a re-issued copy
    // is its original's delivery; two events of one version are never both published): the
    // rule the randomized runs judge by, one copy.
    let deliveries = logged.iter().map(|(_, e)| rules::Delivery {
        dedup: e.dedup_id(),
        aggregate: &e.aggregate_id,
        version: e.aggregate_version,
        injected_duplicate: false,
    });
    if let Some(d) = rules::first_delivery_disorder(deliveries).first() {
        let (e, prev) = (&logged[d.at].1, &logged[d.after].1);
        return Err(format!(
            "first delivery of {} v{} after v{}",
            e.aggregate_id, e.aggregate_version, prev.aggregate_version
        ));
    }
    // Each effect at most once, and in version order per aggregate.
    for (id, n) in &seen.effects.counts {
        ensure(*n == 1, || format!("effect of {id} applied {n} times"))?;
    }
    if !seen.order_promised {
        return check_acked(seen, &logged);
    }
    if let Some(v) = seen.effects.out_of_order.first() {
        return Err(format!("effects out of version order: {v}"));
    }
    // A message parked on the consumer side blocks its aggregate, under every version policy:
    // nothing of a higher version of the aggregate is applied while it is open.
    for (agg, v, id) in &seen.consumer_open {
        let applied = seen.effects.last_applied.get(agg).copied().unwrap_or(0);
        ensure(applied <= *v, || {
            format!(
                "{agg} v{applied} was applied while v{v} ({}) is parked on the consumer side",
                id.map_or_else(|| "?".to_owned(), |i| i.to_string())
            )
        })?;
    }
    check_acked(seen, &logged)
}

/// The committed offset never passes a message whose outcome is not final (Kafka); a message
/// the broker holds acknowledged is final (JetStream, RabbitMQ).
fn check_acked(seen: &Observed, logged: &[(&LogRecord, Envelope)]) -> Check {
    for r in &seen.acked {
        let Ok(e) = r.decode() else { continue };
        ensure(
            seen.registered.contains(&e.dedup_id())
                || seen.parked_events.contains(&e.event_id)
                || seen.parked_events.contains(&e.dedup_id()),
            || {
                format!(
                    "message {} (stream sequence / queue entry {}) was acknowledged but its \
                     outcome is not final",
                    e.event_id,
                    r.offset + 1
                )
            },
        )?;
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
        for (r, e) in logged {
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

/// A park the store just made is the one the version rule calls for: a version gap only for a
/// head that skips a version, and only after the gap timeout; out of order only for a version
/// at or below the last one done.
fn check_park(model: &mut Model, seen: &Observed, row: &RowView) -> Check {
    let floor = model.floor(&seen.rows, &row.aggregate_id);
    match row.park_kind {
        Some(ParkKind::VersionGap) => {
            model.gap_parked += 1;
            ensure(row.version > floor + 1, || {
                format!(
                    "{} v{} was parked as a version gap but v{floor} is the last done: no gap",
                    row.aggregate_id, row.version
                )
            })?;
            if let Some(at) = model.committed_at.get(&row.event_id) {
                let held = seen.now.signed_duration_since(*at);
                ensure(
                    held >= chrono::Duration::from_std(seen.gap_timeout).unwrap_or_default(),
                    || {
                        format!(
                            "{} v{} was parked as a version gap {held} after its commit, before \
                             the gap timeout of {:?}",
                            row.aggregate_id, row.version, seen.gap_timeout
                        )
                    },
                )?;
            }
        }
        Some(ParkKind::OutOfOrder) => {
            model.out_of_order_parked += 1;
            ensure(row.version <= floor, || {
                format!(
                    "{} v{} was parked as out of order but v{floor} is the last done",
                    row.aggregate_id, row.version
                )
            })?;
        }
        _ => {}
    }
    Ok(())
}

/// A sent batch: each record is not parked, and is the next version of its aggregate (the
/// one after the last published or discarded, or after the version an operator accepted):
/// nothing goes out past a gap, and nothing at or below a version already done. Runs (send
/// order): a version past the next goes out only when the acknowledgement of every version
/// between came back to its sender under the claim that holds it (`acked_before(e, v)`), so
/// v+1 is never sent before v's acknowledgement, nor after v's failure. Returns how many
/// records went out inside a run.
pub(crate) fn check_send_order(
    model: &Model,
    rows: &[RowView],
    sending: &[Envelope],
    acked_before: impl Fn(&Envelope, i64) -> bool,
) -> Result<usize, String> {
    let mut in_run = 0;
    for e in sending {
        if let Some(row) = rows.iter().find(|r| r.event_id == e.event_id) {
            ensure(row.status != DeliveryStatus::Parked, || {
                format!("parked event {} sent", e.event_id)
            })?;
        }
        let floor = model.floor(rows, &e.aggregate_id);
        if rules::is_next_version(floor, e.aggregate_version) {
            continue;
        }
        let unacked = (floor + 1..e.aggregate_version).find(|v| !acked_before(e, *v));
        ensure(e.aggregate_version > floor + 1 && unacked.is_none(), || {
            let others: Vec<String> = rows
                .iter()
                .filter(|r| r.aggregate_id == e.aggregate_id && r.event_id != e.event_id)
                .map(|r| format!("v{} {:?}", r.version, r.status))
                .collect();
            format!(
                "{} v{} sent while v{floor} is the last version done{} (others: {})",
                e.aggregate_id,
                e.aggregate_version,
                unacked.map_or_else(String::new, |v| format!(
                    " and v{v} was not acknowledged to its sender under its claim"
                )),
                others.join(", ")
            )
        })?;
        in_run += 1;
    }
    Ok(in_run)
}

/// Prefix: a published event that its latest claim handed out inside a run (after the event
/// `runs[e]`) has that event published too: a store never lets `last` pass a version whose
/// predecessors are not all published.
pub(crate) fn check_run_prefix(rows: &[RowView], runs: &BTreeMap<EventId, EventId>) -> Check {
    let status: BTreeMap<EventId, (DeliveryStatus, &str, i64)> = rows
        .iter()
        .map(|r| (r.event_id, (r.status, r.aggregate_id.as_str(), r.version)))
        .collect();
    for (e, pred) in runs {
        let Some((DeliveryStatus::Published, agg, v)) = status.get(e).copied() else {
            continue;
        };
        // A row removed by cleanup was published.
        let Some((st, _, pv)) = status.get(pred).copied() else {
            continue;
        };
        ensure(
            matches!(st, DeliveryStatus::Published | DeliveryStatus::Discarded),
            || {
                format!(
                    "prefix: {agg} v{v} is published while v{pv}, before it in its run, is \
                     {st:?}: the store let its last version pass an unpublished one"
                )
            },
        )?;
    }
    Ok(())
}
