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
//! 5. every published row's ack metadata is an acknowledgement the broker reported for it;
//! 6. runs (the contract's *Runs* clause, `outbox_core::store`): the events of one aggregate
//!    in one claim are a run: adjacent in the batch, consecutive versions in order,
//!    `run_position` 0, 1, 2, ..., no longer than the claim asked for (one event from a store
//!    without runs); a head, with a run or without, is at `last + 1` (not above every `last`
//!    the history allows: a version skipped or unfinished before it), and no other row of the aggregate at one of its versions is certainly
//!    unfinished when it is claimed (a duplicate ends a run before it); a completion applies a
//!    run's outcomes only as a published prefix, then at most one other outcome.

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
    /// (event, aggregate, version, run position)
    pub(crate) records: Vec<(EventId, String, i64, u32)>,
    /// The run length the claim asked for (`ClaimRequest::run_len`).
    pub(crate) run: usize,
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
    /// Every outcome or operator action that may have moved an aggregate's `last`, from the
    /// moment it was asked for (whether it was applied or not: an upper bound of `last`).
    pub(crate) finishes: Vec<Finish>,
    /// Runs handed out (two or more events of one aggregate in a claim), and their events.
    pub(crate) runs_claimed: usize,
    pub(crate) run_events: usize,
}

/// Something that may have finished an event (published, discarded) or moved its aggregate's
/// `last` (a retry accepts `version - 1`), asked for at `call`.
pub(crate) struct Finish {
    /// The event finished; `None` for a retry (which finishes nothing).
    pub(crate) event: Option<EventId>,
    pub(crate) agg: String,
    /// The highest `last` it may have set.
    pub(crate) last: i64,
    pub(crate) call: Instant,
    /// The claim whose completion asked for it (`None`: an operator action).
    pub(crate) claim: Option<Uuid>,
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
    /// When its commit returned (visible to every claim after).
    pub(crate) at: Instant,
}

/// (aggregate, version) of a producer's label (`<agg>/v<version>/<kind><n>`).
pub(crate) fn parse_label(label: &str) -> Option<(&str, i64)> {
    let mut parts = label.split('/');
    let agg = parts.next()?;
    let version = parts.next()?.strip_prefix('v')?.parse().ok()?;
    Some((agg, version))
}

pub(crate) struct World {
    pub(crate) test: &'static str,
    pub(crate) seed: u64,
    /// Where the backend keeps the run's data (a schema, a database), for the failure message.
    pub(crate) location: String,
    pub(crate) t0: Instant,
    /// Locked mode: the server may end a claim this long after it was requested.
    pub(crate) locked_hold: Option<Duration>,
    /// The store hands out heads only (it ignores `ClaimRequest::run`): a run is a finding.
    pub(crate) heads_only: bool,
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
        run: usize,
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
        let records: Vec<(EventId, String, i64, u32)> = batch
            .records
            .iter()
            .map(|r| {
                let e = &r.envelope;
                (
                    e.event_id,
                    e.aggregate_id.clone(),
                    e.aggregate_version,
                    r.run_position,
                )
            })
            .collect();
        let allowed = if self.heads_only { 1 } else { run };
        for (agg, at) in runs_of(&records) {
            if at.len() > 1 {
                log.runs_claimed += 1;
                log.run_events += at.len();
            }
            let shape: Vec<(i64, u32)> = at.iter().map(|&i| (records[i].2, records[i].3)).collect();
            let what = format!(
                "the claim of {owner} at {} (asked for runs of {run}) holds aggregate {agg} as \
                 (version, run_position) {shape:?} at batch places {at:?}",
                self.ms(start)
            );
            if at.len() > allowed {
                self.violation(format!(
                    "check 6 (run too long): {what}: more than {allowed} event(s){}",
                    if self.heads_only {
                        " from a store without runs"
                    } else {
                        ""
                    }
                ));
            }
            if at.windows(2).any(|w| w[1] != w[0] + 1) {
                self.violation(format!("check 6 (run not adjacent): {what}"));
            }
            if shape.windows(2).any(|w| w[1].0 != w[0].0 + 1) {
                self.violation(format!(
                    "check 6 (run not consecutive): {what}: a gap, a duplicate or a version out \
                     of order"
                ));
            }
            if shape.iter().enumerate().any(|(k, &(_, p))| p as usize != k) {
                self.violation(format!("check 6 (run positions): {what}"));
            }
        }
        let idx = log.claims.len();
        log.claims.push(ClaimRec {
            owner: owner.to_owned(),
            before,
            start,
            deadline,
            end: None,
            records,
            run,
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
            self.check_run_completion(&log, (token, i), outcomes, &refused, w);
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

    /// The outcomes of a completion, noted when it is asked for (before the store answers: a
    /// relay killed mid-call, or an error, may still have committed them): each publication
    /// may have moved its aggregate's `last` from then on.
    pub(crate) fn note_completion_call(&self, token: Uuid, outcomes: &[Outcome], call: Instant) {
        let mut log = self.claims.lock().unwrap();
        let Some(&i) = log.by_token.get(&token) else {
            return;
        };
        let mut finishes = Vec::new();
        for o in outcomes {
            if let Outcome::Published { event_id, .. } = o {
                if let Some((_, agg, v, _)) =
                    log.claims[i].records.iter().find(|r| r.0 == *event_id)
                {
                    finishes.push(Finish {
                        event: Some(*event_id),
                        agg: agg.clone(),
                        last: *v,
                        call,
                        claim: Some(token),
                    });
                }
            }
        }
        log.finishes.extend(finishes);
    }

    /// Check 6, the prefix rule of a run's completion: for each run of the claim, the outcomes
    /// the store applied (those it did not refuse) are publications of positions 0..p, then at
    /// most one other outcome for p + 1, then none. A position whose predecessor was already
    /// published (possibly, by an earlier completion) may start over.
    fn check_run_completion(
        &self,
        log: &ClaimLog,
        (token, i): (Uuid, usize),
        outcomes: &[Outcome],
        refused: &HashSet<EventId>,
        w: Window,
    ) {
        let c = &log.claims[i];
        let outcome_of = |id: EventId| outcomes.iter().find(|o| o.event_id() == id);
        for (agg, at) in runs_of(&c.records) {
            if at.len() < 2 {
                continue;
            }
            let mut open = true;
            for (k, &place) in at.iter().enumerate() {
                let id = c.records[place].0;
                let o = outcome_of(id);
                let applied = o.is_some() && !refused.contains(&id);
                let may_start = open
                    || k > 0 && {
                        let pred = c.records[at[k - 1]].0;
                        log.finishes.iter().any(|f| {
                            f.event == Some(pred) && f.claim != Some(token) && f.call < w.call
                        })
                    };
                if applied && !may_start {
                    let shown: Vec<String> = at
                        .iter()
                        .map(|&p| {
                            let id = c.records[p].0;
                            let o = outcome_of(id).map_or("none", outcome_name);
                            let r = if refused.contains(&id) {
                                " refused"
                            } else {
                                ""
                            };
                            format!("v{} {o}{r}", c.records[p].2)
                        })
                        .collect();
                    self.violation(format!(
                        "check 6 (run prefix): the completion at {} of {}'s run of aggregate \
                         {agg} applied an outcome for version {} although the versions before \
                         it in the run were not all published: {shown:?}",
                        self.ms(w.call),
                        c.owner,
                        c.records[place].2
                    ));
                    break;
                }
                open = may_start && applied && matches!(o, Some(Outcome::Published { .. }));
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

/// The records of a claim grouped by aggregate, in the order each aggregate first appears:
/// (aggregate, the batch places of its records in order).
pub(crate) fn runs_of(records: &[(EventId, String, i64, u32)]) -> Vec<(&str, Vec<usize>)> {
    let mut out: Vec<(&str, Vec<usize>)> = Vec::new();
    for (i, (_, agg, ..)) in records.iter().enumerate() {
        match out.iter_mut().find(|(a, _)| *a == agg.as_str()) {
            Some((_, at)) => at.push(i),
            None => out.push((agg.as_str(), vec![i])),
        }
    }
    out
}

fn outcome_name(o: &Outcome) -> &'static str {
    match o {
        Outcome::Published { .. } => "published",
        Outcome::Retry { .. } => "retry",
        Outcome::Park { .. } => "park",
        Outcome::Defer { .. } => "defer",
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
        for (_, agg, ..) in &c.records {
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

    // 6. Runs against the history. `last` of an aggregate when a claim took effect is at most
    //    the highest `last` any publication, discard, re-issue or retry asked for before the
    //    claim returned may have set (applied or not): a head (with a run or without) above
    //    that skipped a version (or an unfinished one). A row of the aggregate at one of the
    //    run's versions, above that bound, committed before the claim was asked for and not
    //    asked to be published or discarded before it returned, was certainly unfinished: a
    //    duplicate the run went past.
    // Per aggregate: (asked at, the `last` it may set, the event it may finish).
    type Move = (Instant, i64, Option<EventId>);
    let mut moves: HashMap<&str, Vec<Move>> = HashMap::new();
    for f in &claims.finishes {
        moves
            .entry(f.agg.as_str())
            .or_default()
            .push((f.call, f.last, f.event));
    }
    for op in ops
        .iter()
        .filter(|o| matches!(o.result, "ok" | "uncertain"))
    {
        let Some((agg, v)) = parse_label(&op.label) else {
            continue;
        };
        let (last, event) = match op.action {
            "retry" => (v - 1, None),
            _ => (v, Some(op.event)),
        };
        moves
            .entry(agg)
            .or_default()
            .push((op.window.call, last, event));
    }
    let mut committed_of: HashMap<&str, Vec<(i64, EventId, Instant)>> = HashMap::new();
    for c in committed.iter() {
        if let Some((agg, v)) = parse_label(&c.label) {
            committed_of.entry(agg).or_default().push((v, c.id, c.at));
        }
    }
    let none = Vec::new();
    for c in &claims.claims {
        for (agg, at) in runs_of(&c.records) {
            let head = c.records[at[0]].2;
            let top = c.records[at[at.len() - 1]].2;
            let m = moves.get(agg).unwrap_or(&none);
            let hi = m
                .iter()
                .filter(|(t, ..)| *t < c.start)
                .map(|(_, l, _)| *l)
                .max()
                .unwrap_or(0);
            if head - 1 > hi {
                failures.push(format!(
                    "check 6 (head above last + 1): the claim of {} at {} handed out aggregate \
                     {agg} from version {head} ({} events), but no version above {hi} was \
                     published, discarded or retried before it",
                    c.owner,
                    world.ms(c.start),
                    at.len()
                ));
            }
            if at.len() < 2 {
                continue;
            }
            let in_run: HashSet<EventId> = at.iter().map(|&p| c.records[p].0).collect();
            for (v, id, t) in committed_of.get(agg).into_iter().flatten() {
                if *v < head || *v > top || *v <= hi || in_run.contains(id) || *t >= c.before {
                    continue;
                }
                if !m
                    .iter()
                    .any(|(call, _, e)| *e == Some(*id) && *call < c.start)
                {
                    failures.push(format!(
                        "check 6 (run past a duplicate): the claim of {} at {} handed out a run \
                         of aggregate {agg} (versions {head}..={top}) while {id}, also at \
                         version {v}, committed before it, was unfinished",
                        c.owner,
                        world.ms(c.start)
                    ));
                }
            }
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
    if !world.heads_only && claims.runs_claimed == 0 && claims.claims.iter().any(|c| c.run > 1) {
        failures.push("coverage: the relays asked for runs but no claim handed one out".to_owned());
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
    use outbox_core::{ClaimHandle, ClaimedRecord, Envelope, ErrorClass, LastError};

    fn world() -> World {
        World {
            test: "history",
            seed: 1,
            location: "nowhere".into(),
            t0: Instant::now(),
            locked_hold: None,
            heads_only: false,
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
                at: Instant::now(),
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
            records: vec![(EventId::now_v7(), "a".into(), 1, 0)],
            run: 1,
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

    /// Commits events (aggregate, version) before now, as the producer does.
    fn commit(w: &World, events: &[(&str, i64)]) -> Vec<Envelope> {
        let envs: Vec<Envelope> = events
            .iter()
            .map(|(agg, v)| {
                Envelope::builder("order", *agg, *v, "order.changed")
                    .json(&serde_json::json!({}))
                    .unwrap()
                    .build()
                    .unwrap()
            })
            .collect();
        let mut c = w.committed.lock().unwrap();
        for e in &envs {
            c.push(Committed {
                id: e.event_id,
                label: format!("{}/v{}/next", e.aggregate_id, e.aggregate_version),
                at: Instant::now(),
            });
        }
        envs
    }

    /// Records a lease claim of `run` holding `records` (envelope, run position), in order.
    fn claim_of(w: &World, run: usize, records: &[(&Envelope, u32)]) -> Uuid {
        std::thread::sleep(Duration::from_millis(1));
        let token = Uuid::new_v4();
        let batch = ClaimedBatch::new(
            ClaimHandle {
                token,
                owner: "r".into(),
            },
            records
                .iter()
                .map(|(e, p)| ClaimedRecord::new((*e).clone(), 0).with_run_position(*p))
                .collect(),
            Some(Duration::from_secs(2)),
        );
        let now = Instant::now();
        w.record_claim("r", run, now, now, &batch);
        token
    }

    fn published_outcome(e: &Envelope) -> Outcome {
        Outcome::Published {
            event_id: e.event_id,
            ack: outbox_core::AckMetadata::kafka(TOPIC, 0, 0),
        }
    }

    fn defer_outcome(e: &Envelope) -> Outcome {
        Outcome::Defer {
            event_id: e.event_id,
            delay: Duration::from_millis(1),
            error: LastError {
                class: ErrorClass::Transient,
                kind: "timeout".into(),
                message: String::new(),
            },
        }
    }

    /// Completes `token` with `outcomes`, the store refusing `refused`.
    fn complete(w: &World, token: Uuid, outcomes: &[Outcome], refused: &[&Envelope]) {
        let call = Instant::now();
        w.end_claim(token, call);
        w.note_completion_call(token, outcomes, call);
        let refused: Vec<EventId> = refused.iter().map(|e| e.event_id).collect();
        let rep = CompletionReport::new(outcomes.len() - refused.len(), refused);
        let ret = Instant::now();
        w.record_completion(token, outcomes, &rep, Window { call, ret });
    }

    fn check_6(w: &World) -> Vec<String> {
        findings(w, &[], &[])
            .into_iter()
            .filter(|f| f.starts_with("check 6") || f.starts_with("check 4"))
            .collect()
    }

    #[test]
    fn check_6_passes_a_legal_run_and_its_published_prefix() {
        let w = world();
        let a = commit(&w, &[("a", 1), ("a", 2), ("a", 3)]);
        let b = commit(&w, &[("b", 1)]);
        let t = claim_of(&w, 3, &[(&a[0], 0), (&a[1], 1), (&a[2], 2), (&b[0], 0)]);
        complete(
            &w,
            t,
            &[
                published_outcome(&a[0]),
                published_outcome(&a[1]),
                defer_outcome(&a[2]),
                published_outcome(&b[0]),
            ],
            &[],
        );
        // The rest of the run after a failure: released, the next claim starts at 3.
        let t = claim_of(&w, 3, &[(&a[2], 0)]);
        complete(&w, t, &[published_outcome(&a[2])], &[]);
        assert_eq!(check_6(&w), Vec::<String>::new());
    }

    #[test]
    fn check_6_finds_a_run_of_the_wrong_shape() {
        type Case = (&'static str, usize, &'static [(usize, u32)]);
        let cases: [Case; 6] = [
            // (finding, run asked, (event index of a1..a3 + b1, position))
            ("run too long", 1, &[(0, 0), (1, 1)]),
            ("run not adjacent", 3, &[(0, 0), (3, 0), (1, 1)]),
            ("run not consecutive", 3, &[(0, 0), (2, 1)]),
            ("run not consecutive", 3, &[(1, 0), (0, 1)]),
            ("run positions", 3, &[(0, 0), (1, 2)]),
            ("run positions", 3, &[(0, 1)]),
        ];
        for (finding, run, layout) in cases {
            let w = world();
            let mut evs = commit(&w, &[("a", 1), ("a", 2), ("a", 3)]);
            evs.extend(commit(&w, &[("b", 1)]));
            let records: Vec<(&Envelope, u32)> =
                layout.iter().map(|&(i, p)| (&evs[i], p)).collect();
            claim_of(&w, run, &records);
            let f = check_6(&w);
            assert!(
                f.iter()
                    .any(|f| f.starts_with(&format!("check 6 ({finding})"))),
                "{finding} {layout:?}: {f:?}"
            );
        }
        // A duplicate version inside a run.
        let w = world();
        let evs = commit(&w, &[("a", 1), ("a", 2), ("a", 2)]);
        claim_of(&w, 3, &[(&evs[0], 0), (&evs[1], 1), (&evs[2], 2)]);
        let f = check_6(&w);
        assert!(f.iter().any(|f| f.contains("run not consecutive")), "{f:?}");
    }

    #[test]
    fn check_6_finds_a_run_from_a_store_without_runs() {
        let mut w = world();
        w.heads_only = true;
        let a = commit(&w, &[("a", 1), ("a", 2)]);
        claim_of(&w, 10, &[(&a[0], 0)]);
        assert_eq!(check_6(&w), Vec::<String>::new());
        claim_of(&w, 10, &[(&a[0], 0), (&a[1], 1)]);
        let f = check_6(&w);
        assert!(f.iter().any(|f| f.contains("run too long")), "{f:?}");
    }

    /// Records an operator's `action` on `event` (labelled `label`): done now, in an instant,
    /// and answered "ok".
    fn operator_did(w: &World, event: &Envelope, label: &str, action: &'static str) {
        let now = Instant::now();
        w.ops.lock().unwrap().push(OpRecord {
            event: event.event_id,
            label: label.into(),
            action,
            window: Window {
                call: now,
                ret: now,
            },
            result: "ok",
            new_id: None,
        });
    }

    #[test]
    fn check_6_finds_a_run_above_last_plus_one() {
        // Version 1 unfinished (or missing): a run from 2 skipped it.
        let w = world();
        let a = commit(&w, &[("a", 1), ("a", 2), ("a", 3)]);
        claim_of(&w, 3, &[(&a[1], 0), (&a[2], 1)]);
        let f = check_6(&w);
        assert!(f.iter().any(|f| f.contains("head above last + 1")), "{f:?}");
        // The same run after version 1 was published: legal.
        let w = world();
        let a = commit(&w, &[("a", 1), ("a", 2), ("a", 3)]);
        let t = claim_of(&w, 1, &[(&a[0], 0)]);
        complete(&w, t, &[published_outcome(&a[0])], &[]);
        claim_of(&w, 3, &[(&a[1], 0), (&a[2], 1)]);
        assert_eq!(check_6(&w), Vec::<String>::new());
        // After an operator's retry of a gap-parked version 2: legal too.
        let w = world();
        let a = commit(&w, &[("a", 2), ("a", 3)]);
        operator_did(&w, &a[0], "a/v2/gap", "retry");
        claim_of(&w, 3, &[(&a[0], 0), (&a[1], 1)]);
        let f: Vec<String> = check_6(&w);
        assert_eq!(f, Vec::<String>::new());
    }

    #[test]
    fn check_6_finds_a_run_past_an_unfinished_duplicate() {
        let w = world();
        let a = commit(&w, &[("a", 1), ("a", 2), ("a", 2), ("a", 3)]);
        claim_of(&w, 3, &[(&a[0], 0), (&a[1], 1)]);
        let f = check_6(&w);
        assert!(
            f.iter().any(|f| f.contains("run past a duplicate")),
            "{f:?}"
        );
        // A duplicate of the head: the run (head included) must end before it.
        let w = world();
        let a = commit(&w, &[("a", 1), ("a", 1), ("a", 2)]);
        claim_of(&w, 3, &[(&a[0], 0), (&a[2], 1)]);
        let f = check_6(&w);
        assert!(
            f.iter().any(|f| f.contains("run past a duplicate")),
            "{f:?}"
        );
        // The duplicate discarded first: legal.
        let w = world();
        let a = commit(&w, &[("a", 1), ("a", 2), ("a", 2), ("a", 3)]);
        operator_did(&w, &a[2], "a/v2/dup", "discard");
        claim_of(&w, 3, &[(&a[0], 0), (&a[1], 1)]);
        let f: Vec<String> = check_6(&w)
            .into_iter()
            .filter(|f| f.contains("duplicate"))
            .collect();
        assert_eq!(f, Vec::<String>::new());
    }

    #[test]
    fn check_6_finds_a_completion_outside_the_published_prefix() {
        // (outcomes as (index, published?), refused indexes): each applies an outcome after
        // a version of the run that was not published.
        type Case = (&'static [(usize, bool)], &'static [usize]);
        let cases: [Case; 4] = [
            // a hole: 1 published, 2 deferred, 3 published
            (&[(0, true), (1, false), (2, true)], &[]),
            // no outcome for the head
            (&[(1, true), (2, true)], &[]),
            // 2 refused, 3 applied
            (&[(0, true), (1, true), (2, true)], &[1]),
            // two failures
            (&[(0, false), (1, false)], &[]),
        ];
        for (outs, refused) in cases {
            let w = world();
            let a = commit(&w, &[("a", 1), ("a", 2), ("a", 3)]);
            let t = claim_of(&w, 3, &[(&a[0], 0), (&a[1], 1), (&a[2], 2)]);
            let outcomes: Vec<Outcome> = outs
                .iter()
                .map(|&(i, p)| {
                    if p {
                        published_outcome(&a[i])
                    } else {
                        defer_outcome(&a[i])
                    }
                })
                .collect();
            let refused: Vec<&Envelope> = refused.iter().map(|&i| &a[i]).collect();
            complete(&w, t, &outcomes, &refused);
            let f = check_6(&w);
            assert!(
                f.iter().any(|f| f.starts_with("check 6 (run prefix)")),
                "{outs:?} refused {refused:?}: {f:?}"
            );
        }
        // The same holes refused by the store: legal.
        let w = world();
        let a = commit(&w, &[("a", 1), ("a", 2), ("a", 3)]);
        let t = claim_of(&w, 3, &[(&a[0], 0), (&a[1], 1), (&a[2], 2)]);
        complete(
            &w,
            t,
            &[
                published_outcome(&a[0]),
                defer_outcome(&a[1]),
                published_outcome(&a[2]),
            ],
            &[&a[2]],
        );
        assert_eq!(check_6(&w), Vec::<String>::new());
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
