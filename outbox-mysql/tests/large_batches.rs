//! Batches longer than one `IN` list of the store's statements (500 values: MariaDB turns
//! lists of 1,000 values or more into a join with a materialized table, so the store writes a
//! longer list as a disjunction of shorter ones, see `head::in_list`). A claim, its completion
//! and the next claim over 1,300 candidates of 1,150 aggregates, in both claim modes: every
//! row of every list is read, locked, decided and written exactly once.
//!
//! Needs MySQL/MariaDB at `MYSQL_URL`; see `common`.

mod common;

use std::collections::BTreeSet;

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, Envelope};

use common::{claim, event, lease, publish_all, versions};

#[tokio::test]
async fn a_batch_of_more_than_two_lists_is_claimed_and_completed_exactly() {
    for mode in [lease(60.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(8);
        let s = ctx.store(mode).await;
        // 1,150 aggregates: 1,000 with one event, 150 with two (the second follows the first
        // in the same batch, so the claim blocks it and the completion unblocks it).
        let mut events: Vec<Envelope> = (0..1150).map(|i| event(&format!("b{i:04}"), 1)).collect();
        events.extend((1000..1150).map(|i| event(&format!("b{i:04}"), 2)));
        for chunk in events.chunks(500) {
            common::append(&ctx, &s, chunk).await;
        }
        let first = claim(&s, "relay", 2000).await;
        let want: Vec<(String, i64)> = (0..1150).map(|i| (format!("b{i:04}"), 1)).collect();
        assert_eq!(
            versions(&first),
            want,
            "{mode:?}: the first version of each"
        );
        let ids: BTreeSet<_> = first.records.iter().map(|r| r.envelope.event_id).collect();
        assert_eq!(ids.len(), 1150, "{mode:?}: each row once");
        publish_all(&s, &first).await;
        let published: i64 = sqlx::query_scalar(&format!(
            "SELECT COUNT(*) FROM {} WHERE status = 'published'",
            ctx.table("outbox_events")
        ))
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(published, 1150, "{mode:?}");
        let lasts: Vec<(i64, i64)> = sqlx::query_as(&format!(
            "SELECT last_version, COUNT(*) FROM {} GROUP BY last_version",
            ctx.table("outbox_events_aggregate")
        ))
        .fetch_all(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(lasts, vec![(1, 1150)], "{mode:?}: every last version moved");
        let second = claim(&s, "relay", 2000).await;
        let want: Vec<(String, i64)> = (1000..1150).map(|i| (format!("b{i:04}"), 2)).collect();
        assert_eq!(
            versions(&second),
            want,
            "{mode:?}: the followers, unblocked"
        );
        publish_all(&s, &second).await;
        assert_eq!(s.stats().await.unwrap().unpublished, 0, "{mode:?}");
        ctx.drop().await;
    }
}
