//! The real relay draining an outbox through an outage of a transport's own server, the part
//! the transports' relay tests share (feature `relay-outage`).
//!
//! [`drain_through_outage`] appends [`AGGREGATES`] × [`VERSIONS`] events to an in-memory
//! outbox, runs a [`Relay`] over it with the transport's publisher, stops the server once a
//! third is published, keeps it down for longer than [`MAX_ATTEMPTS`] delivery timeouts allow,
//! and starts it again. The backlog must drain with nothing parked and no attempt spent.
//! [`assert_first_copies_in_order`] then checks what the server stored, read back by the
//! transport's own test: every event, and per aggregate the first copies in version order.
//!
//! The publisher must be built with [`DELIVERY_TIMEOUT`] (and a short connect timeout).

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{DeliveryStatus, Publisher, RelayConfig};
use outbox_testkit::scenarios::{memory_backlog, retry_policy, seeded_relay};

use crate::{NatsServer, RabbitNode};

/// Aggregates in the backlog.
pub const AGGREGATES: usize = 30;
/// Versions per aggregate in the backlog.
pub const VERSIONS: i64 = 8;
/// The delivery timeout the publisher must be built with.
pub const DELIVERY_TIMEOUT: Duration = Duration::from_secs(1);
/// The relay's attempt limit; the outage lasts longer than this many delivery timeouts.
pub const MAX_ATTEMPTS: u32 = 2;

/// A server of the test's own that the outage stops and starts again.
pub trait OutageServer {
    /// Stops the server; what it stored stays.
    fn stop_server(&mut self);
    /// Starts it again with what it had stored.
    fn restart_server(&mut self);
}

impl OutageServer for NatsServer {
    /// SIGKILL.
    fn stop_server(&mut self) {
        self.stop();
    }
    fn restart_server(&mut self) {
        self.restart();
    }
}

impl OutageServer for RabbitNode {
    /// SIGTERM ([`RabbitNode::stop_gracefully`]): a killed node may lose confirmed messages of
    /// a quorum queue's unsynced log (see outbox-rabbitmq's `outage.rs`).
    fn stop_server(&mut self) {
        self.stop_gracefully();
    }
    fn restart_server(&mut self) {
        self.restart();
    }
}

/// What [`drain_through_outage`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Drained {
    /// Events in the backlog (all published).
    pub total: usize,
    /// Events the relay deferred during the outage (at least one).
    pub deferred: usize,
}

/// Drains the backlog through `publisher` (relay owner `owner`) while `server` is stopped and
/// restarted (see the module docs); fails unless it drained within `deadline` with nothing
/// parked, no attempt spent and at least one deferral. Needs a multi-thread runtime.
pub async fn drain_through_outage<P: Publisher + 'static>(
    publisher: P,
    owner: &str,
    server: &mut impl OutageServer,
    deadline: Duration,
) -> Drained {
    let (store, total) = memory_backlog(AGGREGATES, VERSIONS).await;

    let config = RelayConfig::builder()
        .owner(owner)
        .batch_size(AGGREGATES)
        .retry(retry_policy(
            Duration::from_millis(50),
            Duration::from_millis(500),
            MAX_ATTEMPTS,
        ))
        .circuit_breaker(Duration::from_millis(200), Duration::from_secs(1))
        .idle(Duration::from_millis(5), Duration::from_millis(50))
        .build()
        .expect("relay config");
    let mut relay = seeded_relay(store.clone(), publisher, config, 5);

    let outage = DELIVERY_TIMEOUT * (MAX_ATTEMPTS + 3);
    let (mut published, mut retried, mut deferred, mut parked) = (0, 0, 0, 0);
    let mut down_since: Option<Instant> = None;
    let mut restarted = false;
    let deadline = Instant::now() + deadline;
    while published < total {
        let report = relay.run_once().await.expect("no store errors");
        published += report.published;
        retried += report.retried;
        deferred += report.deferred;
        parked += report.parked + report.parked_at_claim;
        assert_eq!((parked, retried), (0, 0), "parked or spent an attempt");
        if !restarted && down_since.is_none() && published >= total / 3 {
            server.stop_server();
            down_since = Some(Instant::now());
        }
        if let Some(since) = down_since {
            if !restarted && since.elapsed() >= outage {
                server.restart_server();
                restarted = true;
            }
        }
        assert!(
            Instant::now() < deadline,
            "not drained: {published} of {total} published"
        );
        if let Some(pause) = report.pause {
            tokio::time::sleep(pause).await;
        } else if report.is_idle() {
            tokio::time::sleep(relay.idle_delay()).await;
        } else {
            relay.reset_idle();
        }
    }
    assert!(restarted && deferred > 0, "the outage deferred nothing");
    let stats = store.stats().await.expect("stats");
    assert_eq!((stats.unpublished, stats.parked), (0, 0), "{stats:?}");
    for r in store.snapshot() {
        assert_eq!(r.status, DeliveryStatus::Published);
        assert_eq!(r.attempts, 0, "attempts spent on {:?}", r.envelope);
    }
    Drained { total, deferred }
}

/// One message the server stored, in the order it stored them: (event id, aggregate id,
/// aggregate version).
pub type StoredEvent = (String, String, i64);

/// Checks what the server stored after [`drain_through_outage`]: every one of the `total`
/// events, and per aggregate the first copy of each event in version order (later copies,
/// resent after the outage, may come anywhere).
pub fn assert_first_copies_in_order(stored: impl IntoIterator<Item = StoredEvent>, total: usize) {
    let mut seen: HashSet<String> = HashSet::new();
    let mut order: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let mut messages = 0;
    for (event_id, aggregate_id, version) in stored {
        messages += 1;
        if seen.insert(event_id) {
            order.entry(aggregate_id).or_default().push(version);
        }
    }
    assert_eq!(
        seen.len(),
        total,
        "every event stored ({messages} messages)"
    );
    for (agg, versions) in &order {
        assert_eq!(versions, &(1..=VERSIONS).collect::<Vec<_>>(), "{agg}");
    }
}
