//! What the simulation's test binaries share: the scripted steps' builders and the operator
//! scenario; for the server binaries (`mysql.rs`, `postgres.rs`), [`server`].
#![allow(dead_code, unreachable_pub)]

pub mod server;

use outbox_sim::{describe, Case, RecordAnswer, Step};
use proptest::test_runner::TestError;

pub fn begin(aggregate: usize, events: usize) -> Step {
    Step::Begin {
        aggregate,
        events,
        command: 0,
    }
}

pub fn answer(relay: usize, answers: &[RecordAnswer]) -> Step {
    Step::Answer {
        relay,
        answers: answers.to_vec(),
    }
}

/// Aggregates `0..aggregates`, each in a business transaction of `events` events committed
/// at once (one after the other).
pub fn committed(aggregates: usize, events: usize) -> Vec<Step> {
    let mut steps = Vec::new();
    for a in 0..aggregates {
        steps.push(begin(a, events));
        steps.push(Step::Commit(0));
    }
    steps
}

/// Operator actions on parked events of several aggregates, and the release of a crashed
/// relay's claims: each is checked for its scope (the store's whole delivery state before and
/// after: nothing outside its target changed, the target only as promised).
pub fn operator_steps() -> Vec<Step> {
    use outbox_sim::OperatorStep::{Discard, Reissue, Retry};
    let mut steps = committed(4, 2);
    steps.extend([
        // Heads of several aggregates park (a permanent failure each).
        Step::Relay(0),
        answer(0, &[RecordAnswer::Permanent]),
        Step::Relay(1),
        answer(1, &[RecordAnswer::Permanent]),
        Step::Operator(Retry, 0),
        Step::Operator(Discard, 0),
        Step::Operator(Reissue, 0),
        // A relay holds a batch (a lease in lease mode), dies, and its claims are released.
        Step::Relay(0),
        Step::ReleaseClaims(0),
        Step::Relay(1),
        answer(1, &[RecordAnswer::Ack]),
        Step::Consumer(20),
    ]);
    steps
}

/// Panics with the failing case (shrunk) when the property failed.
pub fn expect_property(result: Result<(), TestError<Case>>) {
    if let Err(e) = result {
        match &e {
            TestError::Fail(reason, case) => panic!("{reason}\n{}", describe(case)),
            TestError::Abort(reason) => panic!("aborted: {reason}"),
        }
    }
}
