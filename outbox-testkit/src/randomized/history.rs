//! The shared history checker of the randomized concurrency runs: what a run records (claims
//! with the window in which each was certainly live, the fake broker's deliveries, operator
//! actions, commits and rollbacks) and the invariants judged on that history and on the
//! outbox's final rows. Store-neutral (core types only): every backend's randomized run
//! (`outbox-postgres`, `outbox-mysql`) is judged by this one `check`, never by a copy.
//!
//! The checks, each reported with its number:
//!
//! 1. nothing parked is ever delivered without an operator retry in between (also checked at
//!    hand-over: the record's row must be `pending`);
//! 2. every committed event ends published, parked or discarded: nothing pending, nothing lost
//!    (also no re-issued copy), nothing invented, nothing of a rolled-back transaction stored
//!    or delivered, nothing discarded without an audited operator action, the audit trail
//!    matching the actions that succeeded;
//! 3. first deliveries (by `Envelope::dedup_id`) strictly increase in version per aggregate
//!    (equal only for an injected duplicate);
//! 4. no two relays held one aggregate with live claims at once, and no claim holds two
//!    events of one aggregate;
//! 5. every published row's ack metadata is an acknowledgement the broker reported for it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use uuid::Uuid;

use outbox_core::{
    AuditEntry, ClaimedBatch, CompletionReport, EventId, OperatorAction, Outcome, StoreError,
    StoreErrorKind,
};

use super::{is_injected_duplicate, MIN_ACKS, PARTITIONS, TOPIC};

/// A claim as the recording wrapper saw it.
pub(crate) struct ClaimRec {
    pub(crate) owner: String,
    /// Before the claim request.
    pub(crate) before: Instant,
    /// When `claim` returned: the claim was certainly in effect.
    pub(crate) start: Instant,
    /// Earliest moment the claim can have expired on its own.
    pub(crate) deadline: Instant,
    /// When `complete` or `release` was called for it.
    pub(crate) end: Option<Instant>,
    /// (event, aggregate, version)
    pub(crate) records: Vec<(EventId, String, i64)>,
    /// Parks of a locked claim, committed only with its completion.
    pub(crate) provisional_parks: Vec<EventId>,
}

/// An interval in which a state change committed: the call, and the return.
#[derive(Clone, Copy)]
pub(crate) struct Window {
    pub(crate) call: Instant,
    pub(crate) ret: Instant,
}

#[derive(Default)]
pub(crate) struct ClaimLog {
    pub(crate) claims: Vec<ClaimRec>,
    pub(crate) by_token: HashMap<Uuid, usize>,
    /// The latest claim of an event by a relay (what the publisher is handed).
    pub(crate) latest: HashMap<(String, EventId), usize>,
    /// Parks that were applied (by a completion that was not refused, or by a claim).
    pub(crate) parks: HashMap<EventId, Vec<Window>>,
    /// A killed relay: the earliest moment its claims can have ended.
    pub(crate) owner_end: HashMap<String, Instant>,
    pub(crate) parks_by_completion: usize,
    pub(crate) parks_by_claim: usize,
    /// Parks reported by locked claims that were rolled back with the claim.
    pub(crate) claim_parks_rolled_back: usize,
    pub(crate) gaps_held: usize,
    pub(crate) completions: usize,
    pub(crate) superseded: usize,
    pub(crate) releases: usize,
}

/// What the fake broker stored: one entry per record it appended to the topic.
pub(crate) struct Ack {
    pub(crate) at: Instant,
    pub(crate) event: EventId,
    pub(crate) dedup: EventId,
    pub(crate) label: String,
    pub(crate) agg: String,
    pub(crate) version: i64,
    pub(crate) relay: String,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
    /// `Ok` was returned to the relay (false: the acknowledgement was "lost", a timeout).
    pub(crate) reported: bool,
}

#[derive(Default)]
pub(crate) struct Broker {
    pub(crate) acks: Vec<Ack>,
    /// Hand-overs per label (the index of the next verdict about it).
    pub(crate) handovers: HashMap<String, u32>,
    pub(crate) offsets: [i64; PARTITIONS],
    pub(crate) verdicts: BTreeMap<&'static str, usize>,
    /// Records checked against their row's status when handed over.
    pub(crate) checked: usize,
    /// Records handed over after their claim's deadline (a stalled relay): not delivered.
    pub(crate) stalled: usize,
    pub(crate) status_query_failures: usize,
    /// Records not delivered because their status could not be checked.
    pub(crate) unchecked: usize,
    pub(crate) calls: usize,
    pub(crate) long_stalls: usize,
}

pub(crate) struct OpRecord {
    pub(crate) event: EventId,
    pub(crate) label: String,
    pub(crate) action: &'static str,
    pub(crate) window: Window,
    /// "ok", "conflict", "not_found", "uncertain" (a lost connection), "error"
    pub(crate) result: &'static str,
    pub(crate) new_id: Option<EventId>,
}

#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) cycles: usize,
    pub(crate) claimed: usize,
    pub(crate) published: usize,
    pub(crate) retried: usize,
    pub(crate) deferred: usize,
    pub(crate) parked: usize,
    pub(crate) superseded: usize,
    pub(crate) released: usize,
    pub(crate) paused: usize,
    pub(crate) errors: BTreeMap<String, usize>,
    pub(crate) unexpected_errors: Vec<String>,
}

pub(crate) struct Committed {
    pub(crate) id: EventId,
    pub(crate) label: String,
}

pub(crate) struct World {
    pub(crate) test: &'static str,
    pub(crate) seed: u64,
    /// Where the backend keeps the run's data (a schema, a database), for the failure message.
    pub(crate) location: String,
    pub(crate) t0: Instant,
    /// Locked mode: the server may end a claim this long after it was requested.
    pub(crate) locked_hold: Option<Duration>,
    /// How long a claim lives at most without being renewed (lease or hold).
    pub(crate) claim_life: Duration,
    pub(crate) claims: Mutex<ClaimLog>,
    pub(crate) broker: Mutex<Broker>,
    pub(crate) ops: Mutex<Vec<OpRecord>>,
    pub(crate) violations: Mutex<Vec<String>>,
    pub(crate) tally: Mutex<Tally>,
    pub(crate) committed: Mutex<Vec<Committed>>,
    pub(crate) rolled_back: Mutex<Vec<(EventId, String)>>,
    /// Decisions taken per label by the operator (the index of its next decision).
    pub(crate) op_counts: Mutex<HashMap<String, u32>>,
}

impl World {
    pub(crate) fn ms(&self, t: Instant) -> String {
        format!("+{}ms", t.saturating_duration_since(self.t0).as_millis())
    }

    pub(crate) fn violation(&self, v: String) {
        self.violations.lock().unwrap().push(v);
    }

    pub(crate) fn record_claim(
        &self,
        owner: &str,
        before: Instant,
        start: Instant,
        batch: &ClaimedBatch,
    ) {
        let mut log = self.claims.lock().unwrap();
        log.parks_by_claim += batch.parked.len();
        log.gaps_held += batch.gaps_held;
        // Every park a claim reports has committed when the claim returns, in both modes (a
        // locked claim commits its parks before it locks its aggregates again; see
        // `regression_locked_claim_reports_parks_that_roll_back_with_the_claim`). A store that
        // reported parks it later rolls back is caught by check 1: the event is then delivered
        // while "parked" with no retry. (`provisional` stays as the hook to model otherwise.)
        let provisional = false;
        let parked: Vec<EventId> = batch.parked.iter().map(|p| p.event_id).collect();
        if !provisional {
            for id in &parked {
                log.parks.entry(*id).or_default().push(Window {
                    call: before,
                    ret: start,
                });
            }
        }
        if batch.records.is_empty() {
            return;
        }
        let deadline = match (self.locked_hold, batch.lease_remaining) {
            (Some(hold), _) => before + hold,
            (None, Some(remaining)) => before + remaining,
            (None, None) => {
                self.violations.lock().unwrap().push(format!(
                    "check 4 (no lease time): a lease claim of {owner} returned {} records without \
                     lease_remaining",
                    batch.records.len()
                ));
                before
            }
        };
        let mut aggs = HashSet::new();
        let mut records = Vec::with_capacity(batch.records.len());
        for r in &batch.records {
            let e = &r.envelope;
            if !aggs.insert(e.aggregate_id.clone()) {
                self.violations.lock().unwrap().push(format!(
                    "check 4 (two events of an aggregate in one claim): the claim of {owner} at {} \
                     holds two events of aggregate {}",
                    self.ms(start),
                    e.aggregate_id
                ));
            }
            records.push((e.event_id, e.aggregate_id.clone(), e.aggregate_version));
        }
        let idx = log.claims.len();
        log.claims.push(ClaimRec {
            owner: owner.to_owned(),
            before,
            start,
            deadline,
            end: None,
            records,
            provisional_parks: if provisional { parked } else { Vec::new() },
        });
        log.by_token.insert(batch.handle.token, idx);
        for r in &batch.records {
            log.latest
                .insert((owner.to_owned(), r.envelope.event_id), idx);
        }
    }

    pub(crate) fn end_claim(&self, token: Uuid, at: Instant) {
        let mut log = self.claims.lock().unwrap();
        if let Some(&i) = log.by_token.get(&token) {
            let c = &mut log.claims[i];
            c.end = Some(c.end.map_or(at, |e| e.min(at)));
        }
    }

    pub(crate) fn record_completion(
        &self,
        token: Uuid,
        outcomes: &[Outcome],
        rep: &CompletionReport,
        w: Window,
    ) {
        let refused: HashSet<EventId> = rep.superseded_events.iter().copied().collect();
        let mut log = self.claims.lock().unwrap();
        log.completions += 1;
        log.superseded += rep.superseded;
        if let Some(&i) = log.by_token.get(&token) {
            let provisional = std::mem::take(&mut log.claims[i].provisional_parks);
            // The claim's transaction committed when something was applied in it (a claim
            // the store had already dropped applies nothing and commits nothing).
            if rep.applied > 0 {
                for id in provisional {
                    log.parks.entry(id).or_default().push(w);
                }
            } else {
                log.claim_parks_rolled_back += provisional.len();
            }
        }
        for o in outcomes {
            if let Outcome::Park { event_id, .. } = o {
                if !refused.contains(event_id) {
                    log.parks.entry(*event_id).or_default().push(w);
                    log.parks_by_completion += 1;
                }
            }
        }
    }

    /// A claim that ends without a completion: its provisional parks roll back with it.
    pub(crate) fn drop_provisional_parks(&self, token: Uuid) {
        let mut log = self.claims.lock().unwrap();
        if let Some(&i) = log.by_token.get(&token) {
            let n = std::mem::take(&mut log.claims[i].provisional_parks).len();
            log.claim_parks_rolled_back += n;
        }
    }

    /// The deadline of the claim under which `relay` was handed `event`.
    pub(crate) fn deadline_of(&self, relay: &str, event: EventId) -> Option<Instant> {
        let log = self.claims.lock().unwrap();
        let i = *log.latest.get(&(relay.to_owned(), event))?;
        Some(log.claims[i].deadline)
    }

    pub(crate) fn note_cycle(&self, rep: &outbox_core::CycleReport) {
        let mut t = self.tally.lock().unwrap();
        t.cycles += 1;
        t.claimed += rep.claimed;
        t.published += rep.published;
        t.retried += rep.retried;
        t.deferred += rep.deferred;
        t.parked += rep.parked;
        t.superseded += rep.superseded;
        t.released += usize::from(rep.released);
        t.paused += usize::from(rep.pause.is_some());
    }

    pub(crate) fn note_relay_error(&self, owner: &str, e: &StoreError) {
        let mut t = self.tally.lock().unwrap();
        *t.errors.entry(e.kind.as_str().to_owned()).or_default() += 1;
        // A claim ended under the relay (locked mode: the server ended the transaction of a
        // relay that stalled past locked_max_hold) and a lost connection are expected here;
        // anything else (an SQL error, a deadlock, a constraint) is a finding.
        if !matches!(
            e.kind,
            StoreErrorKind::LeaseLost | StoreErrorKind::Connection
        ) {
            t.unexpected_errors
                .push(format!("{owner} at {}: {e}", self.ms(Instant::now())));
        }
    }
}

// ---------------------------------------------------------------------------------------------
/// A final row of the outbox table, as a backend reads it for the checker.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FinalRow {
    /// The event.
    pub event_id: EventId,
    /// Its status as stored (`pending`, `published`, `parked`, `discarded`).
    pub status: String,
    /// The producer's label of the event (header [`LABEL`](super::LABEL)).
    pub label: Option<String>,
    /// The acknowledgement recorded with a publication: topic, partition, offset.
    pub ack: Option<(String, i32, i64)>,
}

impl FinalRow {
    /// A row.
    pub fn new(
        event_id: EventId,
        status: impl Into<String>,
        label: Option<String>,
        ack: Option<(String, i32, i64)>,
    ) -> Self {
        Self {
            event_id,
            status: status.into(),
            label,
            ack,
        }
    }
}

/// Figures of the checks, for the summary.
#[derive(Default)]
pub(crate) struct Checked {
    pub(crate) first_deliveries: usize,
    pub(crate) takeovers: usize,
}

/// The invariants of a recorded run, judged from the history (`world`), the outbox's final
/// rows and its audit trail. Appends one line per finding to `failures`, each starting with the
/// check it fails (`check 1 (...)`).
pub(crate) fn check(
    world: &World,
    rows: &[FinalRow],
    audit: &[AuditEntry],
    (released_claims, uncertain_releases): (u64, usize),
    failures: &mut Vec<String>,
) -> Checked {
    let violations = std::mem::take(&mut *world.violations.lock().unwrap());
    failures.extend(violations);
    let claims = world.claims.lock().unwrap();
    let broker = world.broker.lock().unwrap();
    let ops = world.ops.lock().unwrap();
    let committed = world.committed.lock().unwrap();
    let rolled_back = world.rolled_back.lock().unwrap();
    let tally = world.tally.lock().unwrap();
    failures.extend(
        tally
            .unexpected_errors
            .iter()
            .map(|e| format!("relay cycle failed unexpectedly: {e}")),
    );

    let mut acks_of: HashMap<EventId, Vec<&Ack>> = HashMap::new();
    for a in &broker.acks {
        acks_of.entry(a.event).or_default().push(a);
    }
    let row_of: HashMap<EventId, &FinalRow> = rows.iter().map(|r| (r.event_id, r)).collect();

    // 1. Nothing parked is delivered without an operator retry in between. (The hand-over
    //    check ran during the run; its findings are in `violations`.) Every delivery is
    //    checked against the parks (applied completions and claims) and the retries.
    let mut retries: HashMap<EventId, Vec<Instant>> = HashMap::new();
    for op in ops.iter() {
        if op.action == "retry" && matches!(op.result, "ok" | "uncertain") {
            retries.entry(op.event).or_default().push(op.window.call);
        }
    }
    for a in &broker.acks {
        let Some(parks) = claims.parks.get(&a.event) else {
            continue;
        };
        let Some(park) = parks.iter().filter(|p| p.ret < a.at).max_by_key(|p| p.ret) else {
            continue;
        };
        let retried = retries
            .get(&a.event)
            .is_some_and(|rs| rs.iter().any(|&r| r > park.call && r < a.at));
        if !retried {
            let status = row_of
                .get(&a.event)
                .map_or("<no row>", |r| r.status.as_str());
            failures.push(format!(
                "check 1 (delivered while parked): {} ({}) was delivered by {} at {} although \
                 it was parked at {}..{} and no operator retried it in between (final status \
                 '{status}')",
                a.label,
                a.event,
                a.relay,
                world.ms(a.at),
                world.ms(park.call),
                world.ms(park.ret)
            ));
        }
    }

    // 2. Every committed event ends published, parked or discarded; nothing else is in the
    //    table; nothing of a rolled-back transaction is anywhere; a discard is audited.
    let copies: HashSet<EventId> = ops.iter().filter_map(|o| o.new_id).collect();
    // A re-issue that lost its connection may have made a copy whose id nobody saw.
    let maybe_copied: HashSet<&str> = ops
        .iter()
        .filter(|o| o.action == "reissue" && o.result == "uncertain")
        .map(|o| o.label.as_str())
        .collect();
    let committed_ids: HashSet<EventId> = committed.iter().map(|c| c.id).collect();
    for c in committed.iter() {
        match row_of.get(&c.id) {
            None => failures.push(format!(
                "check 2 (lost): committed event {} ({}) is not in the outbox (lost)",
                c.label, c.id
            )),
            Some(r) if !matches!(r.status.as_str(), "published" | "parked" | "discarded") => {
                failures.push(format!(
                    "check 2 (not finished): committed event {} ({}) ended '{}'",
                    c.label, c.id, r.status
                ));
            }
            Some(_) => {}
        }
    }
    for r in rows {
        let id = r.event_id;
        let maybe_copy = r.label.as_deref().is_some_and(|l| maybe_copied.contains(l));
        if !committed_ids.contains(&id) && !copies.contains(&id) && !maybe_copy {
            failures.push(format!(
                "check 2 (invented): row {id} ({:?}, '{}') was neither committed by the producer \
                 nor created by a re-issue",
                r.label, r.status
            ));
        }
        if copies.contains(&id) && r.status == "pending" {
            failures.push(format!(
                "check 2 (not finished): re-issued copy {id} ended pending"
            ));
        }
    }
    for op in ops.iter() {
        if let Some(copy) = op.new_id {
            if !row_of.contains_key(&copy) {
                failures.push(format!(
                    "check 2 (lost copy): the copy {copy} that re-issuing {} ({}) returned is not \
                     in the outbox",
                    op.label, op.event
                ));
            }
        }
    }
    for (id, label) in rolled_back.iter() {
        if row_of.contains_key(id) || acks_of.contains_key(id) {
            failures.push(format!(
                "check 2 (rolled back): {label} ({id}) of a rolled-back transaction was stored or \
                 delivered"
            ));
        }
    }
    let audited: HashSet<EventId> = audit
        .iter()
        .filter(|e| matches!(e.action, OperatorAction::Discard | OperatorAction::Reissue))
        .map(|e| e.event_id)
        .collect();
    for r in rows.iter().filter(|r| r.status == "discarded") {
        let id = r.event_id;
        if !audited.contains(&id) {
            failures.push(format!(
                "check 2 (unaudited discard): {:?} ({id}) was discarded without an audited \
                 operator discard or re-issue",
                r.label
            ));
        }
    }
    let ok_ops = ops.iter().filter(|o| o.result == "ok").count();
    let uncertain_ops = ops.iter().filter(|o| o.result == "uncertain").count();
    let audited_ops = audit
        .iter()
        .filter(|e| {
            matches!(
                e.action,
                OperatorAction::Retry | OperatorAction::Discard | OperatorAction::Reissue
            )
        })
        .count();
    if audited_ops < ok_ops || audited_ops > ok_ops + uncertain_ops {
        failures.push(format!(
            "check 2 (audit): {ok_ops} operator actions succeeded ({uncertain_ops} more lost \
             their connection) but the audit trail holds {audited_ops}"
        ));
    }
    let audited_releases = audit
        .iter()
        .filter(|e| e.action == OperatorAction::ReleaseClaim)
        .count() as u64;
    if audited_releases < released_claims
        || (uncertain_releases == 0 && audited_releases != released_claims)
    {
        failures.push(format!(
            "check 2 (audit): release_claims_of released {released_claims} claims but the \
             audit trail holds {audited_releases}"
        ));
    }

    // 3. First deliveries per aggregate, in delivery order: versions strictly increase (equal
    //    only between an injected duplicate and the event it duplicates).
    let deliveries = broker.acks.iter().map(|a| crate::rules::Delivery {
        dedup: a.dedup,
        aggregate: &a.agg,
        version: a.version,
        injected_duplicate: is_injected_duplicate(&a.label),
    });
    let first_deliveries = {
        let mut seen: HashSet<EventId> = HashSet::new();
        broker.acks.iter().filter(|a| seen.insert(a.dedup)).count()
    };
    for d in crate::rules::first_delivery_disorder(deliveries) {
        let (a, prev) = (&broker.acks[d.at], &broker.acks[d.after]);
        failures.push(format!(
            "check 3 (version order): aggregate {}: version {} ({}, by {} at {}) was first \
             delivered after version {} ({}, by {} at {})",
            a.agg,
            a.version,
            a.label,
            a.relay,
            world.ms(a.at),
            prev.version,
            prev.label,
            prev.relay,
            world.ms(prev.at)
        ));
    }

    // 4. No two relays held one aggregate with live claims at once.
    let mut by_agg: HashMap<&str, Vec<(Instant, Instant, &ClaimRec)>> = HashMap::new();
    for c in &claims.claims {
        let mut end = c.deadline;
        if let Some(e) = c.end {
            end = end.min(e);
        }
        if let Some(&e) = claims.owner_end.get(&c.owner) {
            end = end.min(e);
        }
        for (_, agg, _) in &c.records {
            by_agg
                .entry(agg.as_str())
                .or_default()
                .push((c.start, end, c));
        }
    }
    let mut takeovers = 0usize;
    for (agg, mut list) in by_agg {
        list.sort_by_key(|(s, ..)| *s);
        for (i, (s2, e2, c2)) in list.iter().enumerate() {
            for (s1, e1, c1) in &list[..i] {
                if c1.owner == c2.owner {
                    continue;
                }
                if s2 < e1 && s1 < e2 {
                    failures.push(format!(
                        "check 4 (overlapping claims): aggregate {agg} was held by {} ({}..{}, \
                         claimed at {}) and by {} ({}..{}) at once",
                        c1.owner,
                        world.ms(*s1),
                        world.ms(*e1),
                        world.ms(c1.before),
                        c2.owner,
                        world.ms(*s2),
                        world.ms(*e2)
                    ));
                }
            }
            if i > 0 {
                let (_, _, prev) = list[i - 1];
                if prev.owner != c2.owner && prev.end.is_none_or(|e| e > prev.deadline) {
                    takeovers += 1;
                }
            }
        }
    }

    // 5. A published row's ack metadata is an acknowledgement the broker reported for it.
    for r in rows.iter().filter(|r| r.status == "published") {
        let id = r.event_id;
        let got = match &r.ack {
            Some((t, p, o)) => (Some(t.as_str()), Some(*p), Some(*o)),
            None => (None, None, None),
        };
        let matches = acks_of.get(&id).is_some_and(|acks| {
            acks.iter()
                .any(|a| a.reported && got == (Some(TOPIC), Some(a.partition), Some(a.offset)))
        });
        if !matches {
            let given: Vec<String> = acks_of
                .get(&id)
                .map(|acks| {
                    acks.iter()
                        .map(|a| {
                            format!(
                                "{TOPIC}/{}@{}{}",
                                a.partition,
                                a.offset,
                                if a.reported { "" } else { " (report lost)" }
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            failures.push(format!(
                "check 5 (ack metadata): published row {:?} ({id}) records ack {got:?}, but the \
                 broker acknowledged it as {given:?}",
                r.label
            ));
        }
    }

    // The run must have exercised what the checks are about.
    if broker.acks.len() < MIN_ACKS || broker.checked < MIN_ACKS {
        failures.push(format!(
            "coverage: only {} deliveries and {} hand-over checks (at least {MIN_ACKS} each \
             expected): the run proved too little",
            broker.acks.len(),
            broker.checked
        ));
    }
    if claims.parks.is_empty() {
        failures.push("coverage: nothing was parked during the run".to_owned());
    }
    Checked {
        first_deliveries,
        takeovers,
    }
}
/// The findings grouped by what failed (the text before the first colon): a count per group,
/// then the first few of each.
pub(crate) fn digest(failures: &[String]) -> String {
    const PER_GROUP: usize = 6;
    let mut groups: BTreeMap<&str, Vec<&String>> = BTreeMap::new();
    for f in failures {
        let key = f.split(':').next().unwrap_or("");
        groups.entry(key).or_default().push(f);
    }
    let mut out = format!(
        "findings: {}",
        groups
            .iter()
            .map(|(k, v)| format!("{k}: {}", v.len()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for list in groups.values() {
        for f in list.iter().take(PER_GROUP) {
            out.push_str(&format!("\n- {f}"));
        }
        if list.len() > PER_GROUP {
            out.push_str(&format!("\n  ({} more like this)", list.len() - PER_GROUP));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    //! The checker finds what it is for: each check is fed a history that breaks it (and the
    //! same history without the break passes it).

    use super::*;

    fn world() -> World {
        World {
            test: "history",
            seed: 1,
            location: "nowhere".into(),
            t0: Instant::now(),
            locked_hold: None,
            claim_life: Duration::from_secs(2),
            claims: Mutex::default(),
            broker: Mutex::default(),
            ops: Mutex::default(),
            violations: Mutex::default(),
            tally: Mutex::default(),
            committed: Mutex::default(),
            rolled_back: Mutex::default(),
            op_counts: Mutex::default(),
        }
    }

    fn ack(w: &World, at: Instant, event: EventId, agg: &str, version: i64, offset: i64) -> Ack {
        let _ = w;
        Ack {
            at,
            event,
            dedup: event,
            label: format!("{agg}/v{version}/next{offset}"),
            agg: agg.into(),
            version,
            relay: "r".into(),
            partition: 0,
            offset,
            reported: true,
        }
    }

    /// Commits `events` (aggregate, version) and returns their ids, with the final rows of
    /// their publication (each acknowledged at its offset) and the deliveries.
    fn published(w: &World, events: &[(&str, i64)]) -> (Vec<EventId>, Vec<FinalRow>) {
        let mut ids = Vec::new();
        let mut rows = Vec::new();
        let mut broker = w.broker.lock().unwrap();
        for (i, (agg, v)) in events.iter().enumerate() {
            let id = EventId::now_v7();
            ids.push(id);
            w.committed.lock().unwrap().push(Committed {
                id,
                label: format!("{agg}/v{v}"),
            });
            broker
                .acks
                .push(ack(w, Instant::now(), id, agg, *v, i as i64));
            rows.push(FinalRow::new(
                id,
                "published",
                Some(format!("{agg}/v{v}")),
                Some((TOPIC.to_owned(), 0, i as i64)),
            ));
        }
        (ids, rows)
    }

    /// The findings of `check` other than the coverage ones (a synthetic history is small).
    fn findings(w: &World, rows: &[FinalRow], audit: &[AuditEntry]) -> Vec<String> {
        let mut failures = Vec::new();
        check(w, rows, audit, (0, 0), &mut failures);
        failures.retain(|f| !f.starts_with("coverage"));
        failures
    }

    #[test]
    fn a_clean_history_passes() {
        let w = world();
        let (_, rows) = published(&w, &[("a", 1), ("a", 2), ("b", 1)]);
        assert_eq!(findings(&w, &rows, &[]), Vec::<String>::new());
    }

    #[test]
    fn check_3_finds_a_first_delivery_out_of_version_order() {
        let w = world();
        let (_, rows) = published(&w, &[("a", 2), ("a", 1)]);
        let f = findings(&w, &rows, &[]);
        assert!(f.iter().any(|f| f.starts_with("check 3")), "{f:?}");
    }

    #[test]
    fn check_2_finds_a_lost_and_an_invented_event() {
        let w = world();
        let (_, mut rows) = published(&w, &[("a", 1), ("b", 1)]);
        rows.remove(0);
        let stranger = FinalRow::new(EventId::now_v7(), "pending", None, None);
        rows.push(stranger);
        let f = findings(&w, &rows, &[]);
        assert!(f.iter().any(|f| f.starts_with("check 2 (lost)")), "{f:?}");
        assert!(
            f.iter().any(|f| f.starts_with("check 2 (invented)")),
            "{f:?}"
        );
    }

    #[test]
    fn check_1_finds_a_parked_event_delivered_without_a_retry() {
        let w = world();
        let parked_at = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        let (ids, rows) = published(&w, &[("a", 1)]);
        w.claims.lock().unwrap().parks.insert(
            ids[0],
            vec![Window {
                call: parked_at,
                ret: parked_at,
            }],
        );
        let f = findings(&w, &rows, &[]);
        assert!(f.iter().any(|f| f.starts_with("check 1")), "{f:?}");
        // With an operator retry in between, the delivery is allowed.
        w.ops.lock().unwrap().push(OpRecord {
            event: ids[0],
            label: "a/v1".into(),
            action: "retry",
            window: Window {
                call: parked_at + Duration::from_micros(1),
                ret: parked_at + Duration::from_micros(2),
            },
            result: "ok",
            new_id: None,
        });
        let audit = vec![AuditEntry::new(
            ids[0],
            OperatorAction::Retry,
            "op",
            "",
            None,
            chrono::Utc::now(),
        )];
        assert_eq!(findings(&w, &rows, &audit), Vec::<String>::new());
    }

    #[test]
    fn check_4_finds_two_relays_holding_one_aggregate() {
        let w = world();
        let now = Instant::now();
        let claim = |owner: &str| ClaimRec {
            owner: owner.into(),
            before: now,
            start: now,
            deadline: now + Duration::from_secs(2),
            end: None,
            records: vec![(EventId::now_v7(), "a".into(), 1)],
            provisional_parks: Vec::new(),
        };
        w.claims
            .lock()
            .unwrap()
            .claims
            .extend([claim("r1"), claim("r2")]);
        let f = findings(&w, &[], &[]);
        assert!(f.iter().any(|f| f.starts_with("check 4")), "{f:?}");
    }

    #[test]
    fn check_5_finds_ack_metadata_the_broker_never_reported() {
        let w = world();
        let (_, mut rows) = published(&w, &[("a", 1)]);
        rows[0].ack = Some((TOPIC.to_owned(), 0, 99));
        let f = findings(&w, &rows, &[]);
        assert!(f.iter().any(|f| f.starts_with("check 5")), "{f:?}");
    }
}
