//! A broker outage as the publisher sees it: the shared outage suite
//! ([`outbox_testkit::conformance::outage`]) against a RabbitMQ node of this test's own (a
//! second node beside the shared one: own name, ports and data), stopped while batches are in
//! flight and started again with its data. The node is stopped with SIGTERM (it closes
//! connections with CONNECTION_FORCED and stops): after a SIGKILL, RabbitMQ 3.10 here loses
//! the Raft member of a freshly declared quorum queue, which then has no leader for good (see
//! `outbox_test_support::RabbitNode::stop_gracefully`); the publisher's side of a SIGKILL (a
//! connection reset, then refused connections) is the first half of this test too. Every
//! error of every batch must be transient and the transport's, every `publish` must return
//! within the delivery timeout (plus [`REPORT_GRACE`]), and every record reported
//! acknowledged must be in the durable quorum queue after the restart (found by its message
//! id, the event id).
//!
//! Needs `rabbitmq-server` installed; fails without it unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{require, Topology};
use lapin::ExchangeKind as LapinKind;
use outbox_core::{async_trait, EventId};
use outbox_rabbitmq::{quorum_arguments, RabbitPublisher, REPORT_GRACE};
use outbox_test_support::RabbitNode;
use outbox_testkit::conformance::outage::{publisher_outage, OutageHarness};

const DELIVERY_TIMEOUT: Duration = Duration::from_secs(2);

/// A RabbitMQ node of the test's own with a topic exchange bound (`#`) to a quorum queue.
struct RabbitOutage {
    // Dropped first: the exchange and queue are deleted while the node still runs.
    topology: Topology,
    queue: String,
    node: RabbitNode,
}

#[async_trait]
impl OutageHarness for RabbitOutage {
    type Publisher = RabbitPublisher;

    async fn publisher(&self) -> RabbitPublisher {
        RabbitPublisher::builder(self.node.url(), &self.topology.exchange)
            .delivery_timeout(DELIVERY_TIMEOUT)
            .connect_timeout(Duration::from_secs(1))
            .start()
            .await
            .expect("start")
    }

    async fn stop(&mut self) {
        self.node.stop_gracefully();
    }

    async fn restart(&mut self) {
        self.node.restart();
    }

    async fn stored(&self, ids: &[EventId]) -> HashSet<EventId> {
        let wanted: HashSet<String> = ids.iter().map(ToString::to_string).collect();
        // The test's own channel died with the node: read the queue on a new connection.
        let reader = Topology::exchange(&self.node.url(), "reader", LapinKind::Topic, true).await;
        let stored: HashSet<EventId> = reader
            .drain(&self.queue)
            .await
            .into_iter()
            .filter(|m| wanted.contains(&m.0))
            .map(|m| m.0.parse().expect("an event id"))
            .collect();
        stored
    }

    fn report_grace(&self) -> Duration {
        REPORT_GRACE
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_stopped_and_restarted_mid_batch_gives_transient_transport_errors_and_no_false_ack()
{
    common::init_tracing();
    let node = require!(RabbitNode::start("rabbit_outage", &[]));
    let mut topology = Topology::exchange(&node.url(), "outage", LapinKind::Topic, true).await;
    let queue = topology.queue("#", quorum_arguments(false)).await;
    let report = publisher_outage(RabbitOutage {
        topology,
        queue,
        node,
    })
    .await;
    eprintln!("rabbitmq outage: {report:?}");
}
