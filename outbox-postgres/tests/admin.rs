//! The operator reads of the PostgreSQL outbox store that the `outbox` command builds on
//! (`published_events` for replay).
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use std::time::Duration;

use outbox_postgres::PublishedFilter;

use common::{claim, event, lease, publish_all, versions};

// FOUND (issue 20, item 3, reproduced): replay read published events in insertion order, so an
// aggregate whose lower version committed after a higher one (v2 held until v1 arrived and
// went out) was replayed v2 first. Published events are now read in publication order.
#[tokio::test]
async fn published_events_come_in_publication_order_across_pages() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    // v2 commits before v1: it has the lower row id, and it is published second.
    store.append(&ctx.pool, &event("late", 2)).await.unwrap();
    store.append(&ctx.pool, &event("late", 1)).await.unwrap();
    store.append(&ctx.pool, &event("other", 1)).await.unwrap();
    let b = claim(&store, "r", 10).await;
    assert_eq!(
        versions(&b),
        vec![("late".into(), 1), ("other".into(), 1)],
        "v2 waits for v1"
    );
    publish_all(&store, &b).await;
    // The held v2 is re-checked within a second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let b = claim(&store, "r", 10).await;
    assert_eq!(versions(&b), vec![("late".into(), 2)]);
    publish_all(&store, &b).await;

    let mut filter = PublishedFilter::default();
    filter.aggregate_id = Some("late".into());
    let all = store.published_events(&filter, None, 100).await.unwrap();
    let order: Vec<i64> = all.iter().map(|r| r.envelope.aggregate_version).collect();
    assert_eq!(order, [1, 2], "replayed in the order they were published");
    // Page by page (one row each), the keyset carries on in the same order, and ends.
    let mut paged = Vec::new();
    let mut after = None;
    loop {
        let page = store.published_events(&filter, after, 1).await.unwrap();
        let Some(last) = page.last() else { break };
        after = Some(last.position);
        paged.extend(page.iter().map(|r| r.envelope.aggregate_version));
        assert!(paged.len() <= 2, "paging does not end: {paged:?}");
    }
    assert_eq!(paged, [1, 2]);
    // Every published event, across aggregates: in publication order as well.
    let every = store
        .published_events(&PublishedFilter::default(), None, 100)
        .await
        .unwrap();
    assert_eq!(every.len(), 3);
    assert!(every.windows(2).all(|w| w[0].position < w[1].position));
    assert_eq!(
        every.last().map(|r| (
            r.envelope.aggregate_id.as_str(),
            r.envelope.aggregate_version
        )),
        Some(("late", 2))
    );
    ctx.drop().await;
}
