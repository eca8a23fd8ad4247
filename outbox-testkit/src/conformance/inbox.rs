//! The inbox checks, one per contract clause of [`InboxStore`]. Each takes a fresh
//! [`InboxHarness`].

use std::time::Duration;

use outbox_core::{Classify, InboxStore, Registration, StoreErrorKind};

use super::{fresh_event_id, unique, InboxHarness};

fn consumer(name: &str) -> String {
    format!("{name}-{}", unique())
}

/// A first registration is fresh; after it committed, the same pair is a duplicate.
pub async fn first_registration_is_fresh_then_duplicate<H: InboxHarness>(h: &H) {
    let s = h.store();
    let (c, id) = (consumer("c"), fresh_event_id());
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register(&mut tx, &c, id).await.expect("register"),
        Registration::Fresh
    );
    s.commit(tx).await.expect("commit");
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register(&mut tx, &c, id).await.expect("register"),
        Registration::Duplicate
    );
    s.rollback(tx).await.expect("rollback");
}

/// A rolled-back registration leaves the event fresh.
pub async fn rolled_back_registration_is_fresh_again<H: InboxHarness>(h: &H) {
    let s = h.store();
    let (c, id) = (consumer("c"), fresh_event_id());
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register(&mut tx, &c, id).await.expect("register"),
        Registration::Fresh
    );
    s.rollback(tx).await.expect("rollback");
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register(&mut tx, &c, id).await.expect("register"),
        Registration::Fresh,
        "a rolled-back registration counted as processed"
    );
    s.commit(tx).await.expect("commit");
}

/// Registrations are per consumer.
pub async fn consumers_deduplicate_independently<H: InboxHarness>(h: &H) {
    let s = h.store();
    let (c1, c2, id) = (consumer("c1"), consumer("c2"), fresh_event_id());
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register(&mut tx, &c1, id).await.expect("register"),
        Registration::Fresh
    );
    s.commit(tx).await.expect("commit");
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register(&mut tx, &c2, id).await.expect("register"),
        Registration::Fresh
    );
    assert_eq!(
        s.register(&mut tx, &c1, fresh_event_id())
            .await
            .expect("register"),
        Registration::Fresh
    );
    s.commit(tx).await.expect("commit");
}

/// Two concurrent transactions registering the same pair never both commit as fresh: exactly
/// one commits; the other blocks and sees a duplicate, or fails with a transient conflict (at
/// registration or at commit).
pub async fn concurrent_registrations_cannot_both_commit<H: InboxHarness>(h: &H) {
    let s = h.store();
    let (c, id) = (consumer("c"), fresh_event_id());
    let mut first = s.begin().await.expect("begin");
    assert_eq!(
        s.register(&mut first, &c, id).await.expect("register"),
        Registration::Fresh
    );
    let step = h.capabilities().time_step;
    let second = async {
        let mut tx = s.begin().await?;
        match s.register(&mut tx, &c, id).await? {
            Registration::Duplicate => {
                s.rollback(tx).await?;
                Ok(Registration::Duplicate)
            }
            Registration::Fresh => s.commit(tx).await.map(|()| Registration::Fresh),
        }
    };
    let commit_first = async {
        // Let the second transaction reach its registration (it may block on ours).
        tokio::time::sleep(step.min(Duration::from_millis(200))).await;
        s.commit(first).await
    };
    let (second, first) = tokio::join!(second, commit_first);
    let mut fresh_commits = 0;
    let check_loser = |e: outbox_core::StoreError| {
        assert!(e.is_transient(), "the loser must fail transiently: {e}");
        assert_eq!(e.kind, StoreErrorKind::Conflict, "{e}");
    };
    match first {
        Ok(()) => fresh_commits += 1,
        Err(e) => check_loser(e),
    }
    match second {
        Ok(Registration::Fresh) => fresh_commits += 1,
        Ok(Registration::Duplicate) => {}
        Err(e) => check_loser(e),
    }
    assert_eq!(
        fresh_commits, 1,
        "exactly one of two concurrent registrations may commit as fresh"
    );
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register(&mut tx, &c, id).await.expect("register"),
        Registration::Duplicate
    );
    s.rollback(tx).await.expect("rollback");
}

/// Cleanup forgets registrations older than the retention, and only those.
pub async fn cleanup_forgets_registrations_past_retention<H: InboxHarness>(h: &H) {
    let s = h.store();
    let step = h.capabilities().time_step;
    let (c, old, new) = (consumer("c"), fresh_event_id(), fresh_event_id());
    let mut tx = s.begin().await.expect("begin");
    s.register(&mut tx, &c, old).await.expect("register");
    s.commit(tx).await.expect("commit");
    h.advance(step * 4).await;
    let mut tx = s.begin().await.expect("begin");
    s.register(&mut tx, &c, new).await.expect("register");
    s.commit(tx).await.expect("commit");
    let removed = s.cleanup(step * 2, 1).await.expect("cleanup");
    assert_eq!(removed, 1, "exactly the old registration is past retention");
    let mut tx = s.begin().await.expect("begin");
    assert_eq!(
        s.register(&mut tx, &c, old).await.expect("register"),
        Registration::Fresh
    );
    assert_eq!(
        s.register(&mut tx, &c, new).await.expect("register"),
        Registration::Duplicate
    );
    s.rollback(tx).await.expect("rollback");
}
