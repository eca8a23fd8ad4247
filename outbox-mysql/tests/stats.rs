//! The monitoring snapshot ([`MaintenanceStore::stats`]) on MySQL/MariaDB, beyond the conformance
//! clause: the classes of unpublished events as outbox-postgres counts them. Per aggregate:
//!
//! * **gap-held**: its head (first unfinished event above the last version) is held by a claim
//!   as a version gap: the head and the events after it, up to the first parked one;
//!   `version_gaps_held` counts such aggregates;
//! * **blocked**: pending events after the aggregate's first parked event (the parked event
//!   itself is counted in `parked`);
//! * **claimable**: the other pending events, in flight and queued behind a flowing head
//!   included: the only ones in `oldest_claimable_age`.
//!
//! Ages count from the insertion (`inserted_at`, the database clock), parked ones too. Each
//! test has its own database on the server at `MYSQL_URL`.

mod common;

use std::time::Duration;

use chrono::Utc;
use outbox_core::prelude::*;
use outbox_core::Envelope;

use common::{append, claim, event, extra, heads, lease, versions};

/// Issue 20 (b), carried: the claimable age is measured from the row's insertion on the
/// database clock (a producer's `created_at` a day old does not make it a day), and covers
/// claimable and in-flight rows only: a gap-held head and the rows behind a parked event are
/// reported apart.
#[tokio::test]
async fn stats_ages_come_from_insertion_and_gaps_and_parked_are_apart() {
    let ctx = ctx!(4);
    let store = ctx.stats_store().await;
    let old = Envelope::builder("order", "flowing", 1, "order.changed")
        .created_at(Utc::now() - chrono::Duration::days(1))
        .build()
        .unwrap();
    let (p1, p2) = (event("parked", 1), event("parked", 2));
    let gap = event("gap", 2);
    append(&ctx, &store, &[p1.clone(), p2, gap]).await;
    let b = claim(&store, "r", 10).await;
    assert_eq!(versions(&b), vec![("parked".into(), 1)]);
    assert_eq!(b.gaps_held, 1);
    store
        .complete(&b.handle, &[common::park(&p1)])
        .await
        .unwrap();
    // A claim meets the parked aggregate's next row and blocks it.
    let b = claim(&store, "r", 10).await;
    assert!(b.is_empty(), "{:?}", versions(&b));
    tokio::time::sleep(Duration::from_millis(1200)).await;
    append(&ctx, &store, &[old]).await;

    let s = store.stats().await.unwrap();
    assert_eq!((s.unpublished, s.parked, s.version_gaps_held), (3, 1, 1));
    assert_eq!((s.blocked, s.gap_held), (1, 1), "{s:?}");
    let age = s.oldest_claimable_age.expect("a flowing row");
    assert!(
        age < Duration::from_millis(1000),
        "the flowing row is fresh (inserted now, created a day ago), got {age:?}: the gap-held \
         and the parked aggregate's rows must not count"
    );
    assert!(s
        .oldest_blocked_age
        .is_some_and(|a| a >= Duration::from_secs(1)));
    assert!(s
        .oldest_parked_age
        .is_some_and(|a| a >= Duration::from_secs(1)));
    ctx.drop().await;
}

// FOUND (reviewing the coordinator's rename against outbox-postgres): `gap_held` counted only
// rows a claim had marked held, so the events after a held head (blocked behind it) read as
// claimable, and a head whose gap had filled since (a lower version arrived) still read as
// gap-held. PostgreSQL counts the held head and the events after it, and only while the
// head is the aggregate's first unfinished event above its last version.
#[tokio::test]
async fn gap_held_counts_the_held_head_and_the_events_after_it_while_it_is_the_head() {
    let ctx = ctx!(4);
    let store = ctx.stats_store().await;
    let (g2, g3, g4) = (event("g", 2), event("g", 3), event("g", 4));
    append(&ctx, &store, &[g2, g3, g4]).await;
    let b = claim(&store, "r", 10).await;
    assert_eq!((b.records.len(), b.gaps_held), (0, 1));
    let s = store.stats().await.unwrap();
    assert_eq!(
        (s.unpublished, s.gap_held, s.version_gaps_held, s.blocked),
        (3, 3, 1, 0),
        "the held head and the two events after it; one aggregate: {s:?}"
    );
    assert_eq!(s.oldest_claimable_age, None, "{s:?}");
    assert_eq!(
        extra(&s, "queued_rows"),
        Some(2.0),
        "the claim took v3 and v4 out of the candidates: {s:?}"
    );
    // The missing version arrives: the aggregate flows again (v1 is its head), nothing of it
    // is held any more, and its events are claimable (v2's age is the oldest).
    let g1 = event("g", 1);
    append(&ctx, &store, std::slice::from_ref(&g1)).await;
    let s = store.stats().await.unwrap();
    assert_eq!(
        (s.unpublished, s.gap_held, s.version_gaps_held),
        (4, 0, 0),
        "{s:?}"
    );
    assert!(s.oldest_claimable_age.is_some(), "{s:?}");
    ctx.drop().await;
}

/// An aggregate whose held head is followed by a parked event (written here by SQL: a state
/// only an operator or an earlier version reaches): the head and the events up to the parked
/// one are gap-held, the events after it blocked; the parked event is in neither.
#[tokio::test]
async fn a_parked_event_behind_a_held_head_splits_gap_held_from_blocked() {
    let ctx = ctx!(4);
    let store = ctx.stats_store().await;
    let m: Vec<Envelope> = (2..=5).map(|v| event("m", v)).collect();
    append(&ctx, &store, &m).await;
    let b = claim(&store, "r", 10).await;
    assert_eq!(b.gaps_held, 1);
    sqlx::query(&format!(
        "UPDATE {} SET status = 'parked', park_kind = 'permanent_error', \
           parked_at = UTC_TIMESTAMP(6), blocked = 0 WHERE event_id = ?",
        ctx.table("outbox_events")
    ))
    .bind(m[2].event_id.as_uuid())
    .execute(&ctx.pool)
    .await
    .unwrap();
    let s = store.stats().await.unwrap();
    assert_eq!(
        (
            s.unpublished,
            s.parked,
            s.gap_held,
            s.blocked,
            s.version_gaps_held
        ),
        (3, 1, 2, 1, 1),
        "v2 (held) and v3 gap-held, v4 parked, v5 blocked: {s:?}"
    );
    assert_eq!(s.oldest_claimable_age, None, "{s:?}");
    ctx.drop().await;
}

// FOUND (reviewing the coordinator's rename against outbox-postgres): the oldest parked age
// was measured from the time the event was parked; `OutboxStats` counts every age from the
// insertion, as PostgreSQL does.
#[tokio::test]
async fn the_oldest_parked_age_counts_from_the_insertion() {
    let ctx = ctx!(4);
    let store = ctx.stats_store().await;
    let (p1, p2, p3) = (event("p", 1), event("p", 2), event("p", 3));
    append(&ctx, &store, &[p1.clone(), p2, p3]).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let b = claim(&store, "r", 10).await;
    assert_eq!(versions(&b), vec![("p".into(), 1)]);
    store
        .complete(&b.handle, &[common::park(&p1)])
        .await
        .unwrap();
    let s = store.stats().await.unwrap();
    assert_eq!((s.parked, s.blocked, s.gap_held), (1, 2, 0), "{s:?}");
    assert!(
        s.oldest_parked_age
            .is_some_and(|a| a >= Duration::from_millis(1200)),
        "parked just now, inserted 1.2 s ago: {s:?}"
    );
    ctx.drop().await;
}

/// With `accept_first_version`, an aggregate without a published or discarded version counts
/// from its lowest unfinished version, in the stats as in the claim: a head held before the
/// store was switched to it (a relay of the earlier configuration held it) is claimable now,
/// not gap-held.
#[tokio::test]
async fn stats_count_from_the_accepted_first_version() {
    let ctx = ctx!(4);
    let strict = ctx.stats_store().await;
    append(&ctx, &strict, &[event("legacy", 5), event("legacy", 6)]).await;
    let b = claim(&strict, "r", 10).await;
    assert_eq!(b.gaps_held, 1);
    let s = strict.stats().await.unwrap();
    assert_eq!((s.gap_held, s.version_gaps_held), (2, 1), "{s:?}");
    let accepting = ctx
        .builder(lease(30.0))
        .accept_first_version(true)
        .build()
        .unwrap();
    let s = accepting.stats().await.unwrap();
    assert_eq!((s.gap_held, s.version_gaps_held), (0, 0), "{s:?}");
    assert!(s.oldest_claimable_age.is_some(), "{s:?}");
    ctx.drop().await;
}

/// Issue 25: the published rows are counted up to 10,000 (exact, flag 0); beyond, they are
/// not counted further (that read the whole status range of the index, the table's size)
/// but estimated from `information_schema`'s row estimate, at least the rows counted, and
/// flagged (`published_retained_estimated` 1).
#[tokio::test]
async fn published_rows_are_counted_exactly_to_ten_thousand_then_estimated() {
    let ctx = ctx!(4);
    let store = ctx.stats_store().await;
    append(&ctx, &store, &heads("p", 10_001)).await;
    let t = ctx.table("outbox_events");
    let publish = |which: &'static str| {
        format!(
            "UPDATE {t} SET status = 'published', published_at = UTC_TIMESTAMP(6), \
               finished_at = UTC_TIMESTAMP(6), ack_transport = 'kafka', \
               ack_destination = 'orders', ack_partition = 0, ack_position = id \
             WHERE {which}"
        )
    };
    ctx.execute(&publish("aggregate_id <> 'p0'")).await;
    let s = store.stats().await.unwrap();
    assert_eq!((s.published_retained, s.unpublished), (10_000, 1), "{s:?}");
    assert_eq!(extra(&s, "published_retained_estimated"), Some(0.0));
    ctx.execute(&publish("aggregate_id = 'p0'")).await;
    ctx.execute(&format!("ANALYZE TABLE {t}")).await;
    let s = store.stats().await.unwrap();
    assert_eq!(
        extra(&s, "published_retained_estimated"),
        Some(1.0),
        "{s:?}"
    );
    assert!(
        s.published_retained >= 10_001 && s.unpublished == 0,
        "at least the rows counted: {s:?}"
    );
    ctx.drop().await;
}
