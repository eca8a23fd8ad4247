//! Proof that the simulation's invariants catch bugs: each seeded bug (a wrapper or double
//! around the production code) is found by the property, with the violation it must cause.
//! The clean run (`tests/memory.rs`) passes with the same configuration.

use outbox_sim::{describe, run_property, SeededBug, SimConfig, Simulation};
use proptest::test_runner::TestError;

/// Runs the property with `bug` and returns the shrunk failure.
fn caught(bug: SeededBug) -> String {
    caught_within(bug, 400)
}

/// Runs the property with `bug` over `cases` cases and returns the shrunk failure.
fn caught_within(bug: SeededBug, cases: u32) -> String {
    let config = SimConfig::default()
        .bug(bug)
        .fixed_cases(cases)
        .max_shrink_iters(150);
    let c = config.clone();
    match run_property(&config, None, |modes| Simulation::memory(c.clone(), modes)) {
        Err(TestError::Fail(reason, case)) => {
            let text = format!("{reason}\n{}", describe(&case));
            eprintln!("{bug:?} caught:\n{text}");
            text
        }
        Err(TestError::Abort(reason)) => panic!("{bug:?}: aborted: {reason}"),
        Ok(()) => panic!("{bug:?} was not caught by the invariants"),
    }
}

fn assert_any(why: &str, expected: &[&str]) {
    assert!(
        expected.iter().any(|e| why.contains(e)),
        "expected one of {expected:?} in:\n{why}"
    );
}

#[test]
fn marking_published_before_the_ack_is_caught() {
    let why = caught(SeededBug::MarkBeforeAck);
    // Found at the send (the row is done before its version goes out) or at the record.
    assert_any(
        &why,
        &[
            "but the log holds nothing there",
            "is the last version done",
        ],
    );
}

#[test]
fn skipping_the_aggregate_head_is_caught() {
    let why = caught(SeededBug::SkipHead);
    assert_any(
        &why,
        &["sent while", "first delivery of", "without a live claim"],
    );
}

#[test]
fn committing_the_offset_before_the_transaction_is_caught() {
    let why = caught(SeededBug::CommitOffsetBeforeTx);
    assert_any(&why, &["is not final"]);
}

#[test]
fn outcomes_shifted_by_one_record_are_caught() {
    let why = caught(SeededBug::ShiftedOutcomes);
    assert_any(
        &why,
        &[
            "but the log holds",
            "was published without an operator action",
        ],
    );
}

#[test]
fn ack_metadata_of_another_record_is_caught() {
    let why = caught(SeededBug::SwappedAckMetadata);
    assert_any(&why, &["but the log holds"]);
}

#[test]
fn a_watermark_past_an_unfinished_offset_is_caught() {
    let why = caught(SeededBug::WatermarkPastUnfinished);
    assert_any(&why, &["is not final", "committed offset"]);
}

#[test]
fn a_fallback_that_skips_a_record_is_caught() {
    let why = caught(SeededBug::FallbackSkipsRecord);
    assert_any(&why, &["was not applied once", "was never applied"]);
}

#[test]
fn a_prefetched_batch_under_a_stale_claim_is_caught() {
    let why = caught(SeededBug::StalePrefetch);
    assert_any(&why, &["without a live claim"]);
}

// The transports' own bugs, which Kafka cases never meet: each caught within the default
// number of cases (150), the transport chosen per case as in the clean run.

#[test]
fn jetstream_positions_by_stream_sequence_are_caught() {
    let why = caught_within(
        SeededBug::JetStreamStreamSequenceOffsets,
        SimConfig::default().cases,
    );
    assert!(why.contains("JetStream"), "{why}");
    assert_any(
        &why,
        &[
            "handed out a position at or below one it had handed out",
            "acknowledged but its outcome is not final",
            "was never applied",
            "was not applied once",
            "never acknowledged",
            "consumer-side parking never cleared",
        ],
    );
}

#[test]
fn a_jetstream_ack_before_the_effect_is_caught() {
    let why = caught_within(
        SeededBug::JetStreamAckOnDelivery,
        SimConfig::default().cases,
    );
    assert!(why.contains("JetStream"), "{why}");
    assert_any(&why, &["acknowledged but its outcome is not final"]);
}

#[test]
fn a_rabbitmq_source_that_skips_redeliveries_is_caught() {
    let why = caught_within(
        SeededBug::RabbitSkipsRedelivered,
        SimConfig::default().cases,
    );
    assert!(why.contains("RabbitMq"), "{why}");
    assert_any(
        &why,
        &[
            "acknowledged but its outcome is not final",
            "was never applied",
            "was not applied once",
        ],
    );
}

// Runs (outbox_core::store, "Runs"): every case claims runs of up to 3 events, so each bug
// meets one; each invariant of runs catches its own bug.

fn caught_with_runs(bug: SeededBug) -> String {
    let config = SimConfig::default()
        .run(3)
        .bug(bug)
        .fixed_cases(400)
        .max_shrink_iters(150);
    let c = config.clone();
    match run_property(&config, None, |modes| Simulation::memory(c.clone(), modes)) {
        Err(TestError::Fail(reason, case)) => {
            let text = format!("{reason}\n{}", describe(&case));
            eprintln!("{bug:?} caught:\n{text}");
            text
        }
        Err(TestError::Abort(reason)) => panic!("{bug:?}: aborted: {reason}"),
        Ok(()) => panic!("{bug:?} was not caught by the invariants"),
    }
}

#[test]
fn a_run_sent_without_waiting_for_each_acknowledgement_is_caught() {
    // Send order: v+1 went out before v's acknowledgement came back to the relay.
    let why = caught_with_runs(SeededBug::RunSentAtOnce);
    assert_any(
        &why,
        &["was not acknowledged to its sender under its claim"],
    );
}

#[test]
fn a_store_accepting_a_completion_with_a_hole_is_caught() {
    // Prefix: the store let `last` pass a version of the run that is not published.
    let why = caught_with_runs(SeededBug::StoreAcceptsRunHoles);
    assert_any(&why, &["prefix:"]);
}

#[test]
fn a_run_skipping_a_missing_version_is_caught() {
    // Send order (nothing goes out past a gap) or first deliveries in version order.
    let why = caught_with_runs(SeededBug::RunSkipsGap);
    assert_any(
        &why,
        &["was not acknowledged to its sender", "first delivery of"],
    );
}
