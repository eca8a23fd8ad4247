//! The real relay drains an outbox into JetStream through a server outage: the relay over the
//! in-memory store publishes through [`NatsPublisher`] to a nats-server of this test's own,
//! which is killed (SIGKILL) for longer than the attempt limit allows and started again. The
//! backlog must drain with nothing parked and no attempt spent, every event must be in the
//! stream, and per aggregate the first copies must be stored in version order. The relay run
//! and the check of what was stored are `outbox_test_support::relay_outage`'s, shared with
//! outbox-rabbitmq's relay test; this file builds the publisher and reads the stream.
//!
//! Needs the nats-server binary; fails without it unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;

use std::time::Duration;

use common::{require, unique, TestStream};
use outbox_nats::NatsPublisher;
use outbox_test_support::relay_outage::{
    assert_first_copies_in_order, drain_through_outage, DELIVERY_TIMEOUT,
};
use outbox_test_support::{nats_server_bin, NatsServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_drains_through_a_server_outage_in_order_with_nothing_parked() {
    common::init_tracing();
    let bin = require!(nats_server_bin("nats_relay_outage"));
    let mut server = NatsServer::start(bin);
    let url = server.url();
    let prefix = unique("relay");
    let stream = TestStream::create(&url, &prefix, &[format!("{prefix}.>")], None, None).await;

    let publisher = NatsPublisher::builder(&url, &prefix)
        .delivery_timeout(DELIVERY_TIMEOUT)
        .connect_timeout(Duration::from_millis(500))
        .relay_lease(Duration::from_secs(30))
        .start()
        .await
        .expect("start");
    let drained = drain_through_outage(
        publisher,
        "nats-relay",
        &mut server,
        Duration::from_secs(90),
    )
    .await;

    // The stream: every event, and per aggregate the first copies in version order.
    let last = stream.count().await;
    let js_stream = stream.js.get_stream(&stream.name).await.unwrap();
    let info_last = {
        let mut s = js_stream.clone();
        s.info().await.unwrap().state.last_sequence
    };
    let mut stored = Vec::new();
    for seq in 1..=info_last {
        let Ok(m) = js_stream.get_raw_message(seq).await else {
            continue;
        };
        let get = |k: &str| m.headers.get(k).map(|v| v.as_str().to_owned()).unwrap();
        stored.push((
            get("event_id"),
            get("aggregate_id"),
            get("aggregate_version").parse().unwrap(),
        ));
    }
    assert_first_copies_in_order(stored, drained.total);
    eprintln!(
        "nats relay outage: {} events, {last} messages stored (copies: {}), {} deferrals",
        drained.total,
        last as usize - drained.total,
        drained.deferred
    );
}
