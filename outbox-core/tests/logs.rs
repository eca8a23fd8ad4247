//! Logs of a relay cycle carry ids and stages but never the payload.
//!
//! Alone in its test binary: tracing caches callsite interest process-wide, so a test running
//! concurrently without a subscriber could disable the callsites this test listens to.

mod common;

use common::{capture_logs, cycle, setup, SECRET};

#[test]
fn logs_carry_ids_and_stages_but_never_the_payload() {
    let (store, log, db) = setup();
    let out = capture_logs(tracing::Level::DEBUG, || {
        futures::executor::block_on(cycle(&store, &log, &db));
    });
    assert!(out.contains("stage=\"parked\""), "{out}");
    assert!(out.contains("stage=\"retry\""), "{out}");
    assert!(out.contains("stage=\"published\""), "{out}");
    assert!(out.contains("aggregate_id=c-3"), "{out}");
    assert!(out.contains("event_id="), "{out}");
    assert!(out.contains("attempt=1"), "{out}");
    assert!(!out.contains(SECRET), "payload leaked into logs:\n{out}");
}
