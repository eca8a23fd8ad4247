//! `InboxStoreExt` over the in-memory inbox: registration by dedup id, and cleanup batch after
//! batch.

use std::time::Duration;

use outbox_core::{Classify, Envelope, EventId, InboxStore, InboxStoreExt, Registration};
use outbox_testkit::fault::{Fault, FaultInjector, FaultSource, FaultyInbox};
use outbox_testkit::{ManualClock, MemoryDb, MemoryInboxStore};

fn event() -> Envelope {
    Envelope::builder("order", "o-1", 1, "order.paid")
        .build()
        .unwrap()
}

#[tokio::test]
async fn register_one_and_register_event_answer_per_dedup_id() {
    let db = MemoryDb::new(ManualClock::default());
    let inbox = MemoryInboxStore::new(&db);
    let original = event();
    let copy = Envelope::builder("order", "o-1", 1, "order.paid")
        .header(
            outbox_core::wire::ORIGINAL_EVENT_ID,
            original.event_id.to_string(),
        )
        .build()
        .unwrap();
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(
        inbox.register_event(&mut tx, "c", &copy).await.unwrap(),
        Registration::Fresh
    );
    // The copy registered the original's id, not its own.
    assert_eq!(
        inbox.register_event(&mut tx, "c", &original).await.unwrap(),
        Registration::Duplicate
    );
    assert_eq!(
        inbox
            .register_one(&mut tx, "c", copy.event_id)
            .await
            .unwrap(),
        Registration::Fresh
    );
    assert_eq!(
        inbox
            .register_one(&mut tx, "c", copy.event_id)
            .await
            .unwrap(),
        Registration::Duplicate
    );
    inbox.commit(tx).await.unwrap();
    assert!(inbox.is_registered("c", original.event_id));
}

async fn register_many(inbox: &MemoryInboxStore, consumer: &str, n: usize) {
    let mut tx = inbox.begin().await.unwrap();
    let ids: Vec<EventId> = (0..n).map(|_| EventId::now_v7()).collect();
    inbox.register(&mut tx, consumer, &ids).await.unwrap();
    inbox.commit(tx).await.unwrap();
}

#[tokio::test]
async fn cleanup_batches_runs_until_a_short_batch_or_the_bound() {
    let clock = ManualClock::default();
    let db = MemoryDb::new(clock.clone());
    let inbox = MemoryInboxStore::new(&db);
    let retention = Duration::from_secs(60);
    register_many(&inbox, "c", 5).await;
    register_many(&inbox, "other", 3).await;
    clock.advance(Duration::from_secs(61));
    // Bounded: two batches of two.
    assert_eq!(
        inbox.cleanup_batches("c", retention, 2, 2).await.unwrap(),
        4
    );
    assert_eq!(inbox.registrations("c").len(), 1);
    // The rest: a short batch ends the loop.
    assert_eq!(
        inbox.cleanup_batches("c", retention, 2, 10).await.unwrap(),
        1
    );
    assert_eq!(
        inbox.cleanup_batches("c", retention, 2, 10).await.unwrap(),
        0
    );
    // Full batches continue: 3 of "other" in batches of 1.
    assert_eq!(
        inbox
            .cleanup_batches("other", retention, 1, 10)
            .await
            .unwrap(),
        3
    );
    assert!(inbox.registrations("other").is_empty());
    // Nothing past retention yet: nothing removed.
    register_many(&inbox, "c", 2).await;
    assert_eq!(
        inbox.cleanup_batches("c", retention, 1, 10).await.unwrap(),
        0
    );
    assert_eq!(inbox.registrations("c").len(), 2);
}

#[tokio::test]
async fn cleanup_batches_stops_at_the_first_short_batch() {
    // A short batch means nothing more is due: the loop must not run another statement. Every
    // cleanup call after the first fails, so one more call shows as an error.
    let clock = ManualClock::default();
    let db = MemoryDb::new(clock.clone());
    let memory = MemoryInboxStore::new(&db);
    register_many(&memory, "c", 3).await;
    clock.advance(Duration::from_secs(61));
    let faults = FaultInjector::new(FaultSource::from_call(1, Fault::Permanent)).only(&["cleanup"]);
    let inbox = FaultyInbox::new(memory, faults);
    assert_eq!(
        inbox
            .cleanup_batches("c", Duration::from_secs(60), 5, 10)
            .await
            .unwrap(),
        3
    );
    assert!(inbox.faults().injected().is_empty());
    // A full batch does continue (and meets the injected failure).
    register_many(inbox.inner(), "c", 2).await;
    clock.advance(Duration::from_secs(61));
    let err = inbox
        .cleanup_batches("c", Duration::from_secs(60), 2, 10)
        .await
        .unwrap_err();
    assert!(!err.is_transient());
    assert_eq!(inbox.faults().injected().len(), 1);
}
