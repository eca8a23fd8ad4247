//! The transports' own delivery semantics in scripted scenarios: a JetStream redelivery that
//! comes after a later message, a RabbitMQ channel lost under the running engine, JetStream's
//! duplicate window; and the transports' seeded bugs caught on them.

use std::time::Duration;

use outbox_sim::{Modes, Policy, RecordAnswer, SeededBug, SimConfig, Simulation, Step, Transport};

fn begin(aggregate: usize, events: usize) -> Step {
    Step::Begin {
        aggregate,
        events,
        command: 0,
    }
}

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
