//! The crash-at-every-step simulation over the in-memory backends, and proof that its
//! invariants catch three seeded bugs.

use std::time::Duration;

use outbox_testkit::sim::{
    self, BrokerFault, CountingHandler, Mutation, OperatorStep, SimConfig, SimReport, Simulation,
    Step,
};
use proptest::test_runner::TestError;

#[test]
fn simulation_holds_every_invariant() {
    // OUTBOX_SIM_CASES=5000 for a long run; OUTBOX_SIM_SEED to replay a printed seed.
    let result = sim::run_property(&SimConfig::default(), Some(file!()), || CountingHandler);
    if let Err(e) = result {
        match &e {
            TestError::Fail(reason, case) => {
                panic!("{reason}\n{}", sim::describe(case))
            }
            TestError::Abort(reason) => panic!("aborted: {reason}"),
        }
    }
}

/// Runs the property with a mutation and returns the shrunk failure message.
fn caught(mutation: Mutation) -> String {
    let config = SimConfig::default().mutation(mutation).fixed_cases(2000);
    match sim::run_property(&config, None, || CountingHandler) {
        Err(TestError::Fail(reason, case)) => {
            let text = format!("{reason}\n{}", sim::describe(&case));
            eprintln!("{mutation:?} caught:\n{text}");
            text
        }
        Err(TestError::Abort(reason)) => panic!("{mutation:?}: aborted: {reason}"),
        Ok(()) => panic!("{mutation:?} was not caught by the invariants"),
    }
}

#[test]
fn mutant_marking_published_before_the_ack_is_caught() {
    let why = caught(Mutation::MarkBeforeAck);
    assert!(
        why.contains("marked published but the broker never stored it")
            || why.contains("never applied"),
        "{why}"
    );
}

#[test]
fn mutant_skipping_the_aggregate_head_is_caught() {
    let why = caught(Mutation::SkipHead);
    assert!(
        why.contains("sent while") || why.contains("first delivery"),
        "{why}"
    );
}

#[test]
fn mutant_committing_the_offset_before_the_transaction_is_caught() {
    let why = caught(Mutation::CommitOffsetBeforeTx);
    assert!(why.contains("committed in partition"), "{why}");
}

#[test]
fn the_generator_reaches_the_interesting_states() {
    // Invariants that never meet a duplicate, a fenced relay or a parked event prove little:
    // check that generated cases get there.
    let config = SimConfig::default();
    let mut total = SimReport::default();
    let mut modes = [0usize; 2];
    for (lease, steps) in sim::sample_cases(&config, 150, 1) {
        modes[usize::from(lease)] += 1;
        let r = Simulation::new(config.clone(), lease, CountingHandler)
            .run(&steps)
            .unwrap_or_else(|v| panic!("{v}"));
        total.committed_events += r.committed_events;
        total.applied += r.applied;
        total.duplicates_in_log += r.duplicates_in_log;
        total.superseded += r.superseded;
        total.parked += r.parked;
        total.operator_actions += r.operator_actions;
        total.duplicate_registrations += r.duplicate_registrations;
        total.relay_crashes_holding_work += r.relay_crashes_holding_work;
        total.conflicts += r.conflicts;
        total.cleaned += r.cleaned;
        total.store_faults += r.store_faults;
    }
    eprintln!("coverage over 150 cases: {total:?}, modes {modes:?}");
    assert!(
        modes[0] > 20 && modes[1] > 20,
        "both claim modes: {modes:?}"
    );
    assert!(total.committed_events > 300, "{total:?}");
    assert!(total.applied > 300, "{total:?}");
    assert!(
        total.duplicates_in_log > 0,
        "no duplicate deliveries: {total:?}"
    );
    assert!(
        total.duplicate_registrations > 0,
        "no duplicates reached the inbox: {total:?}"
    );
    assert!(total.superseded > 0, "no stale relay was fenced: {total:?}");
    assert!(total.parked > 0, "nothing parked: {total:?}");
    assert!(total.operator_actions > 0, "no operator action: {total:?}");
    assert!(
        total.relay_crashes_holding_work > 0,
        "no relay crashed mid-batch: {total:?}"
    );
    assert!(total.conflicts > 0, "no optimistic conflict: {total:?}");
    assert!(total.cleaned > 0, "cleanup never removed a row: {total:?}");
    assert!(total.store_faults > 0, "{total:?}");
}

fn begin(aggregate: usize, events: usize) -> Step {
    Step::Begin { aggregate, events }
}

#[test]
fn scripted_crash_between_send_and_mark_duplicates_but_loses_nothing() {
    for lease in [true, false] {
        let mut sim = Simulation::new(SimConfig::default(), lease, CountingHandler);
        let steps = vec![
            begin(0, 2),
            Step::Commit(0),
            Step::Relay(0), // claim v1
            Step::Relay(0), // send v1: the broker stores it
            Step::RelayCrash(0),
            Step::Advance(Duration::from_secs(31)),
            Step::Relay(1), // claims v1 again
            Step::Relay(1),
            Step::Relay(1),
            Step::Relay(1), // marks v1
            Step::Consumer,
            Step::Consumer,
            Step::Consumer,
            Step::Consumer,
            Step::Consumer, // receives the duplicate of v1
            Step::Consumer,
            Step::Consumer,
            Step::Consumer,
        ];
        let report = sim.run(&steps).expect("invariants hold");
        assert_eq!(report.committed_events, 2);
        assert_eq!(report.applied, 2, "each event applied once");
        assert_eq!(report.log_records, 3, "v1 was published twice");
    }
}

#[test]
fn scripted_lost_acks_permanent_faults_and_operator_actions() {
    let mut sim = Simulation::new(SimConfig::default(), true, CountingHandler);
    let steps = vec![
        begin(0, 1),
        begin(1, 2),
        Step::Commit(1),
        Step::Commit(0),
        Step::BrokerFault(BrokerFault::AckLost, 1),
        Step::BrokerFault(BrokerFault::Permanent, 1),
        Step::Relay(0),
        Step::Relay(0),
        Step::Relay(0),
        Step::Relay(0), // one retry scheduled, one parked
        Step::Operator(OperatorStep::Reissue, 0),
        Step::Advance(Duration::from_secs(10)),
        Step::Relay(1),
        Step::Relay(1),
        Step::Rebalance,
        Step::Relay(1),
        Step::Relay(1),
    ];
    let report = sim.run(&steps).expect("invariants hold");
    assert_eq!(report.committed_events, 3);
    assert!(report.applied >= 3, "the re-issued copy is a new event");
}

#[test]
fn scripted_mark_before_ack_with_a_broker_fault_is_a_violation() {
    let config = SimConfig::default().mutation(Mutation::MarkBeforeAck);
    let mut sim = Simulation::new(config, true, CountingHandler);
    let steps = vec![
        begin(0, 1),
        Step::Commit(0),
        Step::BrokerFault(BrokerFault::Transient, 1),
        Step::Relay(0),
        Step::Relay(0),
    ];
    let v = sim.run(&steps).expect_err("the mutant must be caught");
    assert_eq!(v.step, Some(4));
    assert!(v.message.contains("never stored"), "{v}");
}

/// A user handler that insists on gap-free versions (v = last + 1). The simulation shows why
/// that is wrong here: after an operator discards a parked event, the aggregate's next version
/// can never be applied.
struct StrictVersionHandler;

#[outbox_core::async_trait]
impl sim::SimHandler for StrictVersionHandler {
    async fn apply(
        &self,
        tx: &mut outbox_testkit::MemoryTx,
        event: &outbox_core::Envelope,
    ) -> Result<(), String> {
        let last = tx
            .get("strict", &event.aggregate_id)
            .and_then(|v| v.as_i64())
            .unwrap_or(0);
        if event.aggregate_version != last + 1 {
            return Err(format!("gap: v{} after v{last}", event.aggregate_version));
        }
        tx.put(
            "strict",
            &event.aggregate_id,
            event.aggregate_version.into(),
        );
        Ok(())
    }
}

#[test]
fn a_users_handler_bug_is_found() {
    let config = SimConfig::default().fixed_cases(2000);
    match sim::run_property(&config, None, || StrictVersionHandler) {
        Err(TestError::Fail(reason, case)) => {
            eprintln!("{reason}\n{}", sim::describe(&case));
            assert!(reason.message().contains("never applied"), "{reason}");
            assert!(
                case.1
                    .iter()
                    .any(|s| matches!(s, Step::Operator(OperatorStep::Discard, _))),
                "the minimal case involves a discard: {}",
                sim::describe(&case)
            );
        }
        other => panic!("the strict handler was not caught: {other:?}"),
    }
}
