//! The operator's reads (`outbox_mysql::MySqlOutboxStore::publish_latency`,
//! `published_events`, `count_published`, `cleanup_candidates`, `interval_counts`,
//! `published_ids`) against MariaDB, each with what outbox-postgres's same reads answer.
//!
//! Each test has its own database on the server at `MYSQL_URL`.

mod common;

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::prelude::*;
use outbox_core::{Envelope, StoreErrorKind};
use outbox_mysql::{MySqlOutboxStore, PublishedFilter};

use common::{append, claim, lease, park, publish_all};

fn created(agg: &str, version: i64, event_type: &str, at: DateTime<Utc>) -> Envelope {
    Envelope::builder("order", agg, version, event_type)
        .created_at(at)
        .build()
        .unwrap()
}

/// Claims and publishes everything claimable, until nothing is.
async fn drain(store: &MySqlOutboxStore) {
    loop {
        let b = claim(store, "r", 100).await;
        if b.records.is_empty() {
            return;
        }
        publish_all(store, &b).await;
    }
}

/// Percentiles of the created-to-published latency, continuous as PostgreSQL's
/// `percentile_cont`: ten events created 10, 20, .., 100 s ago and published now have a median
/// of 55 s, a 90th percentile of 91 s, a 99th of 99.1 s and a largest of 100 s (plus the
/// moment the test takes). Events created before the window are not counted as created in it.
#[tokio::test]
async fn publish_latency_percentiles_over_a_window() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let now = Utc::now();
    let empty = store
        .publish_latency(Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(
        (empty.count, empty.created, empty.p50, empty.max),
        (0, 0, None, None)
    );
    let events: Vec<Envelope> = (1..=10)
        .map(|k| {
            created(
                &format!("a{k}"),
                1,
                "t",
                now - chrono::Duration::seconds(10 * k),
            )
        })
        .collect();
    let outside = created("old", 1, "t", now - chrono::Duration::hours(2));
    append(&ctx, &store, &events).await;
    append(&ctx, &store, std::slice::from_ref(&outside)).await;
    let b = claim(&store, "r", 100).await;
    let outs: Vec<_> = b
        .records
        .iter()
        .filter(|r| r.envelope.event_id != outside.event_id)
        .enumerate()
        .map(|(i, r)| common::published(&r.envelope, i as i64))
        .collect();
    store.complete(&b.handle, &outs).await.unwrap();
    let s = store
        .publish_latency(Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!((s.count, s.created), (10, 10), "{s:?}");
    let near = |got: Option<f64>, want: f64| got.is_some_and(|g| g >= want && g < want + 5.0);
    assert!(near(s.p50, 55.0), "{s:?}");
    assert!(near(s.p90, 91.0), "{s:?}");
    assert!(near(s.p99, 99.1), "{s:?}");
    assert!(near(s.max, 100.0), "{s:?}");
    // A window of one microsecond, ending now, holds none of them.
    let tiny = store
        .publish_latency(Duration::from_micros(1))
        .await
        .unwrap();
    assert_eq!(tiny.count, 0, "{tiny:?}");
    ctx.drop().await;
}

/// Replay reads published events in publication order, not insertion order: version 2 of an
/// aggregate inserted before version 1 (held as a gap until 1 arrived) comes after 1, as the
/// broker got them. Paging by position returns each once; filters by aggregate, event type and
/// creation time select; pending, parked and discarded events are never returned.
#[tokio::test]
async fn published_events_come_in_publication_order_and_page_by_position() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let now = Utc::now();
    let a2 = created("a", 2, "order.paid", now);
    append(&ctx, &store, std::slice::from_ref(&a2)).await;
    let b = claim(&store, "r", 10).await;
    assert_eq!(b.gaps_held, 1, "version 2 waits for version 1");
    let a1 = created("a", 1, "order.created", now - chrono::Duration::minutes(5));
    let (b1, b2) = (
        created("b", 1, "order.created", now),
        created("b", 2, "x", now),
    );
    append(&ctx, &store, &[a1.clone(), b1.clone(), b2.clone()]).await;
    tokio::time::sleep(Duration::from_millis(1100)).await; // a2's re-check
    drain(&store).await;
    // Not published: pending, parked, discarded.
    let (p1, d1) = (created("p", 1, "t", now), created("d", 1, "t", now));
    append(&ctx, &store, &[p1.clone(), d1.clone()]).await;
    let b = claim(&store, "r", 10).await;
    store
        .complete(&b.handle, &[park(&p1), park(&d1)])
        .await
        .unwrap();
    store
        .discard_parked(d1.event_id, "ops", "test")
        .await
        .unwrap();
    append(&ctx, &store, &[created("q", 1, "t", now)]).await;

    let all = PublishedFilter::default();
    assert_eq!(store.count_published(&all).await.unwrap(), 4);
    let mut filter = PublishedFilter::default();
    filter.aggregate_type = Some("order".into());
    filter.aggregate_id = Some("a".into());
    assert_eq!(store.count_published(&filter).await.unwrap(), 2);
    let rows = store.published_events(&filter, None, 10).await.unwrap();
    let got: Vec<_> = rows.iter().map(|r| r.envelope.event_id).collect();
    assert_eq!(got, [a1.event_id, a2.event_id], "publication order");
    assert!(
        rows[0].position < rows[1].position,
        "{:?}",
        rows.iter().map(|r| r.position).collect::<Vec<_>>()
    );
    assert_eq!(rows[0].ack.topic, "orders");
    assert_eq!(rows[0].envelope, a1, "the event reads back whole");
    // Paging one at a time over everything: each published event once, in order.
    let (mut seen, mut after) = (Vec::new(), None);
    loop {
        let page = store.published_events(&all, after, 1).await.unwrap();
        let Some(last) = page.last() else { break };
        after = Some(last.position);
        seen.extend(page.iter().map(|r| r.envelope.event_id));
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
    let pos = |id| seen.iter().position(|s| *s == id).unwrap();
    assert!(pos(a1.event_id) < pos(a2.event_id));
    assert!(pos(b1.event_id) < pos(b2.event_id));
    // Event type and creation time.
    let mut by_type = PublishedFilter::default();
    by_type.event_type = Some("order.created".into());
    assert_eq!(store.count_published(&by_type).await.unwrap(), 2);
    let mut by_time = PublishedFilter::default();
    by_time.since = Some(now - chrono::Duration::minutes(10));
    by_time.until = Some(now - chrono::Duration::minutes(1));
    let rows = store.published_events(&by_time, None, 10).await.unwrap();
    assert_eq!(
        rows.iter().map(|r| r.envelope.event_id).collect::<Vec<_>>(),
        [a1.event_id]
    );
    let mut only_id = PublishedFilter::default();
    only_id.aggregate_id = Some("b".into());
    assert_eq!(store.count_published(&only_id).await.unwrap(), 2);
    ctx.drop().await;
}

/// Cleanup candidates are the published and discarded rows past the retention: what a
/// cleanup with that retention removes.
#[tokio::test]
async fn cleanup_candidates_count_what_a_cleanup_removes() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let now = Utc::now();
    let (e1, e2, e3) = (
        created("a", 1, "t", now),
        created("b", 1, "t", now),
        created("c", 1, "t", now),
    );
    append(&ctx, &store, &[e1.clone(), e2.clone(), e3]).await;
    let b = claim(&store, "r", 10).await;
    store
        .complete(&b.handle, &[common::published(&e1, 1), park(&e2)])
        .await
        .unwrap();
    store
        .discard_parked(e2.event_id, "ops", "test")
        .await
        .unwrap();
    let hour = Duration::from_secs(3600);
    assert_eq!(store.cleanup_candidates(hour).await.unwrap(), 0);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let just = Duration::from_millis(10);
    assert_eq!(store.cleanup_candidates(just).await.unwrap(), 2);
    assert_eq!(store.cleanup(just, 100).await.unwrap().removed, 2);
    assert_eq!(store.cleanup_candidates(Duration::ZERO).await.unwrap(), 0);
    ctx.drop().await;
}

/// Reconciliation counts per interval (from `since`, in whole intervals, as PostgreSQL's
/// `date_bin`) and event type: created, published with an offset, pending past the grace,
/// parked, discarded; events before `since` are left out; a zero interval is refused.
#[tokio::test]
async fn interval_counts_per_interval_and_event_type() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let since: DateTime<Utc> = "2024-03-01T10:00:00.000001Z".parse().unwrap();
    let at = |min: i64| since + chrono::Duration::minutes(min);
    let events = [
        created("a", 1, "order.created", at(1)),  // published
        created("b", 1, "order.created", at(9)),  // parked
        created("c", 1, "order.paid", at(5)),     // discarded
        created("d", 1, "order.created", at(12)), // pending, overdue
        created("e", 1, "order.created", at(-1)), // before since
    ];
    append(&ctx, &store, &events).await;
    let b = claim(&store, "r", 10).await;
    store
        .complete(
            &b.handle,
            &[
                common::published(&events[0], 7),
                park(&events[1]),
                park(&events[2]),
            ],
        )
        .await
        .unwrap();
    store
        .discard_parked(events[2].event_id, "ops", "test")
        .await
        .unwrap();
    store.release(&b.handle).await.unwrap();
    let counts = store
        .interval_counts(since, Duration::from_secs(600), Duration::ZERO)
        .await
        .unwrap();
    let row = |start: DateTime<Utc>, t: &str, c: [u64; 5]| {
        let mut r = outbox_mysql::IntervalCount::zero(start, t);
        [r.events, r.published, r.overdue, r.parked, r.discarded] = c;
        r
    };
    assert_eq!(
        counts,
        [
            row(since, "order.created", [2, 1, 0, 1, 0]),
            row(since, "order.paid", [1, 0, 0, 0, 1]),
            row(at(10), "order.created", [1, 0, 1, 0, 0]),
        ]
    );
    // A grace longer than the events' age: nothing overdue.
    let counts = store
        .interval_counts(
            since,
            Duration::from_secs(600),
            Duration::from_secs(3600 * 24 * 365 * 50),
        )
        .await
        .unwrap();
    assert_eq!(counts[2].overdue, 0);
    let err = store
        .interval_counts(since, Duration::ZERO, Duration::ZERO)
        .await
        .unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Configuration);
    ctx.drop().await;
}

/// What consumers should have applied: the published events of a type created in a range,
/// on the given topics, published at least the grace ago; a re-issued copy comes with the id
/// of its original (the header the inboxes deduplicate by).
#[tokio::test]
async fn published_ids_name_the_original_of_a_copy() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let now = Utc::now();
    let (x, y, other) = (
        created("x", 1, "order.created", now),
        created("y", 1, "order.created", now),
        created("z", 1, "order.paid", now),
    );
    append(&ctx, &store, &[x.clone(), y.clone(), other.clone()]).await;
    let b = claim(&store, "r", 10).await;
    store
        .complete(
            &b.handle,
            &[
                common::published(&x, 1),
                park(&y),
                common::published(&other, 2),
            ],
        )
        .await
        .unwrap();
    let copy = store
        .reissue_parked(y.event_id, "ops", "again")
        .await
        .unwrap();
    drain(&store).await;
    let (start, end) = (
        now - chrono::Duration::minutes(1),
        now + chrono::Duration::minutes(1),
    );
    let mut ids = store
        .published_ids("order.created", start, end, &[], Duration::ZERO)
        .await
        .unwrap();
    ids.sort();
    let mut want = vec![
        (x.event_id.as_uuid(), None),
        (copy.as_uuid(), Some(y.event_id.as_uuid())),
    ];
    want.sort();
    assert_eq!(ids, want);
    let on_topic = store
        .published_ids(
            "order.created",
            start,
            end,
            &["orders".into()],
            Duration::ZERO,
        )
        .await
        .unwrap();
    assert_eq!(on_topic.len(), 2);
    let elsewhere = store
        .published_ids(
            "order.created",
            start,
            end,
            &["other".into()],
            Duration::ZERO,
        )
        .await
        .unwrap();
    assert!(elsewhere.is_empty());
    let too_recent = store
        .published_ids("order.created", start, end, &[], Duration::from_secs(3600))
        .await
        .unwrap();
    assert!(too_recent.is_empty(), "published less than the grace ago");
    ctx.drop().await;
}
