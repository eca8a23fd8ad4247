//! Logs of a relay cycle carry ids and stages but never the payload.
//!
//! Alone in its test binary: tracing caches callsite interest process-wide, so a test running
//! concurrently without a subscriber could disable the callsites this test listens to.

mod common;

use common::{cycle, setup, SECRET};
use std::io::Write;
use std::sync::{Arc, Mutex};

#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);
impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn logs_carry_ids_and_stages_but_never_the_payload() {
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let (store, log, db) = setup();
    tracing::subscriber::with_default(subscriber, || {
        futures::executor::block_on(cycle(&store, &log, &db));
    });
    let out = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    assert!(out.contains("stage=\"parked\""), "{out}");
    assert!(out.contains("stage=\"retry\""), "{out}");
    assert!(out.contains("stage=\"published\""), "{out}");
    assert!(out.contains("aggregate_id=c-3"), "{out}");
    assert!(out.contains("event_id="), "{out}");
    assert!(out.contains("attempt=1"), "{out}");
    assert!(!out.contains(SECRET), "payload leaked into logs:\n{out}");
}
