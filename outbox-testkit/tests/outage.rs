//! The publisher outage suite, run against the in-memory outage harness: the in-memory
//! publisher passes, and each deliberately broken publisher (or a harness whose stop stops
//! nothing) makes the suite fail with the promise it broke.

use std::collections::HashSet;
use std::time::Duration;

use outbox_core::{
    async_trait, Envelope, ErrorClass, EventId, FailureScope, PublishResult, Publisher,
};
use outbox_testkit::conformance::outage::{
    publisher_outage, MemoryOutageHarness, OutageHarness, OutagePublisher, SLACK,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_memory_publisher_passes_the_outage_suite() {
    let harness = MemoryOutageHarness::new();
    let log = harness.log().clone();
    let report = publisher_outage(harness).await;
    assert!(report.errors > 0, "{report:?}");
    assert!(report.acknowledged >= 6 * 50, "{report:?}");
    // What was acknowledged is exactly what the log holds (nothing sent while down).
    assert_eq!(log.all_records().len(), report.acknowledged, "{report:?}");
}

/// How a [`Broken`] publisher breaks its promise.
#[derive(Clone, Copy, Debug)]
enum Breakage {
    /// Drops the last record of each batch and reports it acknowledged (with its neighbour's
    /// acknowledgement).
    FalseAck,
    /// Reports the outage's errors as permanent.
    Permanent,
    /// Reports the outage's errors as the record's own.
    RecordScoped,
    /// Returns a batch with errors only after the delivery timeout plus the slack.
    Overdue,
    /// Returns one result fewer than it was given records.
    MissingResult,
    /// Not broken.
    Intact,
}

struct Broken {
    inner: OutagePublisher,
    how: Breakage,
}

#[async_trait]
impl Publisher for Broken {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        if let (Breakage::FalseAck, [head @ .., _last]) = (self.how, batch) {
            if !head.is_empty() {
                let mut results = self.inner.publish(head).await;
                let neighbour = results.last().cloned().expect("one result per record");
                results.push(neighbour);
                return results;
            }
        }
        let mut results = self.inner.publish(batch).await;
        let failed = results.iter().any(Result::is_err);
        match self.how {
            Breakage::Permanent => {
                for r in &mut results {
                    if let Err(e) = r {
                        *e = e.clone().with_class(ErrorClass::Permanent);
                    }
                }
            }
            Breakage::RecordScoped => {
                for r in &mut results {
                    if let Err(e) = r {
                        *e = e.clone().with_scope(FailureScope::Record);
                    }
                }
            }
            Breakage::Overdue if failed => {
                tokio::time::sleep(self.delivery_timeout() + SLACK).await;
            }
            Breakage::MissingResult => {
                results.pop();
            }
            _ => {}
        }
        results
    }

    fn delivery_timeout(&self) -> Duration {
        self.inner.delivery_timeout()
    }
}

/// The in-memory harness with a broken publisher, or (`stop_stops_nothing`) a stop that
/// leaves the server up.
struct BrokenHarness {
    inner: MemoryOutageHarness,
    how: Breakage,
    stop_stops_nothing: bool,
}

#[async_trait]
impl OutageHarness for BrokenHarness {
    type Publisher = Broken;

    async fn publisher(&self) -> Broken {
        Broken {
            inner: self.inner.publisher().await,
            how: self.how,
        }
    }

    async fn stop(&mut self) {
        if !self.stop_stops_nothing {
            self.inner.stop().await;
        }
    }

    async fn restart(&mut self) {
        self.inner.restart().await;
    }

    async fn stored(&self, ids: &[EventId]) -> HashSet<EventId> {
        self.inner.stored(ids).await
    }

    fn report_grace(&self) -> Duration {
        self.inner.report_grace()
    }
}

/// Runs the suite and returns its panic message (fails when the suite passes).
async fn suite_failure(harness: BrokenHarness) -> String {
    let what = format!("{:?}", harness.how);
    let outcome = tokio::spawn(publisher_outage(harness)).await;
    let err = match outcome {
        Ok(report) => panic!("the suite passed a broken publisher ({what}): {report:?}"),
        Err(e) => e,
    };
    assert!(err.is_panic(), "{err}");
    let payload = err.into_panic();
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}

fn broken(how: Breakage) -> BrokenHarness {
    BrokenHarness {
        inner: MemoryOutageHarness::new(),
        how,
        stop_stops_nothing: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_false_acknowledgement_fails_the_suite() {
    let msg = suite_failure(broken(Breakage::FalseAck)).await;
    assert!(msg.contains("not stored on the server"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_outage_error_fails_the_suite() {
    let msg = suite_failure(broken(Breakage::Permanent)).await;
    assert!(msg.contains("not transient"), "{msg}");
    assert!(msg.contains("Permanent"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_scoped_outage_error_fails_the_suite() {
    let msg = suite_failure(broken(Breakage::RecordScoped)).await;
    assert!(msg.contains("not transient"), "{msg}");
    assert!(msg.contains("Record"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_outliving_its_delivery_timeout_fails_the_suite() {
    let msg = suite_failure(broken(Breakage::Overdue)).await;
    assert!(msg.contains("longer than the delivery timeout"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_result_fails_the_suite() {
    let msg = suite_failure(broken(Breakage::MissingResult)).await;
    assert!(msg.contains("49 results for 50 records"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_that_failed_nothing_fails_the_suite() {
    let msg = suite_failure(BrokenHarness {
        inner: MemoryOutageHarness::new(),
        how: Breakage::Intact,
        stop_stops_nothing: true,
    })
    .await;
    assert!(msg.contains("the outage produced no error"), "{msg}");
}
