//! A server outage as the publisher sees it: a nats-server of this test's own (JetStream, file
//! storage) is killed while batches are in flight and started again. Every error of every
//! batch must be transient and the transport's, every `publish` must return within the
//! delivery timeout (plus the report grace), and every record reported acknowledged must be in
//! the stream after the restart, at its acknowledged sequence.
//!
//! Needs the nats-server binary (`NATS_SERVER_BIN`, the `PATH`, or `/usr/sbin/nats-server`);
//! fails without it unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{event, require, unique, TestStream};
use outbox_core::{AckMetadata, ErrorClass, FailureScope, PublishError, Publisher};
use outbox_nats::{NatsPublisher, REPORT_GRACE};
use outbox_test_support::{nats_server_bin, NatsServer};

const DELIVERY_TIMEOUT: Duration = Duration::from_secs(2);
const BATCH: usize = 50;

struct Call {
    elapsed: Duration,
    acked: Vec<(String, AckMetadata)>,
    errors: Vec<PublishError>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_killed_and_restarted_mid_batch_gives_transient_transport_errors_and_no_false_ack() {
    common::init_tracing();
    let bin = require!(nats_server_bin("nats_outage"));
    let mut server = NatsServer::start(bin);
    let url = server.url();
    let prefix = unique("outage");
    let stream = TestStream::create(&url, &prefix, &[format!("{prefix}.>")], None, None).await;
    let publisher = Arc::new(
        NatsPublisher::builder(&url, &prefix)
            .delivery_timeout(DELIVERY_TIMEOUT)
            .connect_timeout(Duration::from_secs(1))
            .start()
            .await
            .expect("start"),
    );

    let stop = Arc::new(AtomicBool::new(false));
    let driver = {
        let (publisher, stop) = (publisher.clone(), stop.clone());
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
                let elapsed = started.elapsed();
                let mut call = Call {
                    elapsed,
                    acked: Vec::new(),
                    errors: Vec::new(),
                };
                for (e, r) in batch.iter().zip(results) {
                    match r {
                        Ok(ack) => call.acked.push((e.event_id.to_string(), ack)),
                        Err(err) => call.errors.push(err),
                    }
                }
                calls.push(call);
            }
            calls
        })
    };

    let wait_for_acks = |stream_min: u64| {
        let stream = &stream;
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if stream.count().await >= stream_min {
                    return;
                }
                assert!(Instant::now() < deadline, "publishing did not progress");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    wait_for_acks(3 * BATCH as u64).await;
    // Killed while the driver is in the middle of a batch (it publishes back to back).
    server.stop();
    tokio::time::sleep(DELIVERY_TIMEOUT * 2).await;
    server.restart();
    let before = stream.count().await;
    wait_for_acks(before + 3 * BATCH as u64).await;
    stop.store(true, Ordering::SeqCst);
    let calls = driver.await.expect("driver");

    let bound = DELIVERY_TIMEOUT + REPORT_GRACE + Duration::from_millis(500);
    let mut errors = 0;
    let mut acked = 0;
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
        acked += call.acked.len();
    }
    assert!(
        errors > 0,
        "the outage produced no error: it was not mid-batch"
    );
    // No false acknowledgement: every acknowledged record is stored where its PubAck said.
    for call in &calls {
        for (id, ack) in &call.acked {
            assert_eq!(ack.topic, stream.name);
            let (_, headers, _) = stream.read(ack.offset as u64).await;
            let stored = headers
                .iter()
                .find(|(k, _)| k == "Nats-Msg-Id")
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned());
            assert_eq!(stored.as_deref(), Some(id.as_str()), "at {}", ack.offset);
        }
    }
    eprintln!(
        "nats outage: {} calls, {acked} acknowledged, {errors} transient transport errors",
        calls.len()
    );
}
