//! Plugging in your own consumer effect and producer commands.
//!
//! The handler below is written for the real inbox transaction (`Handler<MemoryTx>`, the same
//! trait the production engine runs); the simulation runs it unchanged inside the real
//! `ConsumerEngine`. The commands are an order's lifecycle with guards: `place` only on a new
//! order, `pay` only on a placed one, `ship` only on a paid one.

use outbox_core::{async_trait, Envelope};
use outbox_inbox::{Handler, HandlerError};
use outbox_sim::{
    describe, run_property, Command, MemoryBackend, Modes, OperatorStep, Policy, RaceOp, SimConfig,
    Simulation, Step, Transition, Transport,
};
use outbox_testkit::MemoryTx;
use proptest::test_runner::TestError;
use serde_json::{json, Value};

/// The consumer's projection: each order's status, moved along only in lifecycle order.
/// An event at or behind the status it holds is already reflected there: skipped (under
/// `VersionPolicy::Unchecked` on JetStream an earlier event comes again after later ones
/// when another member died holding it).
#[derive(Clone, Copy, Default)]
struct OrderProjection {
    /// A bug to find: require the previous status to be exactly the step before, so an order
    /// whose step an operator discarded can never move on.
    strict: bool,
    /// A bug to find: refuse (permanently) an event behind the status instead of skipping
    /// it, so an earlier event redelivered after later ones is parked for good.
    refuse_stale: bool,
}

fn rank(event_type: &str) -> i64 {
    match event_type {
        "order.placed" => 1,
        "order.paid" => 2,
        "order.shipped" => 3,
        _ => 0,
    }
}

#[async_trait]
impl Handler<MemoryTx> for OrderProjection {
    async fn handle(&self, tx: &mut MemoryTx, e: &Envelope) -> Result<(), HandlerError> {
        let current = tx
            .get("order_status", &e.aggregate_id)
            .and_then(|v| v.as_str().map(rank))
            .unwrap_or(0);
        let next = rank(&e.event_type);
        if next <= current && self.refuse_stale {
            return Err(HandlerError::permanent(format!(
                "{} would move back from {current} to {next}",
                e.aggregate_id
            )));
        }
        if next <= current {
            return Ok(());
        }
        if self.strict && next != current + 1 {
            return Err(HandlerError::permanent("a lifecycle step is missing"));
        }
        tx.put("order_status", &e.aggregate_id, json!(e.event_type));
        Ok(())
    }
}

struct Place;
struct Pay;
struct Ship;

fn status(state: &Value) -> &str {
    state.as_str().unwrap_or("new")
}

impl Command for Place {
    fn name(&self) -> &str {
        "place"
    }
    fn guard(&self, state: &Value) -> bool {
        status(state) == "new"
    }
    fn apply(&self, _: &Value) -> Transition {
        Transition::new(json!("placed"), "order.placed", json!({ "total": 42 }))
    }
}

impl Command for Pay {
    fn name(&self) -> &str {
        "pay"
    }
    fn guard(&self, state: &Value) -> bool {
        status(state) == "placed"
    }
    fn apply(&self, _: &Value) -> Transition {
        Transition::new(json!("paid"), "order.paid", json!({}))
    }
}

impl Command for Ship {
    fn name(&self) -> &str {
        "ship"
    }
    fn guard(&self, state: &Value) -> bool {
        status(state) == "paid"
    }
    fn apply(&self, _: &Value) -> Transition {
        Transition::new(json!("shipped"), "order.shipped", json!({}))
    }
}

fn commands() -> Vec<Box<dyn Command>> {
    vec![Box::new(Place), Box::new(Pay), Box::new(Ship)]
}

fn simulation(
    config: &SimConfig,
    modes: Modes,
    handler: OrderProjection,
) -> Simulation<MemoryBackend, OrderProjection> {
    Simulation::new(
        config.clone(),
        modes,
        |_, mode| MemoryBackend::new(mode),
        handler,
        commands(),
    )
}

#[test]
fn a_users_handler_and_commands_hold_the_invariants() {
    // The projection understands its own commands' events only: no out-of-order appends.
    let config = SimConfig::default().fixed_cases(40).without_skew();
    let result = run_property(&config, None, |modes| {
        simulation(&config, modes, OrderProjection::default())
    });
    if let Err(TestError::Fail(reason, case)) = &result {
        panic!("{reason}\n{}", describe(case));
    }
    assert!(result.is_ok(), "{result:?}");
}

#[test]
fn the_guards_decide_which_events_exist_and_the_projection_follows() {
    let mut sim = simulation(
        &SimConfig::default(),
        Modes {
            lease: true,
            prefetch: true,
            ..Modes::default()
        },
        OrderProjection::default(),
    );
    // Command 1 (pay) first: its guard refuses a new order, so only `place` runs; then the
    // lifecycle continues from `pay`.
    let steps = vec![
        Step::Begin {
            aggregate: 0,
            events: 1,
            command: 1,
        },
        Step::Commit(0),
        Step::Begin {
            aggregate: 0,
            events: 3,
            command: 0,
        },
        Step::Commit(0),
    ];
    let report = sim.run(&steps).expect("invariants hold");
    assert_eq!(report.committed_events, 3, "place, pay, ship: {report:?}");
    assert_eq!(
        sim.backend().db().read("order_status", "agg-0"),
        Some(json!("order.shipped"))
    );
}

#[test]
fn a_handler_bug_is_found_by_the_simulation() {
    // A strict projection that insists on every lifecycle step: an operator discarding a
    // parked `order.paid` makes `order.shipped` unapplicable, and the simulation says so.
    // Its own commands' events only (a skewed event would fail the strict projection first).
    let config = SimConfig::default()
        .fixed_cases(600)
        .max_shrink_iters(40)
        .without_skew();
    let result = run_property(&config, None, |modes| {
        simulation(
            &config,
            modes,
            OrderProjection {
                strict: true,
                ..OrderProjection::default()
            },
        )
    });
    match result {
        Err(TestError::Fail(reason, case)) => {
            eprintln!("{reason}\n{}", describe(&case));
            let discard = |s: &Step| match s {
                Step::Operator(OperatorStep::Discard, _) => true,
                Step::Race { ops, .. } => ops
                    .iter()
                    .any(|o| matches!(o, RaceOp::Operator(OperatorStep::Discard, _))),
                _ => false,
            };
            assert!(
                case.1.iter().any(discard),
                "the minimal case involves a discard: {}",
                describe(&case)
            );
        }
        other => panic!("the strict handler was not caught: {other:?}"),
    }
}

#[test]
fn a_projection_refusing_an_earlier_event_redelivered_late_is_found() {
    // Under `Unchecked` on JetStream, another member dies holding `order.placed`; the live
    // member applies `paid` and `shipped`; `placed` comes back after the ack wait. A
    // projection that refuses it (permanently) has it parked: the simulation counts the
    // refusal as the handler's permanent failure (the park is accounted for), and finds that
    // no operator's retry can clear it.
    let steps = vec![
        Step::Begin {
            aggregate: 0,
            events: 1,
            command: 0,
        },
        Step::Commit(0),
        Step::Relay(0),
        Step::Begin {
            aggregate: 0,
            events: 3,
            command: 0,
        },
        Step::Relay(0),
        Step::Relay(0),
        Step::OtherMemberDies(1),
    ];
    let config = SimConfig::default().transport(Transport::JetStream);
    let modes = Modes {
        policy: Policy::Unchecked,
        transport: Transport::JetStream,
        ..Modes::default()
    };
    let refusing = OrderProjection {
        refuse_stale: true,
        ..OrderProjection::default()
    };
    let v = simulation(&config, modes, refusing)
        .run(&steps)
        .expect_err("the refusal parks order.placed for good");
    assert!(
        v.message.contains("consumer-side parking never cleared"),
        "{v}"
    );
    // The projection that skips what its status already reflects holds on the same steps.
    let report = simulation(&config, modes, OrderProjection::default())
        .run(&steps)
        .unwrap_or_else(|v| panic!("{v}"));
    assert_eq!(report.committed_events, 3, "{report:?}");
    assert_eq!(report.applied, 3, "{report:?}");
    assert!(report.taken_by_dead_members > 0, "{report:?}");
}
