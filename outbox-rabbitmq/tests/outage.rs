//! A broker outage as the publisher sees it: a RabbitMQ node of this test's own (a second node
//! beside the shared one: own name, ports and data) is stopped while batches are in flight and
//! started again with its data. The node is stopped with SIGTERM (it closes connections with
//! CONNECTION_FORCED and stops): after a SIGKILL, RabbitMQ 3.10 here loses the Raft member of a
//! freshly declared quorum queue, which then has no leader for good (see
//! `outbox_test_support::RabbitNode::stop_gracefully`); the publisher's side of a SIGKILL (a
//! connection reset, then refused connections) is the first half of this test too. Every error of every batch must be transient and the
//! transport's, every `publish` must return within the delivery timeout (plus the report
//! grace), and every record reported acknowledged must be in the durable quorum queue after
//! the restart.
//!
//! Needs `rabbitmq-server` installed; fails without it unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{event, require, Topology};
use lapin::ExchangeKind as LapinKind;
use outbox_core::{ErrorClass, FailureScope, PublishError, Publisher};
use outbox_rabbitmq::{quorum_arguments, RabbitPublisher, REPORT_GRACE};
use outbox_test_support::RabbitNode;

const DELIVERY_TIMEOUT: Duration = Duration::from_secs(2);
const BATCH: usize = 50;

struct Call {
    elapsed: Duration,
    acked: Vec<String>,
    errors: Vec<PublishError>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_stopped_and_restarted_mid_batch_gives_transient_transport_errors_and_no_false_ack()
{
    common::init_tracing();
    let mut node = require!(RabbitNode::start("rabbit_outage", &[]));
    let url = node.url();
    let mut t = Topology::exchange(&url, "outage", LapinKind::Topic, true).await;
    let q = t.queue("#", quorum_arguments(false)).await;
    let publisher = Arc::new(
        RabbitPublisher::builder(&url, &t.exchange)
            .delivery_timeout(DELIVERY_TIMEOUT)
            .connect_timeout(Duration::from_secs(1))
            .start()
            .await
            .expect("start"),
    );

    let stop = Arc::new(AtomicBool::new(false));
    let acked_total = Arc::new(AtomicUsize::new(0));
    let last_error = Arc::new(std::sync::Mutex::new(String::new()));
    let driver = {
        let (publisher, stop, acked_total) = (publisher.clone(), stop.clone(), acked_total.clone());
        let last_error = last_error.clone();
        tokio::spawn(async move {
            let mut calls: Vec<Call> = Vec::new();
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let batch: Vec<_> = (0..BATCH)
                    .map(|_| {
                        n += 1;
                        event("order", &format!("o-{n}"), 1)
                    })
                    .collect();
                let started = Instant::now();
                let results = publisher.publish(&batch.iter().collect::<Vec<_>>()).await;
                let mut call = Call {
                    elapsed: started.elapsed(),
                    acked: Vec::new(),
                    errors: Vec::new(),
                };
                for (e, r) in batch.iter().zip(results) {
                    match r {
                        Ok(_) => call.acked.push(e.event_id.to_string()),
                        Err(err) => call.errors.push(err),
                    }
                }
                acked_total.fetch_add(call.acked.len(), Ordering::SeqCst);
                if let Some(e) = call.errors.last() {
                    *last_error.lock().unwrap() = e.to_string();
                }
                if !call.errors.is_empty() {
                    // Backing off as the relay would; the broker is away.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                calls.push(call);
            }
            calls
        })
    };
    let wait_acked = |at_least: usize| {
        let (acked_total, last_error) = (acked_total.clone(), last_error.clone());
        async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            while acked_total.load(Ordering::SeqCst) < at_least {
                assert!(
                    Instant::now() < deadline,
                    "publishing did not progress; last error: {}",
                    last_error.lock().unwrap()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    wait_acked(3 * BATCH).await;
    node.stop_gracefully();
    tokio::time::sleep(DELIVERY_TIMEOUT * 2).await;
    node.restart();
    let before = acked_total.load(Ordering::SeqCst);
    wait_acked(before + 3 * BATCH).await;
    stop.store(true, Ordering::SeqCst);
    let calls = driver.await.expect("driver");

    let bound = DELIVERY_TIMEOUT + REPORT_GRACE + Duration::from_millis(500);
    let mut errors = 0;
    let mut acked: HashSet<String> = HashSet::new();
    for (i, call) in calls.iter().enumerate() {
        assert!(
            call.elapsed <= bound,
            "publish call {i} took {:?} (bound {bound:?})",
            call.elapsed
        );
        for err in &call.errors {
            assert_eq!(
                (err.class, err.scope),
                (ErrorClass::Transient, FailureScope::Transport),
                "call {i}: {err}"
            );
        }
        errors += call.errors.len();
        acked.extend(call.acked.iter().cloned());
    }
    assert!(errors > 0, "the outage produced no error");
    // The test's own channel died with the node: read the queue on a new connection.
    let reader = Topology::exchange(&url, "reader", LapinKind::Topic, true).await;
    let stored: HashSet<String> = reader.drain(&q).await.into_iter().map(|m| m.0).collect();
    let missing: Vec<&String> = acked.difference(&stored).collect();
    assert!(
        missing.is_empty(),
        "{} acknowledged messages are not in the queue: {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    eprintln!(
        "rabbitmq outage: {} calls, {} acknowledged, {errors} transient transport errors, {} \
         stored",
        calls.len(),
        acked.len(),
        stored.len()
    );
    drop(t);
}
