//! The relay registry checks, one per clause of [`RelayRegistry`]. They run on any
//! [`OutboxHarness`] whose store also implements [`RelayRegistry`], so `outbox status` and
//! `outbox parked release-claims` read the same answers from every store.

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimRequest, RelayEntry, RelayRegistration, RelayState};

use super::{event, not_applicable, unique, OutboxHarness};

fn registration(owner: &str, pid: u32, interval: Duration) -> RelayRegistration {
    RelayRegistration::new(owner, "host-a", pid, "1.2.3", "lease", interval)
}

async fn any_store<H: OutboxHarness>(h: &H) -> H::Store {
    let caps = h.capabilities();
    if caps.lease {
        h.store(caps.lease_mode()).await
    } else {
        h.store(ClaimMode::LockedTransaction).await
    }
}

async fn entry<S: RelayRegistry>(store: &S, owner: &str) -> Option<RelayEntry> {
    store
        .relays()
        .await
        .expect("relays")
        .into_iter()
        .find(|e| e.registration.owner == owner)
}

/// A registered relay is listed live with what it registered; a heartbeat records what it
/// holds; deregistering removes it (twice is a no-op) and a heartbeat after that says so.
pub async fn registered_relays_are_listed_until_they_deregister<H: OutboxHarness>(h: &H)
where
    H::Store: RelayRegistry,
{
    let store = any_store(h).await;
    assert!(store.relays().await.expect("relays").is_empty());
    let (a, b) = (
        format!("relay-a-{}", unique()),
        format!("relay-b-{}", unique()),
    );
    let interval = Duration::from_secs(5);
    store
        .register_relay(&registration(&a, 11, interval))
        .await
        .expect("register a");
    store
        .register_relay(&registration(&b, 12, interval))
        .await
        .expect("register b");
    let listed = store.relays().await.expect("relays");
    assert_eq!(listed.len(), 2, "{listed:?}");
    let ea = entry(&store, &a).await.expect("a listed");
    assert_eq!(ea.registration, registration(&a, 11, interval));
    assert_eq!(ea.held, 0);
    assert_eq!(ea.state(), RelayState::Live);
    assert!(ea.started_at <= ea.heartbeat_at, "{ea:?}");
    assert!(store.heartbeat_relay(&a, 7).await.expect("heartbeat"));
    assert_eq!(entry(&store, &a).await.expect("a").held, 7);
    store.deregister_relay(&a).await.expect("deregister");
    store.deregister_relay(&a).await.expect("deregister twice");
    assert!(entry(&store, &a).await.is_none());
    assert!(entry(&store, &b).await.is_some(), "b is untouched");
    assert!(
        !store.heartbeat_relay(&a, 1).await.expect("heartbeat"),
        "a heartbeat of a relay without entry must say so (the relay registers again)"
    );
    assert!(
        entry(&store, &a).await.is_none(),
        "a heartbeat never creates an entry"
    );
}

/// A relay whose heartbeat is older than three of its intervals is stale; its next heartbeat
/// makes it live again. Registering again replaces the entry.
pub async fn a_relay_without_heartbeat_turns_stale<H: OutboxHarness>(h: &H)
where
    H::Store: RelayRegistry,
{
    let store = any_store(h).await;
    let owner = format!("relay-{}", unique());
    let interval = Duration::from_millis(100);
    store
        .register_relay(&registration(&owner, 1, interval))
        .await
        .expect("register");
    assert_eq!(
        entry(&store, &owner).await.expect("listed").state(),
        RelayState::Live
    );
    h.advance(Duration::from_millis(450)).await;
    let stale = entry(&store, &owner).await.expect("listed");
    assert_eq!(stale.state(), RelayState::Stale, "{stale:?}");
    assert!(
        stale.heartbeat_age >= Duration::from_millis(400),
        "{stale:?}"
    );
    assert!(store.heartbeat_relay(&owner, 2).await.expect("heartbeat"));
    let live = entry(&store, &owner).await.expect("listed");
    assert_eq!(live.state(), RelayState::Live, "{live:?}");
    assert!(live.heartbeat_at > stale.heartbeat_at);
    assert_eq!(
        live.started_at, stale.started_at,
        "a heartbeat keeps started_at"
    );
    // Registering again (a restart under the same owner) replaces the entry.
    store
        .register_relay(&registration(&owner, 2, interval))
        .await
        .expect("register again");
    let all = store.relays().await.expect("relays");
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!((all[0].registration.pid, all[0].held), (2, 0));
}

/// `live_claims_of` counts the events an owner holds under a live lease: what
/// `release_claims_of` would release.
pub async fn live_claims_of_counts_what_a_release_would_end<H: OutboxHarness>(h: &H)
where
    H::Store: RelayRegistry,
{
    let caps = h.capabilities();
    if !caps.lease {
        return not_applicable(
            "live_claims_of_counts_what_a_release_would_end",
            "no lease mode",
        );
    }
    let store = h.store(caps.lease_mode()).await;
    let (gone, other) = (format!("gone-{}", unique()), format!("other-{}", unique()));
    let events = [
        event(&format!("x-{}", unique()), 1),
        event(&format!("y-{}", unique()), 1),
        event(&format!("z-{}", unique()), 1),
    ];
    let mut tx = h.begin().await;
    store.append(&mut tx, &events).await.expect("append");
    h.commit(tx).await.expect("commit");
    let held = store
        .claim(&ClaimRequest::new(&gone, 2))
        .await
        .expect("claim");
    assert_eq!(held.records.len(), 2);
    let kept = store
        .claim(&ClaimRequest::new(&other, 10))
        .await
        .expect("claim");
    assert_eq!(kept.records.len(), 1);
    assert_eq!(store.live_claims_of(&gone).await.expect("count"), 2);
    assert_eq!(store.live_claims_of(&other).await.expect("count"), 1);
    assert_eq!(store.live_claims_of("nobody").await.expect("count"), 0);
    assert_eq!(
        store
            .release_claims_of(&gone, "ops")
            .await
            .expect("release"),
        2
    );
    assert_eq!(store.live_claims_of(&gone).await.expect("count"), 0);
    assert_eq!(store.live_claims_of(&other).await.expect("count"), 1);
}
