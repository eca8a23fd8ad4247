//! The producer side: business transactions that run the user's [`Command`]s. A command is a
//! transition of an aggregate with its guard; when the guard allows it, the transaction
//! writes the aggregate's new state and appends the command's event to the outbox, in one
//! transaction.

use serde_json::Value;

/// A producer command: a transition of one aggregate and the event it appends.
///
/// The simulation keeps each aggregate's state (a JSON value, `null` before the first command)
/// and version in the business transaction; a [`crate::Step::Begin`] runs commands on one
/// aggregate, skipping those whose guard refuses the current state.
pub trait Command: Send + Sync {
    /// A name for failure reports.
    fn name(&self) -> &str;
    /// The guard: whether the command may run on `state`.
    fn guard(&self, state: &Value) -> bool;
    /// The transition: the new state, the event type and the event's JSON payload.
    fn apply(&self, state: &Value) -> Transition;
}

/// What a [`Command`] does to its aggregate.
#[derive(Clone, Debug, PartialEq)]
pub struct Transition {
    /// The aggregate's state afterwards.
    pub state: Value,
    /// The event type appended.
    pub event_type: String,
    /// The event's payload.
    pub payload: Value,
}

impl Transition {
    /// A transition to `state` appending an `event_type` event with `payload`.
    pub fn new(state: Value, event_type: impl Into<String>, payload: Value) -> Self {
        Self {
            state,
            event_type: event_type.into(),
            payload,
        }
    }
}

/// The default command: always allowed, counts the aggregate's changes.
#[derive(Clone, Copy, Debug, Default)]
pub struct Touch;

impl Command for Touch {
    fn name(&self) -> &str {
        "touch"
    }
    fn guard(&self, _state: &Value) -> bool {
        true
    }
    fn apply(&self, state: &Value) -> Transition {
        let n = state.as_i64().unwrap_or(0) + 1;
        Transition::new(n.into(), "sim.changed", serde_json::json!({ "n": n }))
    }
}
