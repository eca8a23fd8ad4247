//! One hot aggregate beside the others (issue 25): an aggregate with a long backlog of versions
//! must not keep the events of other aggregates out of the claims while it drains. One body
//! for every store: the in-memory store (`outbox-testkit/tests/hot_aggregate.rs`) and the
//! real servers through [`hot_aggregate_tests!`] (`outbox-postgres/tests/hot_aggregate.rs`,
//! `outbox-mysql/tests/hot_aggregate.rs`, in both claim modes).
//!
//! Order lets a claim hand out only an aggregate's head, so the hot aggregate drains at one
//! version per claim and completion whatever the claim's limit. What the scenarios hold a store
//! to is the other half: the hot aggregate's later versions, which are not heads, must not fill
//! a claim's window (the first `limit` candidates a claim looks at), since then an event of
//! another aggregate appended after them waits until the hot aggregate's backlog has passed
//! through the windows one batch at a time (about 100 claims for 10,000 versions and a limit
//! of 100, before the stores blocked an aggregate's followers beyond the window).
//!
//! * [`event_after_a_hot_backlog_is_claimed_at_once`]: 10,000 versions of one aggregate, then
//!   one event of another; with a claim limit of 100, the other event is claimed within the
//!   first two claims (each claim completed before the next, as a relay does).
//! * [`event_appended_while_a_hot_aggregate_drains_is_claimed_next`]: while the hot aggregate
//!   drains, an event of another aggregate appended between two claims is claimed by the next.
//!
//! Both check that each claim hands out at most the hot aggregate's head, in version order.

use outbox_core::prelude::*;
use outbox_core::{async_trait, ClaimMode, ClaimRequest, ClaimedBatch, Envelope, Outcome};

use super::{event, params};
use crate::randomized::RandomizedBackend;

/// Versions of the hot aggregate.
pub const HOT_VERSIONS: i64 = 10_000;

/// The claims' limit.
pub const CLAIM_LIMIT: usize = 100;

/// Versions appended per transaction.
const PER_TRANSACTION: usize = 2_000;

/// Appends events in transactions of their own, committed before it returns.
#[async_trait]
pub trait Appender: Send + Sync {
    /// Appends `events` in one transaction and commits it.
    async fn append_committed(&self, events: &[Envelope]);
}

#[async_trait]
impl Appender for crate::MemoryOutboxStore {
    async fn append_committed(&self, events: &[Envelope]) {
        let mut tx = self.db().begin();
        self.append(&mut tx, events).await.expect("append");
        tx.commit().expect("commit");
    }
}

/// A server backend and one store over its data.
pub struct OnServer<'a, B: RandomizedBackend> {
    backend: &'a B,
    store: B::Store,
}

impl<'a, B: RandomizedBackend> OnServer<'a, B> {
    /// A store of `backend` in claim mode `mode` (tables created), for a scenario.
    pub async fn new(backend: &'a B, mode: ClaimMode) -> Self {
        let p = params(
            mode,
            std::time::Duration::from_secs(60),
            std::time::Duration::from_millis(500),
        );
        let store = backend.store(&p);
        backend.prepare(&store).await.expect("migrate");
        Self { backend, store }
    }

    /// The store.
    pub fn store(&self) -> &B::Store {
        &self.store
    }
}

#[async_trait]
impl<B: RandomizedBackend> Appender for OnServer<'_, B> {
    async fn append_committed(&self, events: &[Envelope]) {
        let mut tx = self.backend.begin().await.expect("begin");
        // MySQL takes at most 500 events per append statement.
        for chunk in events.chunks(500) {
            self.backend
                .append(&self.store, &mut tx, chunk)
                .await
                .expect("append");
        }
        self.backend.commit(tx).await.expect("commit");
    }
}

/// Appends versions 1..=`versions` of `aggregate`, [`PER_TRANSACTION`] per transaction.
async fn append_backlog<A: Appender>(appender: &A, aggregate: &str, versions: i64) {
    let all: Vec<Envelope> = (1..=versions).map(|v| event(aggregate, v)).collect();
    for chunk in all.chunks(PER_TRANSACTION) {
        appender.append_committed(chunk).await;
    }
}

/// What one claim handed out.
struct Claimed {
    /// The hot aggregate's versions.
    hot: Vec<i64>,
    /// The other aggregates' events, by aggregate id.
    others: Vec<String>,
}

/// Claims with [`CLAIM_LIMIT`], completes every claimed event as published (as a relay that
/// was acknowledged would), and tells what was claimed. Checks that at most the hot
/// aggregate's next version came out.
async fn claim_and_publish<S: RelayStore>(
    store: &S,
    hot: &str,
    next_hot: &mut i64,
    round: usize,
) -> Claimed {
    let batch: ClaimedBatch = store
        .claim(&ClaimRequest::new("hot-relay", CLAIM_LIMIT))
        .await
        .expect("claim");
    let mut out = Claimed {
        hot: Vec::new(),
        others: Vec::new(),
    };
    for r in &batch.records {
        if r.envelope.aggregate_id == hot {
            out.hot.push(r.envelope.aggregate_version);
        } else {
            out.others.push(r.envelope.aggregate_id.clone());
        }
    }
    assert!(
        out.hot.len() <= 1,
        "claim {round} handed out {} versions of the hot aggregate at once: {:?}",
        out.hot.len(),
        out.hot
    );
    if let Some(&v) = out.hot.first() {
        assert_eq!(
            v, *next_hot,
            "claim {round}: the hot aggregate out of order"
        );
        *next_hot += 1;
    }
    let outcomes: Vec<Outcome> = super::published_in_order(&batch);
    if !outcomes.is_empty() {
        let rep = store
            .complete(&batch.handle, &outcomes)
            .await
            .expect("complete");
        assert_eq!(rep.applied, outcomes.len(), "claim {round}: {rep:?}");
    }
    out
}

/// `versions` versions of one aggregate, then one event of another: with a claim limit of
/// [`CLAIM_LIMIT`] and every claim completed before the next, the other event is claimed by
/// one of the first two claims (the first claim looks at the hot aggregate's first versions
/// only; the second must not find its window full of the hot aggregate's later versions).
pub async fn event_after_a_hot_backlog_is_claimed_at_once<A: Appender, S: RelayStore>(
    appender: &A,
    store: &S,
    versions: i64,
) {
    append_backlog(appender, "hot", versions).await;
    appender.append_committed(&[event("cold", 1)]).await;
    let mut next_hot = 1;
    let mut seen = Vec::new();
    for round in 1..=2 {
        let c = claim_and_publish(store, "hot", &mut next_hot, round).await;
        seen.push(format!(
            "claim {round}: hot {:?}, others {:?}",
            c.hot, c.others
        ));
        if c.others.iter().any(|a| a == "cold") {
            assert!(
                next_hot > 1,
                "the hot aggregate's head was not claimed: {seen:?}"
            );
            return;
        }
    }
    panic!(
        "the event after {versions} versions of a hot aggregate was not claimed within 2 \
         claims of {CLAIM_LIMIT}: {seen:?}"
    );
}

/// While `versions` versions of one aggregate drain (three claims completed), an event of
/// another aggregate is appended; the next claim hands it out, beside the hot aggregate's next
/// version. Twice, with two more claims between.
pub async fn event_appended_while_a_hot_aggregate_drains_is_claimed_next<
    A: Appender,
    S: RelayStore,
>(
    appender: &A,
    store: &S,
    versions: i64,
) {
    append_backlog(appender, "hot", versions).await;
    let mut next_hot = 1;
    let mut round = 0;
    for late in ["late-1", "late-2"] {
        for _ in 0..3 {
            round += 1;
            let c = claim_and_publish(store, "hot", &mut next_hot, round).await;
            assert_eq!(c.hot.len(), 1, "claim {round}: the hot aggregate drains");
        }
        appender.append_committed(&[event(late, 1)]).await;
        round += 1;
        let c = claim_and_publish(store, "hot", &mut next_hot, round).await;
        assert!(
            c.others.iter().any(|a| a == late),
            "claim {round}, the first after {late} was appended, did not hand it out (hot {:?}, \
             others {:?})",
            c.hot,
            c.others
        );
        assert_eq!(c.hot.len(), 1, "claim {round}: the hot aggregate drains");
    }
}

/// Emits the hot-aggregate tests for a server backend type (one `#[tokio::test]` per scenario
/// and claim mode): in a test crate of a backend with a `new(connections)` constructor and
/// a [`RandomizedBackend`] impl, one line, `outbox_testkit::hot_aggregate_tests!(Backend);`.
#[macro_export]
macro_rules! hot_aggregate_tests {
    ($backend:ty) => {
        $crate::hot_aggregate_tests!(@case $backend, event_after_a_hot_backlog_lease,
            $crate::scenarios::early_claim::lease(30.0),
            event_after_a_hot_backlog_is_claimed_at_once);
        $crate::hot_aggregate_tests!(@case $backend, event_after_a_hot_backlog_locked,
            ::outbox_core::ClaimMode::LockedTransaction,
            event_after_a_hot_backlog_is_claimed_at_once);
        $crate::hot_aggregate_tests!(@case $backend, event_appended_while_a_hot_aggregate_drains_lease,
            $crate::scenarios::early_claim::lease(30.0),
            event_appended_while_a_hot_aggregate_drains_is_claimed_next);
        $crate::hot_aggregate_tests!(@case $backend, event_appended_while_a_hot_aggregate_drains_locked,
            ::outbox_core::ClaimMode::LockedTransaction,
            event_appended_while_a_hot_aggregate_drains_is_claimed_next);
    };
    (@case $backend:ty, $name:ident, $mode:expr, $scenario:ident) => {
        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let Some(b) = <$backend>::new(4).await else {
                return;
            };
            {
                let on = $crate::scenarios::hot_aggregate::OnServer::new(&b, $mode).await;
                $crate::scenarios::hot_aggregate::$scenario(
                    &on,
                    on.store(),
                    $crate::scenarios::hot_aggregate::HOT_VERSIONS,
                )
                .await;
            }
            $crate::randomized::RandomizedBackend::finish(&b).await;
        }
    };
}
