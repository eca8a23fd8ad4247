//! A server outage as the publisher sees it: the shared outage suite
//! ([`outbox_testkit::conformance::outage`]) against a nats-server of this test's own
//! (JetStream, file storage), killed (SIGKILL) while batches are in flight and started again
//! with its storage. Every error of every batch must be transient and the transport's, every
//! `publish` must return within the delivery timeout (plus [`REPORT_GRACE`]), and every record
//! reported acknowledged must be in the stream after the restart (found by its `Nats-Msg-Id`,
//! the event id).
//!
//! Needs the nats-server binary (`NATS_SERVER_BIN`, the `PATH`, or `/usr/sbin/nats-server`);
//! fails without it unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{require, unique, TestStream};
use outbox_core::{async_trait, EventId};
use outbox_nats::{NatsPublisher, REPORT_GRACE};
use outbox_test_support::{nats_server_bin, NatsServer};
use outbox_testkit::conformance::outage::{publisher_outage, OutageHarness};

const DELIVERY_TIMEOUT: Duration = Duration::from_secs(2);

/// A nats-server of the test's own with a stream of the test's own capturing `prefix.>`.
struct NatsOutage {
    // Dropped first: the stream is deleted while the server still runs.
    stream: TestStream,
    server: NatsServer,
    prefix: String,
}

#[async_trait]
impl OutageHarness for NatsOutage {
    type Publisher = NatsPublisher;

    async fn publisher(&self) -> NatsPublisher {
        NatsPublisher::builder(self.server.url(), &self.prefix)
            .delivery_timeout(DELIVERY_TIMEOUT)
            .connect_timeout(Duration::from_secs(1))
            .start()
            .await
            .expect("start")
    }

    async fn stop(&mut self) {
        self.server.stop();
    }

    async fn restart(&mut self) {
        self.server.restart();
    }

    async fn stored(&self, ids: &[EventId]) -> HashSet<EventId> {
        let wanted: HashSet<String> = ids.iter().map(ToString::to_string).collect();
        // A fresh connection: the test's own was cut by the kill.
        let js = common::js(&self.server.url()).await;
        let mut stream = js.get_stream(&self.stream.name).await.expect("stream");
        let state = stream.info().await.expect("stream info").state.clone();
        let mut found = HashSet::new();
        for seq in state.first_sequence..=state.last_sequence {
            let Ok(m) = stream.get_raw_message(seq).await else {
                continue; // a gap in the sequence: nothing stored there
            };
            let id = m
                .headers
                .get(async_nats::header::NATS_MESSAGE_ID)
                .map(|v| v.as_str().to_owned())
                .unwrap_or_default();
            if wanted.contains(&id) {
                found.insert(id.parse().expect("an event id"));
            }
        }
        found
    }

    fn report_grace(&self) -> Duration {
        REPORT_GRACE
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_killed_and_restarted_mid_batch_gives_transient_transport_errors_and_no_false_ack() {
    common::init_tracing();
    let bin = require!(nats_server_bin("nats_outage"));
    let server = NatsServer::start(bin);
    let prefix = unique("outage");
    let stream =
        TestStream::create(&server.url(), &prefix, &[format!("{prefix}.>")], None, None).await;
    let report = publisher_outage(NatsOutage {
        stream,
        server,
        prefix,
    })
    .await;
    eprintln!("nats outage: {report:?}");
}
