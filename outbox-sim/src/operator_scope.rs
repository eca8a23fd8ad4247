//! The operator-action invariant: an operator's action changes the delivery state of its
//! target only, and the target only as the action promises.
//!
//! The store's whole delivery state ([`DeliverySnapshot`]: every column of every row, and the
//! aggregates' own state rows with their last version and lease) is read right before and
//! right after the action, while nothing else runs, and compared:
//!
//! * every aggregate outside the target is exactly as it was (its rows' versions, status,
//!   attempts, parking, publication, acknowledgement, deadlines, and its last version and
//!   lease), and no row appears or vanishes there;
//! * a retry makes the event pending with no attempts and no park reason; a discard and a
//!   re-issue mark it discarded with its attempts kept; a re-issue adds exactly one copy, of
//!   the same aggregate and version, pending, fresh; the target aggregate's last version
//!   becomes exactly the greater of what it was and what the action accepts (the version
//!   below a retried or re-issued event, a discarded event's own), and its lease and its
//!   other rows' delivery (status, attempts, parking, publication, claim) stay;
//! * a release of an owner's claims ends leases of that owner only: an aggregate it leased
//!   may lose that lease (and its lease row come due, marked possibly sent), nothing else of
//!   it changes;
//! * a refused action changes nothing at all.

use std::collections::{BTreeMap, BTreeSet};

use outbox_core::{DeliveryStatus, EventId};

use crate::backend::{DeliverySnapshot, StoredAggregate, StoredRow};
use crate::invariants::{ensure, Check};
use crate::steps::OperatorStep;

/// What an operator did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// A retry, discard or re-issue of `event`; `copy`: the re-issued copy.
    Parked {
        op: OperatorStep,
        event: EventId,
        copy: Option<EventId>,
    },
    /// Every claim of `owner` released.
    ReleaseClaims { owner: String },
    /// An action the store refused: nothing may change.
    Refused(String),
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Action::Parked { op, event, .. } => write!(f, "{op:?} of parked {event}"),
            Action::ReleaseClaims { owner } => write!(f, "release of {owner}'s claims"),
            Action::Refused(what) => write!(f, "refused {what}"),
        }
    }
}

/// Columns of a target aggregate's other rows that its action must keep, beside the row's
/// view (status, attempts, park kind, acknowledgement).
const KEPT_ROW_COLUMNS: [&str; 3] = ["published_at", "claim", "claim_owner"];

fn is_lease(column: &str) -> bool {
    column.starts_with("lease_")
}

fn value<'a>(map: &'a BTreeMap<String, String>, key: &str) -> &'a str {
    map.get(key).map_or("null", String::as_str)
}

fn version(map: &BTreeMap<String, String>, key: &str) -> Result<Option<i64>, String> {
    match value(map, key) {
        "null" => Ok(None),
        v => v
            .parse()
            .map(Some)
            .map_err(|e| format!("{key} {v:?} is not a version: {e}")),
    }
}

/// The first column of `before` and `after` that differs, among those `keep` selects.
fn changed(
    before: &BTreeMap<String, String>,
    after: &BTreeMap<String, String>,
    keep: impl Fn(&str) -> bool,
) -> Option<String> {
    let keys: BTreeSet<&String> = before.keys().chain(after.keys()).collect();
    keys.into_iter()
        .filter(|k| keep(k))
        .find(|k| value(before, k) != value(after, k))
        .map(|k| format!("{k}: {} -> {}", value(before, k), value(after, k)))
}

fn describe_row(row: &StoredRow) -> String {
    format!(
        "{} v{} ({:?})",
        row.view.event_id, row.view.version, row.view.status
    )
}

/// Checks `action`, taken between `before` and `after`.
pub(crate) fn check(action: &Action, before: &DeliverySnapshot, after: &DeliverySnapshot) -> Check {
    let targets = targets(action, before)?;
    let empty = StoredAggregate::default();
    let aggregates: BTreeSet<&String> = before.keys().chain(after.keys()).collect();
    for agg in aggregates {
        let b = before.get(agg).unwrap_or(&empty);
        let a = after.get(agg).unwrap_or(&empty);
        let why = if targets.contains(agg.as_str()) {
            match action {
                Action::Parked { op, event, copy } => parked_target(*op, *event, *copy, b, a),
                Action::ReleaseClaims { owner } => released_target(owner, b, a),
                Action::Refused(_) => unchanged(b, a),
            }
        } else {
            unchanged(b, a)
        };
        if let Err(why) = why {
            let role = if targets.contains(agg.as_str()) {
                "its target"
            } else {
                "another aggregate,"
            };
            return Err(format!(
                "operator action changed more than it promises: {action} changed {role} {agg}: {why}"
            ));
        }
    }
    Ok(())
}

/// The aggregates an action may change.
fn targets<'a>(action: &Action, before: &'a DeliverySnapshot) -> Result<BTreeSet<&'a str>, String> {
    let mut out = BTreeSet::new();
    match action {
        Action::Parked { event, .. } => {
            let agg = before
                .iter()
                .find(|(_, a)| a.rows.contains_key(event))
                .map(|(agg, _)| agg.as_str())
                .ok_or_else(|| format!("the operator acted on {event}, which is not stored"))?;
            out.insert(agg);
        }
        Action::ReleaseClaims { owner } => {
            for (agg, a) in before {
                let leased = value(&a.state, "lease_owner") == owner
                    || a.rows
                        .values()
                        .any(|r| value(&r.raw, "claim_owner") == owner);
                if leased {
                    out.insert(agg.as_str());
                }
            }
        }
        Action::Refused(_) => {}
    }
    Ok(out)
}

/// Nothing of the aggregate changed: no row appeared or vanished, no column of a row or of
/// its state changed.
fn unchanged(b: &StoredAggregate, a: &StoredAggregate) -> Check {
    if let Some(c) = changed(&b.state, &a.state, |_| true) {
        return Err(format!("its state changed ({c})"));
    }
    rows_kept(b, a, &BTreeSet::new(), |_| true)
}

/// Every row of `b` but those in `skip` is still there with its view and the columns `keep`
/// selects unchanged, and no row appeared but those in `skip`.
fn rows_kept(
    b: &StoredAggregate,
    a: &StoredAggregate,
    skip: &BTreeSet<EventId>,
    keep: impl Fn(&str) -> bool,
) -> Check {
    for (id, rb) in &b.rows {
        if skip.contains(id) {
            continue;
        }
        let ra = a
            .rows
            .get(id)
            .ok_or_else(|| format!("row {} vanished", describe_row(rb)))?;
        ensure(ra.view == rb.view, || {
            format!(
                "row {} became {:?} with {} attempts, park {:?}, ack {:?} (was {:?}, {} \
                 attempts, park {:?}, ack {:?})",
                describe_row(rb),
                ra.view.status,
                ra.view.attempts,
                ra.view.park_kind,
                ra.view.ack,
                rb.view.status,
                rb.view.attempts,
                rb.view.park_kind,
                rb.view.ack
            )
        })?;
        if let Some(c) = changed(&rb.raw, &ra.raw, &keep) {
            return Err(format!("row {} changed ({c})", describe_row(rb)));
        }
    }
    for (id, ra) in &a.rows {
        ensure(b.rows.contains_key(id) || skip.contains(id), || {
            format!("row {} appeared", describe_row(ra))
        })?;
    }
    Ok(())
}

/// The target aggregate of a retry, discard or re-issue of `event`.
fn parked_target(
    op: OperatorStep,
    event: EventId,
    copy: Option<EventId>,
    b: &StoredAggregate,
    a: &StoredAggregate,
) -> Check {
    let xb = b.rows.get(&event).ok_or("the event is not stored")?;
    let xa = a
        .rows
        .get(&event)
        .ok_or_else(|| format!("the event {} vanished", describe_row(xb)))?;
    let v = xb.view.version;
    // The event itself.
    let (status, attempts, promised) = match op {
        OperatorStep::Retry => (DeliveryStatus::Pending, 0, v - 1),
        OperatorStep::Discard => (DeliveryStatus::Discarded, xb.view.attempts, v),
        OperatorStep::Reissue => (DeliveryStatus::Discarded, xb.view.attempts, v - 1),
    };
    ensure(
        xa.view.status == status
            && xa.view.attempts == attempts
            && xa.view.ack == xb.view.ack
            && xa.view.version == v
            && (op != OperatorStep::Retry || xa.view.park_kind.is_none())
            && value(&xa.raw, "published_at") == value(&xb.raw, "published_at"),
        || {
            format!(
                "the event {} became {:?} with {} attempts, park {:?}, ack {:?} (expected \
                 {status:?} with {attempts})",
                describe_row(xb),
                xa.view.status,
                xa.view.attempts,
                xa.view.park_kind,
                xa.view.ack
            )
        },
    )?;
    // The copy of a re-issue: one new row of the same version, pending and fresh.
    let mut skip = BTreeSet::from([event]);
    if op == OperatorStep::Reissue {
        let id = copy.ok_or("a re-issue returned no copy")?;
        let c = a
            .rows
            .get(&id)
            .ok_or_else(|| format!("the re-issued copy {id} is not stored with its aggregate"))?;
        ensure(
            !b.rows.contains_key(&id)
                && c.view.version == v
                && c.view.status == DeliveryStatus::Pending
                && c.view.attempts == 0
                && c.view.park_kind.is_none()
                && c.view.ack.is_none(),
            || format!("the re-issued copy is {}: {:?}", describe_row(c), c.view),
        )?;
        skip.insert(id);
    }
    // The aggregate's other rows keep their delivery; its lease stays; its last version is
    // raised to exactly what the action accepts (a store that keeps it).
    rows_kept(b, a, &skip, |k| KEPT_ROW_COLUMNS.contains(&k))?;
    if let Some(c) = changed(&b.state, &a.state, is_lease) {
        return Err(format!("its lease changed ({c})"));
    }
    if a.state.contains_key("last_version") {
        let lb = version(&b.state, "last_version")?;
        let la = version(&a.state, "last_version")?;
        let expected = lb.map_or(promised, |l| l.max(promised));
        ensure(la == Some(expected), || {
            format!(
                "its last version went from {lb:?} to {la:?}; {op:?} of v{v} promises {expected}"
            )
        })?;
    }
    Ok(())
}

/// An aggregate `owner` held a claim on, after the release of `owner`'s claims: it may lose
/// that claim (and its claimed row come due); nothing else of it changes.
fn released_target(owner: &str, b: &StoredAggregate, a: &StoredAggregate) -> Check {
    let may_change_state = |k: &str| is_lease(k) || k == "updated_at";
    if let Some(c) = changed(&b.state, &a.state, |k| !may_change_state(k)) {
        return Err(format!("its state changed ({c})"));
    }
    let owner_after = value(&a.state, "lease_owner");
    ensure(owner_after == "null" || owner_after == owner, || {
        format!("its lease went from {owner} to {owner_after}")
    })?;
    let may_change_row = |k: &str| {
        matches!(
            k,
            "claim" | "claim_owner" | "next_attempt_at" | "maybe_delivered"
        )
    };
    rows_kept(b, a, &BTreeSet::new(), |k| !may_change_row(k))?;
    for (id, ra) in &a.rows {
        let before = b.rows.get(id).map(|r| value(&r.raw, "claim_owner"));
        let now = value(&ra.raw, "claim_owner");
        ensure(now == "null" || Some(now) == before, || {
            format!("row {} was claimed by {now}", describe_row(ra))
        })?;
        // A released row may have been sent by the relay that is gone: it may become
        // "possibly sent" (its next publication counts as a re-publication), and only a row
        // that owner held; nothing un-marks a row.
        let was = b.rows.get(id).map(|r| value(&r.raw, "maybe_delivered"));
        let is = value(&ra.raw, "maybe_delivered");
        // Held: the row names the owner's claim, or (a store that keeps the lease in the
        // aggregate's state row) the aggregate was leased by the owner.
        let held = before == Some(owner) || value(&b.state, "lease_owner") == owner;
        if let Some(was) = was.filter(|w| *w != is) {
            ensure(is_true(is) && !is_true(was) && held, || {
                format!(
                    "row {} went from maybe_delivered {was} to {is} (held by {})",
                    describe_row(ra),
                    before.unwrap_or("nobody")
                )
            })?;
        }
    }
    Ok(())
}

fn is_true(v: &str) -> bool {
    matches!(v, "1" | "true" | "t")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::RowView;
    use outbox_testkit::ManualClock;

    fn id(n: u8) -> EventId {
        EventId::from_parts(ManualClock::epoch(), u128::from(n) << 16)
    }

    fn row(n: u8, agg: &str, v: i64, status: DeliveryStatus) -> StoredRow {
        StoredRow {
            view: RowView {
                event_id: id(n),
                aggregate_id: agg.to_owned(),
                version: v,
                status,
                ack: None,
                attempts: 1,
                park_kind: None,
            },
            raw: BTreeMap::from([("blocked".to_owned(), "false".to_owned())]),
        }
    }

    fn snapshot(rows: Vec<StoredRow>, lasts: &[(&str, i64)]) -> DeliverySnapshot {
        let mut s = DeliverySnapshot::new();
        for r in rows {
            s.entry(r.view.aggregate_id.clone())
                .or_default()
                .rows
                .insert(r.view.event_id, r);
        }
        for (agg, last) in lasts {
            s.entry((*agg).to_owned()).or_default().state =
                BTreeMap::from([("last_version".to_owned(), last.to_string())]);
        }
        s
    }

    fn before() -> DeliverySnapshot {
        snapshot(
            vec![
                row(1, "a", 2, DeliveryStatus::Parked),
                row(2, "a", 3, DeliveryStatus::Pending),
                row(3, "b", 1, DeliveryStatus::Parked),
            ],
            &[("a", 1)],
        )
    }

    fn retried(rows: &mut DeliverySnapshot, n: u8, agg: &str) {
        let r = rows.get_mut(agg).unwrap().rows.get_mut(&id(n)).unwrap();
        r.view.status = DeliveryStatus::Pending;
        r.view.attempts = 0;
    }

    #[test]
    fn a_retry_that_keeps_to_its_event_passes() {
        let mut after = before();
        retried(&mut after, 1, "a");
        // The store's own bookkeeping of the aggregate's other rows may change.
        let follower = after.get_mut("a").unwrap().rows.get_mut(&id(2)).unwrap();
        follower.raw.insert("blocked".into(), "true".into());
        let retry = Action::Parked {
            op: OperatorStep::Retry,
            event: id(1),
            copy: None,
        };
        check(&retry, &before(), &after).unwrap();
    }

    #[test]
    fn a_retry_that_also_retries_another_aggregate_is_caught() {
        let mut after = before();
        retried(&mut after, 1, "a");
        retried(&mut after, 3, "b");
        let retry = Action::Parked {
            op: OperatorStep::Retry,
            event: id(1),
            copy: None,
        };
        let why = check(&retry, &before(), &after).unwrap_err();
        assert!(why.contains("another aggregate, b"), "{why}");
    }

    #[test]
    fn a_last_version_raised_past_the_promise_is_caught() {
        let mut after = before();
        after.get_mut("a").unwrap().state =
            BTreeMap::from([("last_version".to_owned(), "2".to_owned())]);
        let discard = Action::Parked {
            op: OperatorStep::Discard,
            event: id(1),
            copy: None,
        };
        // A discard of v2 raises the last version to 2, but leaves the event parked here.
        let why = check(&discard, &before(), &after).unwrap_err();
        assert!(why.contains("became Parked"), "{why}");
        after
            .get_mut("a")
            .unwrap()
            .rows
            .get_mut(&id(1))
            .unwrap()
            .view
            .status = DeliveryStatus::Discarded;
        check(&discard, &before(), &after).unwrap();
        // A retry of v2 accepts v1 as done, not v2.
        retried(&mut after, 1, "a");
        let retry = Action::Parked {
            op: OperatorStep::Retry,
            event: id(1),
            copy: None,
        };
        let why = check(&retry, &before(), &after).unwrap_err();
        assert!(
            why.contains("last version went from Some(1) to Some(2)"),
            "{why}"
        );
    }

    #[test]
    fn a_release_touches_only_the_owners_leases() {
        let mut b = before();
        b.get_mut("a")
            .unwrap()
            .state
            .insert("lease_owner".into(), "relay-0-0".into());
        b.get_mut("b")
            .unwrap()
            .state
            .insert("lease_owner".into(), "relay-1-0".into());
        let mut after = b.clone();
        after
            .get_mut("a")
            .unwrap()
            .state
            .insert("lease_owner".into(), "null".into());
        let release = Action::ReleaseClaims {
            owner: "relay-0-0".into(),
        };
        check(&release, &b, &after).unwrap();
        after
            .get_mut("b")
            .unwrap()
            .state
            .insert("lease_owner".into(), "null".into());
        let why = check(&release, &b, &after).unwrap_err();
        assert!(why.contains("another aggregate, b"), "{why}");
        // A refused action changes nothing at all.
        let refused = Action::Refused("retry".into());
        assert!(check(&refused, &b, &b).is_ok());
        assert!(check(&refused, &b, &after).is_err());
    }

    #[test]
    fn a_release_marks_possibly_sent_only_the_rows_the_owner_held() {
        let set = |s: &mut DeliverySnapshot, n: u8, k: &str, v: &str| {
            let r = s.get_mut("a").unwrap().rows.get_mut(&id(n)).unwrap();
            r.raw.insert(k.into(), v.into());
        };
        let mut b = before();
        set(&mut b, 2, "claim_owner", "relay-0-0");
        set(&mut b, 2, "maybe_delivered", "0");
        set(&mut b, 1, "maybe_delivered", "0");
        let release = Action::ReleaseClaims {
            owner: "relay-0-0".into(),
        };
        // The row the owner held: its claim ends and it may have been sent.
        let mut after = b.clone();
        set(&mut after, 2, "claim_owner", "null");
        set(&mut after, 2, "maybe_delivered", "1");
        check(&release, &b, &after).unwrap();
        // A row the owner did not hold is not marked.
        let mut wrong = after.clone();
        set(&mut wrong, 1, "maybe_delivered", "1");
        let why = check(&release, &b, &wrong).unwrap_err();
        assert!(why.contains("maybe_delivered"), "{why}");
        // Nothing un-marks a row.
        let mut b2 = b.clone();
        set(&mut b2, 2, "maybe_delivered", "1");
        let mut cleared = b2.clone();
        set(&mut cleared, 2, "maybe_delivered", "0");
        assert!(check(&release, &b2, &cleared).is_err());
    }
}
