//! The claim's decision for one candidate row, from what was read after its aggregate's lock:
//! a pure function, so every rule of the version order is tested without a server.

use super::head::AggView;

/// A candidate row as read after its aggregate's lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub(crate) id: i64,
    pub(crate) version: i64,
    /// Still `pending` and not blocked (another transaction may have moved it since the scan).
    pub(crate) open: bool,
    /// Its retry time has come.
    pub(crate) due: bool,
    /// Held as a version gap for longer than the gap timeout.
    pub(crate) gap_expired: bool,
}

/// What a claim does with a candidate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// The aggregate's head at `last + 1`, due, under no live lease: hand it out.
    Claim,
    /// At or below the last version published or discarded: would go out after a later
    /// version; parked as out of order.
    Stale,
    /// An unfinished row of its aggregate precedes it: blocked (it leaves the candidates until
    /// the store unblocks it).
    Follower,
    /// The head skips a version: held, checked again shortly.
    GapHold,
    /// The head has skipped a version for longer than the gap timeout: parked as a gap.
    GapPark,
    /// Nothing now (not due, under a live lease, or no longer a candidate).
    Wait,
}

/// The decision for `c` in aggregate state `v`.
pub(crate) fn decide(c: &Candidate, v: &AggView) -> Action {
    if !c.open || v.leased {
        return Action::Wait;
    }
    if c.version <= v.last_eff {
        return Action::Stale;
    }
    match &v.head {
        Some(h) if h.id == c.id => {}
        // Another unfinished row precedes it (or the read raced with a change: not a head).
        _ => return Action::Follower,
    }
    if c.version > v.last_eff + 1 {
        return if c.gap_expired {
            Action::GapPark
        } else {
            Action::GapHold
        };
    }
    if !c.due {
        return Action::Wait;
    }
    Action::Claim
}

#[cfg(test)]
mod tests {
    use super::super::head::Head;
    use super::*;

    fn view(last: i64, head: Option<(i64, i64, bool)>, leased: bool) -> AggView {
        AggView {
            last_eff: last,
            last: Some(last),
            leased,
            legacy_lease_row: None,
            head: head.map(|(id, version, parked)| Head {
                id,
                version,
                parked,
                blocked: false,
                leased: false,
            }),
        }
    }

    fn cand(id: i64, version: i64) -> Candidate {
        Candidate {
            id,
            version,
            open: true,
            due: true,
            gap_expired: false,
        }
    }

    #[test]
    fn decision_table() {
        use Action::*;
        let table: Vec<(&str, Candidate, AggView, Action)> = vec![
            (
                "head at last + 1",
                cand(7, 3),
                view(2, Some((7, 3, false)), false),
                Claim,
            ),
            (
                "first event of a new aggregate",
                cand(1, 1),
                view(0, Some((1, 1, false)), false),
                Claim,
            ),
            (
                "live lease",
                cand(7, 3),
                view(2, Some((7, 3, false)), true),
                Wait,
            ),
            (
                "duplicate of the last",
                cand(9, 2),
                view(2, Some((7, 3, false)), false),
                Stale,
            ),
            ("below the last", cand(9, 1), view(2, None, false), Stale),
            (
                "behind a pending head",
                cand(9, 4),
                view(2, Some((7, 3, false)), false),
                Follower,
            ),
            (
                "behind a parked head",
                cand(9, 4),
                view(2, Some((5, 3, true)), false),
                Follower,
            ),
            (
                "same version, later id",
                cand(9, 3),
                view(2, Some((7, 3, false)), false),
                Follower,
            ),
            (
                "gap",
                cand(7, 5),
                view(2, Some((7, 5, false)), false),
                GapHold,
            ),
            (
                "gap past its timeout",
                Candidate {
                    gap_expired: true,
                    ..cand(7, 5)
                },
                view(2, Some((7, 5, false)), false),
                GapPark,
            ),
            (
                "not due",
                Candidate {
                    due: false,
                    ..cand(7, 3)
                },
                view(2, Some((7, 3, false)), false),
                Wait,
            ),
            (
                "moved since the scan",
                Candidate {
                    open: false,
                    ..cand(7, 3)
                },
                view(2, Some((7, 3, false)), false),
                Wait,
            ),
            (
                "no head seen (raced)",
                cand(7, 3),
                view(2, None, false),
                Follower,
            ),
        ];
        for (name, c, v, want) in table {
            assert_eq!(decide(&c, &v), want, "{name}");
        }
    }
}
