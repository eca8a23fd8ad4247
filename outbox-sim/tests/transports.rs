//! The transports' own delivery semantics in scripted scenarios: a JetStream redelivery that
//! comes after a later message, a RabbitMQ channel lost under the running engine, JetStream's
//! duplicate window; and the transports' seeded bugs caught on them.

mod common;

use std::time::Duration;

use common::begin;

use outbox_sim::{
    HandlerFault, Modes, Policy, RecordAnswer, SeededBug, SimConfig, Simulation, Step, Transport,
};

fn answer(answers: &[RecordAnswer]) -> Step {
    Step::Answer {
        relay: 0,
        answers: answers.to_vec(),
    }
}

fn modes(transport: Transport, policy: Policy) -> Modes {
    Modes {
        lease: true,
        policy,
        transport,
        ..Modes::default()
    }
}

/// v1 is delivered to a member that crashes; v2 reaches the next member first; v1 comes back
/// after the ack wait, at a higher delivery sequence.
fn overtaken_head() -> Vec<Step> {
    vec![
        begin(0, 2),
        Step::Commit(0),
        Step::Relay(0),
        answer(&[RecordAnswer::Ack]), // v1 stored
        Step::Consumer(1),            // v1 delivered, not applied
        Step::ConsumerCrash,
        Step::Relay(0),
        answer(&[RecordAnswer::Ack]), // v2 stored
        Step::Consumer(4),            // v2 delivered first: held, or parked as a gap
        Step::Advance(Duration::from_secs(31)),
        Step::Consumer(10), // v1 redelivered
    ]
}

#[test]
fn a_jetstream_redelivery_after_a_later_version_is_applied_in_order() {
    for policy in [Policy::Reject, Policy::Hold] {
        let config = SimConfig::default().transport(Transport::JetStream);
        let report = Simulation::memory(config, modes(Transport::JetStream, policy))
            .run(&overtaken_head())
            .unwrap_or_else(|v| panic!("{policy:?}: {v}"));
        assert_eq!(report.applied, 2, "{policy:?}: {report:?}");
        assert!(report.redelivered >= 1, "{policy:?}: {report:?}");
    }
}

#[test]
fn a_rabbitmq_channel_lost_under_the_engine_redelivers_everything_unacked() {
    let steps = vec![
        begin(0, 2),
        Step::Commit(0),
        Step::Relay(0),
        answer(&[RecordAnswer::Ack]),
        Step::Relay(0),
        answer(&[RecordAnswer::Ack]),
        Step::Consumer(1), // both delivered on channel 1, not acked
        Step::Rebalance,   // the channel is lost; the engine runs on
        Step::Consumer(10),
    ];
    let config = SimConfig::default().transport(Transport::RabbitMq);
    let report = Simulation::memory(config.clone(), modes(Transport::RabbitMq, Policy::Reject))
        .run(&steps)
        .unwrap_or_else(|v| panic!("{v}"));
    assert_eq!(report.channels_lost, 1, "{report:?}");
    assert!(report.redelivered >= 1, "{report:?}");
    assert_eq!(report.applied, 2, "{report:?}");

    // The same with a source that skips redelivered messages: they are acknowledged and
    // never applied.
    let err = Simulation::memory(
        config.bug(SeededBug::RabbitSkipsRedelivered),
        modes(Transport::RabbitMq, Policy::Reject),
    )
    .run(&steps)
    .expect_err("skipped redeliveries are caught");
    assert!(
        err.message
            .contains("acknowledged but its outcome is not final"),
        "{err}"
    );
}

#[test]
fn jetstream_keeps_a_resend_inside_its_duplicate_window_out_of_the_stream() {
    // The acknowledgement of v1 is lost; the relay sends it again: inside the window the
    // stream stores nothing new and its ack names the first copy; after it, a second copy.
    for (wait, copies) in [(31, 1usize), (121, 2)] {
        let steps = vec![
            begin(0, 1),
            Step::Commit(0),
            Step::Relay(0),
            answer(&[RecordAnswer::AckLost]),
            Step::Advance(Duration::from_secs(wait)),
            Step::Relay(0),
            answer(&[RecordAnswer::Ack]),
        ];
        let config = SimConfig::default().transport(Transport::JetStream);
        let mut sim = Simulation::memory(config, modes(Transport::JetStream, Policy::Reject));
        let report = sim.run(&steps).unwrap_or_else(|v| panic!("{v}"));
        assert_eq!(sim.log().all_records().len(), copies, "{report:?}");
        assert_eq!(report.deduplicated_sends, 2 - copies, "{report:?}");
        assert_eq!(report.applied, 1, "{report:?}");
    }
}

#[test]
fn a_jetstream_ack_before_the_effect_is_caught_at_once() {
    let steps = vec![
        begin(0, 1),
        Step::Commit(0),
        Step::Relay(0),
        answer(&[RecordAnswer::Ack]),
        Step::Consumer(1),
    ];
    let config = SimConfig::default()
        .transport(Transport::JetStream)
        .bug(SeededBug::JetStreamAckOnDelivery);
    let err = Simulation::memory(config, modes(Transport::JetStream, Policy::Reject))
        .run(&steps)
        .expect_err("an ack before the effect is caught");
    assert!(
        err.message
            .contains("acknowledged but its outcome is not final"),
        "{err}"
    );
}

/// A member crashes holding v1 of `agg-0`; the next member receives a later message (v2 of
/// `agg-0`, or v1 of `agg-1`) and stalls past the ack wait with it in flight: v1 comes back
/// *behind* it, at a higher delivery sequence, and is the newest delivery, not a rewind. Every
/// effect once, in order; the same steps with a source that orders by stream sequence are a
/// rewind, caught at once.
#[test]
fn a_crashed_members_message_redelivered_behind_later_ones_in_flight_is_the_newest() {
    for (later_aggregate, policy) in [
        (0, Policy::Hold),
        (0, Policy::Reject),
        (1, Policy::Unchecked),
    ] {
        let steps = vec![
            begin(0, 1),
            Step::Commit(0),
            Step::Relay(0),
            answer(&[RecordAnswer::Ack]), // agg-0 v1 stored
            Step::Consumer(1),            // delivered, not applied
            Step::ConsumerCrash,
            begin(later_aggregate, 1),
            Step::Commit(0),
            Step::Relay(0),
            answer(&[RecordAnswer::Ack]), // the later message stored
            Step::ConsumerStalls {
                before: 1, // the later message received
                after: 4,  // v1 comes back behind it
            },
            Step::Consumer(10),
        ];
        let config = SimConfig::default().transport(Transport::JetStream);
        let report = Simulation::memory(config.clone(), modes(Transport::JetStream, policy))
            .run(&steps)
            .unwrap_or_else(|v| panic!("{policy:?}: {v}"));
        assert_eq!(report.applied, 2, "{policy:?}: {report:?}");
        assert_eq!(report.redelivered_behind_later, 1, "{policy:?}: {report:?}");

        let err = Simulation::memory(
            config.bug(SeededBug::JetStreamStreamSequenceOffsets),
            modes(Transport::JetStream, policy),
        )
        .run(&steps)
        .expect_err("positions by stream sequence are caught");
        assert!(
            err.message
                .contains("handed out a position at or below one it had handed out"),
            "{policy:?}: {err}"
        );
    }
}

/// Another member of the durable consumer pulls v1 of `agg-0` and dies; the live engine reads
/// v1 of `agg-1` meanwhile; v1 of `agg-0` comes back after the ack wait, behind it. Clean:
/// every effect once. Positions by stream sequence: a rewind, caught.
#[test]
fn another_members_message_redelivered_after_later_ones_is_not_a_rewind() {
    let steps = vec![
        Step::OtherMemberDies(1),
        begin(0, 1),
        Step::Commit(0),
        Step::Relay(0),
        answer(&[RecordAnswer::Ack]), // agg-0 v1: pulled by the member that dies
        begin(1, 1),
        Step::Commit(0),
        Step::Relay(0),
        answer(&[RecordAnswer::Ack]), // agg-1 v1: the live engine's
        Step::ConsumerStalls {
            before: 1,
            after: 6,
        },
    ];
    let config = SimConfig::default().transport(Transport::JetStream);
    let report = Simulation::memory(config.clone(), modes(Transport::JetStream, Policy::Reject))
        .run(&steps)
        .unwrap_or_else(|v| panic!("{v}"));
    assert_eq!(report.taken_by_dead_members, 1, "{report:?}");
    assert_eq!(report.redelivered_behind_later, 1, "{report:?}");
    assert_eq!(report.applied, 2, "{report:?}");
    let err = Simulation::memory(
        config.bug(SeededBug::JetStreamStreamSequenceOffsets),
        modes(Transport::JetStream, Policy::Reject),
    )
    .run(&steps)
    .expect_err("positions by stream sequence are caught");
    assert!(
        err.message
            .contains("handed out a position at or below one it had handed out"),
        "{err}"
    );
}

/// Found with `Step::OtherMemberDies` in the generator (the coverage sample, seed 2), shrunk by
/// hand: agg-1 gets v3 (v1, v2 never committed; the outbox parks and the drain's operator
/// publishes it), then v4 and v5; the member that dies holds v3, so the live engine (Hold,
/// 20 ms) reads v4 first and parks it as a gap (v5 waits behind it); v3 comes back after the
/// ack wait and, its aggregate blocked, is parked waiting behind v4 (nothing releases a parked
/// gap but an operator). The operator retries v4: the release goes in version order, and v3
/// fails on its own gap (`require_first_version`: v1 expected) and becomes a second head. The
/// simulation's operator used to retry the first head listed (v4) again and again; it now
/// retries an aggregate's lowest parked head, v3, whose gap the retry accepts: v3, v4, v5.
#[test]
fn a_redelivered_lower_version_after_a_parked_gap_clears() {
    let steps = vec![
        Step::OtherMemberDies(1),
        Step::Skew {
            aggregate: 1,
            skew: outbox_sim::Skew::Gap(2),
        },
        Step::Commit(1),
        begin(1, 2),
    ];
    let config = SimConfig::default().transport(Transport::JetStream);
    Simulation::memory(config, modes(Transport::JetStream, Policy::Hold))
        .run(&steps)
        .unwrap_or_else(|v| panic!("{v}"));
}

/// A RabbitMQ channel lost while a batch of the engine is in its store-failure backoff (a
/// finding of the handler ledger, not of the engine). The loss starts a new generation of the
/// ledger, but the running batch still hands its old delivery to the handler once more: a
/// transient failure (the event stuck), after which the old delivery is handed back and
/// dropped (its ticket is stale). The redelivered copy then gets its own `max_attempts` (3)
/// calls, as the engine counts attempts per delivery, and is parked: four failures in the
/// generation. The ledger allows one transient failure more in the generation to an event
/// the lost channel held (its old delivery's), not two: the engine's attempt counting is
/// still checked (an engine that gave the redelivery a fourth attempt fails here).
///
/// The inbox stays down from the batch's first commit until the channel is lost, so the batch
/// is in its backoff then whatever the machine's load: with one failed commit only, a backoff
/// (10 ms, real time) that ran out within the engine step that started the batch (the thread
/// held that long by a loaded machine) committed the event before the channel was lost, and
/// the stuck handler was never called (`consumer_parked` 0, seen once under load). The engine
/// thread is held that long here on purpose.
#[test]
fn a_channel_lost_under_a_batch_in_backoff_keeps_the_redelivery_budget() {
    let steps = |inbox_down: bool| {
        let mut steps = vec![
            begin(0, 1),
            Step::Commit(0),
            Step::Relay(0),
            answer(&[RecordAnswer::Ack]),
            if inbox_down {
                Step::InboxDown
            } else {
                Step::InboxCommitFault { lost_reply: false }
            },
            Step::Consumer(1), // received on channel 1
            // Held past the batch's backoff, in the step that starts it.
            Step::EngineThreadStalls(Duration::from_millis(40)),
            Step::Consumer(1), // its batch: handled, the commit fails, the batch backs off
            Step::HandlerFault(HandlerFault::Stuck),
            Step::Rebalance, // the channel is lost under the running batch
        ];
        if inbox_down {
            steps.push(Step::InboxUp);
        }
        steps.push(Step::Consumer(20));
        steps
    };
    let config = SimConfig::default().transport(Transport::RabbitMq);
    let report = Simulation::memory(
        config.clone(),
        modes(Transport::RabbitMq, Policy::Unchecked),
    )
    .run(&steps(true))
    .unwrap_or_else(|v| panic!("{v}"));
    assert_eq!(report.channels_lost, 1, "{report:?}");
    assert_eq!(report.consumer_parked, 1, "{report:?}");
    assert_eq!(report.applied, 1, "{report:?}");

    // With one failed commit, the stall lets the batch commit before the channel is lost:
    // the scenario above does not happen (what a loaded machine did to this test).
    let report = Simulation::memory(config, modes(Transport::RabbitMq, Policy::Unchecked))
        .run(&steps(false))
        .unwrap_or_else(|v| panic!("{v}"));
    assert_eq!(
        (report.consumer_parked, report.applied),
        (0, 1),
        "the stall did not let the batch finish: {report:?}"
    );
}
