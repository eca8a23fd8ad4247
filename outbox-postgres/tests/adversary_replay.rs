//! Adversary pass on issue 20, item 3: `outbox replay` reads published events in publication
//! order (publication time, then row id) through `published_events`. Attacked here: an
//! aggregate with a re-issued version, replay paging while the relay publishes further
//! versions and while a publication commits late, and page boundaries between rows with equal
//! publication times.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use outbox_core::prelude::*;
use outbox_postgres::{PostgresOutboxStore, PublishedFilter, PublishedRow};

use common::{claim, event, lease, park, publish_all, versions};

fn of(agg: &str) -> PublishedFilter {
    let mut f = PublishedFilter::default();
    f.aggregate_id = Some(agg.into());
    f
}

/// Claims once and publishes what it got; the versions it got.
async fn publish_next(store: &PostgresOutboxStore) -> Vec<(String, i64)> {
    let b = claim(store, "r", 10).await;
    publish_all(store, &b).await;
    versions(&b)
}

/// Pages through `filter` with pages of `size`, running `between` after each page.
async fn page_through<F, Fut>(
    store: &PostgresOutboxStore,
    filter: &PublishedFilter,
    size: usize,
    mut between: F,
) -> Vec<PublishedRow>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let (mut out, mut after) = (Vec::new(), None);
    for page_no in 0.. {
        let page = store.published_events(filter, after, size).await.unwrap();
        let Some(last) = page.last() else { break };
        after = Some(last.position);
        out.extend(page);
        assert!(out.len() < 1000, "paging does not end");
        between(page_no).await;
    }
    out
}

/// v1 published, v2 parked then re-issued (the copy published), v3 published: the replay has
/// v1, the copy (carrying the original's id), v3, and not the discarded original.
#[tokio::test]
async fn a_reissued_version_is_replayed_once_in_its_place() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let (v1, v2, v3) = (event("re", 1), event("re", 2), event("re", 3));
    store
        .append_many(&ctx.pool, &[v1.clone(), v2.clone(), v3.clone()])
        .await
        .unwrap();
    assert_eq!(publish_next(&store).await, vec![("re".into(), 1)]);
    let b = claim(&store, "r", 10).await;
    store.complete(&b.handle, &[park(&v2)]).await.unwrap();
    let copy = store
        .reissue_parked(v2.event_id, "ops", "fixed")
        .await
        .unwrap();
    assert_eq!(publish_next(&store).await, vec![("re".into(), 2)]);
    assert_eq!(publish_next(&store).await, vec![("re".into(), 3)]);
    for size in [1, 2, 100] {
        let rows = page_through(&store, &of("re"), size, |_| async {}).await;
        let got: Vec<_> = rows.iter().map(|r| r.envelope.event_id).collect();
        assert_eq!(got, [v1.event_id, copy, v3.event_id], "pages of {size}");
        assert_eq!(
            rows[1]
                .envelope
                .headers
                .get(outbox_core::wire::ORIGINAL_EVENT_ID)
                .map(String::as_str),
            Some(v2.event_id.to_string().as_str())
        );
    }
    ctx.drop().await;
}

/// Rows whose publication times are equal (a batch completed in one microsecond, or times
/// written by an upgrade) are ordered by row id, and a page boundary between them neither skips
/// nor repeats one, whatever the page size.
#[tokio::test]
async fn equal_publication_times_across_page_boundaries() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let evs: Vec<_> = (0..7).map(|i| event(&format!("eq{i}"), 1)).collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();
    let b = claim(&store, "r", 10).await;
    publish_all(&store, &b).await;
    // Two groups of equal times, the later group on the lower ids.
    sqlx::raw_sql(&format!(
        "UPDATE \"{0}\".outbox_events SET finished_at = '2030-01-01T00:00:00Z', \
            published_at = '2030-01-01T00:00:00Z' WHERE aggregate_id IN ('eq4', 'eq5', 'eq6'); \
         UPDATE \"{0}\".outbox_events SET finished_at = '2031-01-01T00:00:00Z', \
            published_at = '2031-01-01T00:00:00Z' WHERE aggregate_id IN ('eq0', 'eq1', 'eq2', 'eq3');",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let want: Vec<String> = [4, 5, 6, 0, 1, 2, 3]
        .iter()
        .map(|i| format!("eq{i}"))
        .collect();
    for size in 1..=8 {
        let rows = page_through(&store, &PublishedFilter::default(), size, |_| async {}).await;
        let got: Vec<_> = rows
            .iter()
            .map(|r| r.envelope.aggregate_id.clone())
            .collect();
        assert_eq!(got, want, "pages of {size}");
    }
    ctx.drop().await;
}

/// A replay pages through an aggregate while the relay keeps publishing it: every version
/// published before the replay started comes exactly once and in order, and versions published
/// meanwhile come (if at all) after them, in order, once. A publication whose transaction
/// commits after a later page was read (its time lies before that page's end) is not replayed
/// by this run: it was published live while the replay ran.
#[tokio::test]
async fn a_replay_while_the_relay_publishes_further_versions() {
    let ctx = ctx!(6);
    let store = ctx.store(lease(30.0)).await;
    let all: Vec<_> = (1..=10).map(|v| event("live", v)).collect();
    store.append_many(&ctx.pool, &all).await.unwrap();
    for v in 1..=4 {
        assert_eq!(publish_next(&store).await, vec![("live".into(), v)]);
    }
    let rows = page_through(&store, &of("live"), 2, |page| {
        let store = store.clone();
        async move {
            if page < 3 {
                publish_next(&store).await;
            }
        }
    })
    .await;
    let got: Vec<i64> = rows.iter().map(|r| r.envelope.aggregate_version).collect();
    assert_eq!(&got[..4], [1, 2, 3, 4], "{got:?}");
    assert!(
        got.windows(2).all(|w| w[0] < w[1]),
        "once each, in order: {got:?}"
    );
    assert_eq!(
        got,
        (1..=7).collect::<Vec<_>>(),
        "the versions published meanwhile too"
    );

    // A completion whose statement ran (its publication time taken) before a page that
    // passes it was read, but that commits after: the row lies behind the keyset.
    let b = claim(&store, "r", 10).await;
    assert_eq!(versions(&b), vec![("live".into(), 8)]);
    let other = event("late-commit", 1);
    store.append(&ctx.pool, &other).await.unwrap();
    let b2 = claim(&store, "r2", 10).await;
    assert_eq!(versions(&b2), vec![("late-commit".into(), 1)]);
    let mut filter = PublishedFilter::default();
    filter.aggregate_type = Some("order".into());
    let before: Vec<_> = store.published_events(&filter, None, 100).await.unwrap();
    let mut tx = ctx.pool.begin().await.unwrap();
    sqlx::query(&format!(
        "UPDATE \"{}\".outbox_events SET status = 'published', published_at = clock_timestamp(), \
            finished_at = clock_timestamp(), ack_transport = 'kafka', ack_destination = 't', ack_partition = 0, ack_position = 8 \
          WHERE aggregate_id = 'live' AND aggregate_version = 8",
        ctx.schema
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    publish_all(&store, &b2).await;
    let page = store
        .published_events(&filter, before.last().map(|r| r.position), 100)
        .await
        .unwrap();
    assert_eq!(
        page.iter()
            .map(|r| r.envelope.aggregate_id.as_str())
            .collect::<Vec<_>>(),
        ["late-commit"]
    );
    tx.commit().await.unwrap();
    let next = store
        .published_events(&filter, page.last().map(|r| r.position), 100)
        .await
        .unwrap();
    assert!(
        next.is_empty(),
        "the late commit lies behind the keyset: {:?}",
        next.iter()
            .map(|r| (&r.envelope.aggregate_id, r.envelope.aggregate_version))
            .collect::<Vec<_>>()
    );
    store.release(&b.handle).await.unwrap();
    ctx.drop().await;
}
